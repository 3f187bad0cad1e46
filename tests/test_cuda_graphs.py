"""CUDA graphs of the runner (GPU only): a graphed prefill gives the eager prefill's logits and KV, and
the slots it pads with are never a request's."""
import pytest
import torch

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
CASES = [([5], (1, 16), 16), ([31, 33], (2, 48), 64), ([7, 64, 100], (4, 128), 256),
         ([200, 3, 9, 250], (4, 256), 512), ([513], None, 1024), ([300] * 3, None, 1024), ([500, 530], None, None)]


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
