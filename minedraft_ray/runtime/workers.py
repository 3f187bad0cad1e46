"""The workers of the GPU actors (runtime/actors.py: each actor builds its worker in its own process and hands it the
manager's calls). Each wraps the engine layer (one device, no Ray inside) and speaks in small host-side messages
(runtime/messages.py): slot ids, token ids, counts. Only the draft channel carries tensors.

The torch device is picked here, not by the placement group: Ray sets CUDA_VISIBLE_DEVICES for
an actor holding a GPU bundle, and on a CPU cluster with logical GPUs the same code runs on CPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import threading
import time

import torch

from ..config import EngineConfig
from ..engine.attention import DecodeRows
from ..engine.engine import ACTIVATION_MARGIN_BYTES, activation_bytes, default_device, pool_tokens
from ..engine.kv_blocks import HEADROOM, CacheSizeError
from ..engine.loader import load_model
from ..engine.model import ModelConfig
from ..engine.parallel import ShardedRunner, TensorParallel
from ..engine.hub import model_dirs
from ..engine.rejection import draft_probs_width
from ..engine.runner import PREFILL_TOKEN_BUDGET, ModelRunner, to_device, to_host_async
from ..engine.sampling import SamplingBatch, SamplingParams
from ..engine.request import DraftRow
from ..engine.spec import Drafter, PromptChunks, Verifier, VerifyResult
from .gcs_store import GcsStore
from .link import PeerLink
from .messages import (GREEDY_ROW, ChannelSpec, DraftRound, KVEdits, LinkRound, LinkTokens, PrefillRow, PrefillTask,
                       SamplingRow, SpecStep, VerifierResult, VerifyTask, WorkerConfig)
from .ray_collective import ChannelEnd, close_end, open_end
from .rendezvous import Rendezvous, fresh_prefix

log = logging.getLogger("minedraft.runtime")


def pick_device(config: EngineConfig) -> torch.device:
    return default_device() if config.device == "auto" else torch.device(config.device)


def pick_dtype(config: EngineConfig, device: torch.device) -> torch.dtype | None:
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    return torch.float32 if device.type == "cpu" else None  # None: the checkpoint's dtype


def fused_rows(config: EngineConfig) -> DecodeRows | None:
    """The most row tokens a fused step of the target holds (every running request's verify, within the budget:
    fused launches never exceed it) and a verify's width (ar: one token, no drafts), whose graphs the target
    captures at start; None when chunks do not ride verifies."""
    if not (config.fused_prefill and config.packed_prefill and config.prefill_chunk_tokens):
        return None
    width = config.k + 1 if config.uses_drafter else 1
    return DecodeRows(min(config.max_running * width, config.prefill_chunk_tokens), width)


class StepTimer:
    """Device time of a block of work: CUDA events on a GPU, wall time on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    @property
    def ms(self) -> float:
        """The block's time, whenever it is read (on a GPU, reading waits for the block's work)."""
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end)
        return (self.t1 - self.t0) * 1e3


class LaunchOrder:
    """Tasks numbered 0, 1, 2, ... by the manager take turns launching device work in that order, whatever
    order a threaded actor runs them in. Everything a step reads (slot state, KV lengths) lives on the
    device, so launching in the manager's order is all that correctness needs; waiting for a step's results
    happens after its turn, so the next task launches behind it while it runs."""

    def __init__(self, timeout_s: float, worker: str):
        self.timeout_s, self.worker = timeout_s, worker
        self.next_seq = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def turn(self, seq: int):
        with self._cond:
            if not self._cond.wait_for(lambda: self.next_seq >= seq, self.timeout_s):
                raise TimeoutError(f"{self.worker} task {seq} waited {self.timeout_s:.0f} s for task {self.next_seq}")
            if self.next_seq > seq:
                raise RuntimeError(f"{self.worker} task {seq} arrived after its turn (next is {self.next_seq})")
        try:
            yield
        finally:
            with self._cond:
                self.next_seq = seq + 1
                self._cond.notify_all()


def sampling_batch(rows: list[SamplingRow], device) -> SamplingBatch:
    params = [SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k) for r in rows]
    return SamplingBatch.build(params, device, seeds=[r.seed for r in rows])


class _Worker:
    def __init__(self, config: WorkerConfig, num_slots: int):
        self.config = EngineConfig.model_validate(config.settings)
        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        self.device = pick_device(self.config)
        self.dtype = pick_dtype(self.config, self.device)
        self.num_slots = num_slots
        self.target_dir, self.draft_dir = model_dirs(self.config)
        if self.config.max_len is None:   # as the manager resolves it (a worker built on its own, in tests)
            context = ModelConfig.from_pretrained(self.target_dir).max_position_embeddings
            self.config = self.config.model_copy(update={"max_len": context})
        self.vocab_limit = config.vocab_limit
        # draft probabilities as they travel (draft_sample_packed): top-k pairs, or the dense vocabulary
        self._probs_width = draft_probs_width(self.vocab_limit, self.config.draft_top_k) if self.vocab_limit else 0
        # the collective channels' end (PeerLink, or ray_collective.ChannelEnd), one per drafter generation
        self.link: PeerLink | None = None
        self.order: LaunchOrder | None = None   # a threaded worker's: tasks launch device work in turn
        self.tp: TensorParallel | None = None   # a rank of a tensor-parallel target's

    def _turn(self, seq: int):
        return self.order.turn(seq) if self.order is not None else contextlib.nullcontext()

    def _link_of(self, generation: int) -> PeerLink | None:
        """The collective channel's link, if it is the one of that drafter generation."""
        return self.link if self.link is not None and self.link.generation == generation else None

    def _runner(self, model, step_widths: tuple[int, ...], num_blocks: int,
                fused: DecodeRows | None = None) -> ModelRunner:
        """`model` on this device with a pool of `num_blocks` KV blocks (handed out by the scheduler); on CUDA its
        graphs for every batch bucket and step width are captured now (and those of fused steps of up to
        `fused.tokens` row tokens, in launches within the per-step budget), so the first requests do not pay for
        captures (and the compiles inside them)."""
        runner = ModelRunner(model, self.device, self.num_slots, self.config.max_len, self.config.max_running,
                             self.config.cuda_graphs, self.vocab_limit, self.config.packed_prefill,
                             block_size=self.config.block_size, num_blocks=num_blocks)
        runner.capture_all(step_widths, fused, self.config.prefill_chunk_tokens or None)
        return runner

    def _load_target(self, group: Rendezvous | None, rank: int):
        """The target, or at tp > 1 this rank's shard of it, in the group met at `group`."""
        if self.config.tp == 1:
            return load_model(self.target_dir, self.device, self.dtype)
        self.tp = TensorParallel.connect(GcsStore.of(group), rank, self.config.tp, self.device, _node_ip(),
                                         self.config.step_timeout_s)
        return load_model(self.target_dir, self.device, self.dtype, tp=self.tp)

    def _target_runner(self, model, rank: int, step_widths: tuple[int, ...], num_blocks: int) -> ModelRunner:
        """The target's runner (`_runner`), sharded at tp > 1: rank 0's calls drive every rank (its graph captures
        too); the others follow (TargetRank)."""
        if self.config.tp == 1:
            return self._runner(model, step_widths, num_blocks, fused_rows(self.config))
        runner = ShardedRunner(model, self.device, self.num_slots, self.config.max_len, self.config.max_running,
                               tp=self.tp, cuda_graphs=self.config.cuda_graphs, vocab_limit=self.vocab_limit,
                               block_size=self.config.block_size, num_blocks=num_blocks)
        if rank == 0:
            runner.capture_all(step_widths)
        return runner

    def _pool_blocks(self, models: list) -> int:
        """KV blocks of each of `models`' pools on this device: `num_kv_blocks` when set, else what
        `gpu_memory_utilization` of the device leaves after what is loaded and the activations (engine.pool_tokens;
        on a CPU a fixed bound), and no more than every slot at max_len can use. At tp > 1 every rank takes the
        least of all ranks (rank 0 in sd also holds the drafter), so they hold the same blocks, and all fail
        together when one has no room."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        reserve = ACTIVATION_MARGIN_BYTES + activation_bytes(models, PREFILL_TOKEN_BUDGET, cfg.max_running,
                                                             cfg.k + 1)
        bound = self.num_slots * (cfg.max_len + HEADROOM)
        error = None
        try:
            blocks = pool_tokens(models, self.device, cfg.gpu_memory_utilization, reserve, bound) \
                // cfg.block_size + 1   # + the null block
        except CacheSizeError as e:   # raised after the other ranks learn of it
            blocks, error = 0, e
        if self.tp is not None:
            blocks = self.tp.min_across_ranks(blocks)
        if blocks < 2:
            raise CacheSizeError(str(error) if error is not None else
                                 f"no room for a KV pool on {self.device} (or on another of the target's GPUs); "
                                 "raise gpu_memory_utilization or lower max_batch")
        return blocks

    @staticmethod
    def _pool_of(runner: ModelRunner) -> dict:
        cache = runner.cache
        return {"num_blocks": cache.num_blocks, "block_size": cache.block_size,
                "blocks_per_slot": cache.blocks_per_slot}

    def kv_pools(self) -> dict:
        """Each KV pool this worker holds, by model (target, draft), as the scheduler sizes its bookkeeping."""
        return {}

    def _map_blocks(self, tables: KVEdits | None) -> None:
        """Apply a task's block-table changes (in its turn, before its device work)."""

    def ready(self) -> dict:
        # everything allocated so far (models, graphs, caches) lives as long as the actor: keep it out of
        # the collector's scans, so a full collection does not stall a step
        gc.collect()
        gc.freeze()
        return {"pid": os.getpid(), "device": str(self.device), "gpu_ids": _gpu_ids(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "kv_pools": self.kv_pools()}


def _node_ip() -> str:
    import ray
    return ray.util.get_node_ip_address()


def _gpu_ids():
    import ray
    try:
        return [str(g) for g in ray.get_gpu_ids()]
    except Exception:  # outside Ray
        return []


class SlotState:
    """What the verifier keeps per slot between steps, on its device: the last two tokens (the next
    step's input; `sd` drafts from them), the sequence length, the output position (the noise key of the
    next token) and the sampling settings. A verify message is then just slot ids plus a draft reference,
    and steps queued behind each other on the actor see each other's results without a round trip
    through the manager."""

    def __init__(self, num_slots: int, device: torch.device):
        self.last_token = torch.zeros(num_slots, dtype=torch.int64, device=device)   # [S]
        self.prev_token = torch.zeros(num_slots, dtype=torch.int64, device=device)   # [S] the one before it
        self.seq_len = torch.zeros(num_slots, dtype=torch.int64, device=device)      # [S] prompt + output
        self.position = torch.zeros(num_slots, dtype=torch.int64, device=device)     # [S]
        self.sampling = SamplingBatch.build([SamplingParams(temperature=0.0)] * num_slots, device,
                                            seeds=[0] * num_slots)                    # [S] rows

    def resume(self, rows: list[PrefillRow], batch: SamplingBatch) -> None:
        """Preempted requests back in their (new) slots: state from their tokens, nothing sampled."""
        slots = [r.slot for r in rows]
        host = torch.tensor([[r.resume.prev_token, r.resume.last_token, r.start + len(r.tokens) + 1,
                              r.resume.position] for r in rows], dtype=torch.int64).to(self.seq_len.device)
        slot_t = to_device(slots, self.seq_len.device)
        self.sampling.assign(slots, batch)
        self.prev_token[slot_t] = host[:, 0]
        self.last_token[slot_t] = host[:, 1]
        self.seq_len[slot_t] = host[:, 2]
        self.position[slot_t] = host[:, 3]

    def start(self, slots: list[int], slot_t: torch.Tensor, batch: SamplingBatch, first: torch.Tensor,
              ends: list[PrefillRow]) -> None:
        # first [B]: each request's first token (output position 0); ends: the rows that ended their prompts
        tails = torch.tensor([[r.tokens[-1], r.start + len(r.tokens)] for r in ends], dtype=torch.int64
                             ).to(first.device)
        self.sampling.assign(slots, batch)
        self.prev_token[slot_t] = tails[:, 0]
        self.last_token[slot_t] = first
        self.seq_len[slot_t] = tails[:, 1] + 1
        self.position[slot_t] = 1

    def advance(self, slot_t: torch.Tensor, tokens: torch.Tensor, num_emitted: torch.Tensor) -> None:
        # tokens [B, k+1] (-1 past the emitted ones), num_emitted [B] >= 1
        before_last = tokens.gather(1, (num_emitted - 2).clamp(min=0)[:, None]).squeeze(1)
        self.prev_token[slot_t] = torch.where(num_emitted >= 2, before_last, self.last_token[slot_t])
        self.last_token[slot_t] = tokens.gather(1, (num_emitted - 1)[:, None]).squeeze(1)
        self.seq_len[slot_t] += num_emitted
        self.position[slot_t] += num_emitted


class VerifierWorker(_Worker):
    """The target model: prefill and verify + rejection sampling. At tp > 1 this actor is rank 0 of the
    target's tensor-parallel group, its representative: it does the sampling and talks to the drafter and the
    manager, and the other ranks (TargetRank) run its model calls with it.

    Every task carries the manager's sequence number. A plain actor runs them one at a time in that order.
    With `verifier_overlap` the actor is threaded: a task launches its device work in its turn
    (LaunchOrder), queues the copies of its results to pinned host memory, hands the turn on and only then
    waits for the device (a CUDA event wait releases the GIL), so the next task's Ray hand-over and host
    work overlap this one's device time instead of following it."""

    def __init__(self, config: dict, num_slots: int, tp_group: Rendezvous | None = None):
        """tp_group: where the target's ranks meet (tp > 1); this actor is rank 0."""
        super().__init__(config, num_slots)
        beside = self._load_beside_target()
        target = self._load_target(tp_group, 0)
        num_blocks = self._pool_blocks([target] + beside)   # every model here caches every token once
        self._start_beside_target(beside, num_blocks)
        # verify steps are k + 1 wide, or 1 when no row carries drafts
        self.verifier = Verifier(self._target_runner(target, 0, (self.config.k + 1, 1), num_blocks))
        self.state = SlotState(num_slots, self.device)
        self.order = LaunchOrder(self.config.step_timeout_s, "verifier") if self.config.verifier_overlap else None

    def _load_beside_target(self) -> list:
        """The models that share this actor's GPU with the target (SpecWorker: the drafter), loaded first so that
        the KV pools are sized from what they all leave free."""
        return []

    def _start_beside_target(self, models: list, num_blocks: int) -> None:
        """Their runners, before the target's."""

    def kv_pools(self) -> dict:
        return {"target": self._pool_of(self.verifier.runner)}

    def _map_blocks(self, tables: KVEdits | None) -> None:
        if tables is not None and tables.target is not None:
            self.verifier.runner.map_blocks(tables.target)

    def open_link(self, generation: int) -> str:
        """The collective channel: wait for the drafter of `generation` -> the rendezvous key prefix it joins
        under (GCS: nothing new listens)."""
        prefix, old = fresh_prefix("link"), self.link
        self.link = PeerLink.listen(generation, _node_ip(), GcsStore(prefix, self.config.step_timeout_s),
                                    self.config.step_timeout_s)
        if old is not None:
            old.close()
        return prefix

    def drain_drafts(self, round_: list) -> None:
        """The collective channel: a round no verify will name (a LinkRound's wire form); take its messages when
        they come."""
        round_ = LinkRound.from_wire(round_)
        link = self._link_of(round_.generation)
        try:
            if link is not None:
                link.drain((round_.rows, round_.k), torch.int64, 2 * round_.key)
                if self.config.draft_temperature > 0:
                    link.drain((round_.rows, round_.k, self._probs_width), torch.float32, 2 * round_.key + 1)
        except Exception:  # noqa: BLE001 - the drafter died: its round will not come
            pass

    def open_channel_end(self, spec: ChannelSpec) -> None:
        """The ray_collective channel: the verifier's end of `spec` (its drafter opens the other end meanwhile)."""
        open_end(self, spec, ChannelEnd.VERIFIER)

    def close_channel_end(self, generation: int, reason: str) -> None:
        """The ray_collective channel: the drafter of `generation` is gone; a verify waiting for its drafts runs
        without them."""
        close_end(self, generation, reason)

    def _take_drafts(self, rounds) -> dict | None:
        """The rounds a verify names -> their drafts, rows concatenated in order, as {"ids", "probs"}; None
        (run without) when there are none or one failed."""
        taken = [self._take_round(r) for r in rounds]
        if not taken or any(t is None for t in taken):
            return None
        if len(taken) == 1:
            return taken[0]
        ids = torch.cat([torch.as_tensor(t["ids"], dtype=torch.int64) for t in taken])
        probs = None if taken[0]["probs"] is None else torch.cat([torch.as_tensor(t["probs"]) for t in taken])
        return {"ids": ids, "probs": probs}

    def _take_round(self, drafts):
        """One round a verify names -> {"ids", "probs"}, or None (the round failed)."""
        if not isinstance(drafts, LinkRound):
            return drafts
        link = self._link_of(drafts.generation)
        if link is None:   # a round of a drafter since replaced
            return None
        try:
            ids = link.recv((drafts.rows, drafts.k), torch.int64, 2 * drafts.key)            # [N, k]
            probs = link.recv((drafts.rows, drafts.k, self._probs_width), torch.float32, 2 * drafts.key + 1) \
                if self.config.draft_temperature > 0 else None                              # [N, k, W] packed
        except Exception as e:  # noqa: BLE001 - the drafter died or hung: verify without its drafts
            log.warning("round %d: no drafts over the link (%s); verifying without", drafts.key, e)
            return None
        return {"ids": ids, "probs": probs}

    def _send_tokens(self, to: LinkTokens, tokens: torch.Tensor) -> None:
        """tokens [B, w] (host, -1 past the emitted ones) -> the drafter, padded to the width it expects."""
        link = self._link_of(to.generation)
        if link is None:
            return
        out = torch.full((to.rows, to.width), -1, dtype=torch.int64)
        out[:, :tokens.shape[1]] = tokens[:to.rows]   # a fused step's chunk rows follow: not the round's
        try:
            link.send(out, to.seq)
        except Exception as e:  # noqa: BLE001 - the drafter's death is the manager's to handle
            log.warning("verify %d: tokens not sent to the drafter (%s)", to.seq, e)

    def _run(self, seq: int, launch, tokens_to: LinkTokens | None = None) -> VerifierResult:
        """launch() -> (VerifyResult staged to host, StepTimer) runs in turn `seq`; then its results are
        awaited (and, for the collective channel, its tokens sent to the drafter first)."""
        with self._turn(seq):
            t_launch = time.time()
            staged, timer = launch()
        ms = timer.ms   # waits for the device (and the staged copies) here, outside the turn
        if tokens_to is not None:
            self._send_tokens(tokens_to, staged.tokens.cpu())
        tokens, logprobs = staged.to_host()
        return VerifierResult(tokens, logprobs, ms, t_launch, time.time())

    def prefill(self, task: list) -> list:
        """A PrefillTask (its wire form; -> a VerifierResult's): prompt chunks into their slots; a request whose
        chunk ends its prompt starts: first token, and the slot state later verify steps read (a resumed request:
        the state from its tokens). The result has a row per chunk (only the new requests' ends' tokens mean
        anything)."""
        task = PrefillTask.from_wire(task)

        def launch():
            self._map_blocks(task.tables)
            with StepTimer(self.device) as timer:
                staged = self._prefill(task.rows, task.num_logprobs).staged()
            return staged, timer
        return self._run(task.seq, launch).to_wire()

    def _prefill(self, rows: list[PrefillRow], num_logprobs: int) -> VerifyResult:
        self._prefill_beside(rows)
        slots, starts = [r.slot for r in rows], [r.start for r in rows]
        batch = sampling_batch([r.sampling or GREEDY_ROW for r in rows], self.device)
        result = self.verifier.prefill(slots, [r.tokens for r in rows], batch, num_logprobs, starts)
        self._start_slots(rows, batch, result)
        return result

    def _prefill_beside(self, rows: list[PrefillRow]) -> None:
        """The same chunks into the models beside the target (SpecWorker: the drafter)."""

    def _start_slots(self, rows: list[PrefillRow], batch: SamplingBatch, result: VerifyResult) -> None:
        """Prefill rows ran (result: a first token per row): requests whose prompt ended start their slot state,
        resumed ones take theirs from their tokens."""
        slots = [r.slot for r in rows]
        ends = [i for i, r in enumerate(rows) if r.starts_request]
        if len(ends) == len(rows):
            self.state.start(slots, to_device(slots, self.device), batch, result.tokens[:, 0], rows)
        elif ends:
            end_rows = [rows[i] for i in ends]
            end_slots = [r.slot for r in end_rows]
            self.state.start(end_slots, to_device(end_slots, self.device),
                             sampling_batch([r.sampling for r in end_rows], self.device),
                             result.tokens[to_device(ends, self.device), 0], end_rows)
        resumed = [r for r in rows if r.resume is not None]
        if resumed:
            self.state.resume(resumed, sampling_batch([r.sampling for r in resumed], self.device))

    def verify(self, task: list, *drafts) -> list:
        """A VerifyTask (its wire form; -> a VerifierResult's): one verify step for its slots.

        drafts: the draft rounds it takes, in order, each {"ids": [N, k], "probs": [N, k, W] packed | None},
        which Ray hands over from the drafter (under a collective channel the task names them: `rounds`). The
        result's rows are the verify's, then its chunks' (as `prefill` returns them)."""
        task = VerifyTask.from_wire(task)
        slots = task.slots

        def launch():
            self._map_blocks(task.tables)
            round_drafts = self._take_drafts(task.rounds if task.rounds is not None else drafts)
            with StepTimer(self.device) as timer:
                slot_t = to_device(slots, self.device)
                draft_ids, num_drafts, draft_probs = self._gather_drafts(round_drafts, task.draft_index, len(slots))
                staged = self._verify(slots, slot_t, draft_ids, num_drafts, draft_probs, task.num_logprobs,
                                      task.chunks).staged()
            return staged, timer
        return self._run(task.seq, launch, task.tokens_to).to_wire()

    def _verify(self, slots: list[int], slot_t: torch.Tensor, draft_ids, num_drafts, draft_probs,
                num_logprobs: int, chunks: list[PrefillRow] | None = None) -> VerifyResult:
        # slot_t: slots [B] on the device; draft_ids [B, k], num_drafts [B], draft_probs [B, k, W] packed | None
        last_t, pos_t = self.state.last_token[slot_t], self.state.position[slot_t]
        batch = self.state.sampling.select(slots, slot_t)
        if not chunks:
            result = self.verifier.verify(slot_t, last_t, draft_ids, num_drafts, batch, pos_t, draft_probs,
                                          num_logprobs)
            self.state.advance(slot_t, result.tokens, result.num_emitted)
            return result
        self._prefill_beside(chunks)
        prompt = PromptChunks([r.slot for r in chunks], [r.start for r in chunks], [r.tokens for r in chunks],
                              sampling_batch([r.sampling or GREEDY_ROW for r in chunks], self.device))
        result, first = self.verifier.verify_with_chunks(slot_t, last_t, draft_ids, num_drafts, batch, pos_t,
                                                         draft_probs, num_logprobs, prompt)
        self.state.advance(slot_t, result.tokens, result.num_emitted)
        self._start_slots(chunks, prompt.batch, first)
        return result.then(first)

    def _gather_drafts(self, drafts, draft_index, batch):
        if drafts is None or draft_index is None or all(i < 0 for i in draft_index):
            empty = torch.zeros((batch, 0), dtype=torch.int64, device=self.device)
            return empty, torch.zeros(batch, dtype=torch.int64, device=self.device), None
        index = to_device(draft_index, self.device)
        has = index >= 0
        ids = to_device(drafts["ids"], self.device)[index.clamp(min=0)]                       # [B, k]
        num_drafts = torch.where(has, ids.shape[1], 0)
        probs = drafts.get("probs")
        if probs is not None:   # packed: Verifier.verify expands it
            probs = to_device(probs, self.device)[index.clamp(min=0)]                         # [B, k, W]
        return ids, num_drafts, probs


class DrafterWorker(_Worker):
    """The draft model on its own GPU: k greedy (or sampled) tokens per row from final tokens.

    Every task carries the manager's drafter sequence number. With `drafter_overlap` the actor is threaded, as
    the verifier is with `verifier_overlap`: a round waits for its tokens (collective channel) and builds its
    rows outside its turn, launches its device work in its turn, and waits for the device after it, so the next
    round's hand-over and host work overlap this one's device time instead of following it."""

    def __init__(self, config: dict, num_slots: int):
        super().__init__(config, num_slots)
        model = load_model(self.draft_dir, self.device, self.dtype)
        # a draft round steps 2 tokens (the re-fed tail), then 1 at a time
        self.drafter = Drafter(self._runner(model, (2, 1), self._pool_blocks([model])),
                               self.config.draft_temperature, self.config.draft_top_k)
        self.order = LaunchOrder(self.config.step_timeout_s, "drafter") if self.config.drafter_overlap else None

    def kv_pools(self) -> dict:
        return {"draft": self._pool_of(self.drafter.runner)}

    def _map_blocks(self, tables: KVEdits | None) -> None:
        if tables is not None and tables.draft is not None:
            self.drafter.runner.map_blocks(tables.draft)

    def prefill(self, task: list) -> float:
        """A PrefillTask (its wire form): new requests' prompt chunks into their slots (once a prompt is all there,
        its first draft feeds only the last two tokens) -> device ms."""
        task = PrefillTask.from_wire(task)
        rows = task.rows
        with self._turn(task.seq):
            self._map_blocks(task.tables)
            with StepTimer(self.device) as timer:
                self.drafter.prefill([r.slot for r in rows], [r.tokens for r in rows], [r.start for r in rows])
        return timer.ms

    def draft(self, round_: list, *sources):
        """A DraftRound (its wire form): `_draft` -> ({"ids": [B, k] lists, "probs": numpy [B, k, W] packed
        (draft_sample_packed) | None}, device ms)."""
        ids, probs, ms = self._draft(DraftRound.from_wire(round_), *sources)
        # host lists and numpy, not torch tensors: Ray pickles a torch tensor through torch's own reducer, which
        # made the hop from the drafter to the verify slower (docs/transport.md)
        return {"ids": ids.tolist(), "probs": probs.numpy() if probs is not None else None}, ms

    def _draft(self, round_: DraftRound, *sources, on_host: bool = True):
        """Drafter task round_.seq. sources: results of verifier tasks (prefill, verify: VerifierResult wire forms)
        still in flight when the round was submitted, which Ray passes in once they exist, after the tokens that
        come over the link (round_.tokens_over_link); rows take their tokens from these (DraftRound.takes).
        -> (ids [B, k] int64, probs [B, k, W] float32 packed (draft_sample_packed) | None, both on the host,
        or left on the device with `on_host` False; device ms)."""
        draft_rows, positions, error = [], list(round_.positions), None
        try:   # outside the turn: the previous round's device work runs meanwhile
            tokens = [VerifierResult.from_wire(s).tokens for s in sources]
            if round_.tokens_over_link is not None:   # source 0
                tokens.insert(0, self._tokens_over_link(round_.tokens_over_link))
            for i, (slot, valid, tail, takes, all_but_two) in enumerate(zip(
                    round_.slots, round_.valid, round_.tails, round_.takes, round_.all_but_two)):
                catchup = list(tail)
                for source, source_row in takes:
                    catchup += tokens[source][source_row]   # a prefill's or verify's emitted tokens of that row
                positions[i] += len(catchup) - len(tail)
                if all_but_two:
                    valid, catchup = valid + len(catchup) - 2, catchup[-2:]
                draft_rows.append(DraftRow(slot, valid, catchup))
        except Exception as e:  # noqa: BLE001 - raised in the turn, which is then handed on
            error = e
        with self._turn(round_.seq):
            self._map_blocks(round_.tables)   # even when the round fails: later rounds take blocks it mapped
            if error is not None:
                raise error
            with StepTimer(self.device) as timer:
                pos_t = torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True)
                ids, probs = self.drafter.draft(draft_rows, round_.k, round_.seeds, pos_t)
                if on_host:
                    ids, probs = to_host_async(ids), (to_host_async(probs) if probs is not None else None)
        ms = timer.ms   # waits for the device (and the copies to the host) here, outside the turn
        return ids, probs, ms

    def _tokens_over_link(self, source: LinkTokens) -> list[list[int]]:
        """A verify's tokens sent over the link -> its emitted tokens per row, as in the verify's own result."""
        link = self._link_of(source.generation)
        if link is None:
            raise ConnectionError(f"no link of generation {source.generation} for verify {source.seq}'s tokens")
        tokens = link.recv((source.rows, source.width), torch.int64, source.seq).tolist()   # [B, w]
        return [[t for t in row if t >= 0] for row in tokens]

    def join_link(self, generation: int, prefix: str) -> None:
        """The collective channel: connect to the verifier waiting for this drafter's generation."""
        store = GcsStore(prefix, self.config.step_timeout_s)
        old, self.link = self.link, PeerLink.join(generation, _node_ip(), store, self.config.step_timeout_s)
        if old is not None:
            old.close()

    def drain_tokens(self, source: list) -> None:
        """The collective channel: tokens sent for a round that was not drafted after all (a LinkTokens' wire
        form); take and drop them."""
        source = LinkTokens.from_wire(source)
        link = self._link_of(source.generation)
        try:
            if link is not None:
                link.drain((source.rows, source.width), torch.int64, source.seq)
        except Exception:  # noqa: BLE001 - the link is down: those tokens will not come
            pass

    def open_channel_end(self, spec: ChannelSpec) -> None:
        """The ray_collective channel: the drafter's end of `spec` (its verifier opens the other end meanwhile)."""
        open_end(self, spec, ChannelEnd.DRAFTER)

    def draft_over(self, key: list, round_: list, *sources) -> float:
        """The collective channel: draft (as `_draft`) and send the round over the link under `key` -> device
        ms (both in their wire forms: a LinkRound, a DraftRound). Should the round fail here, the manager replaces
        this drafter, and its link's end fails the verify waiting for the round: that verify runs without
        drafts."""
        key = LinkRound.from_wire(key)
        ids, probs, ms = self._draft(DraftRound.from_wire(round_), *sources, on_host=not self.link.on_device)
        self.link.send(ids, 2 * key.key)
        if probs is not None:
            self.link.send(probs.contiguous(), 2 * key.key + 1)
        return ms


class SpecWorker(VerifierWorker):
    """`sd` mode: drafter and target in one actor on one GPU; a whole step with no Ray hop inside.

    The drafter's slots are prefilled with the prompt together with the target's, and every step drafts
    from the slot state alone, so the manager can queue a step before the previous one's tokens are back."""

    def _load_beside_target(self) -> list:
        return [load_model(self.draft_dir, self.device, self.dtype)]

    def _start_beside_target(self, models: list, num_blocks: int) -> None:
        # a draft round steps 2 tokens (the re-fed tail), then 1 at a time
        self.drafter = Drafter(self._runner(models[0], (2, 1), num_blocks), self.config.draft_temperature,
                               self.config.draft_top_k)

    def kv_pools(self) -> dict:
        return {**super().kv_pools(), "draft": self._pool_of(self.drafter.runner)}

    def _map_blocks(self, tables: KVEdits | None) -> None:
        super()._map_blocks(tables)
        if tables is not None and tables.draft is not None:
            self.drafter.runner.map_blocks(tables.draft)

    def _prefill_beside(self, rows: list[PrefillRow]) -> None:
        # the drafter's own launch: it is small beside the target
        self.drafter.prefill([r.slot for r in rows], [r.tokens for r in rows], [r.start for r in rows])

    def step(self, task: list) -> list:
        """A SpecStep (its wire form; -> a VerifierResult's): draft k tokens for every slot from the slot state,
        then verify them."""
        task = SpecStep.from_wire(task)
        slots, k, num_logprobs, chunks = task.slots, task.k, task.num_logprobs, task.chunks
        state, timers = self.state, {}

        def launch():
            self._map_blocks(task.tables)
            with StepTimer(self.device) as timers["draft"]:
                slot_t = to_device(slots, self.device)
                last2 = torch.stack([state.prev_token[slot_t], state.last_token[slot_t]], 1)     # [B, 2]
                ids, probs = self.drafter.draft_in_step(slot_t, last2, state.seq_len[slot_t], k,
                                                        state.sampling.seed[slot_t], state.position[slot_t])
            with StepTimer(self.device) as timer:
                num_drafts = torch.full((len(slots),), ids.shape[1], dtype=torch.int64, device=self.device)
                staged = self._verify(slots, slot_t, ids, num_drafts, probs, num_logprobs, chunks).staged()
            return staged, timer
        result = self._run(task.seq, launch)
        return dataclasses.replace(result, draft_ms=timers["draft"].ms).to_wire()


class TargetRank(_Worker):
    """Rank `rank` > 0 of a tensor-parallel target: its shard, following rank 0's model calls (`follow`, which runs
    as long as the group does)."""

    def __init__(self, config: dict, num_slots: int, rank: int, tp_group: Rendezvous):
        super().__init__(config, num_slots)
        self.rank = rank
        model = self._load_target(tp_group, rank)
        self.runner = self._target_runner(model, rank, (), self._pool_blocks([model]))

    def follow(self) -> int:
        """Run rank 0's calls until it stops (-> this rank) or the group breaks (raises: rank 0 or a peer died)."""
        self.runner.follow()
        return self.rank
