"""A request's sampling settings: plain data without torch, so the processes that only build or check them (the
Serve ingress) need not import it. engine/sampling.py turns them into device tensors."""
from __future__ import annotations

from dataclasses import dataclass

GREEDY_EPS = 1e-5      # temperatures below this are greedy (as vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 5


@dataclass
class SamplingParams:
    temperature: float = 1.0      # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 = off
    max_tokens: int = 16
    seed: int | None = None       # None: a random seed is drawn once on the host when the batch row is built
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None   # number of top logprobs to return (<= MAX_LOGPROBS); None = off

    def validate(self):
        if not self.temperature >= 0:          # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int)
                                              and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS
