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


@pytest.mark.parametrize("lengths", [[5], [31, 33], [7, 64, 100], [200, 3, 9, 512], [513]])
def test_cuda_graphed_prefill_matches_eager(tiny_llama, lengths):
    graphed, eager = _runners(tiny_llama)
    gen = torch.Generator().manual_seed(len(lengths))
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]
    slots = [5 - i for i in range(len(prompts))]
    # another request already decoding in slot 0: the padding rows of a graphed prefill must not touch it
    for runner in (graphed, eager):
        runner.prefill([0], [list(range(3, 40))])
    logits = [runner.prefill(slots, prompts).clone() for runner in (graphed, eager)]
    if max(lengths) <= 512:
        assert graphed._prefill_graphs, "a prefill this small should replay a graph"
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert graphed.cache.lengths.tolist() == eager.cache.lengths.tolist()
    first = logits[1].argmax(-1)
    assert _greedy(graphed, slots, first, 6) == _greedy(eager, slots, first, 6)
    assert _greedy(graphed, [0], first[:1] * 0 + 7, 4) == _greedy(eager, [0], first[:1] * 0 + 7, 4)
