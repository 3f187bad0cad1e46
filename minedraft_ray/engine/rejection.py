"""Lossless batched rejection sampling for speculative decoding (Leviathan et al. 2023, arXiv 2211.17192).

With p the processed target distribution (`process_logits`) and q the distribution a draft was sampled
from, draft j is accepted with probability min(1, p(d_j) / q(d_j)); at the first rejection the emitted token
is drawn from norm(max(0, p - q)); if every draft is accepted a bonus token is drawn from p at the position
after the last draft. Each emitted token is then distributed exactly as the target would have sampled it.

Everything is batched over rows with per-row draft counts, and nothing reads back to the host: the first
rejection index comes from a cumprod, and only the one distribution per row that is actually sampled from
(residual or bonus) is gathered and raced, with one vocab-wide noise draw per row.
"""
from __future__ import annotations

import torch

from .sampling import (PURPOSE_ACCEPT, PURPOSE_DRAFT, PURPOSE_RESIDUAL, PURPOSE_SAMPLE, SamplingBatch,
                       exponential_race, noise_uniform, process_logits, sample)


def draft_sample_packed(draft_logits: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor,
                        top_k: int = 0):
    """Probabilistic drafting: draft_logits [B, V], positions [B] (output position of the drafted token).
    Returns (ids [B] int64, q [B, W] float32): q is exactly the distribution the ids were drawn from, in the
    form it travels in and that Verifier.verify takes (unpack_draft_probs gives it dense).

    top_k with 2 top_k < V: q is the drafter's distribution cut to its top_k tokens (exactly top_k entries,
    ties or not) and renormalised, and W = 2 top_k: the probabilities, then their ids as float32 (exact below
    2^24, far above any vocabulary); at 8B/1B shapes (V = 128256), N = 64, k = 3, 98 KB a round instead of 98 MB.
    Any q keeps the output lossless; a cut one only accepts a little less where the drafter's tail mass is
    large. Otherwise W = V: q dense. Greedy rows get argmax ids and one-hot q. (Greedy drafting is plain argmax
    with draft_probs=None in rejection_sample.)"""
    probs = process_logits(draft_logits, batch)                                   # [B, V]
    where = positions.view(-1, 1)
    if draft_probs_width(probs.shape[-1], top_k) == probs.shape[-1]:
        return exponential_race(probs, noise_uniform(batch.seed, where, PURPOSE_DRAFT, probs.shape[-1])[:, 0]), probs
    vals, idx = probs.topk(top_k, -1)                                             # [B, top_k]
    vals = vals / vals.sum(-1, keepdim=True)
    # the race over the kept tokens with their own noise: the dense race over the cut q, zeros never winning
    u = noise_uniform(batch.seed, where, PURPOSE_DRAFT, idx)[:, 0]                # [B, top_k]
    ids = idx.gather(-1, exponential_race(vals, u)[:, None])[:, 0]
    return ids, torch.cat([vals, idx.float()], -1)


def draft_sample(draft_logits: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor, top_k: int = 0):
    """draft_sample_packed with q dense: (ids [B] int64, q [B, V] float32)."""
    ids, q = draft_sample_packed(draft_logits, batch, positions, top_k)
    return ids, unpack_draft_probs(q, draft_logits.shape[-1])


def draft_probs_width(vocab: int, top_k: int) -> int:
    """Last dimension of draft probabilities as they travel: top_k (prob, id) pairs where that is narrower
    than the vocabulary (and so cannot be mistaken for it), else the dense vocabulary."""
    return 2 * top_k if 0 < 2 * top_k < vocab else vocab


def unpack_draft_probs(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """draft_sample_packed's q [..., W] -> q [..., V] float32, exactly the q the drafts were drawn from."""
    if packed.shape[-1] == vocab:
        return packed
    top_k = packed.shape[-1] // 2
    dense = torch.zeros(*packed.shape[:-1], vocab, dtype=torch.float32, device=packed.device)
    return dense.scatter_(-1, packed[..., top_k:].long(), packed[..., :top_k])


def rejection_sample(target_logits: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                     batch: SamplingBatch, positions: torch.Tensor, draft_probs: torch.Tensor | None = None):
    """target_logits [B, k+1, V] float32: logits at the k+1 verify positions (position j predicts the token
    after draft j-1); draft_ids [B, k] int64; num_drafts [B] int64 in 0..k (entries past it are ignored);
    positions [B]: absolute output position of the first token this step emits; draft_probs [B, k, V] or
    None for greedy (one-hot) drafting.

    Returns out_ids [B, k+1] int64 (-1 past the emitted ones) and num_emitted [B] int64 = accepted + 1."""
    B, k = draft_ids.shape
    device = draft_ids.device
    if k == 0:
        ids = sample(target_logits[:, 0], batch, positions)
        return ids.view(B, 1), torch.ones(B, dtype=torch.int64, device=device)
    j = torch.arange(k + 1, device=device)                                         # [k+1]
    valid = j[:k] < num_drafts.view(-1, 1)                                         # [B, k]
    drafts = torch.where(valid, draft_ids, 0)                                      # padding may hold -1
    if batch.all_greedy:
        return _greedy(target_logits, drafts, valid, j)
    if draft_probs is None:
        return _sample_then_compare(target_logits, drafts, valid, j, batch, positions)

    p = process_logits(target_logits, batch)                                       # [B, k+1, V]
    p_draft = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)                # [B, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    u = noise_uniform(batch.seed, positions.view(-1, 1) + j[:k], PURPOSE_ACCEPT)  # [B, k]
    # accept with probability min(1, p/q), written without a division: q = 0 with p > 0 accepts
    accept = (u * q_draft < p_draft) & valid
    num_accepted = accept.long().cumprod(1).sum(1)                                 # [B], first rejection index
    rejected = num_accepted < num_drafts                                           # [B]

    rows = torch.arange(B, device=device)
    p_last = p[rows, num_accepted]                                                 # [B, V]
    # the rejected draft; where all were accepted the last real one (q_last is then unused, but never padding)
    last_draft = torch.minimum(num_accepted, num_drafts - 1).clamp_min(0)
    if draft_probs is None:
        q_last = torch.zeros_like(p_last).scatter_(-1, drafts[rows, last_draft].view(-1, 1), 1.0)
    else:
        q_last = draft_probs[rows, last_draft]                                     # [B, V]
    weights = _final_weights(p_last, q_last, rejected)                             # [B, V]
    purpose = torch.where(rejected, PURPOSE_RESIDUAL, PURPOSE_SAMPLE).view(-1, 1)
    u_last = noise_uniform(batch.seed, (positions + num_accepted).view(-1, 1), purpose, p.shape[-1])[:, 0]
    last = exponential_race(weights, u_last)                                       # [B]

    out = torch.where(j < num_accepted.view(-1, 1), torch.cat([drafts, drafts[:, :1]], 1),
                      torch.where(j == num_accepted.view(-1, 1), last.view(-1, 1), -1))
    return out, num_accepted + 1


def _sample_then_compare(target_logits, drafts, valid, j, batch, positions):
    """Greedy (one-hot) drafts: sample the target at every verify position with the very noise plain
    decoding would use there, and accept while the draft equals that sample.

    Accepting d with probability p(d), and otherwise emitting the target sample conditioned on != d,
    is exactly min(1, p/q) with q one-hot and the residual norm(max(0, p - q)); drawing both from the
    target's own sample makes every emitted token the token `sample` would emit at that position for
    that prefix, so a seeded request gives the same text in ar, sd and psd, at any load."""
    p = process_logits(target_logits, batch)                                       # [B, k+1, V]
    u = noise_uniform(batch.seed, positions.view(-1, 1) + j, PURPOSE_SAMPLE, p.shape[-1])  # [B, k+1, V]
    target = exponential_race(p, u)                                                # [B, k+1]
    k = drafts.shape[1]
    num_accepted = ((drafts == target[:, :k]) & valid).long().cumprod(1).sum(1)    # [B]
    return torch.where(j <= num_accepted.view(-1, 1), target, -1), num_accepted + 1


def _greedy(target_logits, drafts, valid, j):
    # accept while draft == target argmax, then emit the argmax (correction or bonus): no probabilities
    target = target_logits.argmax(-1)                                              # [B, k+1]
    k = drafts.shape[1]
    num_accepted = ((drafts == target[:, :k]) & valid).long().cumprod(1).sum(1)    # [B]
    out = torch.where(j <= num_accepted.view(-1, 1), target, -1)
    return out, num_accepted + 1


def _final_weights(p_last: torch.Tensor, q_last: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    # the distribution of the token emitted after the accepted drafts, as race weights [B, V]:
    # the residual after a rejection, else the bonus distribution p
    return torch.where(rejected.view(-1, 1), _residual(p_last, q_last), p_last)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    # max(0, p - q), left unnormalised: the exponential race is scale-invariant. All-zero happens only
    # when p == q, where a rejection has probability 0 but rounding can still produce one: fall back to p.
    r = (p - q).clamp_min(0)
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)
