"""The Ray runtime (issue: MineDraft on Ray), on a CPU with fake GPUs and one real local Ray
cluster for the session: every mode's greedy output equals `ar`, the psd balance invariant holds
through finishes and aborts, faults are survived, and sampled output follows the target."""
import asyncio
import time

import numpy as np
import pytest
import ray

from minedraft_ray.engine.engine import Engine
from minedraft_ray.runtime import LLM, make_bundles
from engines import TINY_PSD, TINY_SD
from runtime_common import (LENGTHS, PROMPTS, check_balance, check_seeded_sampling_equals_ar, greedy,
                            links_in_flight, links_listening_everywhere, manager_imports, reconfigure_when_idle,
                            settled, whole_tables, worker_collectors)


def test_make_bundles():
    assert make_bundles("psd", use_gpus=True) == [{"CPU": 0.5}, {"GPU": 1, "CPU": 0.5}, {"GPU": 1, "CPU": 0.5}]
    assert make_bundles("sd_split", use_gpus=True) == make_bundles("psd", use_gpus=True)
    assert make_bundles("sd", use_gpus=True) == [{"CPU": 0.5}, {"GPU": 1, "CPU": 0.5}]
    assert make_bundles("ar", use_gpus=False) == [{"CPU": 0.5}, {"CPU": 0.5}]
    # tensor parallel: tp GPUs for the target's ranks, plus the drafter's in psd and sd_split (sd: beside rank 0)
    gpu = {"GPU": 1, "CPU": 0.5}
    assert make_bundles("psd", use_gpus=True, tp=4) == [{"CPU": 0.5}] + [gpu] * 5
    assert make_bundles("sd_split", use_gpus=True, tp=2) == [{"CPU": 0.5}] + [gpu] * 3
    assert make_bundles("ar", use_gpus=True, tp=4) == make_bundles("sd", use_gpus=True, tp=4) == [{"CPU": 0.5}] + [gpu] * 4
    with pytest.raises(ValueError, match="unknown mode"):
        make_bundles("fast")


def test_an_incompatible_draft_is_refused_by_llm_and_the_serve_builder(tiny_llama, tiny_llama_draft, tmp_path):
    """The pair is checked once, where the engine is started (the manager and its workers take the vocabulary it
    shares): LLM and the Serve app builder refuse a draft whose EOS differs, before any engine starts."""
    import json
    import shutil
    from minedraft_ray.engine.pair import IncompatiblePairError
    from minedraft_ray.serve.app import build_app

    draft = shutil.copytree(tiny_llama_draft, tmp_path / "other_eos")
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((draft / name).read_text())
        (draft / name).write_text(json.dumps({**cfg, "eos_token_id": 9}))
    with pytest.raises(IncompatiblePairError, match="EOS ids differ"):
        LLM(tiny_llama, draft, mode="psd")
    with pytest.raises(IncompatiblePairError, match="EOS ids differ"):
        build_app({"target": str(tiny_llama), "draft": str(draft), "mode": "psd"})


SAMPLED_DRAFTS = {"draft_temperature": 0.3, "draft_top_k": 8}   # q cut to 8 of 512 tokens, sent packed
# psd over the object store, split at every load: one engine for the tests that leave it as they found it (the
# greedy check, staggered arrivals and aborts, k reconfigured in place; an engine's start is most of such a test),
# shared with test_chunked_prefill.py (tests/engines.py)
SHARED_PSD = TINY_PSD


@pytest.fixture
def shared_psd(shared_engines, tiny_llama, tiny_llama_draft):
    return shared_engines.get(tiny_llama, tiny_llama_draft, **SHARED_PSD)


# every mode, every channel, greedy and sampled drafts, each at least once (suite time: not every pairing)
@pytest.mark.parametrize("mode, transport, drafting", [
    ("ar", "object_store", {}), ("sd", "object_store", {}), ("psd", "object_store", {}),
    ("sd_split", "collective", {}), ("psd", "collective", SAMPLED_DRAFTS), ("sd_split", "ray_collective", {}),
    ("psd", "ray_collective", SAMPLED_DRAFTS)], ids=lambda v: ("sampled_drafts" if v else "greedy_drafts")
                                            if isinstance(v, dict) else None)
def test_greedy_modes_equal_ar(shared_engines, tiny_llama, tiny_llama_draft, reference, mode, transport,
                               drafting):
    # psd splits whenever more than one batch's worth runs (psd_high_load=psd; the shared engine at every load): the
    # split's output is checked; with probabilistic drafting the drafts (and their packed q) travel the link, and
    # greedy output is still ar's. psd's and sd's object-store engines are the shared ones (tests/engines.py), so
    # the counters are read as changes
    shared = (mode, transport, drafting) in (("psd", "object_store", {}), ("sd", "object_store", {}))
    llm = shared_engines.get(tiny_llama, tiny_llama_draft, **(SHARED_PSD if mode == "psd" else TINY_SD)) \
        if shared else LLM(
        tiny_llama, None if mode == "ar" else tiny_llama_draft, mode=mode, k=3, max_batch=3, torch_threads=1,
        transport=transport, **({"psd_high_load": "psd"} if mode == "psd" else {}), **drafting)
    before, steps_before = llm.info(), len(llm.history())
    try:
        if mode in ("psd", "sd_split"):
            gpus = {llm.worker_info["verifier"]["gpu_ids"][0], llm.worker_info["drafter"]["gpu_ids"][0]}
            assert len(gpus) == 2, llm.worker_info   # drafter and verifier on different (fake) GPUs
        outs = llm.generate(PROMPTS, [greedy(n) for n in LENGTHS])
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
        if mode != "ar":
            rate = sum(o.stats["accepted"] for o in outs) / sum(o.stats["drafted"] for o in outs)
            assert 0.3 <= rate <= 0.9, rate
        history = llm.history()[steps_before:]
        info = llm.info()
        change = {name: info[name] - before[name] for name in ("drafter_prefills", "queued_behind",
                                                               "drafts_ahead_used")}
        if mode == "psd":
            assert any(h.regime == "psd" for h in history)
            check_balance(history, max_batch=3)
            assert info["balance_violations"] == 0
        # psd and sd_split prefill the drafter beside the verifier (sd's worker prefills both itself)
        assert (change["drafter_prefills"] > 0) == (mode in ("psd", "sd_split")), (change, info)
        # sd and ar build steps from the verifier's slot state, so the next one is queued behind the running one
        assert (change["queued_behind"] > 0) == (mode in ("sd", "ar")), (change, info)
        # psd and sd_split draft each batch's next round behind its verify, and nearly every verify uses one
        if mode in ("psd", "sd_split"):
            assert change["drafts_ahead_used"] >= 0.8 * sum(h.drafted > 0 for h in history), (change, info)
        else:
            assert info["drafts_ahead_used"] == 0
        assert settled(llm)["slots_in_use"] == 0
        assert manager_imports(llm) == []   # it keeps books; the workers own the tensors
        assert set(worker_collectors(llm).values()) == {(True, True)}
        if transport in ("collective", "ray_collective"):   # every message was taken (rounds nobody named, drained)
            deadline = time.time() + 5
            while (in_flight := links_in_flight(llm)) != {"verifier": 0, "drafter": 0} and time.time() < deadline:
                time.sleep(0.05)
            assert in_flight == {"verifier": 0, "drafter": 0}
            # the channel's rendezvous and sockets: nothing of either actor listens on every interface
            assert links_listening_everywhere(llm) == {"verifier": [], "drafter": []}
        if mode == "ar":   # on the same engine (suite time: an engine's start is most of a test)
            check_seeded_sampling_equals_ar(llm, tiny_llama, drafts=False)
        if mode in ("ar", "sd_split"):
            check_fused_chunks_equal_ar(llm, reference)
    finally:
        if not shared:
            llm.shutdown()


def check_fused_chunks_equal_ar(llm, reference):
    """ar and sd_split with prompt chunks fused into their verifies (test_chunked_prefill.py checks sd's and psd's
    step paths at every budget): ar's output at a budget that fits one row and a chunk, and at one that fits
    three, and chunks rode verifies at both."""
    for chunk in (5, 13):
        reconfigure_when_idle(llm, prefill_chunk_tokens=chunk)
        before = llm.info()["fused_prefills"]
        outs = llm.generate(PROMPTS, [greedy(n) for n in LENGTHS])
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference], chunk
        assert llm.info()["fused_prefills"] > before, chunk


@pytest.mark.parametrize("mode", ["sd", "psd"])   # ar's chain is sd's without drafts (suite time)
def test_verifier_overlap_keeps_output_and_launch_order(ray_cluster, tiny_llama, tiny_llama_draft, reference, mode):
    """verifier_overlap: a threaded verifier (and in psd a threaded drafter) whose tasks take turns launching in
    the manager's order. The output is still ar's token for token, and every numbered task launched exactly
    once, in order."""
    llm = LLM(tiny_llama, None if mode == "ar" else tiny_llama_draft, mode=mode, k=3, max_batch=3,
              torch_threads=1, verifier_overlap=True)
    try:
        outs = llm.generate(PROMPTS, [greedy(n) for n in LENGTHS])
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
        settled(llm)   # sd and ar keep a step queued behind the last one: let it run before counting
        numbered = ray.get(llm.manager.__ray_call__.remote(lambda self: self.manager.sched.tasks_numbered))
        verifier = ray.get(llm.manager.__ray_call__.remote(lambda self: self.manager.verifier))
        launched = ray.get(verifier.__ray_call__.remote(lambda a: a.worker.order.next_seq))
        assert launched == numbered > len(PROMPTS) // 3, (launched, numbered)
        assert llm.info()["fused_prefills"] > 0   # fused verifies take their prefill's number: none skipped
        if mode == "psd":
            check_balance(llm.history(), max_batch=3)
            # the drafter follows the verifier's overlap: threaded too, its tasks launched once each, in order
            drafter_numbered = ray.get(llm.manager.__ray_call__.remote(lambda self: self.manager.actors.drafter_seq))
            drafter = ray.get(llm.manager.__ray_call__.remote(lambda self: self.manager.drafter))
            # a round drafted ahead for a batch that then emptied was sent and dropped, not awaited: it may still be
            # on its way when the slots are free, so give its launch a moment (a task never launched stays short)
            deadline = time.time() + 10.0
            while (drafter_launched := ray.get(drafter.__ray_call__.remote(lambda a: a.worker.order.next_seq))) \
                    < drafter_numbered and time.time() < deadline:
                time.sleep(0.05)
            assert drafter_launched == drafter_numbered > len(PROMPTS) // 3, (drafter_launched, drafter_numbered)
    finally:
        llm.shutdown()


def test_verifier_overlap_defaults_to_the_verifiers_device(tiny_llama):
    """Measured: overlap helps on a GPU (busy 0.91-0.99) and costs on a CPU; an explicit choice always wins."""
    import torch
    from minedraft_ray.config import EngineConfig
    from minedraft_ray.runtime.manager import overlap_by_default

    def resolved(**kw):
        config = EngineConfig(target=tiny_llama, **kw)
        return config.verifier_overlap if config.verifier_overlap is not None else overlap_by_default(config)

    assert EngineConfig(target=tiny_llama).verifier_overlap is None
    assert resolved() == torch.cuda.is_available()
    assert resolved(device="cpu") is False and resolved(device="cuda") is True
    assert resolved(device="cpu", verifier_overlap=True) is True
    assert resolved(device="cuda", verifier_overlap=False) is False


def test_collector_paused_gives_the_collector_back_as_it_was():
    """A worker actor imports its module with the collector paused (runtime/actors.py): on again after it, also when
    the import fails, and left off where it was off."""
    import gc

    from minedraft_ray.runtime.actors import collector_paused

    assert gc.isenabled()
    with pytest.raises(ImportError):
        with collector_paused():
            assert not gc.isenabled()
            raise ImportError("a worker module that does not import")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_launch_order_runs_turns_in_sequence_whatever_the_arrival():
    import threading
    from minedraft_ray.runtime.workers import LaunchOrder

    order, launched = LaunchOrder(10, "verifier"), []

    def task(seq):
        with order.turn(seq):
            launched.append(seq)

    threads = [threading.Thread(target=task, args=(seq,)) for seq in (3, 1, 2, 0)]   # arrive out of order
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert launched == [0, 1, 2, 3] and order.next_seq == 4
    order.timeout_s = 0.2
    with pytest.raises(TimeoutError, match="task 6 waited .* for task 4"):   # task 4 never came
        with order.turn(6):
            pass
    with pytest.raises(RuntimeError, match="arrived after its turn"):
        with order.turn(2):
            pass
    assert order.next_seq == 4


ABORTED_LEN = 120


def test_psd_staggered_arrivals_and_aborts(shared_psd, reference):
    # psd at every load (no sequential batch, low or high load): the balance invariant through arrivals, finishes,
    # aborts
    llm = shared_psd
    aborted_before = llm.info()["aborted"]

    async def run_one(i, delay, abort_after=None):
        await asyncio.sleep(delay)
        ids, last = [], None
        rid = f"r{i}-{abort_after}"
        # an aborted request asks for many more tokens than it reads before its abort: room for the abort's round
        # trip while the engine keeps stepping, however slow the machine
        async for out in llm.stream(PROMPTS[i], greedy(LENGTHS[i] if abort_after is None else ABORTED_LEN), rid):
            ids += out.new_token_ids
            last = out
            if abort_after is not None and len(ids) >= abort_after:
                await asyncio.to_thread(llm.abort, rid)
        return ids, last

    async def main():
        jobs = [run_one(i, 0.05 * i) for i in range(len(PROMPTS))]
        jobs += [run_one(1, 0.02, abort_after=4), run_one(4, 0.3, abort_after=2)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    for i, (ids, last) in enumerate(results[:len(PROMPTS)]):
        assert ids == reference[i].token_ids, i
        assert last.finished and last.finish_reason == "length"
    for ids, last in results[len(PROMPTS):]:
        assert last.finish_reason == "abort"
        assert len(ids) < ABORTED_LEN
    history = llm.history()
    check_balance(history)
    info = settled(llm)
    assert info["balance_violations"] == 0 and info["aborted"] - aborted_before == 2
    assert info["slots_in_use"] == 0 and info["running"] == 0


def test_default_pair_loads_and_psd_equals_ar(ray_cluster):
    """The embedded default pair (trained by the project, shipped in the package) loads through the
    normal checkpoint path with no flags, and its greedy output is identical in ar and psd."""
    from minedraft_ray.config import EngineConfig
    config = EngineConfig(max_batch=2, torch_threads=1)
    prompts = ["def fibonacci(n):", "import numpy as np\n\n", "class Config:\n    \"\"\"", "for i in range("]
    ref = Engine(config.target, mode="ar", device="cpu").generate(prompts, greedy(32))
    llm = LLM(config=config)
    try:
        outs = llm.generate(prompts, greedy(32))
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        assert sum(o.stats["accepted"] for o in outs) / sum(o.stats["drafted"] for o in outs) > 0.3
    finally:
        llm.shutdown()


def test_reconfigure_k_in_place(shared_psd, reference_10):
    llm = shared_psd
    try:
        pid = llm.worker_info["verifier"]["pid"]
        for k in (1, 4):
            llm.reconfigure(k=k)
            outs = llm.generate(PROMPTS[:4], [greedy(10)] * 4)
            assert [o.token_ids for o in outs] == [r.token_ids for r in reference_10[:4]]
            assert max(max(o.stats["drafted_per_position"], default=0) and len(o.stats["drafted_per_position"])
                       for o in outs) == k
        assert ray.get(llm.manager.__ray_call__.remote(lambda self: self.manager.worker_info))["verifier"]["pid"] == pid
    finally:
        llm.reconfigure(k=SHARED_PSD["k"])   # as the module's other tests found it


@pytest.mark.parametrize("draft_temperature", [0.0, 0.8])
def test_sd_drafts_from_slot_state_match_host_catch_up(tiny_llama, tiny_llama_draft, draft_temperature):
    """`sd` drafts from device-side slot state (no host tokens); a worker fed the same sequences through
    the host catch-up path drafts the same tokens (and, drafting probabilistically, the same q), and the
    slot state follows the committed tokens."""
    import torch
    from minedraft_ray.config import EngineConfig
    from minedraft_ray.engine.pair import shared_vocab
    from minedraft_ray.engine.request import DraftRow
    from minedraft_ray.runtime.messages import (KVEdits, PrefillRow, PrefillTask, SamplingRow, SpecStep, VerifierResult,
                                                WorkerConfig)
    from minedraft_ray.runtime.workers import SpecWorker

    engine = EngineConfig(target=str(tiny_llama), draft=str(tiny_llama_draft), mode="sd", k=3, max_batch=4,
                          device="cpu", torch_threads=1, draft_temperature=draft_temperature)
    cfg = WorkerConfig(engine.model_dump(), shared_vocab(engine))
    state_worker, host_worker = SpecWorker(cfg, 4), SpecWorker(cfg, 4)
    prompts = [[5, 17, 42, 9], [3] * 11, [7, 8]]
    slots, greedy_rows = [2, 0, 3], [SamplingRow(0.0, 1.0, 0, s) for s in range(3)]
    rows = [PrefillRow(s, 0, p, r) for s, p, r in zip(slots, prompts, greedy_rows)]
    tables = [KVEdits(*(whole_tables(w, model, slots, 64) for model in ("target", "draft")))
              for w in (state_worker, host_worker)]
    def prefill(worker, task):
        return VerifierResult.from_wire(worker.prefill(task.to_wire())).tokens

    first = prefill(state_worker, PrefillTask(0, rows, 0, tables[0]))
    assert prefill(host_worker, PrefillTask(0, rows, 0, tables[1])) == first
    sequences = [p + f for p, f in zip(prompts, first)]
    for seq in range(1, 4):   # a few sd steps: state path on one worker, host rows on the other
        st = state_worker.state
        slot_t = torch.tensor(slots)
        ids_state, q_state = state_worker.drafter.draft_in_step(
            slot_t, torch.stack([st.prev_token[slot_t], st.last_token[slot_t]], 1), st.seq_len[slot_t], 3,
            st.sampling.seed[slot_t], st.position[slot_t])
        rows = [DraftRow(s, 0, seq) for s, seq in zip(slots, sequences)]   # catch up from scratch
        ids_host, q_host = host_worker.drafter.draft(rows, 3, seeds=[0, 1, 2], positions=st.position[slot_t])
        assert torch.equal(ids_state, ids_host)
        if draft_temperature:
            assert torch.allclose(q_state, q_host, atol=1e-6)
        else:
            assert q_state is None and q_host is None
        tokens = VerifierResult.from_wire(state_worker.step(SpecStep(seq, slots, 3).to_wire())).tokens
        sequences = [seq + t for seq, t in zip(sequences, tokens)]
        assert state_worker.state.last_token[slot_t].tolist() == [seq[-1] for seq in sequences]
        assert state_worker.state.prev_token[slot_t].tolist() == [seq[-2] for seq in sequences]
        assert state_worker.state.seq_len[slot_t].tolist() == [len(seq) for seq in sequences]


@pytest.mark.parametrize("draft_temperature", [0.0, 0.8])
def test_drafts_ahead_match_drafts_from_committed_tokens(tiny_llama, tiny_llama_draft, draft_temperature):
    """A round drafted ahead (psd, sd_split) reads its rows' newest tokens from the prefill and verify results
    and feeds only the last two; a worker catching up on the whole committed sequence drafts the same tokens
    (and q), for new rows (prompt prefilled on the drafter + prefill + first verify) and for rows whose
    drafts were partly accepted, wholly accepted or all rejected."""
    from minedraft_ray.config import EngineConfig
    from minedraft_ray.engine.pair import shared_vocab
    from minedraft_ray.runtime.messages import (DraftRound, KVEdits, PrefillRow, PrefillTask, VerifierResult,
                                                WorkerConfig)
    from minedraft_ray.runtime.workers import DrafterWorker

    k = 3
    engine = EngineConfig(target=str(tiny_llama), draft=str(tiny_llama_draft), mode="psd", k=k, max_batch=4,
                          device="cpu", torch_threads=1, draft_temperature=draft_temperature)
    cfg = WorkerConfig(engine.model_dump(), shared_vocab(engine))
    ahead, scratch = DrafterWorker(cfg, 4), DrafterWorker(cfg, 4)
    prompts, slots, seeds = [[5, 17, 42, 9], [3] * 11, [7]], [2, 0, 3], [10, 11, 12]
    ahead.prefill(PrefillTask(0, [PrefillRow(s, 0, p) for s, p in zip(slots, prompts)],
                              tables=KVEdits(draft=whole_tables(ahead, "draft", slots, 64))).to_wire())
    scratch_tables = [KVEdits(draft=whole_tables(scratch, "draft", slots, 64))]   # sent with its first round
    # results as the verifier returns them (wire forms)
    prefill_result = VerifierResult([[31], [32], [33]], None, 0.0).to_wire()   # the first token
    verify_result = VerifierResult([[41], [42], [43]], None, 0.0).to_wire()    # a first verify without drafts
    sequences = [p + [31 + i, 41 + i] for i, p in enumerate(prompts)]

    def round_of(seq, rows, positions):
        """rows: (slot, valid, tail, takes, all_but_two) per row -> the round's columns."""
        columns = [list(c) for c in zip(*rows)]
        return DraftRound(seq, k, *columns, seeds, positions, scratch_tables.pop() if seq == 0 and scratch_tables
                          else None)

    def compare(rows, positions, *sources):
        ids, _ = ahead.draft(round_of(1, rows, positions).to_wire(), *sources)
        full = [(slot, 0, seq, [], False) for slot, seq in zip(slots, sequences)]   # catch up from scratch
        ref, _ = scratch.draft(round_of(0, full, [len(s) - len(p) for s, p in zip(sequences, prompts)]).to_wire())
        assert ids["ids"] == ref["ids"]
        if draft_temperature:   # q travels packed: the drafter's top 64 (prob, id) pairs of the 512-token vocabulary
            assert ids["probs"].shape == (3, k, 2 * 64) and np.allclose(ids["probs"], ref["probs"], atol=1e-6)
        else:
            assert ids["probs"] is None and ref["probs"] is None
        return ids["ids"]

    # new rows: committed = the prompt (the drafter holds it), tokens from the prefill, then the first verify
    rows = [(slot, max(0, len(p) - 2), p[-2:], [(0, i), (1, i)], True)
            for i, (slot, p) in enumerate(zip(slots, prompts))]
    drafts = compare(rows, [0, 0, 0], prefill_result, verify_result)
    for accepted in ([1, 3, 0], [0, 2, 3]):   # part, all, none of the drafts accepted (then one new token)
        committed = sequences
        emitted = [d[:a] + [50 + a] for d, a in zip(drafts, accepted)]
        sequences = [s + e for s, e in zip(committed, emitted)]
        rows = [(slot, len(c) - 2, c[-2:], [(0, i)], True) for i, (slot, c) in enumerate(zip(slots, committed))]
        drafts = compare(rows, [len(c) - len(p) for c, p in zip(committed, prompts)],
                         VerifierResult(emitted, None, 0.0).to_wire())


def test_step_timer_on_cpu_times_its_block_not_the_read():
    import time as _time
    from minedraft_ray.runtime.workers import StepTimer
    outside = _time.perf_counter()
    with StepTimer(__import__("torch").device("cpu")) as timer:
        _time.sleep(0.02)
    outside = (_time.perf_counter() - outside) * 1e3   # the block seen from outside it: however slow the machine
    _time.sleep(0.1)    # work after the block (sd reads its draft timer after the verify) must not count
    assert 15 <= timer.ms <= outside, (timer.ms, outside)
