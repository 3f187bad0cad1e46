"""The two halves of a speculative step, shared by the in-process engine and the Ray actors.

Drafter: proposes k tokens per row from final (verified) tokens.
Verifier: scores [last token, drafts] in one pass and rejection-samples against the target.

KV rules (docs/design.md): the target slot holds seq_len - 1 tokens (the newest token is not in
it yet); the drafter slot is rewound to seq_len - 2 before each round and re-fed the last two
tokens, so a fully accepted run (whose last draft never went through the drafter) needs no
special case.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .rejection import draft_sample_packed, rejection_sample, unpack_draft_probs
from .request import DraftRow
from .runner import ModelRunner, to_host_async
from .sampling import GREEDY_EPS, SamplingBatch, SamplingParams, logprobs_topk, sample


class Drafter:
    def __init__(self, runner: ModelRunner, draft_temperature: float = 0.0, draft_top_k: int = 0):
        self.runner, self.device = runner, runner.device
        self.draft_temperature, self.draft_top_k = draft_temperature, draft_top_k

    def prefill(self, slots: list[int], prompts: list[list[int]], starts: list[int] | None = None) -> None:
        """Prompts (or chunks of them, starting at `starts`) into the drafter's slots."""
        self.runner.prefill_chunks(slots, starts or [0] * len(slots), prompts)

    @torch.inference_mode()
    def draft(self, rows: list[DraftRow], k: int, seeds: list[int] | None = None,
              positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> draft_ids [B, k] int64 (device), draft_probs [B, k, W] float32 (draft_sample_packed's q: top-k
        pairs or dense) or None (greedy drafting).

        positions [B]: absolute output position of each row's first draft token and seeds: the
        requests' seeds; both only matter for probabilistic drafting (its noise keys).
        """
        runner = self.runner
        # rewind to `valid`, then feed everything but the last two tokens as a catch-up prefill
        runner.set_lengths([r.slot for r in rows], [r.valid for r in rows])
        lagging = [r for r in rows if len(r.catchup) > 2]
        if lagging:
            runner.extend([r.slot for r in lagging], [r.catchup[:-2] for r in lagging])
        slots = torch.tensor([r.slot for r in rows], dtype=torch.int64).to(self.device, non_blocking=True)
        last2 = torch.tensor([r.catchup[-2:] for r in rows], dtype=torch.int64).to(self.device, non_blocking=True)
        seed_t = None
        if self.draft_temperature > 0:
            seed_t = SamplingBatch.build([SamplingParams()] * len(rows), self.device, seeds=seeds).seed
        return self._draft_loop(slots, last2, k, seed_t, positions)

    @torch.inference_mode()
    def draft_in_step(self, slots: torch.Tensor, last2: torch.Tensor, seq_lens: torch.Tensor, k: int,
                      seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`draft` from device state alone, for slots that hold every token but the last two of their
        sequence or more (prefilled with the prompt, then drafted every step): no host data, so steps can be
        queued before the previous one's tokens reach the host. slots, seq_lens, seeds, positions [B];
        last2 [B, 2] the sequence's last two tokens."""
        self.runner.set_lengths(slots, seq_lens - 2)
        return self._draft_loop(slots, last2, k, seeds if self.draft_temperature > 0 else None, positions)

    def _draft_loop(self, slots, last2, k, seeds, positions):
        runner, probabilistic = self.runner, seeds is not None
        if probabilistic:
            B = slots.shape[0]
            draft_batch = SamplingBatch(
                temperature=torch.full((B,), self.draft_temperature, dtype=torch.float32, device=self.device),
                top_k=torch.zeros(B, dtype=torch.int64, device=self.device),
                top_p=torch.ones(B, dtype=torch.float32, device=self.device), seed=seeds,
                all_greedy=self.draft_temperature < GREEDY_EPS, any_greedy=self.draft_temperature < GREEDY_EPS,
                use_top_k=False, use_top_p=False)
        ids, probs = [], []
        logits = runner.step(slots, last2)[:, -1]                        # [B, V]
        for j in range(k):
            if probabilistic:
                tok, p = draft_sample_packed(logits, draft_batch, positions + j, self.draft_top_k)
                probs.append(p)
            else:
                tok = logits.argmax(-1)                                 # [B]
            ids.append(tok)
            if j + 1 < k:
                logits = runner.step(slots, tok[:, None])[:, -1]
        draft_ids = torch.stack(ids, 1)                                  # [B, k]
        return draft_ids, (torch.stack(probs, 1) if probabilistic else None)


@dataclass
class VerifyResult:
    tokens: torch.Tensor        # [B, k+1] int64, -1 past the emitted ones
    num_emitted: torch.Tensor   # [B] int64, 1..num_drafts+1
    logprobs: tuple | None = None   # (token_lp [B, k+1], top_ids [B, k+1, n], top_lp [B, k+1, n])

    def staged(self) -> "VerifyResult":
        """This result copied into pinned host memory, the copies queued on the stream (on CUDA; a CPU
        result is returned as it is): once the stream has passed them, `to_host` reads the copies without a
        sync, which would also wait for any step queued behind this one."""
        if self.tokens.device.type != "cuda":
            return self
        logprobs = tuple(to_host_async(t) for t in self.logprobs) if self.logprobs is not None else None
        return VerifyResult(to_host_async(self.tokens), to_host_async(self.num_emitted), logprobs)

    def then(self, other: "VerifyResult") -> "VerifyResult":
        """This result's rows followed by `other`'s (a fused step: the verify's, then its chunks' first tokens);
        the narrower one's tokens are padded with -1 (past its emitted ones), and both carry logprobs or neither."""
        width = max(self.tokens.shape[1], other.tokens.shape[1])

        def wide(t: torch.Tensor, fill) -> torch.Tensor:   # [B, w, ...] -> [B, width, ...]
            pad = [0, 0] * (t.dim() - 2) + [0, width - t.shape[1]]
            return torch.nn.functional.pad(t, pad, value=fill)
        logprobs = None
        if self.logprobs is not None:
            logprobs = tuple(torch.cat([wide(a, 0), wide(b, 0)]) for a, b in zip(self.logprobs, other.logprobs))
        return VerifyResult(torch.cat([wide(self.tokens, -1), wide(other.tokens, -1)]),
                            torch.cat([self.num_emitted, other.num_emitted]), logprobs)

    def to_host(self) -> tuple[list[list[int]], list[list[dict]] | None]:
        """The emitted tokens per row (and their logprobs), copied to the host in one go."""
        emitted = self.num_emitted.tolist()
        tokens = [row[:n] for row, n in zip(self.tokens.tolist(), emitted)]
        if self.logprobs is None:
            return tokens, None
        token_lp, top_ids, top_lp = (t.tolist() for t in self.logprobs)
        # the top (id, logprob) pairs as lists: the runtime's messages carry lists as they are (runtime/workers.py)
        logprobs = [[{"token_id": tokens[b][i], "logprob": token_lp[b][i],
                      "top": [list(pair) for pair in zip(top_ids[b][i], top_lp[b][i])]} for i in range(n)]
                    for b, n in enumerate(emitted)]
        return tokens, logprobs


@dataclass(frozen=True)
class PromptChunks:
    """Prompt chunks riding a verify's target pass: chunk i is tokens [starts[i], starts[i] + len(tokens[i])) of
    slot slots[i]'s prompt (the slot holds the tokens before it); its last token's sample (row i of `batch`,
    output position 0) is the request's first token where the chunk ends the prompt."""
    slots: list[int]
    starts: list[int]
    tokens: list[list[int]]
    batch: SamplingBatch


class Verifier:
    def __init__(self, runner: ModelRunner):
        self.runner, self.device = runner, runner.device

    @torch.inference_mode()
    def prefill(self, slots: list[int], prompts: list[list[int]], batch: SamplingBatch,
                num_logprobs: int = 0, starts: list[int] | None = None,
                cached: list[int] | None = None) -> VerifyResult:
        """Prefill slots with prompts (or chunks of them, starting at `starts`) and sample each row's first
        token (output position 0): a request's own where its chunk ends its prompt. `cached`: tokens of each
        prompt the slot already holds (a prefix-cache hit), not recomputed."""
        if cached is not None and any(cached):
            if starts is not None and any(starts):
                raise ValueError("a prefill takes prompt chunks or a prefix-cache hit, not both")
            logits = self.runner.prefill(slots, prompts, cached=cached)      # [B, V]
        else:
            logits = self.runner.prefill_chunks(slots, starts or [0] * len(slots), prompts)   # [B, V]
        return self._first_tokens(logits, batch, num_logprobs)

    def _first_tokens(self, logits: torch.Tensor, batch: SamplingBatch, num_logprobs: int) -> VerifyResult:
        # logits [B, V] of each prompt's last token -> its first token, at output position 0
        positions = torch.zeros(logits.shape[0], dtype=torch.int64, device=self.device)
        first = sample(logits, batch, positions)                         # [B]
        lp = logprobs_topk(logits[:, None], batch, first[:, None], num_logprobs) if num_logprobs else None
        return VerifyResult(first[:, None], torch.ones_like(first), lp)

    @torch.inference_mode()
    def verify(self, slots: torch.Tensor, last_tokens: torch.Tensor, draft_ids: torch.Tensor,
               num_drafts: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor,
               draft_probs: torch.Tensor | None = None, num_logprobs: int = 0) -> VerifyResult:
        """One target pass over [last token, drafts] and rejection sampling.

        slots, last_tokens, num_drafts, positions: [B]; draft_ids [B, k] (k may be 0: plain decode);
        draft_probs [B, k, W]: the drafter's q as it comes (draft_sample_packed), expanded here.
        The target slot keeps the last token plus the accepted drafts; the rest is rolled back.
        """
        ids = torch.cat([last_tokens[:, None], draft_ids], 1)            # [B, k+1]
        logits = self.runner.step(slots, ids)                            # [B, k+1, V]
        return self._accept_rows(logits, slots, draft_ids, num_drafts, batch, positions, draft_probs, num_logprobs)

    @torch.inference_mode()
    def verify_with_chunks(self, slots: torch.Tensor, last_tokens: torch.Tensor, draft_ids: torch.Tensor,
                           num_drafts: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor,
                           draft_probs: torch.Tensor | None, num_logprobs: int,
                           chunks: "PromptChunks") -> tuple[VerifyResult, VerifyResult]:
        """`verify` with prompt chunks riding in its target pass (one launch: ModelRunner.step_with_chunks)
        -> (the verify's result, as `verify`; each chunk's first token, as `prefill`)."""
        ids = torch.cat([last_tokens[:, None], draft_ids], 1)            # [B, k+1]
        logits, chunk_logits = self.runner.step_with_chunks(slots, ids, chunks.slots, chunks.starts,
                                                            chunks.tokens)   # [B, k+1, V], [C, V]
        first = self._first_tokens(chunk_logits, chunks.batch, num_logprobs)
        verified = self._accept_rows(logits, slots, draft_ids, num_drafts, batch, positions, draft_probs,
                                     num_logprobs)
        return verified, first

    def _accept_rows(self, logits, slots, draft_ids, num_drafts, batch, positions, draft_probs,
                     num_logprobs) -> VerifyResult:
        k = draft_ids.shape[1]
        if draft_probs is not None:
            draft_probs = unpack_draft_probs(draft_probs, logits.shape[-1])   # [B, k, V]
        tokens, num_emitted = self.accept(logits, draft_ids, num_drafts, batch, positions, draft_probs)
        self.runner.rollback(slots, (k + 1) - num_emitted)
        lp = logprobs_topk(logits, batch, tokens.clamp(min=0), num_logprobs) if num_logprobs else None
        return VerifyResult(tokens, num_emitted, lp)

    def accept(self, logits, draft_ids, num_drafts, batch, positions, draft_probs):
        """Rejection sampling -> (tokens [B, k+1], -1 past the emitted ones; num_emitted [B]). A method, so a
        benchmark's verifier (minedraft_ray.testing.workers) can replace it."""
        return rejection_sample(logits, draft_ids, num_drafts, batch, positions, draft_probs)
