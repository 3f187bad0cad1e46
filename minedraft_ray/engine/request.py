"""Host-side request state: emitted tokens, where to stop, and speculative-decoding stats; what a step feeds the
drafter for a request (`draft_rows`) and how a step's tokens are committed to it (`commit_tokens`). No torch: the
runtime's manager and scheduler run it in a process without it."""
from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field

from .sampling_params import SamplingParams

_ids = itertools.count()


@dataclass
class RequestStats:
    arrival: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    verify_steps: int = 0                  # verify passes that carried at least one draft for this request
    target_only_steps: int = 0             # verify passes with no drafts (ar mode, fallbacks, first PSD step)
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # accepted count at draft index j
    drafted_per_position: list[int] = field(default_factory=list)
    preemptions: int = 0                   # times its KV blocks were taken back (it was resumed by recompute)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verify step: 1 + accepted / verify steps (vLLM's definition)."""
        return 1.0 + self.accepted / self.verify_steps if self.verify_steps else 1.0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def latency(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    def record_verify(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            self.target_only_steps += 1
            return
        self.verify_steps += 1
        self.drafted += num_drafts
        self.accepted += num_accepted
        grow = num_drafts - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        drafted, accepted = self.drafted_per_position, self.accepted_per_position
        for j in range(num_drafts):
            drafted[j] += 1
        for j in range(min(num_accepted, num_drafts)):
            accepted[j] += 1

    def as_dict(self) -> dict:
        return {"ttft": self.ttft, "latency": self.latency, "verify_steps": self.verify_steps,
                "target_only_steps": self.target_only_steps, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance_rate": self.acceptance_rate,
                "acceptance_length": self.acceptance_length,
                "accepted_per_position": list(self.accepted_per_position),
                "drafted_per_position": list(self.drafted_per_position), "preemptions": self.preemptions}


class Request:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, eos_token_ids: tuple[int, ...] = (),
                 request_id: str | None = None):
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        self.id = request_id if request_id is not None else f"req-{next(_ids)}"
        self.prompt_ids = list(prompt_ids)
        self.params = params
        # a request without a seed still gets one, drawn once here, so its run is reproducible from its record
        self.seed = params.seed if params.seed is not None else random.getrandbits(62)
        self.output_ids: list[int] = []
        self.logprobs: list = []
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.finish_reason: str | None = None
        self.slot: int | None = None
        self.draft_valid = 0      # tokens of the sequence known to be in the drafter's slot
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at (re)admission
        self.stats = RequestStats(arrival=time.perf_counter())

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def tail(self, start: int) -> list[int]:
        """Tokens of prompt + output from index `start` on."""
        n = len(self.prompt_ids)
        return (self.prompt_ids[start:] if start < n else []) + self.output_ids[max(start - n, 0):]

    def draft_feed(self) -> tuple[int, list[int]]:
        """What the drafter must be fed for this request: (the tokens of the sequence its slot already holds, at
        most seq_len - 2, and the tokens past them; from the start for a one-token prompt)."""
        valid = max(0, min(self.draft_valid, len(self.prompt_ids) + len(self.output_ids) - 2))
        return valid, self.tail(valid)

    def span(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without building the whole sequence."""
        n = len(self.prompt_ids)
        head = self.prompt_ids[start:min(stop, n)] if start < n else []
        return head + self.output_ids[max(start - n, 0):max(stop - n, 0)]

    @property
    def tokens(self) -> "TokenView":
        """Prompt + output as a read-only view that slices like a list (prefix-cache hashing reads a few blocks
        of a long sequence)."""
        return TokenView(self)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, tokens: list[int], logprobs: list | None = None) -> list[int]:
        """Append emitted tokens, cutting the run at a stop id or max_tokens (a stop id that is also the last token
        max_tokens allows is a stop). Returns what was kept. Sliced, not token by token: every step appends to
        every row."""
        if not tokens:
            return []
        room = self.params.max_tokens - len(self.output_ids)
        keep, reason = (len(tokens), None) if len(tokens) < room else (max(room, 1), "length")
        if self.stop_ids and not self.stop_ids.isdisjoint(tokens):
            for i in range(keep):
                if tokens[i] in self.stop_ids:
                    keep, reason = i + 1, "stop"
                    break
        kept = tokens[:keep]
        self.output_ids += kept
        if logprobs is not None:
            self.logprobs += logprobs[:keep]
        if reason is not None:
            self.finish_reason = reason
        now = time.perf_counter()
        if self.stats.first_token is None and kept:
            self.stats.first_token = now
        if self.finished:
            self.stats.finished = now
        return kept


class TokenView:
    """A request's prompt + output, sliced like one list (`view[a:b]`) without building it."""

    def __init__(self, request: Request):
        self.request = request

    def __len__(self) -> int:
        return self.request.seq_len

    def __getitem__(self, index: slice) -> list[int]:
        start, stop, step = index.indices(self.request.seq_len)
        assert step == 1, "a token view slices contiguous runs only"
        return self.request.span(start, stop)


@dataclass
class DraftRow:
    """What the drafter needs for one request: its slot and the final tokens it has not cached.

    `catchup` = seq[valid:] where `valid` = tokens of the sequence already in the drafter's slot
    (at most seq_len - 2); normally the last two tokens.
    """
    slot: int
    valid: int
    catchup: list[int]


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict
    logprobs: list | None = None


def draft_rows(requests: list[Request]) -> list[DraftRow]:
    """What the drafter must be fed for each request: everything past what its slot already holds (from the
    start for a one-token prompt)."""
    return [DraftRow(r.slot, *r.draft_feed()) for r in requests]


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
