"""A fused step (engine layer, fp32 CPU): decode/verify rows and prompt chunks in one packed launch
(`ModelRunner.step_with_chunks`, `Verifier.verify_with_chunks`) give the logits, KV, lengths and sampled tokens
of the two separate launches they replace (`prefill_chunks`, then `step` / `verify`)."""
import pytest
import torch

from minedraft_ray.engine.loader import load_model
from minedraft_ray.engine.runner import ModelRunner
from minedraft_ray.engine.sampling import SamplingBatch, SamplingParams
from minedraft_ray.engine.spec import PromptChunks, Verifier

# fp32 reduction-order noise: GEMMs of other token counts sum in another order (logits here reach ~10)
TOL = dict(atol=3e-5, rtol=1e-5)
MAX_LEN = 64
NUM_SLOTS = 6


def _prompts(lengths, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=gen).tolist() for n in lengths]


def _kv(runner, slot, length):
    return torch.stack([torch.stack(runner.cache.slot_kv(layer, slot, length))
                        for layer in range(len(runner.cache.k))])


def _runner(model, **kw):
    return ModelRunner(model, "cpu", num_slots=NUM_SLOTS, max_len=MAX_LEN, max_batch=4, block_size=4, **kw)


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen3"])
def model(request):
    return load_model(request.getfixturevalue(request.param), "cpu")


def _setup(model, runner):
    """Rows on slots 4, 0, 2 hold contexts of 9, 5 and 14 tokens; slot 1 holds the first 6 tokens of a prompt and
    slot 3 an earlier, longer request's junk (its next chunk restarts it)."""
    vocab = model.cfg.vocab_size
    contexts = _prompts([9, 5, 14], vocab, seed=1)
    runner.prefill([4, 0, 2], contexts)
    long, short = _prompts([17, 7], vocab, seed=2)
    runner.prefill([3], _prompts([30], vocab, seed=3))   # junk
    runner.prefill_chunks([1], [0], [long[:6]])
    return long, short


# chunks: (slot, start, stop) of the long prompt (slot 1) and the short one (slot 3, restarting)
CASES = [((1, 6, 17),), ((1, 6, 10), (3, 0, 7)), ((3, 0, 3),), ((1, 6, 7), (3, 0, 1))]


@pytest.mark.parametrize("q", [1, 4])
@pytest.mark.parametrize("chunks", CASES)
@pytest.mark.parametrize("max_prefill_tokens", [8192, 9])   # 9: rows and chunks too many for one launch
def test_fused_launch_equals_separate_launches(model, q, chunks, max_prefill_tokens):
    fused, separate = _runner(model, max_prefill_tokens=max_prefill_tokens), _runner(model)
    long, short = _setup(model, fused)
    _setup(model, separate)
    prompt = {1: long, 3: short}
    slots = torch.tensor([4, 0, 2])
    ids = torch.tensor(_prompts([3 * q], model.cfg.vocab_size, seed=5)[0]).view(3, q)
    c_slots, c_starts = [c[0] for c in chunks], [c[1] for c in chunks]
    c_tokens = [prompt[s][a:b] for s, a, b in chunks]
    want_chunks = separate.prefill_chunks(c_slots, c_starts, c_tokens).clone()
    want = separate.step(slots, ids).clone()
    got, got_chunks = fused.step_with_chunks(slots, ids, c_slots, c_starts, c_tokens)
    assert got.shape == (3, q, fused.vocab) and got_chunks.shape == (len(chunks), fused.vocab)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_chunks, want_chunks, **TOL)
    assert fused.cache.lengths.tolist() == separate.cache.lengths.tolist()
    for slot, length in enumerate(separate.cache.lengths[:NUM_SLOTS].tolist()):
        torch.testing.assert_close(_kv(fused, slot, length), _kv(separate, slot, length), **TOL)


def test_a_step_without_chunks_is_a_step(model):
    runner, plain = _runner(model), _runner(model)
    _setup(model, runner)
    _setup(model, plain)
    slots, ids = torch.tensor([4, 2]), torch.tensor([[5, 6], [7, 8]])
    got, none = runner.step_with_chunks(slots, ids, [], [], [])
    torch.testing.assert_close(got, plain.step(slots, ids), **TOL)
    assert none.shape == (0, runner.vocab)


def test_bad_fused_calls(model):
    runner = _runner(model)
    with pytest.raises(ValueError):
        runner.step_with_chunks(torch.tensor([0]), torch.tensor([[1]]), [1], [0], [[]])
    with pytest.raises(ValueError):
        runner.step_with_chunks(torch.tensor([0]), torch.tensor([[1]]), [1, 2], [0], [[3]])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verify_with_chunks_samples_what_prefill_then_verify_sample(model, temperature):
    """The verifier's fused step: the same accepted tokens, first tokens, logprobs and rollback as a prefill task
    followed by a verify (seeded sampling: the same noise at the same positions)."""
    results = []
    for fuse in (True, False):
        runner = _runner(model)
        long, short = _setup(model, runner)
        verifier = Verifier(runner)
        params = [SamplingParams(temperature=temperature, top_p=0.9)] * 3
        batch = SamplingBatch.build(params, "cpu", seeds=[11, 12, 13])
        chunk_batch = SamplingBatch.build(params[:2], "cpu", seeds=[21, 22])
        slots, last = torch.tensor([4, 0, 2]), torch.tensor([3, 4, 5])
        drafts = torch.tensor(_prompts([9], model.cfg.vocab_size, seed=6)[0]).view(3, 3)
        num_drafts, positions = torch.tensor([3, 0, 3]), torch.tensor([2, 7, 1])
        chunks = PromptChunks([1, 3], [6, 0], [long[6:], short], chunk_batch)
        if fuse:
            verified, first = verifier.verify_with_chunks(slots, last, drafts, num_drafts, batch, positions, None, 2,
                                                          chunks)
        else:
            first = verifier.prefill(chunks.slots, chunks.tokens, chunk_batch, 2, chunks.starts)
            verified = verifier.verify(slots, last, drafts, num_drafts, batch, positions, None, 2)
        joined = verified.then(first)
        results.append((joined.to_host(), runner.cache.lengths.tolist()))
        assert joined.tokens.shape == (5, 4)
    (fused_out, fused_lengths), (separate_out, separate_lengths) = results
    assert fused_out[0] == separate_out[0] and fused_lengths == separate_lengths
    for fused_row, separate_row in zip(fused_out[1], separate_out[1]):
        for a, b in zip(fused_row, separate_row):
            assert a["token_id"] == b["token_id"]
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)


def test_fused_graphs_captured_for_each_modes_rows():
    """The target captures its fused graphs for the rows its verifies hold: ar's are one token each (no drafts), a
    drafter's modes k + 1; all running requests' rows, within the budget; none when chunks do not ride verifies."""
    from minedraft_ray.config import EngineConfig
    from minedraft_ray.engine.attention import DecodeRows
    from minedraft_ray.runtime.workers import fused_rows

    def rows(mode, **kw):
        return fused_rows(EngineConfig(**{"mode": mode, "max_batch": 32, "k": 3, "prefill_chunk_tokens": 512, **kw}))
    assert rows("ar") == DecodeRows(32, 1)
    assert rows("sd") == DecodeRows(128, 4)
    assert rows("psd") == DecodeRows(256, 4)            # two batches of 32 in flight
    assert rows("psd", prefill_chunk_tokens=64) == DecodeRows(64, 4)
    assert rows("ar", fused_prefill=False) is None
