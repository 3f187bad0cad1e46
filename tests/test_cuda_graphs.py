"""CUDA graphs of the runner (GPU only): a graphed prefill gives the eager prefill's logits and KV, and
the slots it pads with are never a request's."""
import pytest
import torch

from minedraft_ray.engine.attention import DecodeRows
from minedraft_ray.engine.loader import load_model
from minedraft_ray.engine.runner import ModelRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _runners(path, graphs_too=True):
    model = load_model(path, "cuda", torch.float32)
    return (ModelRunner(model, "cuda", num_slots=6, max_len=600, max_batch=4, cuda_graphs=True),
            ModelRunner(model, "cuda", num_slots=6, max_len=600, max_batch=4, cuda_graphs=False))


def _greedy(runner, slots, first, steps):
    out, ids = [], first
    slot_t = torch.tensor(slots, device="cuda")
    for _ in range(steps):
        ids = runner.step(slot_t, ids[:, None])[:, -1].argmax(-1)
        out.append(ids.tolist())
    return out


# lengths, the padded path's graph shape (rows, padded length), the packed path's graph bucket (tokens)
CASES = [([5], (1, 16), 16), ([31, 33], (2, 48), 64), ([7, 64, 100], (4, 128), 256), ([300], (1, 384), 320),
         ([100, 250], (2, 256), 384), ([200, 3, 9, 250], (4, 256), 512), ([513], None, 640),
         ([300] * 3, None, 1024), ([500, 530], None, None)]


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("lengths, shape, bucket", CASES)
def test_cuda_graphed_prefill_matches_eager(tiny_llama, lengths, shape, bucket, packed):
    graphed, eager = _runners(tiny_llama)
    gen = torch.Generator().manual_seed(len(lengths))
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]
    slots = [5 - i for i in range(len(prompts))]
    # another request already decoding in slot 0: the padding rows/tokens of a graphed prefill must not touch it
    for runner in (graphed, eager):
        runner.prefill([0], [list(range(3, 40))], packed=packed)
    graphs = graphed._packed_graphs if packed else graphed._prefill_graphs
    before = set(graphs)
    logits = [runner.prefill(slots, prompts, packed=packed).clone() for runner in (graphed, eager)]
    # padded: the smallest captured shape that holds the prompts, or eager past PREFILL_GRAPH_TOKENS / 512 tokens;
    # packed: the smallest token bucket that holds them all, or eager past the largest
    new = bucket if packed else shape
    assert set(graphs) - before == ({new} if new and new not in before else set())
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert graphed.cache.lengths.tolist() == eager.cache.lengths.tolist()
    first = logits[1].argmax(-1)
    assert _greedy(graphed, slots, first, 6) == _greedy(eager, slots, first, 6)
    assert _greedy(graphed, [0], first[:1] * 0 + 7, 4) == _greedy(eager, [0], first[:1] * 0 + 7, 4)


@pytest.mark.parametrize("q", [1, 4])
@pytest.mark.parametrize("chunk_lengths", [[5], [40, 3], [300], [250, 120], [440], [500, 200], [550, 500]])
def test_cuda_graphed_fused_step_matches_separate_launches(tiny_llama, q, chunk_lengths):
    """A verify's rows and prompt chunks in one launch (step_with_chunks), graphed by token count and row count
    (or eager past the largest bucket), give the logits and lengths of the separate graphed launches: the ids and
    slots of the rows are written on the device into the graph's input, and the rows' attention (a row per program,
    keys split) and the chunks' (prefill-sized blocks) cover every token."""
    fused, separate = _runners(tiny_llama)
    gen = torch.Generator().manual_seed(q)
    contexts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (9, 57, 130)]
    chunks = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in chunk_lengths]
    ids = torch.randint(3, 500, (3, q), generator=gen).cuda()
    slots, chunk_slots = torch.tensor([0, 2, 1], device="cuda"), [5, 4][:len(chunks)]
    for runner in (fused, separate):
        runner.prefill([0, 2, 1], contexts)
        runner.prefill([5], [list(range(3, 20))])   # an earlier request's length: the chunk restarts the slot
    before = set(fused._fused_graphs)
    # the smallest token bucket that holds the rows and the chunks (with the rows' own bucket and width: their
    # attention takes a program per row up to it), or eager past the largest
    bucket = next((n for n in fused.packed_buckets if n >= 3 * q + sum(chunk_lengths)), None)
    key = (bucket, DecodeRows(min(16, bucket), q)) if bucket else None   # 3 rows of q <= 4 tokens: the first bucket
    got, got_chunks = fused.step_with_chunks(slots, ids, chunk_slots, [0] * len(chunks), chunks)
    got, got_chunks = got.clone(), got_chunks.clone()
    want_chunks = separate.prefill_chunks(chunk_slots, [0] * len(chunks), chunks).clone()
    want = separate.step(slots, ids).clone()
    assert set(fused._fused_graphs) - before == ({key} if key and key not in before else set())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_chunks, want_chunks, rtol=1e-4, atol=1e-4)
    assert fused.cache.lengths.tolist() == separate.cache.lengths.tolist()


def test_cuda_fused_rows_of_an_uncaptured_width_take_a_captured_graph(tiny_llama):
    """Graphs captured at start for verify rows of k + 1 = 4 tokens; a fused step of one-token rows (no drafts: the
    drafter down) replays the graph of the same counts rather than capturing mid-serving, with the separate
    launches' logits."""
    fused, separate = _runners(tiny_llama)
    fused.capture_all((4, 1), DecodeRows(16, 4))
    before = set(fused._fused_graphs)
    assert (64, DecodeRows(16, 4)) in before
    gen = torch.Generator().manual_seed(0)
    contexts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (9, 57, 130)]
    chunk = torch.randint(3, 500, (40,), generator=gen).tolist()
    ids = torch.randint(3, 500, (3, 1), generator=gen).cuda()
    slots = torch.tensor([0, 2, 1], device="cuda")
    for runner in (fused, separate):
        runner.prefill([0, 2, 1], contexts)
    got, got_chunks = (t.clone() for t in fused.step_with_chunks(slots, ids, [5], [0], [chunk]))
    want_chunks = separate.prefill_chunks([5], [0], [chunk]).clone()
    want = separate.step(slots, ids).clone()
    assert set(fused._fused_graphs) == before
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_chunks, want_chunks, rtol=1e-4, atol=1e-4)


def test_cuda_fused_graphs_cover_the_budget_in_fine_buckets(tiny_llama):
    """Fused graphs are captured at start for launches within the budget only (a fused launch never exceeds it),
    in every token bucket up to the budget's, so a fused step of any size up to it replays a captured graph, with
    the separate launches' logits; one past the budget still runs (its graph captured then)."""
    fused, separate = _runners(tiny_llama)
    fused.capture_all((4, 1), DecodeRows(16, 4), fused_tokens=300)
    captured = {tokens for tokens, _ in fused._fused_graphs}
    assert captured == {16, 32, 64, 128, 256, 320} == set(fused.fused_buckets(300))
    gen = torch.Generator().manual_seed(1)
    contexts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (9, 57, 130)]
    ids = torch.randint(3, 500, (3, 4), generator=gen).cuda()
    slots = torch.tensor([0, 2, 1], device="cuda")
    for runner in (fused, separate):
        runner.prefill([0, 2, 1], contexts)
    for chunk_len, new in ((288, set()), (150, set()), (360, {(384, DecodeRows(16, 4))})):   # 300, 162, 372 tokens
        chunk = torch.randint(3, 500, (chunk_len,), generator=gen).tolist()
        before = set(fused._fused_graphs)
        got, got_chunks = (t.clone() for t in fused.step_with_chunks(slots, ids, [5], [0], [chunk]))
        want_chunks = separate.prefill_chunks([5], [0], [chunk]).clone()
        want = separate.step(slots, ids).clone()
        assert set(fused._fused_graphs) - before == new
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_chunks, want_chunks, rtol=1e-4, atol=1e-4)
        assert fused.cache.lengths.tolist() == separate.cache.lengths.tolist()
