"""Tensor parallelism of the target (Megatron style), with no Ray here: a rank takes its group, rank and size.

Sharding (model.py, loader.py): q/k/v and gate/up are split by output (column parallel: whole heads and whole
MLP columns per rank), o_proj and down by input (row parallel: each rank's partial sums are all-reduced); the
embedding and lm_head are split by vocabulary (each rank looks up or scores its rows; the embedding is
all-reduced, the logits all-gathered, since sampling needs the whole distribution). The KV cache holds a
rank's own KV heads.

Control: rank 0, the leader, is driven by its caller (the verifier); each call of its `ShardedRunner` that
touches the model or the KV lengths first sends the call's inputs to the other ranks, which run the same call
in `follow()`. Headers travel over a gloo group on the host, tensors that already live on the device (a verify's
input ids, a rollback's counts) over the device group, so the leader never waits for its device to send them.
Sampling and rejection happen on rank 0 only; the others see their outcome as the next rollback.

Faults: a rank's death closes its gloo connections, so the other ranks' pending and later gloo operations fail
at once; on NCCL the device group's timeout ends a collective stuck on a dead peer. Followers wait for the
leader's next call without a deadline (an idle server), since a gloo operation that times out closes the
connection for good: they end when the leader dies or says stop.
"""
from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from .attention import DecodeRows
from .kv_blocks import BlocksExhaustedError, TableEdits
from .runner import ModelRunner, to_device

# how long a follower waits for the leader's next call: as long as the leader lives (see above)
FOLLOW_TIMEOUT = timedelta(days=3650)
HEADER = 8   # int64 words of a control header: op, then its arguments


@dataclass
class TensorParallel:
    """A rank's view of its tensor-parallel group. device_group carries the activations' collectives (NCCL on
    GPUs, gloo on CPUs); control_group (gloo) the leader's headers and host payloads."""
    rank: int
    world_size: int
    device_group: dist.ProcessGroup
    control_group: dist.ProcessGroup
    # the rendezvous store, held as long as the groups: NCCL calls it again (its unique id at the first collective,
    # its watchdog's flags), and a store written in Python lives only while Python holds it
    store: dist.Store

    @classmethod
    def connect(cls, store: dist.Store, rank: int, world_size: int, device: torch.device, host: str,
                timeout_s: float) -> "TensorParallel":
        """Both groups of this rank, over a rendezvous store every rank reaches; gloo listens on `host` only.
        Blocks until every rank has connected."""
        def gloo(prefix: str, timeout: timedelta):
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            options._timeout = timeout
            return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, options)

        control = gloo("control", FOLLOW_TIMEOUT)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=timeout_s)
            device_group = dist.ProcessGroupNCCL(dist.PrefixStore("device", store), rank, world_size, options)
        else:
            device_group = gloo("device", timedelta(seconds=timeout_s))
        return cls(rank, world_size, device_group, control, store)

    # ---- the model's collectives ----------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] of every rank -> [..., world_size * n], rank r's at columns r*n..(r+1)*n."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def shard(self, size: int, what: str) -> int:
        if size % self.world_size:
            raise ValueError(f"{what} ({size}) is not divisible by the tensor-parallel size {self.world_size}")
        return size // self.world_size

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows per rank) of this rank's vocabulary shard; the last may hold rows past the vocabulary."""
        per_rank = -(-vocab_size // self.world_size)
        return self.rank * per_rank, per_rank

    # ---- control messages -----------------------------------------------------------------------
    def send_header(self, op: "Op", *args: int) -> None:
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = int(op)
        header[1:1 + len(args)] = torch.tensor(args, dtype=torch.int64)
        dist.broadcast(header, group=self.control_group, group_src=0)

    def recv_header(self) -> list[int]:
        header = torch.empty(HEADER, dtype=torch.int64)
        dist.broadcast(header, group=self.control_group, group_src=0)
        return header.tolist()

    def broadcast_host(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, group=self.control_group, group_src=0)
        return t

    def broadcast_device(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, group=self.device_group, group_src=0)
        return t

    def min_across_ranks(self, value: int) -> int:
        """The smallest `value` of all ranks (e.g. free device memory, which sizes a KV pool every rank holds)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())


class Op(enum.IntEnum):
    STOP = 0
    STEP = 1
    EXTEND = 2
    PREFILL = 3
    SET_LENGTHS = 4
    ROLLBACK = 5
    CAPTURE = 6
    RESERVE = 7          # block bookkeeping: every rank keeps the same tables by making the same calls
    RELEASE = 8
    ADOPT_PREFIX = 9
    REGISTER_PREFIX = 10
    MAP_BLOCKS = 11      # table entries chosen by the runtime's scheduler


_PACKED = {None: -1, False: 0, True: 1}   # a call's `packed` argument in a header


class ShardedRunner(ModelRunner):
    """A ModelRunner over one rank's shard. On rank 0 every call that runs the model or moves KV lengths
    sends its inputs to the other ranks first (calls made inside such a call send nothing: the other ranks'
    copies make them too); the other ranks run `follow()` until the leader stops or dies."""

    def __init__(self, model, device, num_slots: int, max_len: int, max_batch: int, tp: TensorParallel, **kwargs):
        super().__init__(model, device, num_slots, max_len, max_batch, **kwargs)
        self.tp = tp
        self._depth = 0

    @property
    def leads(self) -> bool:
        return self.tp.rank == 0

    @contextlib.contextmanager
    def _call(self, op: Op | None = None, *args: int):
        """A call of the runner; an outermost one on the leader first sends op's header."""
        outermost = self._depth == 0 and self.leads
        if outermost and op is not None:
            self.tp.send_header(op, *args)
        self._depth += 1
        try:
            yield outermost
        finally:
            self._depth -= 1

    def step(self, slots: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        with self._call(Op.STEP, *input_ids.shape) as send:
            if send:
                self.tp.broadcast_device(torch.cat([slots[:, None], input_ids], 1))
            return super().step(slots, input_ids)

    def step_with_chunks(self, slots: torch.Tensor, input_ids: torch.Tensor, chunk_slots: list[int],
                         chunk_starts: list[int], chunks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunks, then the step: two calls that the other ranks follow as they follow any (not one launch)."""
        if not chunks:
            return self.step(slots, input_ids), torch.empty((0, self.vocab), device=self.device)
        chunk_logits = self.prefill_chunks(chunk_slots, chunk_starts, chunks).clone()   # maybe a graph's buffer
        return self.step(slots, input_ids), chunk_logits

    def extend(self, slots: list[int], token_lists: list[list[int]], packed: bool | None = None) -> torch.Tensor:
        with self._call(Op.EXTEND, *_lists_header(token_lists, packed)) as send:
            if send:
                self.tp.broadcast_host(_pack_lists(slots, token_lists))
            return super().extend(slots, token_lists, packed)

    def prefill(self, slots: list[int], prompts: list[list[int]], packed: bool | None = None,
                cached: list[int] | None = None) -> torch.Tensor:
        if cached is not None and any(cached):   # a prefix-cache hit: the two calls it makes, each sent on its own
            self.set_lengths(slots, cached)
            return self.extend(slots, [p[c:] for p, c in zip(prompts, cached)], packed=packed)
        with self._call(Op.PREFILL, *_lists_header(prompts, packed)) as send:
            if send:
                self.tp.broadcast_host(_pack_lists(slots, prompts))
            return super().prefill(slots, prompts, packed)

    def reserve(self, slots: list[int], num_tokens: list[int]) -> None:
        with self._call(Op.RESERVE, len(slots)) as send:
            if send:
                self.tp.broadcast_host(torch.tensor([slots, num_tokens], dtype=torch.int64).reshape(2, -1))
            super().reserve(slots, num_tokens)

    def map_blocks(self, edits: TableEdits) -> None:
        with self._call(Op.MAP_BLOCKS, len(edits)) as send:
            if send:
                self.tp.broadcast_host(torch.tensor([edits.rows, edits.cols, edits.ids], dtype=torch.int64))
            super().map_blocks(edits)

    def release(self, slot: int) -> None:
        with self._call(Op.RELEASE, slot):
            super().release(slot)

    def adopt_prefix(self, slot: int, tokens: list[int], max_tokens: int) -> int:
        with self._call(Op.ADOPT_PREFIX, slot, len(tokens), max_tokens) as send:
            if send:
                self.tp.broadcast_host(torch.tensor(tokens, dtype=torch.int64))
            return super().adopt_prefix(slot, tokens, max_tokens)

    def register_prefix(self, slot: int, tokens: list[int], num_tokens: int) -> None:
        with self._call(Op.REGISTER_PREFIX, slot, len(tokens), num_tokens) as send:
            if send:
                self.tp.broadcast_host(torch.tensor(tokens, dtype=torch.int64))
            super().register_prefix(slot, tokens, num_tokens)

    def set_lengths(self, slots, lengths) -> None:
        with self._call(Op.SET_LENGTHS, len(slots)) as send:
            slot_t, length_t = to_device(slots, self.device), to_device(lengths, self.device)
            if send:
                self.tp.broadcast_device(torch.stack([slot_t, length_t]))
            super().set_lengths(slot_t, length_t)

    def rollback(self, slots: torch.Tensor, num_tokens: torch.Tensor) -> None:
        with self._call(Op.ROLLBACK, slots.shape[0]) as send:
            if send:
                self.tp.broadcast_device(torch.stack([slots, num_tokens]))
            super().rollback(slots, num_tokens)

    def capture_all(self, qs: tuple[int, ...], fused: DecodeRows | None = None,
                    fused_tokens: int | None = None) -> None:
        """As ModelRunner's, without fused steps' graphs: a fused step here is its two calls."""
        if not self.use_graphs:
            return
        if len(qs) > HEADER - 2:
            raise ValueError(f"at most {HEADER - 2} step widths, got {qs}")
        with self._call(Op.CAPTURE, len(qs), *qs):
            super().capture_all(qs)

    def stop_followers(self) -> None:
        """The leader: let the other ranks' follow() return."""
        if self.leads:
            self.tp.send_header(Op.STOP)

    @torch.inference_mode()
    def follow(self) -> None:
        """A follower: run the leader's calls until it stops (returns) or its group breaks (raises)."""
        if self.leads:
            raise RuntimeError("rank 0 leads; it does not follow")
        tp, device = self.tp, self.device
        while True:
            op, *args = tp.recv_header()
            op = Op(op)
            if op is Op.STOP:
                return
            with self._call():
                if op is Op.STEP:
                    rows, width = args[0], args[1]
                    got = tp.broadcast_device(torch.empty((rows, 1 + width), dtype=torch.int64, device=device))
                    ModelRunner.step(self, got[:, 0], got[:, 1:])
                elif op in (Op.EXTEND, Op.PREFILL):
                    slots, lists, packed = _unpack_lists(tp, *args[:3])
                    (ModelRunner.extend if op is Op.EXTEND else ModelRunner.prefill)(self, slots, lists, packed)
                elif op in (Op.SET_LENGTHS, Op.ROLLBACK):
                    got = tp.broadcast_device(torch.empty((2, args[0]), dtype=torch.int64, device=device))
                    (ModelRunner.set_lengths if op is Op.SET_LENGTHS else ModelRunner.rollback)(self, got[0], got[1])
                elif op is Op.CAPTURE:
                    ModelRunner.capture_all(self, tuple(args[1:1 + args[0]]))
                elif op is Op.RESERVE:
                    got = tp.broadcast_host(torch.empty((2, args[0]), dtype=torch.int64)).tolist()
                    try:
                        ModelRunner.reserve(self, got[0], got[1])
                    except BlocksExhaustedError:   # the leader's pool ran out the same way: it preempts, we follow
                        pass
                elif op is Op.MAP_BLOCKS:
                    rows, cols, ids = tp.broadcast_host(torch.empty((3, args[0]), dtype=torch.int64)).tolist()
                    ModelRunner.map_blocks(self, TableEdits(rows, cols, ids))
                elif op is Op.RELEASE:
                    ModelRunner.release(self, args[0])
                elif op in (Op.ADOPT_PREFIX, Op.REGISTER_PREFIX):
                    tokens = tp.broadcast_host(torch.empty(args[1], dtype=torch.int64)).tolist()
                    (ModelRunner.adopt_prefix if op is Op.ADOPT_PREFIX else ModelRunner.register_prefix)(
                        self, args[0], tokens, args[2])


def _lists_header(token_lists: list[list[int]], packed: bool | None) -> tuple[int, int, int]:
    return len(token_lists), sum(len(t) for t in token_lists), _PACKED[packed]


def _pack_lists(slots: list[int], token_lists: list[list[int]]) -> torch.Tensor:
    # [n slots, n lengths, the tokens back to back]
    flat = [np.asarray(slots, dtype=np.int64), np.asarray([len(t) for t in token_lists], dtype=np.int64)]
    flat += [np.asarray(t, dtype=np.int64) for t in token_lists]
    return torch.from_numpy(np.concatenate(flat))


def _unpack_lists(tp: TensorParallel, count: int, total: int, packed: int):
    flat = tp.broadcast_host(torch.empty(2 * count + total, dtype=torch.int64)).tolist()
    slots, lengths, tokens = flat[:count], flat[count:2 * count], flat[2 * count:]
    ends = np.cumsum(lengths).tolist()
    lists = [tokens[end - n:end] for n, end in zip(lengths, ends)]
    return slots, lists, {v: k for k, v in _PACKED.items()}[packed]
