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
        for j in range(num_drafts):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += j < num_accepted

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
        """Append emitted tokens, cutting the run at a stop id or max_tokens. Returns what was kept."""
        kept = []
        for i, tok in enumerate(tokens):
            kept.append(tok)
            if logprobs is not None:
                self.logprobs.append(logprobs[i])
            self.output_ids.append(tok)
            if tok in self.stop_ids:
                self.finish_reason = "stop"
                break
            if len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
                break
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
    rows = []
    for r in requests:
        valid = max(0, min(r.draft_valid, r.seq_len - 2))
        rows.append(DraftRow(r.slot, valid, r.tail(valid)))
    return rows


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
