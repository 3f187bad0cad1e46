import math

import numpy as np
import pytest
import torch
from scipy import stats as sps

from minedraft_ray.engine.sampling import (PURPOSE_ACCEPT, PURPOSE_DRAFT, PURPOSE_RESIDUAL, PURPOSE_SAMPLE,
                                           SamplingBatch, SamplingParams, logprobs_topk, noise_uniform,
                                           process_logits, sample)
from tests.stats import chi_square_pvalue

P_MIN = 1e-3
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def batch_of(*params, seeds=None, device="cpu"):
    return SamplingBatch.build(list(params), device, seeds=seeds or list(range(len(params))))


# ---------------------------------------------------------------- params and batch

@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(top_k=-1), dict(max_tokens=0), dict(logprobs=6),
                                    dict(logprobs=-1), dict(seed=1.5), dict(stop_token_ids=(3, -2))])
def test_validate_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs).validate()


def test_validate_accepts_good_values():
    SamplingParams().validate()
    SamplingParams(temperature=0, top_p=0.5, top_k=20, max_tokens=1, seed=7, stop_token_ids=(2,),
                   logprobs=5).validate()


def test_build_flags_and_select():
    b = batch_of(SamplingParams(temperature=0), SamplingParams(top_k=5), SamplingParams(top_p=0.9),
                 SamplingParams(temperature=0.5))
    assert (b.all_greedy, b.any_greedy, b.use_top_k, b.use_top_p) == (False, True, True, True)
    assert b.temperature.tolist() == [0.0, 1.0, 1.0, 0.5]
    assert b.seed.tolist() == [0, 1, 2, 3]
    s = b.select([0])
    assert (s.all_greedy, s.any_greedy, s.use_top_k, s.use_top_p) == (True, True, False, False)
    s = b.select([1, 3])
    assert (s.all_greedy, s.any_greedy, s.use_top_k, s.use_top_p) == (False, False, True, False)
    assert s.seed.tolist() == [1, 3] and s.top_k.tolist() == [5, 0]
    # a tensor selection keeps the parent's (conservative) flags and needs no host read
    s = b.select(torch.tensor([3]))
    assert (s.all_greedy, s.any_greedy, s.use_top_k, s.use_top_p) == (False, True, True, True)
    assert s.temperature.tolist() == [0.5]


def test_greedy_row_ignores_top_k_top_p_and_seeds_wrap_to_int64():
    b = SamplingBatch.build([SamplingParams(temperature=0, top_k=2, top_p=0.5)], "cpu", seeds=[2**64 - 1])
    assert b.all_greedy and not b.use_top_k and not b.use_top_p
    assert b.seed.tolist() == [-1]
    b = SamplingBatch.build([SamplingParams(), SamplingParams()], "cpu")   # random seeds drawn on the host
    assert b.seed[0] != b.seed[1]


# ---------------------------------------------------------------- logits processing

LOGITS = [1.0, 2.0, 3.0, 0.5]


def test_temperature():
    probs = process_logits(torch.tensor([LOGITS]), batch_of(SamplingParams(temperature=0.5)))
    assert torch.allclose(probs[0], torch.tensor(softmax([x / 0.5 for x in LOGITS])), atol=1e-6)


def test_top_k():
    probs = process_logits(torch.tensor([LOGITS]), batch_of(SamplingParams(temperature=0.5, top_k=2)))
    kept = softmax([2.0 / 0.5, 3.0 / 0.5])
    assert torch.allclose(probs[0], torch.tensor([0.0, kept[0], kept[1], 0.0]), atol=1e-6)


@pytest.mark.parametrize("top_p,expected", [
    (0.75, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),              # the top two hold 0.8 >= 0.75
    (0.85, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    (0.3, [1.0, 0.0, 0.0, 0.0]),                            # the top token always stays
    (1.0, [0.5, 0.3, 0.15, 0.05]),
])
def test_top_p(top_p, expected):
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = process_logits(logits, batch_of(SamplingParams(top_p=top_p)))
    assert torch.allclose(probs[0], torch.tensor(expected), atol=1e-6)


def test_top_k_then_top_p_on_the_renormalised_top_k():
    # top-k 3 leaves [0.5, 0.3, 0.15] / 0.95 = [0.526, 0.316, 0.158]; top-p 0.8 then keeps the first two
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = process_logits(logits, batch_of(SamplingParams(top_k=3, top_p=0.8)))
    assert torch.allclose(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=1e-6)


def test_mixed_batch_rows_are_independent_and_greedy_is_one_hot():
    logits = torch.tensor([LOGITS, LOGITS, LOGITS])
    b = batch_of(SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_k=2), SamplingParams())
    probs = process_logits(logits, b)
    assert probs[0].tolist() == [0.0, 0.0, 1.0, 0.0]
    kept = softmax([4.0, 6.0])
    assert torch.allclose(probs[1], torch.tensor([0.0, kept[0], kept[1], 0.0]), atol=1e-6)
    assert torch.allclose(probs[2], torch.tensor(softmax(LOGITS)), atol=1e-6)


def test_three_dim_logits_match_row_by_row():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 10)
    b = batch_of(SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=3),
                 SamplingParams(top_p=0.6))
    probs = process_logits(logits, b)                        # [3, 4, 10]
    assert probs.shape == (3, 4, 10)
    for j in range(4):
        assert torch.allclose(probs[:, j], process_logits(logits[:, j], b))
    assert torch.allclose(probs.sum(-1), torch.ones(3, 4))


# ---------------------------------------------------------------- noise

def test_noise_is_uniform():
    seeds = torch.arange(2000)
    u = noise_uniform(seeds, torch.arange(2000).view(-1, 1) % 37, PURPOSE_SAMPLE, None)   # [2000, 1]
    assert sps.kstest(u.flatten().numpy(), "uniform").pvalue > P_MIN
    u = noise_uniform(seeds[:20], torch.full((20, 3), 5), PURPOSE_RESIDUAL, 1000)         # [20, 3, 1000]
    assert u.shape == (20, 3, 1000)
    assert sps.kstest(u.flatten().numpy(), "uniform").pvalue > P_MIN
    assert 0 < u.min() and u.max() < 1


@pytest.mark.parametrize("vary", ["seed", "position", "purpose", "vocab"])
def test_noise_pairs_are_independent(vary):
    # neighbouring keys must not correlate: the joint of (u, u') over a 10 x 10 grid is uniform
    n = 20000
    seeds, pos = torch.arange(n), torch.full((n, 1), 3)
    u = noise_uniform(seeds, pos, PURPOSE_ACCEPT, 2)[:, 0]     # [n, 2]
    a = u[:, 0]
    b = {"seed": noise_uniform(seeds + 1, pos, PURPOSE_ACCEPT, 2)[:, 0, 0],
         "position": noise_uniform(seeds, pos + 1, PURPOSE_ACCEPT, 2)[:, 0, 0],
         "purpose": noise_uniform(seeds, pos, PURPOSE_DRAFT, 2)[:, 0, 0],
         "vocab": u[:, 1]}[vary]
    cells = (a * 10).long() * 10 + (b * 10).long()
    counts = np.bincount(cells.numpy(), minlength=100)
    assert chi_square_pvalue(counts, np.full(100, 0.01)) > P_MIN


def test_noise_does_not_depend_on_batch_composition():
    seeds = torch.tensor([11, 22, 33, 44])
    pos = torch.tensor([[5, 6], [0, 1], [100, 101], [7, 8]])
    full = noise_uniform(seeds, pos, PURPOSE_SAMPLE, 50)
    for rows in ([2], [3, 1], [0, 2]):
        part = noise_uniform(seeds[rows], pos[rows], PURPOSE_SAMPLE, 50)
        assert torch.equal(part, full[rows])
    # a [B, q] draw is the same as q separate [B, 1] draws
    assert torch.equal(full[:, 1:], noise_uniform(seeds, pos[:, 1:], PURPOSE_SAMPLE, 50))
    # the scalar stream is its own stream, distinct from the vocab-wide one, and purposes differ
    assert not torch.equal(noise_uniform(seeds, pos, PURPOSE_SAMPLE), full[..., 0])
    assert not torch.equal(noise_uniform(seeds, pos, PURPOSE_ACCEPT), noise_uniform(seeds, pos, PURPOSE_DRAFT))


def test_noise_purpose_tensor_matches_int():
    seeds, pos = torch.tensor([1, 2]), torch.tensor([[3], [4]])
    mixed = noise_uniform(seeds, pos, torch.tensor([[PURPOSE_SAMPLE], [PURPOSE_RESIDUAL]]), 16)
    assert torch.equal(mixed[0], noise_uniform(seeds[:1], pos[:1], PURPOSE_SAMPLE, 16)[0])
    assert torch.equal(mixed[1], noise_uniform(seeds[1:], pos[1:], PURPOSE_RESIDUAL, 16)[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_noise_and_sampling_identical_on_cpu_and_cuda():
    seeds = torch.tensor([0, 1, -5, 2**62 + 3])
    pos = torch.tensor([[0, 1], [7, 8], [2**33, 2**33 + 1], [123456, 123457]])
    for purpose in (PURPOSE_SAMPLE, PURPOSE_ACCEPT):
        assert torch.equal(noise_uniform(seeds, pos, purpose, 3000),
                           noise_uniform(seeds.cuda(), pos.cuda(), purpose, 3000).cpu())
    torch.manual_seed(0)
    logits = torch.randn(4, 3000)
    params = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(top_k=50),
              SamplingParams(temperature=0)]
    cpu = sample(logits, SamplingBatch.build(params, "cpu", seeds=[1, 2, 3, 4]), pos[:, 0])
    gpu = sample(logits.cuda(), SamplingBatch.build(params, "cuda", seeds=[1, 2, 3, 4]), pos[:, 0].cuda())
    assert torch.equal(cpu, gpu.cpu())


# ---------------------------------------------------------------- sample

TARGET = torch.tensor([0.3, -1.0, 1.2, 0.0, 2.0, -0.5, 0.8, -2.0])


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=1.3, top_k=4, top_p=0.9)])
def test_sample_distribution(params):
    n = 20000
    b = SamplingBatch.build([params] * n, "cpu", seeds=list(range(n)))
    logits = TARGET.expand(n, -1)
    ids = sample(logits, b, torch.full((n,), 9))
    expected = process_logits(TARGET.view(1, -1), b.select([0]))[0]
    assert chi_square_pvalue(np.bincount(ids.numpy(), minlength=8), expected.numpy()) > P_MIN
    # the same rows one position later draw fresh noise: the pairs are independent
    ids2 = sample(logits, b, torch.full((n,), 10))
    assert chi_square_pvalue(np.bincount(ids.numpy() * 8 + ids2.numpy(), minlength=64),
                             torch.outer(expected, expected).numpy()) > P_MIN


def test_sample_distribution_test_has_power():
    # sampling at T = 1 judged against the T = 0.7 distribution must be rejected
    n = 20000
    b = SamplingBatch.build([SamplingParams()] * n, "cpu", seeds=list(range(n)))
    ids = sample(TARGET.expand(n, -1), b, torch.full((n,), 9))
    wrong = torch.softmax(TARGET / 0.7, -1)
    assert chi_square_pvalue(np.bincount(ids.numpy(), minlength=8), wrong.numpy()) < P_MIN


def test_sample_greedy_rows_seeded_rows_and_shapes():
    torch.manual_seed(0)
    logits = torch.randn(4, 3, 50)
    b = batch_of(SamplingParams(temperature=0), SamplingParams(), SamplingParams(top_p=0.5),
                 SamplingParams(temperature=0), seeds=[1, 2, 3, 4])
    pos = torch.tensor([[0, 1, 2], [5, 6, 7], [9, 10, 11], [0, 1, 2]])
    ids = sample(logits, b, pos)                                     # [4, 3]
    assert ids.shape == (4, 3)
    assert torch.equal(ids[[0, 3]], logits[[0, 3]].argmax(-1))
    assert torch.equal(ids, sample(logits, b, pos))                  # deterministic
    # a row's token depends on its own (seed, position) only: not on the batch around it
    for j in range(3):
        assert torch.equal(ids[:, j], sample(logits[:, j], b, pos[:, j]))
    assert torch.equal(ids[1:3, 0], sample(logits[1:3, 0], b.select([1, 2]), pos[1:3, 0]))
    # different seeds draw differently
    b2 = batch_of(*[SamplingParams()] * 4, seeds=[100, 101, 102, 103])
    b1 = batch_of(*[SamplingParams()] * 4, seeds=[200, 201, 202, 203])
    assert not torch.equal(sample(logits, b1, pos), sample(logits, b2, pos))


def test_all_greedy_sample_is_argmax():
    logits = torch.randn(5, 7)
    b = batch_of(*[SamplingParams(temperature=0)] * 5)
    assert torch.equal(sample(logits, b, torch.zeros(5, dtype=torch.long)), logits.argmax(-1))


# ---------------------------------------------------------------- logprobs

def test_logprobs_topk():
    logits = torch.tensor([LOGITS, LOGITS])
    b = batch_of(SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_k=3))
    token_lp, top_ids, top_lp = logprobs_topk(logits, b, torch.tensor([1, 3]), 2)
    raw = torch.tensor(LOGITS).log_softmax(-1)                # greedy row: the raw distribution
    assert torch.allclose(token_lp[0], raw[1])
    assert top_ids[0].tolist() == [2, 1] and torch.allclose(top_lp[0], raw[[2, 1]])
    kept = softmax([1.0 / 0.5, 2.0 / 0.5, 3.0 / 0.5])
    assert torch.allclose(top_lp[1], torch.tensor([kept[2], kept[1]]).log())
    assert top_ids[1].tolist() == [2, 1]
    assert token_lp[1] == float("-inf")                        # token 3 is outside the top-3
    token_lp, top_ids, top_lp = logprobs_topk(logits.view(2, 1, 4), b, torch.tensor([[2], [2]]), 0)
    assert token_lp.shape == (2, 1) and top_ids.shape == (2, 1, 0)
    assert torch.allclose(token_lp[1, 0], torch.tensor(kept[2]).log())
