"""In-process engine on one device: `ar` (target only) and `sd` (draft k, then verify)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .kv_cache import MAX_K, KVCache, SlotAllocator
from .loader import check_pair, load_model, load_tokenizer
from .presets import resolve_model
from .request import Request
from .runner import PREFILL_TOKEN_BUDGET, ModelRunner
from .sampling import SamplingBatch, SamplingParams
from .spec import Drafter, DraftRow, Verifier

ENGINE_MODES = ("ar", "sd")


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict
    logprobs: list | None = None


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def draft_rows(requests: list[Request]) -> list[DraftRow]:
    """What the drafter must be fed for each request: everything past what its slot already holds (from the
    start for a one-token prompt)."""
    rows = []
    for r in requests:
        valid = max(0, min(r.draft_valid, r.seq_len - 2))
        rows.append(DraftRow(r.slot, valid, r.tail(valid)))
    return rows


def verify_inputs(requests: list[Request], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """slots [B], last tokens [B], output positions [B] (index of the next token each row emits)."""
    host = torch.tensor([[r.slot, r.last_token, len(r.output_ids)] for r in requests], dtype=torch.int64)
    host = host.to(device, non_blocking=True)
    return host[:, 0], host[:, 1], host[:, 2]


def commit_tokens(requests: list[Request], tokens: list[list[int]], logprobs: list[list[dict]] | None,
                  num_drafts: list[int]) -> list[list[int]]:
    """Append each row's emitted tokens to its request (cut at EOS / stop ids / max_tokens) and
    record the step's acceptance. Returns the tokens each request kept."""
    kept = []
    for row, (r, toks, nd) in enumerate(zip(requests, tokens, num_drafts)):
        r.stats.record_verify(nd, len(toks) - 1)
        kept.append(r.append(toks, logprobs[row] if logprobs is not None else None))
        if nd:  # the drafter's slot now matches the sequence up to seq_len - 2 (docs/design.md)
            r.draft_valid = r.seq_len - 2
    return kept


class Engine:
    """Single-device generation: `ar` (target only) or `sd` (standard speculative decoding).

    Engine(target_dir, draft_dir, mode="sd", k=4).generate(prompts, SamplingParams(...))
    """

    def __init__(self, target: str | Path, draft: str | Path | None = None, mode: str = "sd", k: int = 4,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None, max_batch: int = 8,
                 max_len: int | None = None, num_slots: int | None = None, draft_temperature: float = 0.0,
                 draft_top_k: int = 64, cuda_graphs: bool = True, memory_fraction: float = 0.85,
                 packed_prefill: bool = True, max_prefill_tokens: int = PREFILL_TOKEN_BUDGET):
        if mode not in ENGINE_MODES:
            raise ValueError(f"mode must be one of {ENGINE_MODES}, got {mode!r}")
        if mode == "sd" and draft is None:
            raise ValueError("mode 'sd' needs a draft model")
        if not 1 <= k <= MAX_K:
            raise ValueError(f"k must be in 1..{MAX_K}, got {k}")
        self.mode, self.k, self.max_batch, self.max_len = mode, k, max_batch, max_len
        self.device = torch.device(device) if device is not None else default_device()
        if dtype is None and self.device.type == "cpu":
            dtype = torch.float32
        target, draft = resolve_model(target), resolve_model(draft)
        self.tokenizer = load_tokenizer(target)
        vocab_limit = check_pair(target, draft).shared_vocab if mode == "sd" else None
        target_model = load_model(target, self.device, dtype)
        if max_len is None:  # the model's own context, bounded so slots stay affordable
            max_len = self.max_len = min(target_model.cfg.max_position_embeddings, 4096)
        if max_len > target_model.cfg.max_position_embeddings:
            raise ValueError(f"max_len ({max_len}) exceeds the target's context "
                             f"({target_model.cfg.max_position_embeddings} positions)")
        draft_model = load_model(draft, self.device, dtype) if mode == "sd" else None
        self.eos_token_ids = tuple(target_model.cfg.eos_token_ids)
        num_slots = self._fit_slots(num_slots, [m for m in (target_model, draft_model) if m is not None],
                                    memory_fraction)
        self.slots = SlotAllocator(num_slots)
        prefill = dict(packed_prefill=packed_prefill, max_prefill_tokens=max_prefill_tokens)
        self.verifier = Verifier(ModelRunner(target_model, self.device, num_slots, max_len, max_batch,
                                             cuda_graphs, vocab_limit, **prefill))
        self.drafter = (Drafter(ModelRunner(draft_model, self.device, num_slots, max_len, max_batch, cuda_graphs,
                                            vocab_limit, **prefill), draft_temperature, draft_top_k)
                        if draft_model is not None else None)

    def _fit_slots(self, requested, models, memory_fraction) -> int:
        if self.device.type != "cuda":
            return requested or self.max_batch
        per_slot = sum(KVCache.bytes_per_slot(m.cfg.num_layers, self.max_len, m.cfg.num_kv_heads, m.cfg.head_dim,
                                              next(m.parameters()).dtype) for m in models)
        free, _ = torch.cuda.mem_get_info(self.device)
        fits = int(free * memory_fraction) // per_slot - 1  # one scratch slot per runner
        want = requested or self.max_batch
        if fits < want:
            from .kv_cache import CacheSizeError
            raise CacheSizeError(f"{want} KV slots of max_len={self.max_len} do not fit: {max(fits, 0)} fit in "
                                 f"{free / 2**30:.1f} GiB free; lower max_batch, num_slots or max_len")
        return want

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
                while waiting and len(running) + len(admitted) < self.max_batch:
                    req = waiting.popleft()
                    req.slot = self.slots.alloc()
                    admitted.append(req)
                if admitted:
                    self._prefill(admitted)
                    running += admitted
                running = self._retire(running, bar)
                if running:
                    self.step(running)
                    running = self._retire(running, bar)
        finally:
            for r in running:
                self.slots.free(r.slot)
            bar.close()
        return [self.output(r) for r in requests]

    def _retire(self, running: list[Request], bar) -> list[Request]:
        alive = []
        for r in running:
            if r.finished:
                self.slots.free(r.slot)
                bar.update(1)
            else:
                alive.append(r)
        return alive

    def _prefill(self, requests: list[Request]) -> None:
        batch = SamplingBatch.build([r.params for r in requests], self.device, seeds=[r.seed for r in requests])
        num_lp = max(r.params.logprobs or 0 for r in requests)
        result = self.verifier.prefill([r.slot for r in requests], [r.prompt_ids for r in requests], batch, num_lp)
        for r in requests:
            r.draft_valid = 0  # the drafter catches up on its first draft round
        commit_tokens(requests, *result.to_host(), [0] * len(requests))

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
