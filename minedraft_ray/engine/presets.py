"""Random-weight models at real shapes, for benchmarks and GPU smoke runs (no hub is reachable).

A spec `random:<preset>` resolves to a model folder like any checkpoint: config.json,
generation_config.json and tokenizer files, plus `random_weights.json` in place of safetensors,
which tells `load_model` to initialise weights on the device instead of reading them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

RANDOM_PREFIX = "random:"
RANDOM_MARKER = "random_weights.json"

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
# what the Qwen3 dense checkpoints share (model_type, RoPE base, head size, vocabulary, norm eps)
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=128, vocab_size=151936,
              rms_norm_eps=1e-6, rope_scaling={"rope_type": "default", "rope_theta": 1000000.0},
              max_position_embeddings=40960)
PRESETS = {
    # Llama-3.1-8B
    "llama-8b": dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=128256, tie_word_embeddings=False, rope_scaling=_LLAMA3_ROPE),
    # Llama-3.2-1B
    "llama-1b": dict(architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                     vocab_size=128256, tie_word_embeddings=True, rope_scaling=_LLAMA3_ROPE),
    # Llama-3.1-70B (about 140 GB in bf16: tensor parallel on one host)
    "llama-70b": dict(architectures=["LlamaForCausalLM"], hidden_size=8192, intermediate_size=28672,
                      num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                      vocab_size=128256, tie_word_embeddings=False, rope_scaling=_LLAMA3_ROPE),
    # Qwen3-32B (the MineDraft paper's target at tp 4)
    "qwen3-32b": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
    # Qwen3-1.7B
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    # Qwen3-0.6B
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    # small shapes for CPU smoke runs of the same code path
    "tiny": dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 vocab_size=512, tie_word_embeddings=False, rope_scaling=None),
}


def cache_root() -> Path:
    return Path(os.environ.get("MINEDRAFT_CACHE", Path.home() / ".cache" / "minedraft"))


def resolve_model(spec: str | os.PathLike | None, revision: str | None = None,
                  download_dir: str | os.PathLike | None = None) -> str | None:
    """A model folder for `spec`: a path is returned as is; `random:<preset>` is materialised once; a Hub id
    ("org/name") is the snapshot that engine/hub.py downloads or finds in the cache."""
    if spec is None or not str(spec).startswith(RANDOM_PREFIX):
        from .hub import resolve_hub_model
        return resolve_hub_model(spec, revision, download_dir)
    name = str(spec)[len(RANDOM_PREFIX):]
    if name not in PRESETS:
        raise ValueError(f"unknown random preset {name!r}; known: {sorted(PRESETS)}")
    folder = cache_root() / f"random-{name}"
    if (folder / RANDOM_MARKER).is_file():
        return str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(folder, PRESETS[name]["vocab_size"])
    config = preset_config(name, tok.bos_token_id, tok.eos_token_id)
    # as save_pretrained writes it: without it, some transformers 5.x releases take a local tokenizer for one of
    # Mistral's with a broken regex and warn on every load
    from transformers import __version__ as transformers_version
    config["transformers_version"] = transformers_version
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id}))
    (folder / RANDOM_MARKER).write_text(json.dumps({"preset": name, "std": 0.02}))
    return str(folder)


def preset_config(name: str, bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict:
    """The config.json of preset `name` (without the transformers version)."""
    preset = dict(PRESETS[name])
    rope = dict(preset.pop("rope_scaling") or {})
    config = {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
              "rope_theta": rope.pop("rope_theta", 10000.0), "torch_dtype": "bfloat16",
              "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, **preset}
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    return config


def _tokenizer(folder: Path, vocab_size: int):
    """The tiny byte-level tokenizer, padded with reserved tokens to the model's vocabulary so
    that every id the model can emit is a token (draft/target checks see equal vocabularies).
    They are plain (not special) tokens, so a random model's output shows up as text in a stream."""
    from .byte_tokenizer import build_tokenizer
    tok = build_tokenizer(folder)
    missing = vocab_size - len(tok)
    if missing > 0:
        tok.add_tokens([f"<|reserved_{i}|>" for i in range(missing)], special_tokens=False)
        tok.save_pretrained(str(folder))
    return tok


def is_random(folder: str | os.PathLike) -> bool:
    return (Path(folder) / RANDOM_MARKER).is_file()

