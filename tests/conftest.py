"""Session-wide tiny checkpoints (random weights, real HF format), built once into a temp dir."""
import pytest


from minedraft_ray.testing.tiny import make_noised_draft, make_tiny_model
from ray_cluster import post_mortem, ray_cluster  # noqa: F401  (one Ray cluster per test session)
from engines import CACHE as ENGINES, SHARING_FILES

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

# `make test` (-n 2 --dist loadfile --no-loadscope-reorder) hands whole files to its two workers in collection
# order, except that the files sharing started engines (tests/engines.py) go together, as one unit, to one worker
# (SharedEnginesTogether): the slowest go first (by their seconds in README's table), so that both workers end together
# instead of one running a long file alone at the end. The other files (a few seconds each) follow in their usual
# order.
SLOWEST_FIRST = ("test_runtime.py", "test_runtime_regimes.py", "test_chunked_prefill.py", "test_cli.py",
                 "test_cluster.py", "test_runtime_faults.py", "test_security.py", "test_openai_compat.py",
                 "test_bench_scripts.py", "test_serve.py", "test_runtime_sampling.py", "test_tensor_parallel.py",
                 "test_runtime_paging.py", "test_attention_triton.py", "test_serve_bench.py", "test_bench_smoke.py",
                 "test_draft_identity.py", "test_metrics.py", "test_real_traffic_bench.py", "test_training.py",
                 "test_serve_streams.py", "test_layering.py", "test_ray_collective.py", "test_engine.py",
                 "test_scheduler.py", "test_tp_serve.py", "test_link.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: a file's tests keep their order


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the files that share started engines one unit of work (xdist's own grouping,
    --dist loadgroup, sets a node id that pytest 9 no longer reads)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedEnginesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "shared engines" if scope.rsplit("/", 1)[-1] in SHARING_FILES else scope

    return SharedEnginesTogether(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure that names a dead Ray worker process carries what the cluster's logs say of it (post_mortem)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        found = post_mortem(str(report.longrepr))
        if found:
            report.sections.append(("Ray post-mortem", found))


def pytest_runtest_setup(item):
    if item.path.name not in SHARING_FILES:
        ENGINES.close()   # the shared engines' files are done on this worker: give their (fake) GPUs back


@pytest.fixture(scope="session")
def shared_engines(ray_cluster):
    yield ENGINES
    ENGINES.close()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    # Llama-3.1 style RoPE scaling; original context 64 puts head-dim frequencies in all three bands
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", rope_scaling=LLAMA3_ROPE)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    # tied embeddings and q/k/v biases, like Qwen2.5-0.5B
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", tie=True, seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", seed=2)


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_mistral"), "mistral", seed=3)


@pytest.fixture(scope="session")
def tiny_llama_draft(tiny_llama, tmp_path_factory):
    # noise 0.02: greedy acceptance ~0.78 at k=1 and ~0.49 at k=5, inside the 0.3..0.9 the tests require
    return make_noised_draft(tiny_llama, tmp_path_factory.mktemp("tiny_llama_draft"), noise=0.02)


# the runtime tests' ar references (tests/runtime_common.py's prompts), one per module that asks
@pytest.fixture(scope="module")
def reference(tiny_llama):
    from runtime_common import LENGTHS, PROMPTS, greedy
    from minedraft_ray.engine.engine import Engine

    eng = Engine(tiny_llama, mode="ar", max_batch=8, device="cpu")
    return eng.generate(PROMPTS, [greedy(n) for n in LENGTHS])


@pytest.fixture(scope="module")
def reference_10(tiny_llama):
    from runtime_common import PROMPTS, greedy
    from minedraft_ray.engine.engine import Engine

    return Engine(tiny_llama, mode="ar", max_batch=8, device="cpu").generate(PROMPTS, greedy(10))
