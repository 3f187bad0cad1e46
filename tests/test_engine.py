"""The in-process engine (issue: foundation): greedy sd == ar token for token, acceptance
accounting, stop handling inside accepted runs, sampled sd follows the target distribution."""
import json
import shutil

import numpy as np
import pytest
import torch
from packaging.version import Version

from minedraft_ray.engine.engine import Engine
from minedraft_ray.engine.kv_blocks import SlotAllocator, SlotsExhaustedError
from minedraft_ray.engine.loader import load_model
from minedraft_ray.engine.sampling import SamplingBatch, SamplingParams, process_logits
from stats import chi_square_pvalue

PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over", "import os\nimport sys\n\n", "a",
           "class Foo:\n    def __init__(self):", "x = [1, 2, 3]\nfor i in x:", "hello world, this is a longer "
           "prompt that has quite a few more tokens than the others do", "# comment"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def ar_reference(tiny_llama):
    return Engine(tiny_llama, mode="ar", max_batch=8, device="cpu").generate(PROMPTS, GREEDY)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("max_batch", [1, 3, 8])
def test_greedy_sd_equals_ar(tiny_llama, tiny_llama_draft, ar_reference, k, max_batch):
    outs = Engine(tiny_llama, tiny_llama_draft, mode="sd", k=k, max_batch=max_batch, device="cpu").generate(
        PROMPTS, GREEDY)
    for ref, out in zip(ar_reference, outs):
        assert out.token_ids == ref.token_ids
        assert out.finish_reason == "length"
    drafted = sum(o.stats["drafted"] for o in outs)
    accepted = sum(o.stats["accepted"] for o in outs)
    rate = accepted / drafted
    # a noised copy: drafts are partly accepted, so rollback really runs
    assert 0.3 <= rate <= 0.9, rate
    steps = sum(o.stats["verify_steps"] for o in outs)
    assert abs(np.mean([o.stats["acceptance_length"] for o in outs]) - (1 + accepted / steps)) < 0.5


@pytest.mark.parametrize("family", ["tiny_qwen2", "tiny_qwen3", "tiny_mistral"])
def test_greedy_sd_equals_ar_other_families(family, request, tmp_path):
    from minedraft_ray.testing.tiny import make_noised_draft
    target = request.getfixturevalue(family)
    draft = make_noised_draft(target, tmp_path / "draft")
    ar = Engine(target, mode="ar", max_batch=4, device="cpu").generate(PROMPTS[:5], GREEDY)
    sd = Engine(target, draft, mode="sd", k=3, max_batch=4, device="cpu").generate(PROMPTS[:5], GREEDY)
    assert [o.token_ids for o in sd] == [o.token_ids for o in ar]
    assert sum(o.stats["accepted"] for o in sd) > 0


@pytest.mark.parametrize("k", [2, 4])
def test_draft_equal_to_target_accepts_everything(tiny_llama, k):
    outs = Engine(tiny_llama, tiny_llama, mode="sd", k=k, max_batch=4, device="cpu").generate(PROMPTS[:4], GREEDY)
    for o in outs:
        assert o.stats["acceptance_rate"] == 1.0
        assert o.stats["acceptance_length"] == k + 1
        assert o.stats["accepted_per_position"] == o.stats["drafted_per_position"]


def test_stop_token_inside_accepted_run(tiny_llama, ar_reference):
    # with draft == target every draft is accepted, so the stop id lands inside an accepted run
    stop = ar_reference[0].token_ids[9]
    first = ar_reference[0].token_ids.index(stop)
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(stop,))
    ar = Engine(tiny_llama, mode="ar", device="cpu").generate(PROMPTS[0], params)[0]
    sd = Engine(tiny_llama, tiny_llama, mode="sd", k=5, device="cpu").generate(PROMPTS[0], params)[0]
    assert ar.token_ids == sd.token_ids == ar_reference[0].token_ids[:first + 1]
    assert sd.finish_reason == ar.finish_reason == "stop"


def test_eos_from_generation_config_inside_accepted_run(tiny_llama, ar_reference, tmp_path):
    # Llama-3 style: several EOS ids in generation_config.json; one of them is the 8th greedy token
    model = tmp_path / "eos_model"
    shutil.copytree(tiny_llama, model)
    eos = ar_reference[2].token_ids[7]
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"] if isinstance(gen["eos_token_id"], int) else gen["eos_token_id"][0], eos]
    (model / "generation_config.json").write_text(json.dumps(gen))
    params = SamplingParams(temperature=0, max_tokens=24)
    ar = Engine(model, mode="ar", device="cpu").generate(PROMPTS[2], params)[0]
    sd = Engine(model, model, mode="sd", k=4, device="cpu").generate(PROMPTS[2], params)[0]
    cut = ar_reference[2].token_ids.index(eos) + 1
    assert ar.token_ids == sd.token_ids == ar_reference[2].token_ids[:cut]
    assert sd.finish_reason == "stop"


def test_max_tokens_inside_accepted_run(tiny_llama, ar_reference):
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    sd = Engine(tiny_llama, tiny_llama, mode="sd", k=5, device="cpu").generate(PROMPTS[:3], params)
    for ref, out in zip(ar_reference, sd):
        assert out.token_ids == ref.token_ids[:7]
        assert out.finish_reason == "length"


def test_seeded_sampling_is_deterministic(tiny_llama, tiny_llama_draft):
    eng = Engine(tiny_llama, tiny_llama_draft, mode="sd", k=3, max_batch=4, device="cpu")
    p = [SamplingParams(temperature=1.0, max_tokens=16, seed=s, ignore_eos=True) for s in (1, 1, 2)]
    a = eng.generate([PROMPTS[0]] * 3, p)
    b = eng.generate([PROMPTS[0]] * 3, p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert a[0].token_ids == a[1].token_ids        # same seed, same text, whatever the batch neighbours
    assert a[0].token_ids != a[2].token_ids


def test_bad_input(tiny_llama, tiny_llama_draft):
    eng = Engine(tiny_llama, mode="ar", max_len=64, device="cpu")
    with pytest.raises(ValueError, match="exceeds max_len"):
        eng.generate("word " * 80, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="k must be"):
        Engine(tiny_llama, tiny_llama_draft, mode="sd", k=0, device="cpu")
    with pytest.raises(ValueError, match="mode"):
        Engine(tiny_llama, mode="psd", device="cpu")
    alloc = SlotAllocator(2)
    alloc.alloc(), alloc.alloc()
    with pytest.raises(SlotsExhaustedError, match="all 2 KV slots are in use"):
        alloc.alloc()


# ---- the sampled distribution through the whole engine -----------------------------------------
def _exact_three_token_distribution(model_dir, prompt_ids, params):
    """p(t1, t2, t3 | prompt) under the processed target distribution, over the top-k support."""
    model = load_model(model_dir, "cpu", torch.float32)
    batch = SamplingBatch.build([params], "cpu", seeds=[0])

    @torch.no_grad()
    def next_probs(seq):
        cache = model.make_cache(1, len(seq) + 1)
        hidden = model(torch.tensor([seq]), cache, torch.zeros(1, dtype=torch.int64))
        return process_logits(model.compute_logits(hidden[:, -1]), batch)[0]

    joint = {}
    p1 = next_probs(prompt_ids)
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = next_probs(prompt_ids + [t1])
        for t2 in torch.nonzero(p2).flatten().tolist():
            p3 = next_probs(prompt_ids + [t1, t2])
            for t3 in torch.nonzero(p3).flatten().tolist():
                joint[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    return joint


@pytest.mark.parametrize("params,draft_temperature", [
    (dict(temperature=0.8, top_k=3), 0.0),
    (dict(temperature=1.3, top_p=0.5), 0.0),
    (dict(temperature=0.8, top_k=3), 0.7),
    (dict(temperature=1.0, top_k=4, top_p=0.8), 1.0),
])
def test_sampled_sd_follows_target_distribution(tiny_llama, tiny_llama_draft, params, draft_temperature):
    n = 2400
    eng = Engine(tiny_llama, tiny_llama_draft, mode="sd", k=2, max_batch=64, device="cpu",
                 draft_temperature=draft_temperature)
    prompt = eng.tokenizer.encode("def fibonacci(n):")
    sp = [SamplingParams(max_tokens=3, ignore_eos=True, seed=s, **params) for s in range(n)]
    outs = eng.generate([prompt] * n, sp)
    assert sum(o.stats["drafted"] for o in outs) > 0
    counts = {}
    for o in outs:
        key = tuple(o.token_ids)
        counts[key] = counts.get(key, 0) + 1
    exact = _exact_three_token_distribution(tiny_llama, prompt, SamplingParams(**params))
    assert set(counts) <= set(exact), "sampled a sequence the target gives zero probability"
    keys = sorted(exact)
    pvalue = chi_square_pvalue([counts.get(k, 0) for k in keys], [exact[k] for k in keys])
    assert pvalue > 1e-3, pvalue


def test_random_presets_load_like_checkpoints(tmp_path, monkeypatch):
    """`random:<preset>` folders (benchmarks, GPU smoke runs) go through the normal loading path."""
    from minedraft_ray.engine.presets import resolve_model
    monkeypatch.setenv("MINEDRAFT_CACHE", str(tmp_path))
    folder = resolve_model("random:tiny")
    config = json.loads((tmp_path / "random-tiny" / "config.json").read_text())
    # transformers 5.x before the fix warns of a Mistral regex on a local tokenizer whose config lacks a 5.x version
    assert Version(config["transformers_version"]) >= Version("5.0")
    out = Engine("random:tiny", "random:tiny", mode="sd", k=3, device="cpu").generate(
        "hello there", SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))[0]
    assert len(out.token_ids) == 9 and out.stats["acceptance_rate"] == 1.0   # identical random draft
    assert resolve_model(folder) == folder
    with pytest.raises(ValueError, match="unknown random preset"):
        resolve_model("random:gpt-5")


@pytest.mark.parametrize("name, arch, billions", [("qwen3-32b", "qwen3", 32.76), ("qwen3-1.7b", "qwen3", 1.72),
                                                  ("qwen3-0.6b", "qwen3", 0.596), ("llama-70b", "llama", 70.55)])
def test_random_presets_have_the_real_shapes(name, arch, billions):
    """The presets' configs parse to their models' architectures and parameter counts (on the meta device)."""
    from minedraft_ray.engine.model import ModelConfig, Transformer
    from minedraft_ray.engine.presets import preset_config
    cfg = ModelConfig.from_hf_dict(preset_config(name, 0, 1))
    with torch.device("meta"):
        model = Transformer(cfg)
    assert cfg.arch == arch and cfg.qk_norm == (arch == "qwen3") and cfg.head_dim == 128 and cfg.num_kv_heads == 8
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)
