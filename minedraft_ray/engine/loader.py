"""Load Hugging Face safetensors checkpoints into `Transformer`, and check target/draft compatibility.

Weights go straight to the device: the model is built on the meta device, given uninitialised device
storage, and each checkpoint tensor (read by safetensors on the device) is copied into its slice of the
fused qkv_proj / gate_up_proj parameters.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from .model import ModelConfig, Transformer, rope_cos_sin
from .presets import init_random_, is_random

log = logging.getLogger(__name__)

# HF tensors that we never load: precomputed RoPE tables of old checkpoints
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    pass


class IncompatiblePairError(ValueError):
    pass


@dataclass
class PairInfo:
    shared_vocab: int  # ids both models may emit; logits at ids >= shared_vocab must be masked


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{path}: shards listed in {index.name} are missing: {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files (only safetensors checkpoints are supported)")
    return files


def _weight_slices(model: Transformer) -> dict[str, tuple[torch.Tensor, int, int]]:
    """HF tensor name -> (parameter, first row, end row) in our (fused) parameters."""
    cfg = model.cfg
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    slices = {}

    def whole(hf_name, param):
        slices[hf_name] = (param, 0, param.shape[0])

    whole("model.embed_tokens.weight", model.embed_tokens.weight)
    whole("model.norm.weight", model.norm.weight)
    if model.lm_head is not None:
        whole("lm_head.weight", model.lm_head.weight)
    for i, layer in enumerate(model.layers):
        pre, attn, mlp = f"model.layers.{i}.", layer.self_attn, layer.mlp
        whole(pre + "input_layernorm.weight", layer.input_layernorm.weight)
        whole(pre + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
        kinds = ["weight"] + (["bias"] if attn.qkv_proj.bias is not None else [])
        for kind in kinds:
            fused = getattr(attn.qkv_proj, kind)
            slices[pre + f"self_attn.q_proj.{kind}"] = (fused, 0, q)
            slices[pre + f"self_attn.k_proj.{kind}"] = (fused, q, q + kv)
            slices[pre + f"self_attn.v_proj.{kind}"] = (fused, q + kv, q + 2 * kv)
        whole(pre + "self_attn.o_proj.weight", attn.o_proj.weight)
        if attn.o_proj.bias is not None:
            whole(pre + "self_attn.o_proj.bias", attn.o_proj.bias)
        if attn.q_norm is not None:
            whole(pre + "self_attn.q_norm.weight", attn.q_norm.weight)
            whole(pre + "self_attn.k_norm.weight", attn.k_norm.weight)
        slices[pre + "mlp.gate_proj.weight"] = (mlp.gate_up_proj.weight, 0, inter)
        slices[pre + "mlp.up_proj.weight"] = (mlp.gate_up_proj.weight, inter, 2 * inter)
        whole(pre + "mlp.down_proj.weight", mlp.down_proj.weight)
    return slices


def load_model(path, device, dtype: torch.dtype | None = None) -> Transformer:
    path = Path(path)
    cfg = ModelConfig.from_pretrained(path)
    random_weights = is_random(path)   # a `random:<preset>` folder (benchmarks): no safetensors to read
    files = [] if random_weights else _checkpoint_files(path)
    if dtype is not None:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    device = torch.device(device)

    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.rope_cache = rope_cos_sin(cfg, device)
    if random_weights:
        init_random_(model)
        return model.requires_grad_(False).eval()

    slices = _weight_slices(model)
    loaded, unexpected = set(), []
    with torch.no_grad():
        # a progress bar on a terminal (tqdm stays silent when stderr is not a TTY: actors, CI)
        bar = tqdm(total=len(slices), desc=f"loading {path.name}", unit="tensor", disable=None, leave=False)
        for file in files:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    bar.update(name in slices)
                    if name not in slices:
                        if not name.endswith(_IGNORED_SUFFIXES) and not (name == "lm_head.weight" and model.lm_head is None):
                            unexpected.append(name)
                        continue
                    param, start, end = slices[name]
                    tensor = f.get_tensor(name)
                    target = param[start:end]
                    if tensor.shape != target.shape:
                        raise CheckpointError(f"{file.name}: tensor {name} has shape {tuple(tensor.shape)}, "
                                              f"expected {tuple(target.shape)} from config.json")
                    target.copy_(tensor)
                    loaded.add(name)
        bar.close()
    missing = sorted(set(slices) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"{path}: checkpoint lacks {len(missing)} tensors the model needs: {shown}")
    if unexpected:
        log.warning("%s: ignored %d unknown tensors, e.g. %s", path, len(unexpected), unexpected[0])
    return model.requires_grad_(False).eval()


_TRANSFORMERS_IMPORT = threading.Lock()


def load_tokenizer(path):
    # transformers' lazy module is not thread-safe on first use: two engines built in threads at once (data-parallel
    # replicas in one process) can fail with "cannot import name 'AutoTokenizer'"
    with _TRANSFORMERS_IMPORT:
        from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer folder {path} does not exist")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_chat_template(value: str) -> str:
    """A chat template given as a file path or as the Jinja text itself (vLLM's --chat-template)."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:   # a long inline template is no valid path
        pass
    if any(c in value for c in "{}\n"):
        return value
    raise FileNotFoundError(f"chat template {value!r}: no such file, and it is no Jinja template either")


def _merges(path: Path) -> list[tuple[str, ...]] | None:
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    merges = json.loads(file.read_text()).get("model", {}).get("merges")
    if merges is None:
        return None
    # tokenizers < 0.20 writes "a b", newer versions ["a", "b"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]


def _special_tokens(tok) -> dict[str, int]:
    specials = {t.content: i for i, t in tok.added_tokens_decoder.items() if t.special}
    for t in tok.all_special_tokens:
        specials[t] = tok.convert_tokens_to_ids(t)
    return specials


def _describe_dict_diff(name: str, a: dict, b: dict) -> str:
    only_a, only_b = a.keys() - b.keys(), b.keys() - a.keys()
    moved = [k for k in a.keys() & b.keys() if a[k] != b[k]]
    parts = []
    if only_a:
        parts.append(f"{len(only_a)} only in target (e.g. {sorted(only_a)[0]!r})")
    if only_b:
        parts.append(f"{len(only_b)} only in draft (e.g. {sorted(only_b)[0]!r})")
    if moved:
        k = sorted(moved)[0]
        parts.append(f"{len(moved)} with different ids (e.g. {k!r}: {a[k]} vs {b[k]})")
    return f"{name} differ: " + "; ".join(parts)


def check_pair(target_path, draft_path) -> PairInfo:
    """Raise IncompatiblePairError unless the draft's token ids mean the same text as the target's."""
    target_path, draft_path = Path(target_path), Path(draft_path)
    target_cfg, draft_cfg = ModelConfig.from_pretrained(target_path), ModelConfig.from_pretrained(draft_path)
    target_tok, draft_tok = load_tokenizer(target_path), load_tokenizer(draft_path)
    problems = []
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        problems.append(_describe_dict_diff("vocabularies", target_vocab, draft_vocab))
    target_merges, draft_merges = _merges(target_path), _merges(draft_path)
    if target_merges is not None and draft_merges is not None and target_merges != draft_merges:
        first = next((i for i, (a, b) in enumerate(zip(target_merges, draft_merges)) if a != b),
                     min(len(target_merges), len(draft_merges)))
        problems.append(f"BPE merges differ ({len(target_merges)} vs {len(draft_merges)} merges, "
                        f"first difference at merge {first})")
    target_special, draft_special = _special_tokens(target_tok), _special_tokens(draft_tok)
    if target_special != draft_special:
        problems.append(_describe_dict_diff("special tokens", target_special, draft_special))
    if set(target_cfg.eos_token_ids) != set(draft_cfg.eos_token_ids):
        problems.append(f"EOS ids differ: target {list(target_cfg.eos_token_ids)}, "
                        f"draft {list(draft_cfg.eos_token_ids)}")
    if problems:
        raise IncompatiblePairError(f"draft {draft_path} cannot draft for target {target_path}: "
                                    + "; ".join(problems))
    # embeddings may be padded past the tokenizer (e.g. 151,936 vs 152,064): only real tokens are shared
    return PairInfo(shared_vocab=min(len(target_tok), target_cfg.vocab_size, draft_cfg.vocab_size))
