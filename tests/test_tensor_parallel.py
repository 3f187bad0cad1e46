"""Tensor parallelism in the engine layer (engine/parallel.py): ranks as threads of this process over gloo groups,
each loading only its shard of a real-format (HF safetensors) checkpoint."""
import threading

import pytest
import torch
import torch.distributed as dist

from minedraft_ray.engine.loader import load_model
from minedraft_ray.engine.parallel import ShardedRunner, TensorParallel
from minedraft_ray.engine.runner import ModelRunner
from minedraft_ray.testing.tiny import make_tiny_model


def run_ranks(world: int, fn, timeout_s: float = 60.0) -> list:
    """fn(tp) on `world` ranks (threads) of one tensor-parallel group -> each rank's result."""
    store = dist.HashStore()
    results, errors = [None] * world, []

    def rank_main(rank):
        try:
            tp = TensorParallel.connect(store, rank, world, torch.device("cpu"), "127.0.0.1", timeout_s=timeout_s)
            results[rank] = fn(tp)
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank is still blocked"
    return results


def _calls(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """A prefill, a verify-like step of 3 tokens, a rollback and a decode step -> their logits."""
    slots = list(range(len(prompts)))
    out = [runner.prefill(slots, prompts).clone()]
    slot_t = torch.tensor(slots)
    ids = torch.tensor([[7, 257, 9]] * len(prompts))
    out.append(runner.step(slot_t, ids).clone())
    runner.rollback(slot_t, torch.tensor([2] * len(prompts)))
    out.append(runner.step(slot_t, torch.tensor([[11]] * len(prompts))).clone())
    runner.extend(slots[:1], [[3, 4, 5, 6]])
    out.append(runner.step(slot_t, torch.tensor([[12]] * len(prompts))).clone())
    return out


@pytest.fixture(scope="module")
def tiny_odd_vocab(tmp_path_factory):
    # 513 rows: the vocabulary does not divide by 2, so the last rank's shard runs past it
    return make_tiny_model(tmp_path_factory.mktemp("tiny_odd_vocab"), "llama", seed=5, vocab_pad=1)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_odd_vocab"])
def test_logits_at_tp2_match_tp1(family, request):
    """Every rank loads its shard; the leader's logits (all-gathered over the vocabulary) are the whole model's
    within 1e-4 in fp32, through prefill, verify-width steps, rollback and extend."""
    path = request.getfixturevalue(family)
    prompts = [[1, 5, 256, 300, 511, 3], [1, 255]]   # ids of both ranks' vocabulary shards
    reference = _calls(ModelRunner(load_model(path, "cpu"), "cpu", 2, 64, 2), prompts)

    def rank(tp):
        runner = ShardedRunner(load_model(path, "cpu", tp=tp), "cpu", 2, 64, 2, tp=tp)
        if tp.rank:
            runner.follow()
            return None
        try:
            return _calls(runner, prompts)
        finally:
            runner.stop_followers()

    sharded = run_ranks(2, rank)[0]
    for ref, got in zip(reference, sharded):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_each_rank_loads_only_its_shard(tiny_qwen2):
    """Column-parallel q/k/v (with biases) and gate/up hold this rank's heads and columns, row-parallel o_proj
    and down its input columns, the tied embedding its vocabulary rows; the KV cache its KV heads."""
    full = load_model(tiny_qwen2, "cpu")
    cfg, attn, mlp = full.cfg, full.layers[1].self_attn, full.layers[1].mlp
    D, heads, kv_heads, inter = cfg.head_dim, cfg.num_heads // 2, cfg.num_kv_heads // 2, cfg.intermediate_size // 2
    q_all, kv_all = cfg.num_heads * D, cfg.num_kv_heads * D

    def rank(tp):
        model = load_model(tiny_qwen2, "cpu", tp=tp)
        r = tp.rank
        a, m = model.layers[1].self_attn, model.layers[1].mlp
        q_rows = slice(r * heads * D, (r + 1) * heads * D)
        kv_rows = slice(r * kv_heads * D, (r + 1) * kv_heads * D)
        full_qkv = attn.qkv_proj.weight
        expected_qkv = torch.cat([full_qkv[:q_all][q_rows], full_qkv[q_all:q_all + kv_all][kv_rows],
                                  full_qkv[q_all + kv_all:][kv_rows]])
        assert torch.equal(a.qkv_proj.weight, expected_qkv)
        full_bias = attn.qkv_proj.bias
        assert torch.equal(a.qkv_proj.bias, torch.cat([full_bias[:q_all][q_rows], full_bias[q_all:q_all + kv_all][kv_rows],
                                                        full_bias[q_all + kv_all:][kv_rows]]))
        assert torch.equal(a.o_proj.weight, attn.o_proj.weight[:, q_rows])
        gate, up = mlp.gate_up_proj.weight.chunk(2)
        assert torch.equal(m.gate_up_proj.weight, torch.cat([gate[r * inter:(r + 1) * inter], up[r * inter:(r + 1) * inter]]))
        assert torch.equal(m.down_proj.weight, mlp.down_proj.weight[:, r * inter:(r + 1) * inter])
        rows = cfg.vocab_size // 2
        assert torch.equal(model.embed_tokens.weight, full.embed_tokens.weight[r * rows:(r + 1) * rows])
        assert model.make_cache(1, 16).k[0].shape[2] == kv_heads
        return True

    assert run_ranks(2, rank) == [True, True]


def test_heads_must_divide_by_tp(tiny_llama):
    with pytest.raises(ValueError, match="num_attention_heads .* not divisible by the tensor-parallel size 3"):
        run_ranks(3, lambda tp: load_model(tiny_llama, "cpu", tp=tp))
