"""The default-pair training script: corpus rules, the acceptance simulation, and a --smoke run end to end
(interrupted, resumed, rerun) on CPU."""
import copy
import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from minedraft_ray.training import corpus
from minedraft_ray.training import train_pair as tp



@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The smoke models are tiny: with two torch threads on a shared 2-core machine (two pytest workers, Ray)
    a training step mostly waits for the other thread, so these tests train on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

# ------------------------------------------------------------------------------------------- corpus


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _fake_site_packages(root: Path) -> None:
    six = "import sys\n\n\ndef with_metaclass(meta, *bases):\n    return meta('tmp', bases, {})\n" * 3
    _write(root / "six.py", six)
    _write(root / "alpha/__init__.py", "from .core import run\n\n\ndef main():\n    return run(1)\n" * 3)
    _write(root / "alpha/core.py", "def run(x):\n    '''Run it.'''\n    return x + 1\n" * 5)
    _write(root / "alpha/_vendor/six.py", six)  # a vendored copy: same content, dropped
    _write(root / "alpha/README.md", "# Alpha\n\nAlpha runs things quickly and reports what it did.\n" * 3)
    _write(root / "alpha/LICENSE.txt", "Permission is hereby granted, free of charge, to any person\n" * 3)
    _write(root / "alpha/tests/data/table.txt", "1.0 2.0 3.0 4.0 5.0 6.0\n" * 20)  # numbers, not prose
    _write(root / "alpha/__pycache__/core.cpython-312.py", "x = 1\n" * 30)
    _write(root / "beta/util.py", "import os\n\n\ndef home():\n    return os.path.expanduser('~')\n" * 3)
    _write(root / "beta/docs.rst", "Beta\n====\n\nBeta helps with paths and homes of users.\n" * 3)
    _write(root / "beta_tools-1.0.dist-info/METADATA",
           "Metadata-Version: 2.1\nName: beta-tools\n\n# beta-tools\n\nThe beta distribution ships the beta package "
           "for finding the home folders of users.\n")
    _write(root / "beta_tools-1.0.dist-info/RECORD", "beta/util.py,sha256=x,1\nbeta/docs.rst,sha256=y,2\n"
           "beta_tools-1.0.dist-info/METADATA,,\n")
    _write(root / "alpha/big.py", "x = 1\n" * 400_000)  # over max_file_bytes


def test_collect_dedups_filters_and_splits_by_package(tmp_path):
    _fake_site_packages(tmp_path)
    docs, dropped = corpus.collect([tmp_path], seed=0, heldout_frac=0.5, max_file_bytes=1 << 20)
    by_path = {d.path: d for d in docs}
    assert set(by_path) == {"six.py", "alpha/__init__.py", "alpha/core.py", "alpha/README.md", "beta/util.py",
                            "beta/docs.rst", "beta_tools-1.0.dist-info/METADATA"}
    assert dropped["duplicate"] == 1 and dropped["filtered"] == 1  # the vendored six, the numeric table
    assert by_path["beta_tools-1.0.dist-info/METADATA"].package == "beta"  # found through RECORD
    assert by_path["beta_tools-1.0.dist-info/METADATA"].text.startswith("# beta-tools")  # headers stripped
    assert by_path["six.py"].package == "six" and by_path["alpha/core.py"].package == "alpha"
    assert {d.path: d.kind for d in docs if d.kind == "prose"}.keys() == {
        "alpha/README.md", "beta/docs.rst", "beta_tools-1.0.dist-info/METADATA"}
    for d in docs:
        assert d.split == ("heldout" if corpus.is_heldout(d.package, 0, 0.5) else "train")
        assert d.sha256 == hashlib.sha256((tmp_path / d.path).read_bytes()).hexdigest()
    # the same tree gives the same corpus; another seed may split differently but never within a package
    again, _ = corpus.collect([tmp_path], seed=0, heldout_frac=0.5)
    assert [(d.path, d.split) for d in again] == [(d.path, d.split) for d in docs]
    for seed in range(8):
        docs_s, _ = corpus.collect([tmp_path], seed=seed, heldout_frac=0.5)
        splits = {}
        for d in docs_s:
            splits.setdefault(d.package, set()).add(d.split)
        assert all(len(s) == 1 for s in splits.values())


def test_sampling_and_manifest_round_trip(tmp_path):
    _fake_site_packages(tmp_path)
    full, _ = corpus.collect([tmp_path], seed=0)
    small, dropped = corpus.collect([tmp_path], seed=0, max_bytes=sum(d.bytes for d in full) / 3)
    assert 0 < len(small) < len(full) and dropped["sampled_out_fraction"] > 0
    corpus.write_manifest(full, tmp_path / "m.jsonl.gz")
    rows = corpus.read_manifest(tmp_path / "m.jsonl.gz")
    assert [tuple(r.values()) for r in rows] == [tuple(getattr(d, k) for k in corpus.MANIFEST_FIELDS) for d in full]
    first = (tmp_path / "m.jsonl.gz").read_bytes()
    corpus.write_manifest(full, tmp_path / "m.jsonl.gz")
    assert (tmp_path / "m.jsonl.gz").read_bytes() == first  # byte-identical: fit to commit


def test_docstrings():
    src = 'def f():\n    """' + "Explains f. " * 20 + '"""\n\nclass C:\n    """short"""\n'
    assert [d.strip() for d in corpus.docstrings(src, min_chars=100)] == [("Explains f. " * 20).strip()]
    assert corpus.docstrings("def broken(:\n") == []


# ---------------------------------------------------------------------------------------- training


def test_batches_visit_every_window_once_per_epoch():
    tokens = torch.arange(10 * 4 + 1, dtype=torch.int32)  # 10 windows of 4 (+1) tokens
    b = tp.Batches(tokens, seq_len=4, batch_size=3, seed=0)
    firsts = torch.cat([b.get(s)[:, 0] for s in range(10)])  # 30 windows = 3 epochs, batches straddle epochs
    for epoch in range(3):
        assert sorted(firsts[epoch * 10:(epoch + 1) * 10].tolist()) == list(range(0, 40, 4))
    assert torch.equal(tp.Batches(tokens, 4, 3, 0).get(7), b.get(7))  # a step's batch depends only on the step


def test_simulate_greedy_sd_by_hand():
    all_match, none = np.ones((2, 10), bool), np.zeros((2, 10), bool)
    assert tp.simulate_greedy_sd(all_match, 4)["acceptance_length"] == 5.0
    assert tp.simulate_greedy_sd(none, 4)["acceptance_length"] == 1.0
    row = np.array([[1, 1, 0, 1, 0, 0, 1, 1, 1, 1]], bool)
    # k=2: p0 accepts 2 (p=3), p3 accepts 1 (p=5), p5 accepts 0 (p=6), p6 accepts 2 (p=9), p9: 9+2 > 10 stop
    r = tp.simulate_greedy_sd(row, 2)
    assert (r["verify_steps"], r["accepted"], r["drafted"]) == (4, 5, 8)
    assert r["acceptance_rate"] == 5 / 8 and r["acceptance_length"] == 1 + 5 / 4


@torch.no_grad()
def _naive_greedy_sd(target, draft, prompt, gen_len, k):
    """Speculative decoding as written in the paper: draft k tokens one by one, verify them in one target pass."""
    seq, produced, accepted, steps = prompt, 0, 0, 0
    while produced + k <= gen_len:
        d = seq
        for _ in range(k):
            d = torch.cat([d, draft(input_ids=d, use_cache=False).logits[:, -1:].argmax(-1)], 1)
        t = target(input_ids=d, use_cache=False).logits[0, seq.shape[1] - 1:].argmax(-1)  # [k + 1]
        drafted = d[0, seq.shape[1]:]
        a = 0
        while a < k and drafted[a] == t[a]:
            a += 1
        seq = torch.cat([seq, drafted[:a][None], t[a:a + 1][None]], 1)
        produced, accepted, steps = produced + a + 1, accepted + a, steps + 1
    return accepted, steps


def test_acceptance_matches_naive_speculative_decoding():
    cfg = tp.Config(**tp.SMOKE)
    special = {"bos": 1, "eos": 0, "pad": 2}
    target = tp.build_model(cfg, cfg.target, 256, special, seed=0).eval()
    # an untrained model with tied embeddings repeats its last token; a separate random head does not
    torch.manual_seed(2)
    target.lm_head.weight = torch.nn.Parameter(torch.randn(256, cfg.target.hidden))
    draft = copy.deepcopy(target)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():  # a draft that agrees with the target often, not always
            p.add_(torch.randn_like(p) * p.std() * 0.2)
    prompts = torch.randint(3, 256, (3, 8), generator=torch.Generator().manual_seed(0))
    fast = tp.acceptance(target, draft, prompts, gen_len=12, ks=(1, 3))
    for r in fast:
        naive = [_naive_greedy_sd(target, draft, prompts[i:i + 1], 12, r["k"]) for i in range(len(prompts))]
        assert (r["accepted"], r["verify_steps"]) == (sum(a for a, _ in naive), sum(s for _, s in naive))
    assert 0 < fast[0]["acceptance_rate"] < 1  # the comparison saw both accepts and rejects


# ----------------------------------------------------------------------------------- smoke end to end


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    base = tmp_path_factory.mktemp("smoke")
    out, ckpt = base / "out", base / "ckpt"
    args = ["--smoke", "--out", str(out), "--ckpt-dir", str(ckpt)]
    assert tp.main(args + ["--step-limit", "15"]) == 3  # interrupted inside the target stage
    interrupted = torch.load(ckpt / "target.pt", weights_only=False)
    assert not (ckpt / "draft.pt").exists() and not (out / "report.md").exists()
    assert tp.main(args) == 0  # resumes the target, trains the draft, writes everything
    stamps = {p.name: p.stat().st_mtime_ns for p in (ckpt / "target.pt", ckpt / "draft.pt", ckpt / "prep" / "prep.json")}
    assert tp.main(args) == 0  # everything finished: only export and evaluation run again
    rerun_stamps = {p.name: p.stat().st_mtime_ns for p in (ckpt / "target.pt", ckpt / "draft.pt", ckpt / "prep" / "prep.json")}
    # the target once more, uninterrupted, in its own checkpoint folder
    straight = base / "straight"
    shutil.copytree(ckpt / "prep", straight / "prep")   # the same prep: only the target's training is compared
    assert tp.main(["--smoke", "--out", str(base / "unused"), "--ckpt-dir", str(straight), "--stop-after", "target"]) == 0
    return {"out": out, "ckpt": ckpt, "interrupted": interrupted, "stamps": (stamps, rerun_stamps), "straight": straight}


def test_smoke_resume_continues_and_skips_finished_stages(smoke):
    assert smoke["interrupted"]["step"] == 15 and not smoke["interrupted"]["done"]
    resumed = torch.load(smoke["ckpt"] / "target.pt", weights_only=False)
    straight = torch.load(smoke["straight"] / "target.pt", weights_only=False)
    assert resumed["done"] and resumed["step"] == straight["step"] == tp.SMOKE["target_steps"]
    # continuing from step 15 gives the weights of an uninterrupted run: data order and LR depend on the step only
    for name, w in straight["model"].items():
        torch.testing.assert_close(resumed["model"][name], w, rtol=1e-5, atol=1e-6)
    steps = [r["step"] for r in resumed["rows"] if r["metric"] == "train_loss"]
    assert steps == sorted(set(steps)) and steps[0] < 15 < steps[-1]
    stamps, rerun = smoke["stamps"]
    assert stamps == rerun  # the third invocation rewrote no checkpoint and no prep


def test_smoke_outputs_load_with_transformers(smoke):
    from transformers import AutoTokenizer, LlamaForCausalLM
    from safetensors import safe_open

    out = smoke["out"]
    for name in ("target", "draft"):
        d = out / name
        for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "chat_template.jinja"):
            assert (d / f).is_file(), f"{d / f} missing"
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        gen = json.loads((d / "generation_config.json").read_text())
        tok = AutoTokenizer.from_pretrained(str(d))
        assert gen["eos_token_id"] == tok.eos_token_id == tok.convert_tokens_to_ids(tp.EOS)
        model = LlamaForCausalLM.from_pretrained(str(d))
        assert model.config.tie_word_embeddings and model.config.vocab_size == len(tok)
        ids = tok("def f(x):\n    return x", return_tensors="pt").input_ids
        with torch.no_grad():
            assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tok))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / "target" / f).read_bytes() == (out / "draft" / f).read_bytes()


def test_smoke_tokenizer_round_trips_and_has_chat_template(smoke):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smoke["out"] / "target"))
    text = "class Façade:\n\tdef __init__(self, n=1_000):\n        self.n = n  # ✓ naïve\n\n\n'''doc'''\r\n"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == text
    assert {tok.bos_token, tok.eos_token, tok.pad_token} == {tp.BOS, tp.EOS, tp.PAD}
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == f"{tp.BOS}<|user|>\nhi{tp.EOS}<|assistant|>\n"
    assert tok.convert_tokens_to_ids("<|assistant|>") in tok(prompt, add_special_tokens=False).input_ids


def test_smoke_manifest(smoke):
    rows = corpus.read_manifest(smoke["out"] / "manifest.jsonl.gz")
    hashes = [r["sha256"] for r in rows]
    assert len(hashes) == len(set(hashes))
    held = {r["package"] for r in rows if r["split"] == "heldout"}
    train = {r["package"] for r in rows if r["split"] == "train"}
    assert held and train and not held & train
    assert any(r["kind"] == "code" and r["split"] == "heldout" for r in rows)
    frac = tp.SMOKE["heldout_frac"]
    assert all((r["split"] == "heldout") == corpus.is_heldout(r["package"], 0, frac) for r in rows)
    roots = corpus.site_packages_roots()
    for r in rows[:: max(1, len(rows) // 10)]:  # hashes are of the files as they are on disk
        path = next(root / r["path"] for root in roots if (root / r["path"]).is_file())
        assert hashlib.sha256(path.read_bytes()).hexdigest() == r["sha256"]
    assert (smoke["out"] / "manifest.jsonl.gz").stat().st_size < 2_000_000


def test_smoke_report_sizes_and_loss_curve(smoke):
    import pyarrow.parquet as pq

    out = smoke["out"]
    metrics = json.loads((out / "metrics.json").read_text())
    on_disk = {str(f.relative_to(out)): f.stat().st_size
               for sub in ("target", "draft") for f in (out / sub).iterdir() if f.is_file()}
    assert metrics["sizes"]["files"] == on_disk and metrics["sizes"]["total"] == sum(on_disk.values())
    assert metrics["sizes"]["ok"] and metrics["sizes"]["total"] <= tp.SIZE_LIMIT
    report = (out / "report.md").read_text()
    assert f"**{metrics['sizes']['total']:,}**" in report and "acceptance_length" in report
    assert [a["k"] for a in metrics["acceptance"]] == [1, 2, 3, 4, 5]
    for a in metrics["acceptance"]:
        assert 0 <= a["acceptance_rate"] <= 1 and a["acceptance_length"] == pytest.approx(1 + a["accepted"] / a["verify_steps"])
    assert metrics["heldout"]["target"]["code"]["loss"] > 0
    table = pq.read_table(out / "loss.parquet").to_pylist()
    assert {r["stage"] for r in table} == {"target", "draft"}
    assert {"train_loss", "heldout_code"} <= {r["metric"] for r in table if r["stage"] == "target"}
    assert {"train_kl", "train_ce"} <= {r["metric"] for r in table if r["stage"] == "draft"}
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_time_driven_stage_ends_within_the_budget(smoke, tmp_path):
    """Without pinned steps the cosine runs over seconds; the last stage must finish, not be cut off at the end.
    The smoke run's prep is reused (the fixture's own pattern): on a loaded machine the corpus scan would take
    most of the budget, leaving the stage none to schedule over."""
    shutil.copytree(smoke["ckpt"] / "prep", tmp_path / "ckpt" / "prep")
    t0 = time.time()
    rc = tp.main(["--smoke", "--target-steps", "0", "--time-budget-s", "10", "--stop-after", "target",
                  "--out", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt")])
    state = torch.load(tmp_path / "ckpt" / "target.pt", weights_only=False)
    assert rc == 0 and state["done"] and state["total_steps"] is None
    assert time.time() - t0 < 10 + 3  # the last step and the final evaluation may pass the stage's end a little
    lrs = [r["value"] for r in state["rows"] if r["metric"] == "lr"]
    assert not lrs or lrs[-1] < 0.5 * tp.Config.target_lr  # the schedule decayed with time
