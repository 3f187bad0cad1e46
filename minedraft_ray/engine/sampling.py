"""On-device sampling: per-request parameters as device tensors, logits processing, seeded noise, `sample`.

Random numbers come from a counter-based hash of (request seed, absolute output position, purpose, vocab
index) instead of a torch.Generator: a token's noise does not depend on which other rows share its batch, on
the device, or on how many tokens were drafted before it, and drawing it needs no host sync. The hash is
plain int64 torch arithmetic on values below 2^32 with multipliers below 2^31, so no product overflows and
CPU and CUDA give bit-identical noise.

Sampling from a (possibly unnormalised) distribution w is the exponential race argmax(w / E), E ~ Exp(1):
exact, no cumsum, no normalisation, no sync.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from .sampling_params import GREEDY_EPS, MAX_LOGPROBS, SamplingParams  # noqa: F401 - imported from here too

# noise purposes: one independent stream per use of randomness at a given (seed, position)
PURPOSE_SAMPLE = 1     # plain sampling and the bonus token of a verify step
PURPOSE_DRAFT = 2      # probabilistic drafting
PURPOSE_ACCEPT = 3     # the accept/reject uniform of a draft token
PURPOSE_RESIDUAL = 4   # the recovered token after a rejection

_M32 = 0xFFFFFFFF


def _as_int64(seed: int) -> int:
    # any Python int -> the int64 with the same low 64 bits
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@dataclass
class SamplingBatch:
    """Device tensors for B rows, built when a batch's composition changes (not every step).

    Greedy rows carry temperature 0, top_k 0 and top_p 1, so their processed logits are the raw logits.
    The flags are decided on the host: exactly at build time and by `select` with a list of rows (from the
    host copy of each row's settings), conservatively by `select` with a device tensor (they may then claim
    work that no selected row needs, never skip work one does)."""
    temperature: torch.Tensor   # [B] float32, 0 = greedy
    top_k: torch.Tensor         # [B] int64, 0 = off
    top_p: torch.Tensor         # [B] float32
    seed: torch.Tensor          # [B] int64
    all_greedy: bool
    any_greedy: bool
    use_top_k: bool
    use_top_p: bool
    host_rows: list[tuple[bool, int, float]] | None = field(default=None, repr=False)  # (greedy, top_k, top_p)

    @classmethod
    def build(cls, params: list[SamplingParams], device, seeds: list[int] | None = None) -> "SamplingBatch":
        # seeds: per-row seeds fixed by the caller (a request should draw its seed once and keep it, so a
        # rebuilt batch continues the same random streams); otherwise SamplingParams.seed or a fresh one
        if seeds is None:
            seeds = [p.seed if p.seed is not None else random.getrandbits(63) for p in params]
        assert len(seeds) == len(params)
        rows = [(True, 0, 1.0) if p.greedy else (False, int(p.top_k), float(p.top_p)) for p in params]
        temperature = [0.0 if p.greedy else float(p.temperature) for p in params]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor([r[1] for r in rows], dtype=torch.int64, device=device),
            top_p=torch.tensor([r[2] for r in rows], dtype=torch.float32, device=device),
            seed=torch.tensor([_as_int64(s) for s in seeds], dtype=torch.int64, device=device),
            **_flags(rows), host_rows=rows)

    def __len__(self):
        return self.temperature.shape[0]

    def select(self, rows, index: torch.Tensor | None = None) -> "SamplingBatch":
        # rows: list of ints or an int64 tensor of row indices; index: the same rows already on the device
        # (saves a host-to-device copy when the caller has them there)
        idx = index if index is not None else torch.as_tensor(rows, dtype=torch.int64).to(self.temperature.device)
        tensors = (self.temperature[idx], self.top_k[idx], self.top_p[idx], self.seed[idx])
        if isinstance(rows, torch.Tensor) or self.host_rows is None:
            return SamplingBatch(*tensors, all_greedy=self.all_greedy, any_greedy=self.any_greedy,
                                 use_top_k=self.use_top_k, use_top_p=self.use_top_p)
        sub = [self.host_rows[i] for i in rows]
        return SamplingBatch(*tensors, **_flags(sub), host_rows=sub)

    def assign(self, rows: list[int], other: "SamplingBatch") -> None:
        """Overwrite rows (host list of indices) with other's rows, in order: a per-slot table kept
        on a worker is updated when requests start, then `select`ed by slot for every step."""
        idx = torch.as_tensor(rows, dtype=torch.int64).to(self.temperature.device, non_blocking=True)
        for mine, theirs in ((self.temperature, other.temperature), (self.top_k, other.top_k),
                             (self.top_p, other.top_p), (self.seed, other.seed)):
            mine.index_copy_(0, idx, theirs)
        for i, row in zip(rows, other.host_rows):
            self.host_rows[i] = row

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature < GREEDY_EPS   # [B] bool


def _flags(rows: list[tuple[bool, int, float]]) -> dict:
    return dict(all_greedy=all(r[0] for r in rows), any_greedy=any(r[0] for r in rows),
                use_top_k=any(r[1] > 0 for r in rows), use_top_p=any(r[2] < 1.0 for r in rows))


# ---------------------------------------------------------------- logits processing

def _apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       use_top_k: bool, use_top_p: bool) -> torch.Tensor:
    # x: [B, q, V] temperature-scaled logits; top_k, top_p: [B]. One ascending sort serves both.
    V = x.shape[-1]
    xs, order = x.sort(dim=-1)                                                  # [B, q, V]
    if use_top_k:
        k = torch.where((top_k > 0) & (top_k < V), top_k, V)                     # [B]
        kth = xs.gather(-1, (V - k).view(-1, 1, 1).expand(-1, x.shape[1], 1))  # [B, q, 1]
        xs = xs.masked_fill(xs < kth, float("-inf"))                           # ties with the k-th stay
    if use_top_p:
        # drop a token when the tokens ranked above it already hold >= top_p of the mass
        mass_below = xs.softmax(-1).cumsum(-1)                                  # [B, q, V]
        drop = (mass_below <= (1 - top_p).view(-1, 1, 1)) & (top_p < 1).view(-1, 1, 1)
        drop[..., -1] = False                                                   # the top token always stays
        xs = xs.masked_fill(drop, float("-inf"))
    return torch.empty_like(xs).scatter_(-1, order, xs)


def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [B, q, V] or [B, V] -> temperature-scaled logits with top-k/top-p tokens set to -inf.
    Greedy rows come back unchanged (temperature 1, no top-k/top-p)."""
    squeeze = logits.dim() == 2
    x = logits.unsqueeze(1) if squeeze else logits                              # [B, q, V]
    x = x.float()
    if not batch.all_greedy:
        t = torch.where(batch.greedy, 1.0, batch.temperature)                  # [B]
        x = x / t.view(-1, 1, 1)
        if batch.use_top_k or batch.use_top_p:
            x = _apply_top_k_top_p(x, batch.top_k, batch.top_p, batch.use_top_k, batch.use_top_p)
    return x.squeeze(1) if squeeze else x


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [B, q, V] or [B, V] float32 -> probs after temperature, top-k, top-p (renormalised).
    Greedy rows: one-hot at the argmax of the raw logits."""
    squeeze = logits.dim() == 2
    x = logits.unsqueeze(1) if squeeze else logits                              # [B, q, V]
    if batch.all_greedy:
        probs = _one_hot_argmax(x)
    else:
        probs = processed_logits(x, batch).softmax(-1)
        if batch.any_greedy:
            probs = torch.where(batch.greedy.view(-1, 1, 1), _one_hot_argmax(x), probs)
    return probs.squeeze(1) if squeeze else probs


def _one_hot_argmax(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x, dtype=torch.float32).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)


# ---------------------------------------------------------------- counter-based noise

def _mix32(x: torch.Tensor) -> torch.Tensor:
    # bijective 32-bit integer hash (xorshift-multiply, Wellons' lowbias32 shape) on int64 values in
    # [0, 2^32); multipliers are odd and < 2^31, so x * m < 2^63 never overflows int64
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x4C8F1A6B) & _M32
    return x ^ (x >> 16)


def noise_uniform(seed: torch.Tensor, position: torch.Tensor, purpose: int | torch.Tensor,
                  vocab: int | torch.Tensor | None = None) -> torch.Tensor:
    """Uniform noise in (0, 1), float32, as a pure function of (seed, absolute position, purpose, vocab index).

    seed [B] int64; position [B, q] int64 (positions are taken mod 2^32); purpose an int or an int64 tensor
    broadcastable to [B, q]. Returns [B, q] if vocab is None, [B, q, V] for every index below vocab = V, or
    [B, q, n] at given vocab indices [B, n] int64 (the same values: a race over a few tokens needs only theirs)."""
    seed = seed.to(torch.int64).view(-1, 1)                                     # [B, 1]
    h = _mix32((seed & _M32) ^ 0x243F6A88)
    h = _mix32(h ^ ((seed >> 32) & _M32) ^ 0x85A308D3)
    h = _mix32(h ^ (position.to(torch.int64) & _M32) ^ 0x13198A2E)              # [B, q]
    h = _mix32(h ^ (purpose & _M32) ^ 0x03707344)
    if vocab is not None:
        v = torch.arange(vocab, device=h.device, dtype=torch.int64) if isinstance(vocab, int) \
            else vocab.unsqueeze(-2)                                              # [V] or [B, 1, n]
        h = _mix32(h.unsqueeze(-1) ^ _mix32(v ^ 0x299F31D0))                    # [B, q, V] or [B, q, n]
    # top 23 bits -> (h + 0.5) / 2^23: exactly representable in float32, never 0 or 1
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def exponential_race(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample index ~ weights / weights.sum(-1) as argmax(weights / E), E = -log(u) ~ Exp(1).
    weights [..., V] >= 0 (need not be normalised), u [..., V] uniform in (0, 1) -> [...] int64."""
    return (weights / -torch.log(u)).argmax(-1)


def _as_positions(positions: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    # positions [B] for [B, V] logits, [B, q] for [B, q, V] logits -> [B, q]
    return positions.view(-1, 1) if logits.dim() == 2 else positions


def sample(logits: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor) -> torch.Tensor:
    """logits [B, V] or [B, q, V]; positions: absolute output position of each sampled token, [B] or [B, q].
    Returns ids [B] or [B, q] int64. Greedy rows take the argmax; others race over process_logits probs
    with noise (seed, position, PURPOSE_SAMPLE)."""
    if batch.all_greedy:
        return logits.argmax(-1)
    probs = process_logits(logits, batch)
    pos = _as_positions(positions, logits)
    u = noise_uniform(batch.seed, pos, PURPOSE_SAMPLE, logits.shape[-1])        # [B, q, V]
    ids = exponential_race(probs.view(u.shape), u)                               # [B, q]
    return ids.view(logits.shape[:-1])


def logprobs_topk(logits: torch.Tensor, batch: SamplingBatch, token_ids: torch.Tensor, n: int):
    """Log-probabilities under the processed target distribution (log_softmax of processed_logits;
    greedy rows: log_softmax of the raw logits, which is what processed_logits leaves them as).

    logits [B, V] or [B, q, V]; token_ids [B] or [B, q] the emitted tokens; n <= MAX_LOGPROBS.
    Returns (token_logprobs [B(, q)] float32, top_ids [B(, q), n] int64, top_logprobs [B(, q), n] float32).
    Tokens masked by top-k/top-p have logprob -inf."""
    lp = processed_logits(logits, batch).log_softmax(-1)
    token_lp = lp.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    top_lp, top_ids = lp.topk(n, dim=-1)
    return token_lp, top_ids, top_lp
