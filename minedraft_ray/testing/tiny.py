"""Tiny random checkpoints in real Hugging Face format, built offline, for tests.

`make_tiny_model` saves a transformers model (LlamaForCausalLM etc.) with a byte-level BPE tokenizer
trained here on a small embedded text. Weights are scaled so logits are well separated (greedy argmax
does not flip between a q=1 and a q=k+1 forward) but not one-hot (sampling stays random).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..engine.byte_tokenizer import build_tokenizer  # noqa: F401  (tests import it from here)

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
LOGIT_STD = 3.0  # spread of the output logits: top-1/top-2 gaps far above fp32 noise, yet sampling is not one-hot


def _hf_config(family: str, vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int,
               tie: bool, rope_scaling, bos: int, eos: int, dtype: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=3 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=hidden // heads, max_position_embeddings=2048, rms_norm_eps=1e-6,
                  tie_word_embeddings=tie, bos_token_id=bos, eos_token_id=eos, pad_token_id=0, dtype=dtype)
    if rope_scaling is not None:
        common["rope_scaling"] = rope_scaling
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(**common)
    if family == "mistral":
        return MistralConfig(sliding_window=None, **common)
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def _randomize(model, seed: int, hidden: int) -> None:
    """Re-draw every parameter: HF's init leaves norms at 1 and biases at 0, which would hide loading bugs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(noise * LOGIT_STD / hidden ** 0.5)
            else:  # a gain > 1 keeps attention sharp and position dependent, so text does not collapse into loops
                p.copy_(noise * 1.5 / p.shape[1] ** 0.5)


def make_tiny_model(out_dir, family: str = "llama", vocab_size: int = 512, hidden: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, seed: int = 0, tie: bool = False, rope_scaling=None,
                    eos_token_ids=None, dtype: str = "float32", vocab_pad: int = 0) -> Path:
    """Save a random `family` checkpoint (+ tokenizer) in `out_dir`; the embedding has vocab_size + vocab_pad rows."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir, vocab_size)
    cfg = _hf_config(family, vocab_size + vocab_pad, hidden, layers, heads, kv_heads, tie, rope_scaling,
                     tok.bos_token_id, tok.eos_token_id, dtype)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed, hidden)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
        eos_token_id=list(eos_token_ids) if eos_token_ids is not None else tok.eos_token_id)
    model.to(getattr(torch, dtype)).save_pretrained(str(out_dir))
    return out_dir


def make_noised_draft(target_dir, out_dir, noise: float = 0.04, seed: int = 1) -> Path:
    """Copy of `target_dir` whose weights get Gaussian noise of `noise` x each tensor's std.

    The default noise gives a greedy acceptance rate of 0.60..0.71 (seeds 1..5) against the default tiny llama:
    the random tiny models are chaotic, so a few percent of noise already flips a third of the argmaxes.
    """
    from safetensors.torch import load_file, save_file

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    shutil.copytree(target_dir, out_dir, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for file in sorted(out_dir.glob("*.safetensors")):
        tensors = load_file(str(file))
        for name in sorted(tensors):
            t = tensors[name]
            scale = t.float().std() if t.numel() > 1 else t.float().abs()
            if "norm" in name:  # norm weights sit around 1; perturb their spread, not their mean
                scale = (t.float() - 1).std()
            t32 = t.float() + noise * scale * torch.randn(t.shape, generator=gen)
            tensors[name] = t32.to(t.dtype)
        save_file(tensors, str(file), metadata={"format": "pt"})
    return out_dir


@torch.no_grad()
def greedy_acceptance_rate(target_model, draft_model, prompts, steps: int) -> float:
    """Fraction of positions along the target's greedy continuation where the draft's argmax equals the target's.

    prompts: lists of token ids. Each prompt is continued greedily by the target for `steps` tokens; both
    models then see the same prefixes, so this is the per-token acceptance of a greedy draft.
    """
    device = target_model.embed_tokens.weight.device
    agree = total = 0
    for prompt in prompts:
        max_len = len(prompt) + steps
        target_cache = target_model.make_cache(1, max_len)
        slots = torch.zeros(1, dtype=torch.int64, device=device)
        ids = torch.tensor([prompt], device=device)
        seq = list(prompt)
        for _ in range(steps):
            hidden = target_model(ids, target_cache, slots)
            target_cache.lengths[slots] += ids.shape[1]
            nxt = int(target_model.compute_logits(hidden[0, -1]).argmax())
            seq.append(nxt)
            ids = torch.tensor([[nxt]], device=device)
        draft_cache = draft_model.make_cache(1, max_len)
        hidden = draft_model(torch.tensor([seq[:-1]], device=device), draft_cache, slots)
        draft_next = draft_model.compute_logits(hidden[0, len(prompt) - 1:]).argmax(-1)  # [steps]
        agree += int((draft_next == torch.tensor(seq[len(prompt):], device=device)).sum())
        total += steps
    return agree / total

