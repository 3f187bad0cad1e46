"""In-process engine on one device: `ar` (target only) and `sd` (draft k, then verify).

KV memory is paged (kv_cache.py): each model's cache is a pool of blocks sized from the device's memory
(`gpu_memory_utilization`, as vLLM names it: the share of the whole device this process may fill). A request
is admitted when its slot and the blocks of its first step are available; it takes more blocks as it grows,
and when the pool runs out the most recently admitted requests are preempted (their blocks given back) and
recomputed from their tokens when blocks free up, which changes no token: sampling noise is keyed by output
position. With `prefix_caching`, requests starting with the same tokens share the blocks of that prefix.
"""
from __future__ import annotations

from collections import deque
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .kv_blocks import HEADROOM, MAX_K, BlocksExhaustedError, CacheSizeError, DEFAULT_BLOCK_SIZE, SlotAllocator
from .kv_cache import bytes_per_token
from .loader import load_model, load_tokenizer
from .pair import check_pair
from .presets import resolve_model
from .request import GenerationOutput, Request, commit_tokens, draft_rows
from .runner import PREFILL_TOKEN_BUDGET, ModelRunner
from .sampling import SamplingBatch, SamplingParams
from .spec import Drafter, Verifier

ENGINE_MODES = ("ar", "sd")
# device memory left outside the KV pool for what is allocated after it: activations, CUDA graph pools, the
# allocator's slack; added to the prefill activations `activation_bytes` estimates
ACTIVATION_MARGIN_BYTES = 1 << 30
CPU_POOL_BYTES = 1 << 30  # bound of the KV pool in host memory, which the rest of the host shares


def activation_bytes(models, max_tokens: int, max_batch: int, step_tokens: int) -> int:
    """A bound on one forward's transient memory: max_tokens tokens through the widest layer (hidden,
    qkv, gate_up and its product, in the model dtype) plus fp32 logits (and two more of their size: probabilities,
    sampling) of a step of step_tokens tokens in every row."""
    widest = max(max_tokens * (4 * m.cfg.hidden_size + 3 * m.cfg.intermediate_size)
                 * next(m.parameters()).element_size() for m in models)
    logits = max(max_batch * step_tokens * m.cfg.vocab_size * 4 * 3 for m in models)
    return widest + logits


def pool_tokens(models, device: torch.device, gpu_memory_utilization: float, reserve_bytes: int,
                bound_tokens: int) -> int:
    """Tokens of K/V that every model's pool can hold (each model caches every token once), at most
    bound_tokens (what the slots can use at once: more would only idle). On CUDA: the share
    `gpu_memory_utilization` of the device, less what is in use now (weights, other processes) and
    `reserve_bytes`; on a CPU: CPU_POOL_BYTES."""
    per_token = sum(bytes_per_token(m.cfg.num_layers, m.cfg.num_kv_heads, m.cfg.head_dim,
                                    next(m.parameters()).dtype) for m in models)
    if device.type != "cuda":
        return min(CPU_POOL_BYTES // per_token, bound_tokens)
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * gpu_memory_utilization) - (total - free) - reserve_bytes
    if budget <= 0:
        raise CacheSizeError(f"no room for a KV cache: {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB free, "
                             f"gpu_memory_utilization={gpu_memory_utilization} leaves none after the weights "
                             f"and {reserve_bytes / 2**30:.1f} GiB for activations")
    return min(budget // per_token, bound_tokens)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def verify_inputs(requests: list[Request], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """slots [B], last tokens [B], output positions [B] (index of the next token each row emits)."""
    host = torch.tensor([[r.slot, r.last_token, len(r.output_ids)] for r in requests], dtype=torch.int64)
    host = host.to(device, non_blocking=True)
    return host[:, 0], host[:, 1], host[:, 2]


class Engine:
    """Single-device generation: `ar` (target only) or `sd` (standard speculative decoding).

    Engine(target_dir, draft_dir, mode="sd", k=4).generate(prompts, SamplingParams(...))

    `max_len` defaults to the target's context (`max_position_embeddings`), lowered to what the KV pool holds
    for one request. `paged=False` gives every slot its whole max_len up front (the former layout; kept as the
    comparison for benchmarks): no preemption, no prefix caching.
    """

    def __init__(self, target: str | Path, draft: str | Path | None = None, mode: str = "sd", k: int = 4,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None, max_batch: int = 8,
                 max_len: int | None = None, num_slots: int | None = None, draft_temperature: float = 0.0,
                 draft_top_k: int = 64, cuda_graphs: bool = True, gpu_memory_utilization: float = 0.9,
                 packed_prefill: bool = True, max_prefill_tokens: int = PREFILL_TOKEN_BUDGET, paged: bool = True,
                 block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: int | None = None, prefix_caching: bool = False):
        if mode not in ENGINE_MODES:
            raise ValueError(f"mode must be one of {ENGINE_MODES}, got {mode!r}")
        if mode == "sd" and draft is None:
            raise ValueError("mode 'sd' needs a draft model")
        if not 1 <= k <= MAX_K:
            raise ValueError(f"k must be in 1..{MAX_K}, got {k}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.mode, self.k, self.max_batch = mode, k, max_batch
        self.device = torch.device(device) if device is not None else default_device()
        if dtype is None and self.device.type == "cpu":
            dtype = torch.float32
        target, draft = resolve_model(target), resolve_model(draft)
        self.tokenizer = load_tokenizer(target)
        vocab_limit = check_pair(target, draft).shared_vocab if mode == "sd" else None
        target_model = load_model(target, self.device, dtype)
        context = target_model.cfg.max_position_embeddings
        if max_len is not None and max_len > context:
            raise ValueError(f"max_len ({max_len}) exceeds the target's context ({context} positions)")
        draft_model = load_model(draft, self.device, dtype) if mode == "sd" else None
        models = [m for m in (target_model, draft_model) if m is not None]
        self.eos_token_ids = tuple(target_model.cfg.eos_token_ids)
        num_slots = num_slots or max_batch
        if paged:
            max_len, num_blocks = self._size_pool(models, max_len or context, max_len is None, num_slots, block_size,
                                                  num_blocks, gpu_memory_utilization, max_prefill_tokens)
        else:
            max_len = max_len or min(context, 4096)
            self._check_static(models, max_len, num_slots, gpu_memory_utilization)
            num_blocks = None
        self.max_len, self.paged, self.prefix_caching = max_len, paged, paged and prefix_caching
        self.slots = SlotAllocator(num_slots)
        self.num_preemptions = 0
        self.peak_running = 0  # the most requests resident at once so far (concurrency)
        runner = dict(packed_prefill=packed_prefill, max_prefill_tokens=max_prefill_tokens, block_size=block_size,
                      num_blocks=num_blocks, prefix_caching=self.prefix_caching)
        self.verifier = Verifier(ModelRunner(target_model, self.device, num_slots, max_len, max_batch,
                                             cuda_graphs, vocab_limit, **runner))
        self.drafter = (Drafter(ModelRunner(draft_model, self.device, num_slots, max_len, max_batch, cuda_graphs,
                                            vocab_limit, **runner), draft_temperature, draft_top_k)
                        if draft_model is not None else None)
        self.runners = [self.verifier.runner] + ([self.drafter.runner] if self.drafter is not None else [])

    def _size_pool(self, models, max_len: int, default_len: bool, num_slots: int, block_size: int,
                   num_blocks: int | None, utilization: float, max_prefill_tokens: int) -> tuple[int, int]:
        """(max_len, blocks per pool): blocks from memory unless given; a default max_len lowered to what one
        request may hold, a given one checked against it."""
        if num_blocks is None:
            reserve = ACTIVATION_MARGIN_BYTES + activation_bytes(models, max_prefill_tokens, self.max_batch,
                                                                self.k + 1 if len(models) > 1 else 1)
            tokens = pool_tokens(models, self.device, utilization, reserve, num_slots * (max_len + HEADROOM))
            num_blocks = tokens // block_size + 1  # + the null block
        holds = (num_blocks - 1) * block_size - HEADROOM  # the most one request can hold
        if max_len > holds:
            if not default_len or holds < 16:
                raise CacheSizeError(f"a request of max_len={max_len} needs {max_len + HEADROOM} tokens of KV, but the "
                                     f"pool holds {max(holds + HEADROOM, 0)}; lower max_len or raise "
                                     "gpu_memory_utilization")
            max_len = holds
        return max_len, num_blocks

    def _check_static(self, models, max_len: int, num_slots: int, utilization: float) -> None:
        if self.device.type != "cuda":
            return
        tokens = pool_tokens(models, self.device, utilization, ACTIVATION_MARGIN_BYTES,
                             (num_slots + 1) * (max_len + HEADROOM))
        fits = tokens // (max_len + HEADROOM) - 1  # one scratch slot per runner
        if fits < num_slots:
            raise CacheSizeError(f"{num_slots} KV slots of max_len={max_len} do not fit: {max(fits, 0)} fit; "
                                 "lower max_batch, num_slots or max_len")

    # ---- requests ---------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams) -> Request:
        params.validate()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if len(ids) + params.max_tokens > self.max_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_len ({self.max_len})")
        return Request(ids, params, self.eos_token_ids)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[GenerationOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        requests = [self.make_request(p, sp) for p, sp in zip(prompts, params_list)]
        waiting, running = deque(requests), []
        bar = tqdm(total=len(requests), disable=not progress, desc=f"generate[{self.mode}]")
        try:
            while waiting or running:
                admitted = []
                while waiting and len(running) + len(admitted) < self.max_batch and self._place(waiting[0]):
                    admitted.append(waiting.popleft())
                if waiting and not admitted and not running:  # cannot happen: max_len is bounded by the pool
                    raise RuntimeError("the KV pool cannot hold one request")
                if admitted:
                    self._prefill(admitted)
                    running += admitted
                    self.peak_running = max(self.peak_running, len(running))
                running = self._retire(running, bar)
                if running:
                    running, preempted = self._grow(running)
                    waiting.extendleft(preempted)  # back in front, in their order
                    self.step(running)
                    self._register(running)
                    running = self._retire(running, bar)
        finally:
            for r in running:
                self._free(r)
            bar.close()
        return [self.output(r) for r in requests]

    def _first_step_len(self, r: Request) -> int:
        # the sequence length at the request's next verify: a fresh prompt gains its first token at prefill
        return r.seq_len + (0 if r.output_ids else 1)

    def _place(self, r: Request) -> bool:
        """Give r a slot, its cached prefix and the blocks of its first step in every model; False (nothing
        held) when the pool cannot."""
        if not self.slots.num_free:
            return False
        slot = self.slots.alloc()
        seq, next_len = r.tail(0), self._first_step_len(r)
        counters = [(run.cache.hit_tokens, run.cache.query_tokens) for run in self.runners]
        try:
            # a hit stops 2 tokens short of the next step's length: the target recomputes the newest prompt
            # token (its logits), the drafter re-feeds the last two tokens of every round
            cached = [run.adopt_prefix(slot, seq, next_len - 2) for run in self.runners]
            for run in self.runners:
                run.reserve([slot], [next_len + self.k])
        except BlocksExhaustedError:
            for run, (hits, queries) in zip(self.runners, counters):
                run.release(slot)
                run.cache.hit_tokens, run.cache.query_tokens = hits, queries  # a retry is not a new lookup
            self.slots.free(slot)
            return False
        r.slot, r.num_cached_tokens = slot, cached[0]
        r.draft_valid = cached[1] if self.drafter is not None else 0
        return True

    def _grow(self, running: list[Request]) -> tuple[list[Request], list[Request]]:
        """Blocks for the next step of every running request; when the pool runs out, the most recently
        admitted are preempted until the rest fit. -> (still running, preempted, latest first)."""
        running, preempted = list(running), []
        while running:
            try:
                for run in self.runners:
                    run.reserve([r.slot for r in running], [r.seq_len + self.k for r in running])
                return running, preempted
            except BlocksExhaustedError:
                victim = running.pop()
                self._free(victim)
                victim.stats.preemptions += 1
                self.num_preemptions += 1
                preempted.append(victim)
        return running, preempted

    def _free(self, r: Request) -> None:
        for run in self.runners:
            run.release(r.slot)
        self.slots.free(r.slot)
        r.slot = None

    def _register(self, running: list[Request]) -> None:
        """Offer each request's final K/V to the prefix cache: the target's below its length (seq_len - 1),
        the drafter's below what it is known to hold."""
        if not self.prefix_caching:
            return
        for r in running:
            seq = r.tail(0)
            self.verifier.runner.register_prefix(r.slot, seq, r.seq_len - 1)
            if self.drafter is not None:
                self.drafter.runner.register_prefix(r.slot, seq, min(r.draft_valid, r.seq_len - 2))

    def _retire(self, running: list[Request], bar) -> list[Request]:
        alive = []
        for r in running:
            if r.finished:
                self._free(r)
                bar.update(1)
            else:
                alive.append(r)
        return alive

    def _prefill(self, requests: list[Request]) -> None:
        fresh = [r for r in requests if not r.output_ids]
        resumed = [r for r in requests if r.output_ids]
        if resumed:  # preempted earlier: recompute the K/V of all but the newest token; nothing is sampled
            self.verifier.runner.prefill([r.slot for r in resumed], [r.tail(0)[:-1] for r in resumed],
                                         cached=[r.num_cached_tokens for r in resumed])
        if fresh:
            batch = SamplingBatch.build([r.params for r in fresh], self.device, seeds=[r.seed for r in fresh])
            num_lp = max(r.params.logprobs or 0 for r in fresh)
            result = self.verifier.prefill([r.slot for r in fresh], [r.prompt_ids for r in fresh], batch, num_lp,
                                           cached=[r.num_cached_tokens for r in fresh])
            commit_tokens(fresh, *result.to_host(), [0] * len(fresh))
        self._register(requests)

    def cache_stats(self) -> dict:
        """Prefix-cache hits per model (tokens found cached / tokens looked up) and preemptions so far."""
        def stats(run):
            c = run.cache
            return {"hit_tokens": c.hit_tokens, "query_tokens": c.query_tokens,
                    "hit_rate": c.hit_tokens / c.query_tokens if c.query_tokens else 0.0,
                    "blocks": c.num_blocks - 1, "blocks_available": c.num_available}
        out = {"target": stats(self.verifier.runner), "preemptions": self.num_preemptions,
               "peak_running": self.peak_running}
        if self.drafter is not None:
            out["draft"] = stats(self.drafter.runner)
        return out

    def step(self, running: list[Request]) -> None:
        """One verify step for every running request (drafting first in `sd`)."""
        batch = SamplingBatch.build([r.params for r in running], self.device, seeds=[r.seed for r in running])
        slots, last, positions = verify_inputs(running, self.device)
        if self.mode == "sd":
            draft_ids, draft_probs = self.drafter.draft(draft_rows(running), self.k, [r.seed for r in running], positions)
            num_drafts = [self.k] * len(running)
        else:
            draft_ids, draft_probs = torch.zeros((len(running), 0), dtype=torch.int64, device=self.device), None
            num_drafts = [0] * len(running)
        nd = torch.full((len(running),), num_drafts[0], dtype=torch.int64, device=self.device)
        num_lp = max(r.params.logprobs or 0 for r in running)
        result = self.verifier.verify(slots, last, draft_ids, nd, batch, positions, draft_probs, num_lp)
        commit_tokens(running, *result.to_host(), num_drafts)

    def output(self, r: Request) -> GenerationOutput:
        return GenerationOutput(r.id, r.prompt_ids, list(r.output_ids),
                                self.tokenizer.decode(r.output_ids, skip_special_tokens=True),
                                r.finish_reason or "abort", r.stats.as_dict(), r.logprobs or None)
