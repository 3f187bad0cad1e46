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


@pytest.mark.parametrize("lengths, shape", [([5], (1, 16)), ([31, 33], (2, 48)), ([7, 64, 100], (4, 128)),
                                           ([200, 3, 9, 250], (4, 256)), ([513], None), ([300] * 3, None)])
def test_cuda_graphed_prefill_matches_eager(tiny_llama, lengths, shape):
    graphed, eager = _runners(tiny_llama)
    gen = torch.Generator().manual_seed(len(lengths))
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]
    slots = [5 - i for i in range(len(prompts))]
    # another request already decoding in slot 0: the padding rows of a graphed prefill must not touch it
    for runner in (graphed, eager):
        runner.prefill([0], [list(range(3, 40))])
    before = set(graphed._prefill_graphs)
    logits = [runner.prefill(slots, prompts).clone() for runner in (graphed, eager)]
    # the smallest captured shape that holds the prompts, or eager past PREFILL_GRAPH_TOKENS / 512 tokens
    assert set(graphed._prefill_graphs) - before == ({shape} if shape else set())
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert graphed.cache.lengths.tolist() == eager.cache.lengths.tolist()
    first = logits[1].argmax(-1)
    assert _greedy(graphed, slots, first, 6) == _greedy(eager, slots, first, 6)
    assert _greedy(graphed, [0], first[:1] * 0 + 7, 4) == _greedy(eager, [0], first[:1] * 0 + 7, 4)
