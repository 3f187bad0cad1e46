"""Our Transformer over the slot KV cache must reproduce transformers' own forward (fp32)."""
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from minedraft_ray.engine.loader import load_model, load_tokenizer
from minedraft_ray.engine.model import ModelConfig, rope_inv_freq
from minedraft_ray.testing.tiny import greedy_acceptance_rate

FAMILIES = ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_mistral"]
ATOL = 1e-4


@pytest.fixture(params=FAMILIES)
def pair(request):
    """(ours, transformers') for one tiny checkpoint."""
    path = request.getfixturevalue(request.param)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return load_model(path, "cpu"), hf


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, V]


def _random_ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_fixtures_cover_each_variant(tiny_llama, tiny_qwen2, tiny_qwen3, tiny_mistral):
    llama, qwen2, qwen3 = (ModelConfig.from_pretrained(p) for p in (tiny_llama, tiny_qwen2, tiny_qwen3))
    assert llama.rope_scaling["rope_type"] == "llama3"
    unscaled = dataclasses.replace(llama, rope_scaling=None)
    assert not torch.allclose(rope_inv_freq(llama), rope_inv_freq(unscaled))  # scaling really changes RoPE
    assert qwen2.attention_bias and qwen2.tie_word_embeddings
    assert qwen3.qk_norm
    assert ModelConfig.from_pretrained(tiny_mistral).arch == "mistral"


@torch.no_grad()
def test_batched_prefill_matches_transformers(pair):
    model, hf = pair
    prompts = [_random_ids(n, seed) for seed, n in enumerate([7, 3, 11])]
    slots = torch.tensor([2, 0, 3])
    cache = model.make_cache(num_slots=4, max_len=32)
    longest = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (longest - len(p)) for p in prompts])  # padded rows; pad outputs ignored
    logits = model.compute_logits(model(ids, cache, slots))  # [B, T, V]
    assert logits.dtype == torch.float32
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[row, :len(prompt)], _hf_logits(hf, prompt), atol=ATOL, rtol=0)
    assert cache.lengths.tolist() == [0, 0, 0, 0]  # forward never advances lengths


@pytest.mark.parametrize("chunk", [1, 3])
@torch.no_grad()
def test_incremental_decode_matches_transformers(pair, chunk):
    """Two rows at different lengths decode together in chunks of `chunk` tokens (q=1 decode, q=3 verify)."""
    model, hf = pair
    prompts = [_random_ids(5, 10), _random_ids(9, 11)]
    continuations = [_random_ids(6, 12), _random_ids(6, 13)]
    slots = torch.tensor([3, 1])
    cache = model.make_cache(num_slots=4, max_len=32)
    # padded prefill writes junk K/V past the short prompt; decode must overwrite it, not read it
    ids = torch.tensor([prompts[0] + [0] * 4, prompts[1]])
    model(ids, cache, slots)
    cache.lengths[slots] += torch.tensor([5, 9])
    got = [[], []]
    for start in range(0, 6, chunk):
        step = torch.tensor([c[start:start + chunk] for c in continuations])  # [2, chunk]
        got_step = model.compute_logits(model(step, cache, slots))
        cache.lengths[slots] += chunk
        for row in range(2):
            got[row].append(got_step[row])
    assert cache.lengths[slots].tolist() == [11, 15]
    for row in range(2):
        full = _hf_logits(hf, prompts[row] + continuations[row])
        want = full[len(prompts[row]):]  # logits at the continuation tokens' positions
        torch.testing.assert_close(torch.cat(got[row]), want, atol=ATOL, rtol=0)


@torch.no_grad()
def test_bfloat16_load_stays_close(tiny_llama):
    """bf16 weights + fp32 RoPE table; same argmax as fp32 on most positions."""
    fp32, bf16 = load_model(tiny_llama, "cpu"), load_model(tiny_llama, "cpu", dtype=torch.bfloat16)
    assert bf16.embed_tokens.weight.dtype == torch.bfloat16 and bf16.rope_cache.dtype == torch.float32
    ids, slots = torch.tensor([_random_ids(16, 3)]), torch.tensor([0])
    a = fp32.compute_logits(fp32(ids, fp32.make_cache(1, 32), slots))
    b = bf16.compute_logits(bf16(ids, bf16.make_cache(1, 32), slots))
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.5 and (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75


def test_noised_draft_is_partly_accepted(tiny_llama, tiny_llama_draft):
    target, draft = load_model(tiny_llama, "cpu"), load_model(tiny_llama_draft, "cpu")
    tok = load_tokenizer(tiny_llama)
    prompts = [tok(s).input_ids for s in ["The quick brown fox", "def fibonacci(n):", "Once upon a time"]]
    assert greedy_acceptance_rate(target, target, prompts[:1], steps=8) == 1.0
    rate = greedy_acceptance_rate(target, draft, prompts, steps=32)
    assert 0.3 <= rate <= 0.9, rate


@torch.no_grad()
def test_column_major_weights_match_transformers(pair):
    """The runner keeps some projections column-major on CUDA (runner.TRANSPOSED_WEIGHTS); the model must
    still compute the same function: checked here on the CPU with every linear weight relaid out."""
    from minedraft_ray.engine.runner import relayout_weights_

    model, hf = pair
    relayout_weights_(model, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"))
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert weights and not any(w.is_contiguous() for w in weights)
    prompt = _random_ids(9, seed=5)
    cache = model.make_cache(num_slots=1, max_len=16)
    logits = model.compute_logits(model(torch.tensor([prompt]), cache, torch.tensor([0])))[0]
    torch.testing.assert_close(logits, _hf_logits(hf, prompt), atol=ATOL, rtol=0)
