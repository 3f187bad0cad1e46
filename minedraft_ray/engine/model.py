"""A lean decoder for Llama / Qwen2 / Qwen3 / Mistral checkpoints over the paged KV cache.

q/k/v and gate/up projections are fused into one matmul each (loader.py fills the slices); RoPE cos/sin
are precomputed once in fp32 and read by position, so a forward step has no host sync and no
per-row Python, and one CUDA graph per (batch, q) shape serves every step.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import DecodeRows, attend, attend_packed, triton_op, write_kv
from .hf_config import CHECKPOINT_DTYPES, ModelSpec
from .kv_blocks import DEFAULT_BLOCK_SIZE, HEADROOM
from .kv_cache import KVCache

_DTYPES = {name: getattr(torch, name) for name in CHECKPOINT_DTYPES}


@dataclass
class ModelConfig(ModelSpec):
    """What a model is built from: its ModelSpec, with the dtype as torch's (the checkpoint's, or the one it is
    loaded in)."""
    dtype: torch.dtype = torch.bfloat16

    @classmethod
    def from_hf_dict(cls, hf: dict, gen: dict | None = None) -> "ModelConfig":
        spec = ModelSpec.from_hf_dict(hf, gen)
        return cls(**{**vars(spec), "dtype": _DTYPES[spec.dtype]})


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[D/2] fp32 inverse frequencies, including Llama-3.1 style frequency scaling."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(cfg: ModelConfig, device=None) -> torch.Tensor:
    """[P, D] fp32: cos in the first D/2 columns, sin in the last D/2, for positions 0..P-1.

    P covers max_position_embeddings plus the KV headroom, since a verify step writes past the length.
    """
    positions = torch.arange(cfg.max_position_embeddings + HEADROOM, dtype=torch.float32, device=device)
    freqs = positions[:, None] * rope_inv_freq(cfg).to(device)[None, :]  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


# Elementwise helpers. On CUDA each one runs as one or two fused Triton kernels (torch.compile): a small-batch
# step is otherwise launch bound (~10 tiny kernels per RMSNorm or RoPE; this halves a 1B model's decode step).
# CPU runs the very same functions eagerly (FUSE_ON_CUDA = False: CUDA too, and no rope_kv_triton kernel).
# Callers pass flattened tokens ([N, ...], fixed rank) so that dynamic shapes cover every batch size with at
# most a second compile for N == 1.
FUSE_ON_CUDA = True
# MINEDRAFT_ROPE_KV_KERNEL=0 keeps the fused elementwise ops but writes K/V through the torch path
ROPE_KV_KERNEL = os.environ.get("MINEDRAFT_ROPE_KV_KERNEL", "1") != "0"
# None: torch.compile's automatic dynamic shapes, so only the token count N turns symbolic (on the second
# shape seen) and feature sizes stay constants in the kernels; True: every dim symbolic
FUSE_DYNAMIC: bool | None = None


def _fused_on_cuda(fn):
    compiled = None

    def dispatch(x, *args):
        nonlocal compiled
        if not (x.is_cuda and FUSE_ON_CUDA):
            return fn(x, *args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=FUSE_DYNAMIC)
        return compiled(x, *args)

    return dispatch


@_fused_on_cuda
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [N, D]. Normalise in fp32, scale in the model dtype (same rounding as HF).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@_fused_on_cuda
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    # x, residual: [N, D] -> (rms_norm(x + residual), x + residual): the residual add rides with the norm
    h = x + residual
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hf.to(h.dtype), h


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # rotates the (first half, second half) pairs of the head dim, as HF's rotate_half does; math in fp32
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@_fused_on_cuda
def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    # q: [N, Hq, D], k: [N, Hkv, D]; cos, sin: [N, 1, D/2] fp32
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rope_write_kv(q, k, v, rope_cache, k_cache, v_cache, block_tables, slots, positions) -> torch.Tensor:
    """RoPE on q and k at their positions, k and v into the cache; returns rotated q [N, Hq, D].

    q: [N, Hq, D], k, v: [N, Hkv, D] (N = B*q, last dim contiguous); rope_cache: [P, D] fp32 (cos | sin);
    k_cache, v_cache: [NB, BS, Hkv, D]; block_tables: [S, W]; slots: [B]; positions: [B, q]. On CUDA one
    Triton kernel does it all
    (rope_kv_triton.py; the same bits as the torch path below run eagerly, which CPU does and tests compare to).
    """
    if q.is_cuda and FUSE_ON_CUDA and ROPE_KV_KERNEL and (kernel := triton_op("rope_kv_triton", "rope_write_kv")) is not None:
        return kernel(q, k, v, rope_cache, k_cache, v_cache, block_tables, slots, positions)
    B, T = positions.shape
    cos, sin = rope_cache[positions.flatten()].unsqueeze(1).chunk(2, dim=-1)  # [N, 1, D/2] each
    q, k = rope_qk(q, k, cos, sin)
    write_kv(k_cache, v_cache, block_tables, slots, positions, k.view(B, T, *k.shape[1:]),
             v.reshape(B, T, *v.shape[1:]))
    return q


@_fused_on_cuda
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [N, 2I] -> [N, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # x: [N, D] -> normed; with residual: (normed(x + residual), x + residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp=None):
        super().__init__()
        # with tensor parallelism (tp: engine/parallel.TensorParallel) this rank's heads only
        self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads") if tp else cfg.num_heads
        self.num_kv_heads = tp.shard(cfg.num_kv_heads, "num_key_value_heads") if tp else cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.tp = tp
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        dt = cfg.dtype
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias, dtype=dt)
        # Qwen2 has q/k/v biases only; Llama/Qwen3 `attention_bias` also covers o_proj
        # o_proj is row parallel: its partial sums are all-reduced, so only rank 0 adds the bias
        o_bias = cfg.attention_bias and cfg.arch != "qwen2" and (tp is None or tp.rank == 0)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=o_bias, dtype=dt)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dt)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dt)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, rope_cache, k_cache, v_cache, block_tables, slots, positions, packed: bool = False,
                rows: DecodeRows | None = None):
        # x: [N = B*q, H]; rope_cache: [P, D] fp32; k_cache, v_cache: [NB, BS, Hkv, D]; block_tables: [S, W];
        # slots: [B]; positions: [B, q].
        # packed: N tokens of several requests back to back, slots [N] and positions [N, 1] per token
        B, T = positions.shape
        N, D = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:  # per-head norm, rows = (token, head)
            q = self.q_norm(q.reshape(-1, D))
            k = self.k_norm(k.reshape(-1, D))
        q = rope_write_kv(q.reshape(N, self.num_heads, D), k.reshape(N, self.num_kv_heads, D),
                          v.reshape(N, self.num_kv_heads, D), rope_cache, k_cache, v_cache, block_tables, slots,
                          positions)
        if packed:
            out = attend_packed(q, k_cache, v_cache, block_tables, slots, positions[:, 0], self.scale,
                                rows)  # [N, Hq, D]
        else:
            out = attend(q.view(B, T, self.num_heads, D), k_cache, v_cache, block_tables, slots, positions,
                         self.scale)  # [B, q, Hq, D]
        out = self.o_proj(out.reshape(N, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp=None):
        super().__init__()
        inter = tp.shard(cfg.intermediate_size, "intermediate_size") if tp else cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False, dtype=cfg.dtype)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False, dtype=cfg.dtype)
        self.tp = tp

    def forward(self, x):
        out = self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, residual, rope_cache, k_cache, v_cache, block_tables, slots, positions,
                packed: bool = False, rows: DecodeRows | None = None):
        # x: [N, H] this layer's input delta; residual: [N, H] the stream before it (None at layer 0)
        x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        x = self.self_attn(x, rope_cache, k_cache, v_cache, block_tables, slots, positions, packed, rows)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Transformer(nn.Module):
    """Decoder over a paged KV cache. `forward` writes K/V but never advances `cache.lengths`.

    tp (engine/parallel.TensorParallel): this rank's shard of a tensor-parallel model; None: the whole model,
    with no collective and no extra work."""

    def __init__(self, cfg: ModelConfig, tp=None):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        # vocabulary rows of this rank (all of them without tp): embedding and lm_head are vocab parallel
        self.vocab_start, vocab_rows = tp.vocab_rows(cfg.vocab_size) if tp else (0, cfg.vocab_size)
        self.embed_tokens = nn.Embedding(vocab_rows, cfg.hidden_size, dtype=cfg.dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        # tied checkpoints reuse embed_tokens.weight in compute_logits
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, vocab_rows, bias=False, dtype=cfg.dtype)
        self.num_kv_heads = self.layers[0].self_attn.num_kv_heads   # what this rank's KV cache holds
        # fp32 even in a bf16 model; the loader rebuilds it on the target device
        self.register_buffer("rope_cache", rope_cos_sin(cfg), persistent=False)

    def forward(self, input_ids: torch.Tensor, cache: KVCache, slots: torch.Tensor) -> torch.Tensor:
        # input_ids: [B, q] int64; slots: [B] int64 -> hidden [B, q, H]
        B, T = input_ids.shape
        positions = cache.lengths[slots][:, None] + torch.arange(T, device=input_ids.device)  # [B, q]
        x, residual = self.embed(input_ids.flatten()), None  # tokens flattened: [N = B*q, H]
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, self.rope_cache, cache.k[i], cache.v[i], cache.block_tables, slots,
                                positions)
        x, _ = self.norm(x, residual)
        return x.view(B, T, -1)

    def forward_packed(self, token_ids: torch.Tensor, cache: KVCache, token_slots: torch.Tensor,
                       offsets: torch.Tensor, rows: DecodeRows | None = None) -> torch.Tensor:
        """Several requests' tokens back to back, no padding: token_ids, token_slots, offsets [T] int64 ->
        hidden [T, H]. Token t goes to position cache.lengths[token_slots[t]] + offsets[t] of its slot and sees
        that slot's keys up to there, so a request may continue a slot that already holds tokens (a later
        chunk of its prompt, a drafter catching up). Like `forward`, it writes K/V but never advances lengths.
        rows: the tokens at the front that are a fused step's decode/verify rows (attention.attend_packed)."""
        positions = (cache.lengths[token_slots] + offsets)[:, None]  # [T, 1]: one query per "row"
        x, residual = self.embed(token_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, self.rope_cache, cache.k[i], cache.v[i], cache.block_tables,
                                token_slots, positions, packed=True, rows=rows)
        x, _ = self.norm(x, residual)
        return x

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        # token_ids [N] -> [N, H]; a shard looks up its own rows (zeros for the others' ids) and the sum is all-reduced
        if self.tp is None:
            return self.embed_tokens(token_ids)
        local = token_ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        x = self.embed_tokens(torch.where(mine, local, 0))
        return self.tp.all_reduce(x * mine[:, None].to(x.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., H] -> [..., V] fp32 (the whole vocabulary on every rank: sampling needs all of it)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)
        if self.tp is not None:
            logits = self.tp.all_gather_last(logits)[..., :self.cfg.vocab_size]
        return logits.float()

    def make_cache(self, num_slots: int, max_len: int, device=None, block_size: int = DEFAULT_BLOCK_SIZE,
                   num_blocks: int | None = None) -> KVCache:
        """A KV cache shaped for this model (in its dtype, on its device unless `device` is given). Without
        `num_blocks`, every slot holds blocks for its whole max_len from the start (static); with it, a pool of
        that many blocks that the caller hands out (`KVCache.reserve`)."""
        device = device if device is not None else self.embed_tokens.weight.device
        cfg = self.cfg
        return KVCache(cfg.num_layers, num_slots, max_len, self.num_kv_heads, cfg.head_dim,
                       self.embed_tokens.weight.dtype, device, block_size=block_size, num_blocks=num_blocks,
                       static=num_blocks is None)
