"""ModelRunner: one model and its paged KV cache on one device.

`step` runs q tokens for a batch of slots. On CUDA it replays a CUDA graph captured per
(batch bucket, q); rows padding a batch up to its bucket point at a scratch slot that no
request owns (its block table is all null block), so the graph never needs to know how many rows are real.
The graphs read the block table from its fixed device tensor, so they serve any assignment of blocks.

Blocks: with `num_blocks` the cache is a pool and the caller maps each slot's positions before writing them
(`reserve`: the tokens a step appends, plus what a verify writes past them) and gives them back when the
request ends (`release`); without it every slot holds its full max_len from the start (`static`).

`prefill` and `extend` pack the prompts by default: every list's tokens back to back in one flat run
with per-token slot and offset (positions continue each slot's cache length), no padding. The run is cut
into launches of at most `max_prefill_tokens` tokens, wherever that falls, even mid-prompt: a later launch
continues the slot at its new length, which is how a prompt is prefilled in chunks. A small launch (what a
server admits per step) replays a graph captured per token-count bucket, padded by tokens on the scratch
slot: run eagerly, such a forward is bound by the host launching ~10 kernels per layer, several times its
device time. Larger launches amortise that and stay eager.

A fused step (`step_with_chunks`) is one packed launch of a decode/verify step's rows and prompt chunks; its
graphs are keyed by token count and by the rows' token count and width, whose attention runs a program per row
with the keys split, as a decode step's does.

The padded path (packed_prefill=False) pads each list to the longest and graphs per (rows, padded length);
it stays for comparison.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from .attention import DecodeRows, triton_op
from .kv_blocks import DEFAULT_BLOCK_SIZE, TableEdits
from .kv_cache import KVCache
from .launch_buckets import PACKED_GRAPH_TOKENS, token_bucket
from .model import Transformer

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)
PREFILL_TOKEN_BUDGET = 8192  # padded prompt tokens per prefill forward; bounds activation memory
# projections whose weight is kept column-major on CUDA (x @ W.T reads a contiguous [in, out] matrix): cuBLAS
# runs these faster that way in a decode, the others not (docs/design.md, bench/results/gemm_sweep.md)
TRANSPOSED_WEIGHTS = ("o_proj", "gate_up_proj")
# Graphed prefills: prompts per call x padded length, up to PREFILL_GRAPH_TOKENS padded tokens. An eager prefill
# of a few short prompts costs the host's kernel launches whatever its length, a graph only its device time,
# which overtakes the launches at about this many tokens (docs/design.md). Lengths step by 1.5x-2x to bound
# the padding.
PREFILL_GRAPH_ROWS = (1, 2, 4)
PREFILL_GRAPH_LENS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
PREFILL_GRAPH_TOKENS = 1024
# a fused launch's static count of row tokens (their attention takes a program per row up to it): doubling steps,
# a few per token bucket, as the rows' count only picks the attention's layout
ROW_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class PrefillPiece:
    """Tokens [start, stop) of list `index` of an extend call, in one launch."""
    index: int
    start: int
    stop: int


@dataclass(frozen=True)
class PackedLaunch:
    """One packed forward: pieces back to back, as host arrays of its T tokens and B pieces."""
    pieces: tuple[PrefillPiece, ...]
    token_ids: np.ndarray     # [T] int64
    token_slots: np.ndarray   # [T] int64
    offsets: np.ndarray       # [T] int64: position within this launch's piece of the slot
    cu_seqlens: np.ndarray    # [B + 1] int64: piece b is tokens cu_seqlens[b]..cu_seqlens[b+1]-1
    piece_slots: np.ndarray   # [B] int64

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def plan_pieces(lengths: list[int], max_tokens: int) -> list[list[PrefillPiece]]:
    """Lists of `lengths` tokens laid back to back and cut into launches of at most max_tokens tokens each;
    a cut may fall inside a list, whose rest then opens the next launch."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    launches, current, room = [], [], max_tokens
    for index, length in enumerate(lengths):
        start = 0
        while start < length:
            stop = start + min(room, length - start)
            current.append(PrefillPiece(index, start, stop))
            room -= stop - start
            start = stop
            if room == 0:
                launches.append(current)
                current, room = [], max_tokens
    if current:
        launches.append(current)
    return launches


def pack(pieces: list[PrefillPiece], slots: list[int], token_lists: list[list[int]]) -> PackedLaunch:
    sizes = np.array([p.stop - p.start for p in pieces], dtype=np.int64)
    cu = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum(sizes, out=cu[1:])
    piece_slots = np.array([slots[p.index] for p in pieces], dtype=np.int64)
    token_ids = np.concatenate([np.asarray(token_lists[p.index][p.start:p.stop], dtype=np.int64) for p in pieces])
    offsets = np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1], sizes)
    return PackedLaunch(tuple(pieces), token_ids, np.repeat(piece_slots, sizes), offsets, cu, piece_slots)


def to_device(values, device: torch.device, dtype=torch.int64) -> torch.Tensor:
    """A host list (as `dtype`), numpy array or tensor on `device`, queued without the host waiting: on CUDA
    the copy starts from pinned memory, the one kind of host memory a copy is documented to be asynchronous
    from (tests/test_cuda_overlap.py checks the queued copy on a GPU)."""
    if isinstance(values, np.ndarray):
        values = torch.from_numpy(values)
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda" and host.device.type == "cpu":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def to_host_async(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into pinned host memory, the copy queued on the stream (a CPU tensor is returned as it is):
    once the stream has passed it, the copy is read without a sync, which would also wait for any work queued
    behind it."""
    if t.device.type != "cuda":
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


@torch.no_grad()
def relayout_weights_(model: Transformer, names: tuple[str, ...]) -> None:
    """Store the named nn.Linear weights column-major: same [out, in] values and shape (loading, state
    dicts and F.linear are unchanged), but F.linear's GEMM then reads the [in, out] matrix contiguously."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in names and module.weight.is_contiguous():
            module.weight.data = module.weight.data.t().contiguous().t()


class ModelRunner:
    def __init__(self, model: Transformer, device: torch.device | str, num_slots: int, max_len: int,
                 max_batch: int, cuda_graphs: bool = True, vocab_limit: int | None = None,
                 packed_prefill: bool = True, max_prefill_tokens: int = PREFILL_TOKEN_BUDGET,
                 block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: int | None = None, prefix_caching: bool = False):
        self.model, self.device = model, torch.device(device)
        self.cfg = model.cfg
        if self.device.type == "cuda":
            relayout_weights_(model, TRANSPOSED_WEIGHTS)
        self.max_len, self.max_batch = max_len, max_batch
        self.vocab = min(vocab_limit or self.cfg.vocab_size, self.cfg.vocab_size)
        # one extra slot: the scratch slot that padding rows write into (never reserved in a pool: the null block)
        dtype = next(model.parameters()).dtype
        self.cache = KVCache(self.cfg.num_layers, num_slots + 1, max_len, model.num_kv_heads, self.cfg.head_dim,
                             dtype, self.device, block_size=block_size, num_blocks=num_blocks,
                             static=num_blocks is None, prefix_caching=prefix_caching)
        self.num_slots, self.scratch_slot = num_slots, num_slots
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self.buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict]] = {}
        # (rows, padded length) -> graph; a padded prompt writes K/V rows up to its padded length
        rows = self.cache.blocks_per_slot * self.cache.block_size
        self.prefill_shapes = [(b, n) for b in PREFILL_GRAPH_ROWS for n in PREFILL_GRAPH_LENS
                               if n <= rows and b <= max(max_batch, 1) and b * n <= PREFILL_GRAPH_TOKENS
                               ] if self.use_graphs else []
        self._prefill_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict]] = {}
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.packed_prefill, self.max_prefill_tokens = packed_prefill, max_prefill_tokens
        # graphs of packed launches need the Triton kernel: the torch reference syncs with the host
        graphs_packed = self.use_graphs and triton_op("attention_packed_triton", "attend_packed_triton") is not None
        self.packed_buckets = [n for n in PACKED_GRAPH_TOKENS if n <= max_prefill_tokens] if graphs_packed else []
        self._packed_graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict]] = {}
        # fused steps' launches: (token bucket, rows up to their bucket) -> graph
        self._fused_graphs: dict[tuple[int, DecodeRows], tuple[torch.cuda.CUDAGraph, dict]] = {}
        self._pool = None

    # ---- model calls -------------------------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids, self.cache, slots)           # [B, q, H]
        return self.model.compute_logits(hidden)[..., :self.vocab]  # [B, q, V] float32

    @torch.inference_mode()
    def step(self, slots: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Append q tokens to each slot and return their logits.

        slots [B] int64 (device), input_ids [B, q] int64 (device) -> logits [B, q, V] float32.
        The returned tensor may be a static graph buffer: use it before the next step.
        """
        batch, q = input_ids.shape
        if self.use_graphs and batch <= self.max_batch:
            logits = self._replay(slots, input_ids)
        else:
            logits = self._forward(input_ids, slots)
        self.cache.lengths.index_add_(0, slots, torch.full_like(slots, q))
        return logits

    def _replay(self, slots: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        batch, q = input_ids.shape
        bucket = self.buckets[bisect.bisect_left(self.buckets, batch)]
        key = (bucket, q)
        if key not in self._graphs:
            self._graphs[key] = self._capture(bucket, q)
        graph, bufs = self._graphs[key]
        bufs["slots"][:batch].copy_(slots)
        bufs["slots"][batch:].fill_(self.scratch_slot)
        bufs["input_ids"][:batch].copy_(input_ids)
        graph.replay()
        return bufs["logits"][:batch]

    def _capture(self, bucket: int, q: int):
        bufs = {"slots": torch.full((bucket,), self.scratch_slot, dtype=torch.int64, device=self.device),
                "input_ids": torch.zeros((bucket, q), dtype=torch.int64, device=self.device)}
        return self._graph(bufs, lambda: self._forward(bufs["input_ids"], bufs["slots"])), bufs

    def _capture_prefill(self, rows: int, length: int):
        bufs = {"slots": torch.full((rows,), self.scratch_slot, dtype=torch.int64, device=self.device),
                "input_ids": torch.zeros((rows, length), dtype=torch.int64, device=self.device),
                "lens": torch.ones(rows, dtype=torch.int64, device=self.device)}
        return self._graph(bufs, lambda: self._last_logits(bufs["input_ids"], bufs["slots"], bufs["lens"])), bufs

    def _graph(self, bufs: dict, forward, output: str = "logits") -> torch.cuda.CUDAGraph:
        """Capture forward() (after two warm-up runs) into bufs[output]. Every graph shares one memory
        pool: outputs are valid until the next replay of any graph, which callers respect."""
        # the scratch slot's length stays 0, so warm-up writes land in its first rows only
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            bufs[output] = forward()
        return graph

    @torch.inference_mode()
    def capture_all(self, qs: tuple[int, ...], fused: DecodeRows | None = None,
                    fused_tokens: int | None = None) -> None:
        """Capture every prefill shape and every bucket for each q up front (largest first, so the shared
        pool is sized once). fused: the most row tokens a fused step holds and its rows' width (step_with_chunks;
        None: none will run), whose launches' graphs are captured too: those of up to `fused_tokens` tokens (the
        per-step budget, which bounds a fused launch; None: every token bucket)."""
        if not self.use_graphs:
            return
        if self.packed_prefill:
            fused_at = set(self.fused_buckets(fused_tokens)) if fused is not None else set()
            for tokens in reversed(self.packed_buckets):
                if tokens not in self._packed_graphs:
                    self._packed_graphs[tokens] = self._capture_packed(tokens)
                if tokens not in fused_at:
                    continue
                most = fused.tokens
                for row_tokens in sorted({self._row_bucket(r, tokens) for r in ROW_BUCKETS if r <= most}
                                         | ({self._row_bucket(most, tokens)} if most else set())):
                    key = (tokens, DecodeRows(row_tokens, fused.width))
                    if key not in self._fused_graphs:
                        self._fused_graphs[key] = self._capture_packed(*key)
            self._warm_eager_packed()
        else:
            for shape in sorted(self.prefill_shapes, key=lambda s: s[0] * s[1], reverse=True):
                if shape not in self._prefill_graphs:
                    self._prefill_graphs[shape] = self._capture_prefill(*shape)
        for q in qs:
            for bucket in reversed(self.buckets):
                if (bucket, q) not in self._graphs:
                    self._graphs[(bucket, q)] = self._capture(bucket, q)

    def _warm_eager_packed(self) -> None:
        """Launches above the largest bucket run eagerly; Triton compiles a kernel per divisibility of the token
        count by 16 on first use, so run one of each now rather than inside the first long prefill."""
        largest = max(self.packed_buckets, default=0)
        for tokens in (largest + 16, largest + 17):
            if tokens > self.max_prefill_tokens:
                break
            zeros = torch.zeros(tokens, dtype=torch.int64, device=self.device)
            # every token at position 0 of the scratch slot, whose length stays 0: it sees only itself
            self.model.forward_packed(zeros, self.cache, torch.full_like(zeros, self.scratch_slot), zeros)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def extend(self, slots: list[int], token_lists: list[list[int]], packed: bool | None = None) -> torch.Tensor:
        """Append variable-length token lists to slots that may already hold tokens (prefill, a later chunk
        of a prompt, or a drafter catching up): list i continues slot slots[i] at its cache length.

        Returns logits of each list's last token: [B, V] float32. `packed` (default: the runner's
        packed_prefill) picks the packed path or the padded one.
        """
        if not token_lists or any(len(t) == 0 for t in token_lists) or len(slots) != len(token_lists):
            raise ValueError("extend needs one non-empty token list per slot")
        if len(set(slots)) != len(slots):
            raise ValueError(f"extend got a slot twice: {slots}")
        if self.packed_prefill if packed is None else packed:
            return self._extend_packed(slots, token_lists)
        return self._extend_padded(slots, token_lists)

    # ---- packed path ---------------------------------------------------------------------------
    def _extend_packed(self, slots: list[int], token_lists: list[list[int]]) -> torch.Tensor:
        out = torch.empty((len(slots), self.vocab), dtype=torch.float32, device=self.device)
        for pieces in plan_pieces([len(t) for t in token_lists], self.max_prefill_tokens):
            launch = pack(pieces, slots, token_lists)
            hidden = self._packed_hidden(launch)  # [>= T, H]
            # a list's logits come from the launch that holds its last token
            ends = [(b, p.index) for b, p in enumerate(pieces) if p.stop == len(token_lists[p.index])]
            if ends:
                last = to_device([launch.cu_seqlens[b + 1] - 1 for b, _ in ends], self.device)
                logits = self.model.compute_logits(hidden[last])[..., :self.vocab]
                out.index_copy_(0, to_device([i for _, i in ends], self.device), logits)
            self.cache.lengths.index_add_(0, to_device(launch.piece_slots, self.device),
                                          to_device(np.diff(launch.cu_seqlens), self.device))
        return out

    def _packed_hidden(self, launch: PackedLaunch, fill=None, rows: DecodeRows | None = None) -> torch.Tensor:
        """Hidden states [>= T, H] of one launch: a graph's buffer when T fits a bucket (use it before the
        next replay), else an eager forward of exactly T tokens. fill(packed [3, >= T] on the device), when
        given, writes the columns whose values only the device holds (a fused step's verify rows) before the run;
        rows: the tokens at the front those rows hold and their width (graphed: up to the next row bucket)."""
        tokens = launch.num_tokens
        host = np.stack([launch.token_ids, launch.token_slots, launch.offsets])  # [3, T]: one copy
        bucket = token_bucket(tokens, self.packed_buckets)
        if bucket is None:
            packed = to_device(host, self.device)
            if fill is not None:
                fill(packed)
            return self.model.forward_packed(packed[0], self.cache, packed[1], packed[2], rows)
        graphs, key = self._packed_graphs, bucket
        if rows is not None:   # the rows' attention is laid out for a static count of them (attention.attend_packed)
            graphs, key = self._fused_graphs, (bucket, DecodeRows(self._row_bucket(rows.tokens, bucket), rows.width))
            # rows of a width not captured at start (a verify without drafts while the drafter is down) take a
            # graph of the same counts at another width, correct for any rows, rather than a capture mid-serving
            key = key if key in graphs else next((k for k in graphs if k[0] == bucket
                                                  and k[1].tokens == key[1].tokens), key)
        if key not in graphs:
            graphs[key] = self._capture_packed(*((key,) if isinstance(key, int) else key))
        graph, bufs = graphs[key]
        # the padding tokens sit at position 0 of the scratch slot (its length stays 0), seeing only themselves
        padded = np.zeros((3, bucket), dtype=np.int64)
        padded[1] = self.scratch_slot
        padded[:, :tokens] = host
        bufs["packed"].copy_(to_device(padded, self.device))
        if fill is not None:
            fill(bufs["packed"])
        graph.replay()
        return bufs["hidden"]

    def _capture_packed(self, tokens: int, rows: DecodeRows | None = None):
        packed = torch.zeros((3, tokens), dtype=torch.int64, device=self.device)
        packed[1] = self.scratch_slot
        bufs = {"packed": packed}
        # the graph ends at the hidden states: the last tokens' logits depend on where the requests end
        forward = lambda: self.model.forward_packed(packed[0], self.cache, packed[1], packed[2], rows)  # noqa: E731
        return self._graph(bufs, forward, output="hidden"), bufs

    def fused_buckets(self, fused_tokens: int | None = None) -> list[int]:
        """The token buckets a fused launch of at most `fused_tokens` tokens (None: any) may replay."""
        top = token_bucket(fused_tokens, self.packed_buckets) if fused_tokens is not None else None
        return [n for n in self.packed_buckets if top is None or n <= top]

    @staticmethod
    def _row_bucket(rows: int, bucket: int) -> int:
        """A fused graph's static count of row tokens: the next row bucket up from `rows`, within `bucket` (chunk
        tokens below it take the rows' programs, which is correct, only slower)."""
        return min(token_bucket(rows, ROW_BUCKETS) or bucket, bucket)

    # ---- padded path ---------------------------------------------------------------------------
    def _extend_padded(self, slots: list[int], token_lists: list[list[int]]) -> torch.Tensor:
        """Rows padded to the longest list; padding sits after the real tokens, so causal attention keeps
        it out of real rows, and the lengths advance by the real counts only."""
        out = []
        start = 0
        while start < len(slots):
            end, longest = start, 0
            while end < len(slots) and max(longest, len(token_lists[end])) * (end - start + 1) <= PREFILL_TOKEN_BUDGET:
                longest = max(longest, len(token_lists[end]))
                end += 1
            end = max(end, start + 1)
            out.append(self._extend_chunk(slots[start:end], token_lists[start:end]))
            start = end
        return torch.cat(out, 0)

    def _extend_chunk(self, slots: list[int], token_lists: list[list[int]]) -> torch.Tensor:
        ids, slot_t, lens_t = (to_device(t, self.device) for t in
                               self._padded(slots, token_lists, len(slots), max(len(t) for t in token_lists)))
        logits = self._last_logits(ids, slot_t, lens_t)
        self.cache.lengths.index_add_(0, slot_t, lens_t)
        return logits

    def _padded(self, slots: list[int], token_lists: list[list[int]], rows: int, length: int):
        """Host tensors: ids [rows, length] (zeros after each list), slots [rows] (padding rows at the
        scratch slot), lens [rows] (1 for padding rows)."""
        ids = torch.zeros((rows, length), dtype=torch.int64)
        for row, toks in enumerate(token_lists):
            ids[row, :len(toks)] = torch.tensor(toks, dtype=torch.int64)
        slot_t = torch.full((rows,), self.scratch_slot, dtype=torch.int64)
        slot_t[:len(slots)] = torch.tensor(slots, dtype=torch.int64)
        lens_t = torch.ones(rows, dtype=torch.int64)
        lens_t[:len(slots)] = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
        return ids, slot_t, lens_t

    def _last_logits(self, ids: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        # ids [B, L], slots [B], lens [B] (device) -> logits of each row's last real token [B, V] float32
        hidden = self.model(ids, self.cache, slots)                                   # [B, L, H]
        last = hidden[torch.arange(ids.shape[0], device=self.device), lens - 1]      # [B, H]
        return self.model.compute_logits(last)[..., :self.vocab]

    @torch.inference_mode()
    def prefill(self, slots: list[int], prompts: list[list[int]], packed: bool | None = None,
                cached: list[int] | None = None) -> torch.Tensor:
        """Start fresh slots with their prompts: [B, V] logits of each prompt's last token (padded path on
        CUDA: a graph's buffer when the prompts fit a captured shape: use it before the next step). `cached`:
        tokens at the start of each prompt whose K/V the slot already holds (a prefix-cache hit), not recomputed."""
        if cached is not None and any(cached):
            self.set_lengths(slots, cached)
            return self.extend(slots, [p[c:] for p, c in zip(prompts, cached)], packed=packed)
        self.set_lengths(slots, [0] * len(slots))
        if self.packed_prefill if packed is None else packed:
            return self.extend(slots, prompts, packed=True)
        longest = max(len(p) for p in prompts)
        fits = [(b, n) for b, n in self.prefill_shapes if b >= len(slots) and n >= longest]
        if not fits:
            return self.extend(slots, prompts, packed=False)
        shape = min(fits, key=lambda s: (s[0] * s[1], s[0]))
        if shape not in self._prefill_graphs:
            self._prefill_graphs[shape] = self._capture_prefill(*shape)
        graph, bufs = self._prefill_graphs[shape]
        for name, host in zip(("input_ids", "slots", "lens"), self._padded(slots, prompts, *shape)):
            bufs[name].copy_(to_device(host, self.device))
        graph.replay()
        self.cache.lengths.index_add_(0, bufs["slots"][:len(slots)], bufs["lens"][:len(slots)])
        return bufs["logits"][:len(slots)]

    @torch.inference_mode()
    def prefill_chunks(self, slots: list[int], starts: list[int], chunks: list[list[int]]) -> torch.Tensor:
        """Prompt chunks: chunk i is tokens [starts[i], starts[i] + len) of slot slots[i]'s prompt, the slot
        holding the tokens before it. -> [B, V] logits of each chunk's last token (as `prefill`). Chunks that
        all start their prompts take `prefill` (the padded path's graphs); others continue their slots."""
        if not any(starts):
            return self.prefill(slots, chunks)
        # a first chunk riding with later ones restarts a slot that still holds an earlier request's length
        self.set_lengths(slots, starts)
        return self.extend(slots, chunks)

    # ---- fused step: decode/verify rows and prompt chunks in one launch ----------------------------
    @torch.inference_mode()
    def step_with_chunks(self, slots: torch.Tensor, input_ids: torch.Tensor, chunk_slots: list[int],
                         chunk_starts: list[int], chunks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """`step` and `prefill_chunks` in one packed launch: row b's q tokens continue slot slots[b] at its cache
        length, as in a step, and chunk i is tokens [chunk_starts[i], + len) of slot chunk_slots[i]'s prompt,
        the slot holding the tokens before it. The slots of the rows and of the chunks are distinct.

        slots [B] int64 and input_ids [B, q] int64 on the device (a verify's inputs never visit the host);
        -> (logits [B, q, V] float32 of every row token, [C, V] float32 of each chunk's last token). A step with
        no chunk is `step` (its graphs); one that does not fit a launch (max_prefill_tokens) is the two calls."""
        if not chunks:
            return self.step(slots, input_ids), torch.empty((0, self.vocab), device=self.device)
        if any(len(c) == 0 for c in chunks) or not len(chunk_slots) == len(chunk_starts) == len(chunks):
            raise ValueError("step_with_chunks needs one non-empty chunk per chunk slot and start")
        batch, q = input_ids.shape
        rows = batch * q
        if rows + sum(len(c) for c in chunks) > self.max_prefill_tokens:
            chunk_logits = self.prefill_chunks(chunk_slots, chunk_starts, chunks).clone()   # maybe a graph's buffer
            return self.step(slots, input_ids), chunk_logits
        # a first chunk restarts a slot that may still hold an earlier request's length
        self.set_lengths(chunk_slots, chunk_starts)
        # the rows go first, as pieces of q tokens whose ids and slots the device fills in; then the chunks
        pieces = [PrefillPiece(index, 0, len(chunk)) for index, chunk in enumerate(chunks)]
        chunk_launch = pack(pieces, chunk_slots, chunks)
        sizes = np.diff(chunk_launch.cu_seqlens)
        launch = PackedLaunch(tuple(pieces), np.concatenate([np.zeros(rows, np.int64), chunk_launch.token_ids]),
                              np.concatenate([np.zeros(rows, np.int64), chunk_launch.token_slots]),
                              np.concatenate([np.tile(np.arange(q, dtype=np.int64), batch), chunk_launch.offsets]),
                              rows + chunk_launch.cu_seqlens, chunk_launch.piece_slots)

        def fill(packed: torch.Tensor) -> None:
            packed[0, :rows] = input_ids.reshape(-1)
            packed[1, :rows] = slots[:, None].expand(batch, q).reshape(-1)

        hidden = self._packed_hidden(launch, fill, DecodeRows(rows, q))   # [>= rows + chunk tokens, H]
        # every row token's logits, and each chunk's last token's, in one head call
        wanted = np.concatenate([np.arange(rows, dtype=np.int64), launch.cu_seqlens[1:] - 1])
        logits = self.model.compute_logits(hidden[to_device(wanted, self.device)])[..., :self.vocab]
        self.cache.lengths.index_add_(0, slots, torch.full_like(slots, q))
        self.cache.lengths.index_add_(0, to_device(chunk_launch.piece_slots, self.device), to_device(sizes, self.device))
        return logits[:rows].view(batch, q, -1), logits[rows:]

    # ---- blocks and lengths --------------------------------------------------------------------
    def reserve(self, slots: list[int], num_tokens: list[int]) -> None:
        """Map positions [0, num_tokens[i]) of slots[i] to blocks before they are written (all or nothing;
        kv_blocks.BlocksExhaustedError when the pool cannot)."""
        self.cache.reserve_many(slots, num_tokens)

    def map_blocks(self, edits: TableEdits) -> None:
        """Set block-table entries that a block manager elsewhere chose (the runtime's scheduler)."""
        self.cache.map_blocks(edits)

    def release(self, slot: int) -> None:
        """The request on `slot` is done: its blocks go back to the pool (cached ones stay cached, idle)."""
        self.cache.release(slot)

    def adopt_prefix(self, slot: int, tokens: list[int], max_tokens: int) -> int:
        """Map the longest cached prefix of `tokens` (whole blocks, within max_tokens) into the empty `slot`;
        returns how many tokens it holds now (0 without prefix caching)."""
        return self.cache.adopt(slot, self.cache.match(tokens, max_tokens))

    def register_prefix(self, slot: int, tokens: list[int], num_tokens: int) -> None:
        """The slot's K/V of tokens[:num_tokens] is final: offer its full blocks to the prefix cache."""
        self.cache.register(slot, tokens, num_tokens)

    def set_lengths(self, slots, lengths) -> None:
        self.cache.lengths.index_copy_(0, to_device(slots, self.device), to_device(lengths, self.device))

    def rollback(self, slots: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """Forget the last num_tokens [B] tokens of each slot: only the lengths move."""
        self.cache.lengths.index_add_(0, slots, -num_tokens)
