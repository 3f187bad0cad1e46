"""Tensor parallelism in the engine layer (engine/parallel.py): ranks as threads of this process over gloo groups,
each loading only its shard of a real-format (HF safetensors) checkpoint."""
import gc
import threading
import time
from datetime import timedelta

import pytest
import ray
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from minedraft_ray.engine.engine import Engine
from minedraft_ray.engine.loader import load_model
from minedraft_ray.engine.parallel import ShardedRunner, TensorParallel
from minedraft_ray.engine.runner import ModelRunner
from minedraft_ray.engine.sampling import SamplingBatch, SamplingParams
from minedraft_ray.engine.spec import Verifier
from minedraft_ray.runtime import LLM
from minedraft_ray.runtime.gcs_store import GcsStore
from minedraft_ray.runtime.rendezvous import Rendezvous, fresh_prefix
from minedraft_ray.testing.workers import DrafterFaults, faulty_drafter
from minedraft_ray.testing.tiny import make_tiny_model


def run_ranks(world: int, fn, timeout_s: float = 60.0, store_of=None) -> list:
    """fn(tp) on `world` ranks (threads) of one tensor-parallel group -> each rank's result. store_of(rank): the
    store that rank meets the others through (default: one in-process store)."""
    shared = dist.HashStore()
    store_of = store_of or (lambda rank: shared)
    results, errors = [None] * world, []

    def rank_main(rank):
        try:
            tp = TensorParallel.connect(store_of(rank), rank, world, torch.device("cpu"), "127.0.0.1",
                                        timeout_s=timeout_s)
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


def _paged_calls(runner: ModelRunner) -> tuple[list[torch.Tensor], list]:
    """Blocks reserved and released, a prefix registered and adopted by a later request (a prefix-cache hit)
    -> the logits, and the block tables the calls left."""
    system = list(range(10, 42))   # two whole blocks of 16
    runner.reserve([0], [len(system) + 3])
    out = [runner.prefill([0], [system + [1, 2, 3]]).clone()]
    runner.register_prefix(0, system + [1, 2, 3], len(system))
    runner.release(0)
    cached = runner.adopt_prefix(1, system + [4, 5], len(system) + 1)
    runner.reserve([1], [len(system) + 2])
    out.append(runner.prefill([1], [system + [4, 5]], cached=[cached]).clone())
    out.append(runner.step(torch.tensor([1]), torch.tensor([[6, 7]])).clone())
    return out, [cached, runner.cache.block_tables.tolist()]


def test_paged_calls_at_tp2_match_tp1(tiny_llama):
    """Every rank makes the leader's block calls (reserve, release, prefix register and adopt), so the tables
    agree and a prefix-cache hit skips the same tokens on every rank; logits within 1e-4 of tp 1."""
    def paged(model):
        return dict(block_size=16, num_blocks=12, prefix_caching=True)
    reference = _paged_calls(ModelRunner(load_model(tiny_llama, "cpu"), "cpu", 2, 64, 2, **paged(None)))

    def rank(tp):
        runner = ShardedRunner(load_model(tiny_llama, "cpu", tp=tp), "cpu", 2, 64, 2, tp=tp, **paged(None))
        if tp.rank:
            runner.follow()
            return runner.cache.block_tables.tolist()
        try:
            return _paged_calls(runner)
        finally:
            runner.stop_followers()

    leader, follower = run_ranks(2, rank)
    logits, (cached, tables) = leader
    assert cached == 32 and reference[1][0] == 32   # the hit: both whole blocks of the system prompt
    assert tables == follower == reference[1][1]
    for ref, got in zip(reference[0], logits):
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
        assert torch.equal(a.qkv_proj.bias, torch.cat([full_bias[:q_all][q_rows],
                                                        full_bias[q_all:q_all + kv_all][kv_rows],
                                                        full_bias[q_all + kv_all:][kv_rows]]))
        assert torch.equal(a.o_proj.weight, attn.o_proj.weight[:, q_rows])
        gate, up = mlp.gate_up_proj.weight.chunk(2)
        mine = slice(r * inter, (r + 1) * inter)
        assert torch.equal(m.gate_up_proj.weight, torch.cat([gate[mine], up[mine]]))
        assert torch.equal(m.down_proj.weight, mlp.down_proj.weight[:, r * inter:(r + 1) * inter])
        rows = cfg.vocab_size // 2
        assert torch.equal(model.embed_tokens.weight, full.embed_tokens.weight[r * rows:(r + 1) * rows])
        assert model.make_cache(1, 16).k[0].shape[2] == kv_heads
        return True

    assert run_ranks(2, rank) == [True, True]


def test_min_across_ranks():
    """What sizes the target's KV on every rank: the least free memory of all of them (runtime/workers.py)."""
    assert run_ranks(3, lambda tp: tp.min_across_ranks([70, 30, 50][tp.rank])) == [30, 30, 30]


def test_heads_must_divide_by_tp(tiny_llama):
    with pytest.raises(ValueError, match="num_attention_heads .* not divisible by the tensor-parallel size 3"):
        run_ranks(3, lambda tp: load_model(tiny_llama, "cpu", tp=tp))


# ---- the runtime: the target as rank actors on (fake) GPUs of the session's Ray cluster -----------------------
PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over", "import os\nimport sys\n\n", "a",
           "class Foo:\n    def __init__(self):", "x = [1, 2, 3]\nfor i in x:"]
LENGTHS = [5, 30, 12, 1, 24, 17]


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _greedy_tokens(verifier: Verifier, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """ar through the engine's Verifier: a prefill, then one-token verifies."""
    batch = SamplingBatch.build([SamplingParams(temperature=0)] * len(prompts), "cpu", seeds=[0] * len(prompts))
    slots = torch.arange(len(prompts))
    result = verifier.prefill(slots.tolist(), prompts, batch)
    out = [result.tokens[:, 0]]
    for position in range(1, steps):
        result = verifier.verify(slots, out[-1], torch.zeros((len(prompts), 0), dtype=torch.int64),
                                 torch.zeros(len(prompts), dtype=torch.int64), batch,
                                 torch.full((len(prompts),), position))
        out.append(result.tokens[:, 0])
    return torch.stack(out, 1).tolist()


def test_greedy_ar_at_tp2_equals_tp1(tiny_llama):
    """The sharded target's greedy text is the whole model's (its logits are far apart), so the runtime tests below
    compare sd and psd at tp 2 with the in-process engine at tp 1."""
    prompts = [[1, 5, 256, 300], [1, 2], [7, 400, 9, 10, 11]]
    reference = Engine(tiny_llama, mode="ar", max_batch=3, device="cpu").generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))

    def rank(tp):
        runner = ShardedRunner(load_model(tiny_llama, "cpu", tp=tp), "cpu", 3, 64, 3, tp=tp)
        if tp.rank:
            return runner.follow()
        try:
            return _greedy_tokens(Verifier(runner), prompts, 12)
        finally:
            runner.stop_followers()

    assert run_ranks(2, rank)[0] == [r.token_ids for r in reference]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return Engine(tiny_llama, mode="ar", max_batch=8, device="cpu").generate(PROMPTS, [greedy(n) for n in LENGTHS])


@pytest.fixture(scope="module")
def sd_tp2(ray_cluster, tiny_llama, tiny_llama_draft):
    """sd at tp 2, for its greedy run and then the rank-0 death drill, which ends it (one start for both). A KV pool
    of 18 blocks of 4 forces preemptions. sd_tp2(take=True): the engine leaves the fixture, to the caller, who ends
    it."""
    started = {"llm": LLM(tiny_llama, tiny_llama_draft, mode="sd", k=3, max_batch=3, tp=2, torch_threads=1,
                          block_size=4, num_kv_blocks=18)}
    yield lambda take=False: started.pop("llm") if take else started["llm"]
    if started:
        started["llm"].shutdown()


def test_greedy_sd_at_tp2_equals_ar(sd_tp2, reference):
    """sd: the drafter beside rank 0, in its actor and on its GPU. The small KV pool forces preemptions: rank 1
    applies every block-table change the scheduler sends rank 0."""
    from ray.experimental import internal_kv
    from minedraft_ray.runtime.rendezvous import KV_NAMESPACE

    llm = sd_tp2()
    outs = llm.generate(PROMPTS, [greedy(n) for n in LENGTHS])
    info, preemptions = llm.worker_info, llm.info()["preemptions"]
    prefix = ray.get(llm.manager.__ray_call__.remote(lambda self: self.manager.actors.tp_group.prefix))
    assert internal_kv._internal_kv_list(prefix, namespace=KV_NAMESPACE)   # where the ranks met
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert info["drafter"] is None and info["verifier"]["gpu_ids"] != info["ranks"][0]["gpu_ids"]
    assert preemptions > 0


def _actors(llm):
    """The engine's rank 0 (the verifier) and its other ranks."""
    return ray.get(llm.manager.__ray_call__.remote(lambda self: (self.manager.verifier, self.manager.actors.ranks)))


def test_rank_0_dying_while_idle_ends_the_others_and_the_engine(sd_tp2):
    """With no step in flight, rank 0's death (the verifier, and in sd the drafter beside it) ends rank 1's wait for
    its next call at once (no rank left waiting on a dead group), and the engine reports dead without waiting for a
    request to fail. Its shutdown still clears the keys the ranks met under. (The sd engine's last test.)"""
    from ray.experimental import internal_kv
    from minedraft_ray.runtime.rendezvous import KV_NAMESPACE

    llm = sd_tp2(take=True)
    try:
        prefix = ray.get(llm.manager.__ray_call__.remote(lambda self: self.manager.actors.tp_group.prefix))
        assert len(llm.generate(PROMPTS[0], greedy(3))[0].token_ids) == 3
        deadline = time.time() + 10
        while llm.info()["slots_in_use"] and time.time() < deadline:   # the step queued behind the last one ends
            time.sleep(0.05)
        verifier, _ = _actors(llm)
        ray.kill(verifier, no_restart=True)
        deadline = time.time() + 20
        while not llm.info()["dead"] and time.time() < deadline:
            time.sleep(0.1)
        assert "target rank 1" in (llm.info()["dead"] or ""), llm.info()["dead"]
    finally:
        llm.shutdown()
    assert internal_kv._internal_kv_list(prefix, namespace=KV_NAMESPACE) == []   # the group's keys went with it


@pytest.fixture(scope="module")
def psd_tp2(ray_cluster, tiny_llama, tiny_llama_draft):
    # the split forced at every load, so greedy output is checked through psd's own schedule; the collective
    # channel (the default on GPUs) links the drafter to rank 0, beside the ranks' own groups; a drafter that
    # takes faults (none until a test sets them on it). psd_tp2(take=True): the engine leaves the fixture, to the
    # caller, who ends it (the rank-kill drill, its last test)
    started = {"llm": LLM(tiny_llama, tiny_llama_draft, mode="psd", k=2, max_batch=16, tp=2, torch_threads=1,
                          psd_low_load="psd", psd_high_load="psd", transport="collective", _workers=faulty_drafter())}
    yield lambda take=False: started.pop("llm") if take else started["llm"]
    if started:
        started["llm"].shutdown()


def test_greedy_psd_at_tp2_equals_ar(psd_tp2, reference):
    """The target's two ranks on two (fake) GPUs, the drafter on a third."""
    psd_tp2 = psd_tp2()
    outs = psd_tp2.generate(PROMPTS, [greedy(n) for n in LENGTHS])
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert any(h.regime == "psd" for h in psd_tp2.history())
    assert sum(o.stats["accepted"] for o in outs) > 0
    info = psd_tp2.worker_info
    gpus = [info["verifier"]["gpu_ids"][0], info["ranks"][0]["gpu_ids"][0], info["drafter"]["gpu_ids"][0]]
    assert len(set(gpus)) == 3, info


def test_psd_sampled_output_at_tp2_follows_target(psd_tp2, tiny_llama):
    """Rank 0 samples from the logits all-gathered over the vocabulary: the target's exact distribution of the
    first three tokens."""
    psd_tp2 = psd_tp2()
    from stats import assert_first_three_tokens_follow_target
    params = dict(temperature=0.8, top_k=3)
    n = 1000
    prompt = psd_tp2._encode("def fibonacci(n):")
    outs = psd_tp2.generate([prompt] * n, [SamplingParams(max_tokens=3, ignore_eos=True, seed=s, **params)
                                           for s in range(n)])
    assert_first_three_tokens_follow_target(outs, tiny_llama, prompt, SamplingParams(**params))


def test_the_ranks_rendezvous_opens_no_listener(psd_tp2):
    """The ranks meet in Ray's GCS (runtime/rendezvous.py), which only the cluster's authenticated processes reach:
    no process of the engine listens for the rendezvous. The manager, which starts the ranks, listens on nothing
    but its Ray worker's port; each rank only for its two gloo groups (gloo listens once per group's device), and
    rank 0 (the verifier) and the drafter for the link between them."""
    psd_tp2 = psd_tp2()
    from runtime_common import listeners_beside_ray
    found = listeners_beside_ray(psd_tp2)
    assert found["manager"] == [], found
    assert (len(found["verifier"]), len(found["rank 1"]), len(found["drafter"])) == (3, 2, 1), found


def test_every_rank_holds_the_same_kv_blocks(psd_tp2):
    """Every rank sizes its pool as the least of all ranks (runtime/workers.py `_pool_blocks`) and applies the
    scheduler's table changes: the same blocks and block tables on every rank, each of its own half of the KV
    heads."""
    psd_tp2 = psd_tp2()
    def caches(self):
        def layout(runner):
            c, cfg = runner.cache, runner.model.cfg
            return {"blocks": c.num_blocks, "tables": c.block_tables.tolist(),
                    "kv_heads": (c.k[0].shape[2], cfg.num_kv_heads)}
        m = self.manager
        return [ray.get(m.verifier.__ray_call__.remote(lambda a: layout(a.worker.verifier.runner)))] + [
            ray.get(rank.__ray_call__.remote(lambda a: layout(a.worker.runner))) for rank in m.actors.ranks]

    rank0, rank1 = ray.get(psd_tp2.manager.__ray_call__.remote(caches))
    assert rank0 == rank1
    assert rank0["kv_heads"][0] * 2 == rank0["kv_heads"][1]


def _pids(llm) -> list[int]:
    """The processes of the target's ranks."""
    return [info["pid"] for info in [llm.worker_info["verifier"], *llm.worker_info["ranks"]]]


def test_drafter_killed_mid_run_at_tp2(psd_tp2, reference):
    """psd at tp 2: the drafter killed while it drafts a round (its rounds slowed, so the kill lands inside one)
    fails no request and the output stays ar's; the engine serves ar meanwhile and restarts the drafter, linked
    to rank 0 again, while the target's ranks and their groups stay as they are."""
    psd_tp2 = psd_tp2()
    manager, pids = psd_tp2.manager, _pids(psd_tp2)
    drafter = ray.get(manager.__ray_call__.remote(lambda self: self.manager.drafter))
    ray.get(drafter.__ray_call__.remote(lambda a: setattr(a.worker.drafter, "faults", DrafterFaults(delay_s=0.2))))
    before = psd_tp2.info()
    ref = manager.generate_batch.remote([psd_tp2._encode(p) for p in PROMPTS], [greedy(n) for n in LENGTHS])
    deadline = time.time() + 60
    while psd_tp2.info()["steps"] < before["steps"] + 3 and time.time() < deadline:
        time.sleep(0.05)
    assert ray.get(manager.kill_drafter.remote())
    outs = ray.get(ref, timeout=120)
    assert [o["token_ids"] for o in outs] == [r.token_ids for r in reference]
    deadline = time.time() + 60
    while not (info := psd_tp2.info())["drafter_alive"] and time.time() < deadline:
        time.sleep(0.2)
    assert info["drafter_failures"] > before["drafter_failures"]
    assert info["draft_rounds_failed"] > before["draft_rounds_failed"]   # a verify ran without its dead round
    assert info["drafter_restarts"] > before["drafter_restarts"]
    outs = psd_tp2.generate(PROMPTS, [greedy(n) for n in LENGTHS])   # speculating again, at full speed
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert sum(o.stats["accepted"] for o in outs) > 0
    assert ray.get(manager.__ray_call__.remote(lambda self: [ray.get(a.ready.remote())["pid"] for a in (
        self.manager.verifier, *self.manager.actors.ranks)])) == pids


def test_reconfigure_at_tp2(psd_tp2, reference):
    """k and the prefill chunk changed in place at tp 2 (rank 0's verify width, and the chunks every rank
    extends its KV by): the same rank processes, output still ar's, drafts of the new k."""
    psd_tp2 = psd_tp2()
    from test_chunked_prefill import reconfigure_when_idle
    pids, k0, chunk0 = _pids(psd_tp2), psd_tp2.info()["k"], psd_tp2.info()["prefill_chunk_tokens"]
    try:
        for k, chunk in ((1, 3), (4, 0)):
            reconfigure_when_idle(psd_tp2, k=k, prefill_chunk_tokens=chunk)
            outs = psd_tp2.generate(PROMPTS, [greedy(n) for n in LENGTHS])
            assert [o.token_ids for o in outs] == [r.token_ids for r in reference], (k, chunk)
            assert max(len(o.stats["drafted_per_position"]) for o in outs) == k
        assert ray.get(psd_tp2.manager.__ray_call__.remote(
            lambda self: [ray.get(a.ready.remote())["pid"] for a in (self.manager.verifier,
                                                                    *self.manager.actors.ranks)])) == pids
    finally:
        reconfigure_when_idle(psd_tp2, k=k0, prefill_chunk_tokens=chunk0 or 0)


def test_a_rank_killed_mid_run_kills_the_engine_and_frees_rank_0(psd_tp2):
    """Rank 1 dies inside a run: the requests fail with an error, the engine reports dead (Serve replaces such a
    replica), and rank 0 is not left blocked in a collective with it (nor on the drafter's link): it answers at once.
    (The psd engine's last test: it ends it.)"""
    llm = psd_tp2(take=True)
    try:
        verifier, (rank1,) = _actors(llm)
        steps_before = llm.info()["steps"]
        ref = llm.manager.generate_batch.remote([llm._encode(p) for p in PROMPTS[:2]], [greedy(1500)] * 2)
        deadline = time.time() + 60
        while llm.info()["steps"] < steps_before + 3 and time.time() < deadline:   # mid-run, not before or after
            time.sleep(0.05)
        ray.kill(rank1, no_restart=True)
        with pytest.raises(Exception):
            ray.get(ref, timeout=30)
        assert llm.info()["dead"]
        assert ray.get(verifier.ready.remote(), timeout=10)["pid"]   # well inside the group's timeout
        with pytest.raises(Exception, match="dead|rank|verifier"):
            llm.generate(PROMPTS[0], greedy(4))
    finally:
        llm.shutdown()


# ---- the rendezvous: a torch.distributed store in Ray's GCS (runtime/rendezvous.py) ---------------------------
KEYS = st.sampled_from(["a", "b", "c/d"])
VALUES = st.sampled_from([b"0", b"7", b"12"])
STORE_OPS = st.one_of(
    st.tuples(st.just("set"), KEYS, VALUES), st.tuples(st.just("get"), KEYS),
    st.tuples(st.just("add"), KEYS, st.integers(-3, 3)),
    st.tuples(st.just("compare_set"), KEYS, st.sampled_from([b""]) | VALUES, VALUES),
    st.tuples(st.just("delete_key"), KEYS), st.tuples(st.just("check"), st.lists(KEYS, min_size=1, max_size=2)),
    st.tuples(st.just("num_keys")))


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(STORE_OPS, max_size=12))
def test_gcs_store_answers_as_torchs_own_store(ray_cluster, ops):
    """Every call, through the C++ PrefixStore that gloo and NCCL wrap it in, answers as torch's in-process
    HashStore does (values, counters, compare-and-set, deletion, key counts)."""
    gcs = GcsStore(fresh_prefix("test"), 5.0)
    store, reference = dist.PrefixStore("g", gcs), dist.PrefixStore("g", dist.HashStore())
    try:
        for op, *args in ops:
            if op == "get" and not reference.check([args[0]]):
                continue   # both would wait for the key
            assert getattr(store, op)(*args) == getattr(reference, op)(*args), (op, args)
    finally:
        gcs.clear()


class _Overtaken(GcsStore):
    """A member whose next update a rival overtakes: the rival writes the key between this member's read of it
    and its own write, the race every update of the store must survive."""

    def __init__(self, prefix: str, rival_move):
        super().__init__(prefix, 5.0)
        self.rival, self.rival_move = GcsStore(prefix, 5.0), rival_move

    def _create(self, name: str, value: bytes) -> bool:
        if self.rival_move is not None:
            move, self.rival_move = self.rival_move, None
            move(self.rival)
        return super()._create(name, value)


def test_gcs_store_updates_survive_a_race_and_waits_end(ray_cluster):
    """An add overtaken by a rival's add counts on from it (no update lost); a compare-and-set of an absent key
    overtaken by a rival's loses and answers the rival's value; a set overtaken by a delete still sets. A wait
    ends at its timeout, a get at the store's."""
    prefix = fresh_prefix("test")
    try:
        assert _Overtaken(prefix, lambda rival: rival.add("count", 5)).add("count", 1) == 6
        assert _Overtaken(prefix, lambda rival: rival.compare_set("leader", b"", b"rival")).compare_set(
            "leader", b"", b"me") == b"rival"
        _Overtaken(prefix, lambda rival: rival.delete_key("count")).set("count", b"9")
        store = GcsStore(prefix, 0.5)
        assert (store.get("count"), store.get("leader")) == (b"9", b"rival")
        t0 = time.perf_counter()
        with pytest.raises(Exception, match="absent"):
            store.wait(["absent"], timedelta(seconds=0.1))
        with pytest.raises(Exception, match="absent"):
            store.get("absent")
        # 0.6 s of timeouts; one ignored would wait for the key forever
        assert time.perf_counter() - t0 < 10.0
    finally:
        GcsStore(prefix, 1.0).clear()


def test_ranks_meet_through_the_gcs_and_keep_their_store(ray_cluster):
    """Two ranks, each with its own store of one Rendezvous, build both groups; each keeps its store, which NCCL
    calls again after its group is built (its unique id at the first collective, its watchdog's flags): a store
    written in Python answers only while Python holds it."""
    rendezvous = Rendezvous.fresh("test", 30.0)

    def rank(tp):
        gc.collect()
        return int(tp.all_reduce(torch.ones(1))), dist.PrefixStore("device", tp.store).check(["0/0"])

    try:
        assert run_ranks(2, rank, store_of=lambda r: GcsStore.of(rendezvous)) == [(2, True), (2, True)]
    finally:
        rendezvous.close()
