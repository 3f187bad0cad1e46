"""Load Hugging Face safetensors checkpoints into `Transformer` (engine/pair.py checks a target/draft pair).

Weights go straight to the device: the model is built on the meta device, given uninitialised device
storage, and each checkpoint tensor (read by safetensors on the device) is copied into its slice of the
fused qkv_proj / gate_up_proj parameters. A tensor-parallel rank (engine/parallel.py) reads only its shard of
each tensor (safetensors' get_slice), never the whole checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from .model import ModelConfig, Transformer, rope_cos_sin
from .presets import is_random
from .tokenizer import load_chat_template, load_tokenizer  # noqa: F401 - imported from here too

log = logging.getLogger(__name__)

# HF tensors that we never load: precomputed RoPE tables of old checkpoints
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    pass


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


@dataclass(frozen=True)
class WeightSlice:
    """Where a checkpoint tensor goes: rows [start, end) of `param`, from the checkpoint tensor's part
    [source_start, source_end) along `source_dim` (None: all of it; a tensor-parallel shard otherwise)."""
    param: torch.Tensor
    start: int
    end: int
    source_dim: int | None = None
    source_start: int = 0
    source_end: int = 0


def _weight_slices(model: Transformer) -> dict[str, WeightSlice | None]:
    """HF tensor name -> its WeightSlice in our (fused, maybe sharded) parameters; None: a tensor this rank does
    not hold (a row-parallel bias, added by rank 0 only)."""
    cfg, tp = model.cfg, model.tp
    rank = tp.rank if tp else 0
    attn0 = model.layers[0].self_attn
    q, kv = attn0.q_size, attn0.kv_size                    # this rank's q and k/v rows
    inter = model.layers[0].mlp.down_proj.in_features      # this rank's MLP columns
    slices: dict[str, WeightSlice | None] = {}

    def whole(hf_name, param):
        slices[hf_name] = WeightSlice(param, 0, param.shape[0])

    def part(hf_name, param, start, end, dim, size):
        """Rows [start, end) of param take this rank's `size` rows (dim 0) or columns (dim 1) of the tensor."""
        slices[hf_name] = WeightSlice(param, start, end, dim if tp else None, rank * size, (rank + 1) * size)

    def vocab(hf_name, param):
        # the last rank's rows may run past the vocabulary; those stay zero (the loader clears them)
        start = model.vocab_start
        rows = min(cfg.vocab_size - start, param.shape[0])
        slices[hf_name] = WeightSlice(param, 0, rows, 0 if tp else None, start, start + rows)

    vocab("model.embed_tokens.weight", model.embed_tokens.weight)
    whole("model.norm.weight", model.norm.weight)
    if model.lm_head is not None:
        vocab("lm_head.weight", model.lm_head.weight)
    for i, layer in enumerate(model.layers):
        pre, attn, mlp = f"model.layers.{i}.", layer.self_attn, layer.mlp
        whole(pre + "input_layernorm.weight", layer.input_layernorm.weight)
        whole(pre + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
        kinds = ["weight"] + (["bias"] if attn.qkv_proj.bias is not None else [])
        for kind in kinds:   # column parallel: this rank's heads
            fused = getattr(attn.qkv_proj, kind)
            part(pre + f"self_attn.q_proj.{kind}", fused, 0, q, 0, q)
            part(pre + f"self_attn.k_proj.{kind}", fused, q, q + kv, 0, kv)
            part(pre + f"self_attn.v_proj.{kind}", fused, q + kv, q + 2 * kv, 0, kv)
        part(pre + "self_attn.o_proj.weight", attn.o_proj.weight, 0, cfg.hidden_size, 1, q)   # row parallel
        if cfg.attention_bias and cfg.arch != "qwen2":
            slices[pre + "self_attn.o_proj.bias"] = None
            if attn.o_proj.bias is not None:
                whole(pre + "self_attn.o_proj.bias", attn.o_proj.bias)
        if attn.q_norm is not None:
            whole(pre + "self_attn.q_norm.weight", attn.q_norm.weight)
            whole(pre + "self_attn.k_norm.weight", attn.k_norm.weight)
        part(pre + "mlp.gate_proj.weight", mlp.gate_up_proj.weight, 0, inter, 0, inter)
        part(pre + "mlp.up_proj.weight", mlp.gate_up_proj.weight, inter, 2 * inter, 0, inter)
        part(pre + "mlp.down_proj.weight", mlp.down_proj.weight, 0, cfg.hidden_size, 1, inter)
    return slices


def _read(f, name: str, where: WeightSlice) -> torch.Tensor:
    """The checkpoint tensor `name`, or only the part `where` takes from it."""
    if where.source_dim is None:
        return f.get_tensor(name)
    part = f.get_slice(name)
    shape = part.get_shape()
    if where.source_end > shape[where.source_dim]:
        raise CheckpointError(f"tensor {name} has shape {tuple(shape)}: too small for its shard "
                              f"{where.source_start}:{where.source_end} along dim {where.source_dim}")
    if where.source_dim == 0:
        return part[where.source_start:where.source_end]
    return part[:, where.source_start:where.source_end]


def load_model(path, device, dtype: torch.dtype | None = None, tp=None) -> Transformer:
    """The model at `path` on `device`; with tp (engine/parallel.TensorParallel) this rank's shard of it."""
    path = Path(path)
    cfg = ModelConfig.from_pretrained(path)
    random_weights = is_random(path)   # a `random:<preset>` folder (benchmarks): no safetensors to read
    files = [] if random_weights else _checkpoint_files(path)
    if dtype is not None:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    device = torch.device(device)

    # built on its device, where initialising the weights that are then loaded costs little; on the meta device
    # the initialisers run torch's Python reference kernels, whose first call imports torch._dynamo (over a second
    # of CPU in every process that loads a model: more than a small model's whole load)
    with torch.device(device):
        model = Transformer(cfg, tp)
    model.rope_cache = rope_cos_sin(cfg, device)
    if random_weights:
        init_random_(model, seed=tp.rank if tp else 0)
        return model.requires_grad_(False).eval()
    if tp is not None:   # vocabulary rows past the end (the last rank's) stay zero
        model.embed_tokens.weight.data.zero_()
        if model.lm_head is not None:
            model.lm_head.weight.data.zero_()

    slices = _weight_slices(model)
    loaded, unexpected = set(), []
    with torch.no_grad():
        # a progress bar on a terminal (tqdm stays silent when stderr is not a TTY: actors, CI)
        bar = tqdm(total=len(slices), desc=f"loading {path.name}", unit="tensor", disable=None, leave=False)
        for file in files:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    bar.update(name in slices)
                    if slices.get(name) is None:
                        if name in slices:   # another rank's
                            loaded.add(name)
                        elif not name.endswith(_IGNORED_SUFFIXES) and not (name == "lm_head.weight"
                                                                           and model.lm_head is None):
                            unexpected.append(name)
                        continue
                    where = slices[name]
                    tensor = _read(f, name, where)
                    target = where.param[where.start:where.end]
                    if tensor.shape != target.shape:
                        raise CheckpointError(f"{file.name}: tensor {name} has shape {tuple(tensor.shape)}, "
                                              f"expected {tuple(target.shape)} from config.json")
                    target.copy_(tensor)
                    loaded.add(name)
        bar.close()
    missing = sorted(n for n in set(slices) - loaded if slices[n] is not None)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"{path}: checkpoint lacks {len(missing)} tensors the model needs: {shown}")
    if unexpected:
        log.warning("%s: ignored %d unknown tensors, e.g. %s", path, len(unexpected), unexpected[0])
    return model.requires_grad_(False).eval()


@torch.no_grad()
def init_random_(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Normal(0, std) weights, unit norms: finite activations at any depth, like a trained model's scale."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif p.dim() == 1:
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)
