"""A Hugging Face model folder's config.json and generation_config.json, read without torch: `ModelSpec` is the
architecture they declare, which the engine builds its ModelConfig (engine/model.py) from and the runtime's manager
reads its limits from; the Serve ingress, which runs no model, takes the EOS ids."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


def read_hf_config(path) -> tuple[dict, dict]:
    """(config.json, generation_config.json or {}) of model folder `path`."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json (expected a Hugging Face model folder)")
    hf = json.loads((path / "config.json").read_text())
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    return hf, gen


def as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def eos_token_ids(hf: dict, gen: dict | None = None) -> tuple[int, ...]:
    """The union of config.json's and generation_config.json's EOS ids, in that order."""
    return tuple(dict.fromkeys(as_ids(hf.get("eos_token_id")) + as_ids((gen or {}).get("eos_token_id"))))


ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
CHECKPOINT_DTYPES = ("float32", "float16", "bfloat16")   # the dtypes a checkpoint may declare


class UnsupportedArchitectureError(ValueError):
    pass


def _unsupported(what: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"{what}; supported architectures: {', '.join(ARCHITECTURES)} "
        "(SiLU MLP, RoPE of type default/linear/llama3, no sliding window)")


@dataclass
class ModelSpec:
    """A model's architecture as its config.json (and generation_config.json) declares it, checked against what the
    engine runs; its dtype by name (engine/model.py's ModelConfig is the same with its torch dtype)."""
    arch: str                      # "llama" | "qwen2" | "qwen3" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None     # rope_type "llama3" or "linear"; None = plain RoPE
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False         # bias on q/k/v (Qwen2 always)
    qk_norm: bool = False                # Qwen3: per-head RMSNorm on q and k before RoPE
    eos_token_ids: tuple[int, ...] = ()  # union of config.json and generation_config.json eos ids
    bos_token_id: int | None = None
    dtype: str = "bfloat16"              # the checkpoint's dtype, one of CHECKPOINT_DTYPES

    @classmethod
    def from_pretrained(cls, path) -> "ModelSpec":
        return cls.from_hf_dict(*read_hf_config(path))

    @classmethod
    def from_hf_dict(cls, hf: dict, gen: dict | None = None) -> "ModelSpec":
        names = hf.get("architectures") or []
        arch = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
        if arch is None:
            raise _unsupported(f"unsupported architecture {names or hf.get('model_type')!r}")
        if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias", False):
            raise _unsupported(f"unsupported MLP (hidden_act={hf.get('hidden_act')!r}, mlp_bias={hf.get('mlp_bias')})")

        # transformers >= 5 folds rope_theta/rope_scaling into rope_parameters; older configs keep them apart
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise _unsupported(f"unsupported rope_type {rope_type!r}")
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}

        max_pos = int(hf.get("max_position_embeddings", 4096))
        window = hf.get("sliding_window") if hf.get("use_sliding_window", arch == "mistral") else None
        if window:
            # no sliding-window attention here: contexts up to the window are exact, longer ones are refused
            max_pos = min(max_pos, int(window))

        heads = int(hf["num_attention_heads"])
        dtype_name = hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"
        if dtype_name not in CHECKPOINT_DTYPES:
            raise ValueError(f"unsupported checkpoint dtype {dtype_name!r}")
        bos = hf.get("bos_token_id", (gen or {}).get("bos_token_id"))
        return cls(
            arch=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(hf.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            eos_token_ids=eos_token_ids(hf, gen),
            bos_token_id=None if bos is None else int(as_ids(bos)[0]),
            dtype=dtype_name,
        )
