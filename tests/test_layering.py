"""Production code never imports the test helpers (minedraft_ray/testing): an installed server must not depend
on code that exists for tests (checked on the source, without importing anything). The processes that run no model
(the Serve ingress, the stream mailbox, the batch manager's: the LLM's actor and the Serve engine replica) start
without torch (checked in fresh interpreters)."""
import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "minedraft_ray"


def imported_modules(path: Path) -> set[str]:
    """Absolute names of what a module imports (relative imports resolved against its package)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names |= {module} | {f"{module}.{a.name}" for a in node.names}
    return names


def test_production_code_does_not_import_testing():
    offenders = {str(p.relative_to(PACKAGE.parent)): sorted(n for n in imported_modules(p)
                                                            if n.startswith("minedraft_ray.testing"))
                 for p in PACKAGE.rglob("*.py") if "testing" not in p.relative_to(PACKAGE).parts}
    assert not {p: n for p, n in offenders.items() if n}



# what the Serve ingress replica and the stream mailbox actor import: their processes start from these modules (Serve
# and Ray pickle their classes by reference) and run no model, so they must not pay for torch's import
TORCH_FREE = ["minedraft_ray.serve.app", "minedraft_ray.serve.streams"]


def run_fresh(code: str, *args: str) -> str:
    """stdout of `code` run by a new interpreter (sys.argv[1:] = args)."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=PACKAGE.parent, capture_output=True, text=True,
                          check=True, timeout=120).stdout


def torch_modules(names) -> list[str]:
    return sorted(n for n in names if n == "torch" or n.startswith("torch."))


def imported_by(module: str) -> list[str]:
    """Every module a fresh interpreter holds after importing `module`."""
    imported = run_fresh("import importlib, sys\nimportlib.import_module(sys.argv[1])\nprint(*sys.modules)",
                         module).split()
    assert module in imported
    return imported


@pytest.mark.parametrize("module", TORCH_FREE)
def test_ingress_side_modules_import_without_torch(module):
    assert not torch_modules(imported_by(module))


BUILD_THE_APP = """
import sys, types
from minedraft_ray.serve.app import build_app_with_key
build_app_with_key({"mode": "psd"}, None)   # the embedded pair, checked
def holds_torch(module):   # torch, or a module of it, among its names
    return any(isinstance(v, types.ModuleType) and v.__name__.split(".")[0] == "torch" for v in vars(module).values())
print(*[name for name, m in list(sys.modules.items()) if name.startswith("minedraft_ray.") and m and holds_torch(m)])
"""


def test_the_app_builder_imports_none_of_the_engines_torch_side():
    """The Serve app builder (`serve run`, `minedraft serve`, every deploy) checks the pair and finds the tokenizer's
    class from the model folders' config and tokenizer files, in a process that runs no model: the pair check's module
    imports no torch, and no module of ours that the build loads holds torch (transformers' AutoTokenizer, which the
    build needs, imports torch itself while torch is installed)."""
    assert not torch_modules(imported_by("minedraft_ray.engine.pair"))
    assert run_fresh(BUILD_THE_APP).split() == []


# what the batch manager's processes import: the LLM's manager actor (runtime/llm.py, whose ManagerActor Ray pickles
# by reference) and the Serve engine replica. They keep books and drive the worker actors, which own the tensors;
# torch's import cost each of them about a CPU-second at start (the suite starts dozens)
MANAGER_SIDE = ["minedraft_ray.runtime.manager", "minedraft_ray.runtime.scheduler", "minedraft_ray.runtime.llm",
                "minedraft_ray.serve.engine_replica"]


@pytest.mark.parametrize("module", MANAGER_SIDE)
def test_manager_side_modules_import_without_torch(module):
    imported = imported_by(module)
    assert not torch_modules(imported)
    assert "transformers" not in imported   # the driver checks the pair and loads the tokenizer, not the manager


def test_the_manager_names_worker_calls_the_workers_have():
    """The actor classes the manager starts (runtime/actors.py, no torch) hand each call to the worker of the same
    name: every call of theirs is a method of the default worker they run."""
    from minedraft_ray.runtime import actors

    roles = {actors.VerifierActor: actors.WorkerSet().verifier, actors.SpecActor: actors.WorkerSet().spec,
             actors.DrafterActor: actors.WorkerSet().drafter, actors.TargetRankActor: actors.TARGET_RANK}
    for actor, path in roles.items():
        worker = actors.import_class(path)
        calls = [name for name in dir(actor) if not name.startswith("_")]
        assert "ready" in calls and all(callable(getattr(worker, name, None)) for name in calls), (actor, path)


def test_fault_drills_keep_the_manager_torch_free():
    """A drill's faults travel through the manager (pickled in its WorkerSet): unpickling them there loads no torch,
    so the drills run on a manager process like production's."""
    import pickle

    from minedraft_ray.testing.workers import faulty_drafter

    code = "import pickle, sys\npickle.loads(bytes.fromhex(sys.argv[1]))\nprint(*sys.modules)"
    assert not torch_modules(run_fresh(code, pickle.dumps(faulty_drafter(error_at=4)).hex()).split())


@pytest.mark.parametrize("path", ["minedraft_ray.runtime.workers", "os:system", "minedraft_ray.x:A.B",
                                  "minedraft_ray.x:<locals>"])
def test_a_worker_class_path_is_a_top_level_class_of_the_package(path):
    from minedraft_ray.runtime.actors import WorkerSet

    with pytest.raises(ValueError):
        WorkerSet(drafter=path)


def test_the_managers_cuda_check_is_torchs():
    """The manager picks its GPU defaults without torch (engine/devices.py); torch would answer the same."""
    import torch

    from minedraft_ray.engine.devices import cuda_available, torch_built_with_cuda

    assert torch_built_with_cuda() == (torch.version.cuda is not None)
    assert cuda_available() == torch.cuda.is_available()


LOAD_AS_THE_INGRESS = """
import json, sys
from minedraft_ray.engine.hf_config import eos_token_ids, read_hf_config
from minedraft_ray.engine.tokenizer import load_tokenizer
folder, class_path, text = sys.argv[1:]
tok = load_tokenizer(folder, class_path)
chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
ids = tok.encode(text)
print(json.dumps({"class": type(tok).__name__, "ids": ids, "text": tok.decode(ids), "chat": chat, "len": len(tok),
                  "eos": list(eos_token_ids(*read_hf_config(folder))),
                  "torch": sorted(n for n in sys.modules if n == "torch" or n.startswith("torch."))}))
"""


def test_the_ingress_loads_autotokenizers_tokenizer_without_torch(tmp_path):
    """The ingress builds the tokenizer from the class AutoTokenizer picked in the app builder: the same tokenizer,
    without AutoTokenizer's import of torch. The folder names a model's own class, which AutoTokenizer picks."""
    from minedraft_ray.engine.model import ModelConfig
    from minedraft_ray.engine.tokenizer import load_tokenizer, tokenizer_class_path

    source = PACKAGE / "assets" / "default-target"
    for name in ("tokenizer.json", "chat_template.jinja", "config.json", "generation_config.json"):
        shutil.copy(source / name, tmp_path / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    auto = load_tokenizer(tmp_path)
    text = "Speculative decoding, <|endoftext|> twice!"
    ids = auto.encode(text)
    expected = {"class": "Qwen2Tokenizer", "ids": ids, "text": auto.decode(ids), "len": len(auto),
                "chat": auto.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False),
                "eos": list(ModelConfig.from_pretrained(tmp_path).eos_token_ids), "torch": []}
    assert type(auto).__name__ == "Qwen2Tokenizer"
    assert json.loads(run_fresh(LOAD_AS_THE_INGRESS, str(tmp_path), tokenizer_class_path(auto), text)) == expected
