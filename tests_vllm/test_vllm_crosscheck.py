"""Cross-check against vLLM (run by `make test-vllm` inside .venv-vllm, see docs/vllm.md).

The same fp32 tiny checkpoint in both engines: minedraft's `ar` greedy ids equal vLLM's greedy ids, and
vLLM's own draft-model speculative decoding (same draft, same k) emits the same ids as minedraft's `sd`.
"""
import gc
import os

# before vllm is imported: engine core in this process, no hub
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default would reserve several

import pytest
import torch

vllm = pytest.importorskip("vllm")

from minedraft_ray.engine.engine import Engine
from minedraft_ray.engine.sampling import SamplingParams as MineParams
from minedraft_ray.testing.tiny import make_noised_draft, make_tiny_model

PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over", "import os\nimport sys\n\n", "a",
           "class Foo:\n    def __init__(self):", "x = [1, 2, 3]\nfor i in x:"]
MAX_TOKENS = 24
K = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # plain RoPE (the check is about the decode path); head_dim 32: vLLM's CPU attention supports 32..512 only
    target = make_tiny_model(tmp_path_factory.mktemp("vllm_target"), "llama", hidden=128, heads=4, kv_heads=2)
    draft = make_noised_draft(target, tmp_path_factory.mktemp("vllm_draft"), noise=0.02)
    return target, draft


@pytest.fixture(scope="module")
def prompt_ids(pair):
    from minedraft_ray.engine.loader import load_tokenizer
    tok = load_tokenizer(pair[0])
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def minedraft_ar(pair, prompt_ids):
    params = MineParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.token_ids for o in Engine(pair[0], mode="ar", max_batch=8, device="cpu").generate(prompt_ids, params)]


def vllm_generate(prompt_ids, **llm_kwargs) -> tuple[list[list[int]], dict]:
    """Greedy token ids per prompt and vLLM's counters (e.g. 'vllm:spec_decode_num_draft_tokens')."""
    from vllm import LLM, SamplingParams

    llm = LLM(dtype="float32", max_model_len=256, max_num_seqs=8, seed=0, enforce_eager=True,
              disable_log_stats=False, **llm_kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
        counters = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        return [list(o.outputs[0].token_ids) for o in outs], counters
    finally:
        del llm
        gc.collect()


def test_ar_greedy_equals_vllm(pair, prompt_ids, minedraft_ar):
    ours = minedraft_ar
    theirs, _ = vllm_generate(prompt_ids, model=str(pair[0]))
    assert all(len(t) == MAX_TOKENS for t in theirs)
    assert ours == theirs


@pytest.fixture(scope="module")
def minedraft_sd(pair, prompt_ids):
    params = MineParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return Engine(pair[0], pair[1], mode="sd", k=K, max_batch=8, device="cpu").generate(prompt_ids, params)


def test_sd_greedy_equals_vllm_draft_model(pair, prompt_ids, minedraft_ar, minedraft_sd):
    outs = minedraft_sd
    ours = [o.token_ids for o in outs]
    theirs, counters = vllm_generate(prompt_ids, model=str(pair[0]), speculative_config={
        "method": "draft_model", "model": str(pair[1]), "num_speculative_tokens": K})
    assert ours == minedraft_ar
    assert ours == theirs
    # vLLM really speculated (a silently disabled SD would also match ar), and both engines accepted the very
    # same drafts: greedy drafting and greedy acceptance are deterministic per sequence
    drafted, accepted = counters["vllm:spec_decode_num_draft_tokens"], counters["vllm:spec_decode_num_accepted_tokens"]
    our_drafted, our_accepted = sum(o.stats["drafted"] for o in outs), sum(o.stats["accepted"] for o in outs)
    print(f"vLLM drafted {drafted} accepted {accepted}; minedraft drafted {our_drafted} accepted {our_accepted}")
    assert 0 < accepted < drafted
    assert (drafted, accepted) == (our_drafted, our_accepted)


def test_vllm_verifier_with_minedraft_drafter_plugin(pair, prompt_ids, minedraft_ar, minedraft_sd, monkeypatch):
    """vLLM verifies, minedraft's draft model proposes through vLLM's `custom_class` hook (docs/vllm.md):
    lossless (ar's ids) and the same drafts as minedraft sd (same accepted count)."""
    monkeypatch.setenv("MINEDRAFT_VLLM_DRAFT", str(pair[1]))
    theirs, counters = vllm_generate(prompt_ids, model=str(pair[0]), speculative_config={
        "method": "custom_class", "model": "bench.vs_vllm.MinedraftProposer", "num_speculative_tokens": K})
    assert theirs == minedraft_ar
    drafted, accepted = counters["vllm:spec_decode_num_draft_tokens"], counters["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted
    assert (drafted, accepted) == (sum(o.stats["drafted"] for o in minedraft_sd),
                                   sum(o.stats["accepted"] for o in minedraft_sd))
