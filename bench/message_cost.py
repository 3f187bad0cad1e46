"""What the manager <-> worker messages cost in Ray's own machinery, typed dataclass against wire form
(runtime/workers.py, "messages"), on the CPU the manager runs on.

    python -m bench.message_cost --batch 16 --k 4

- serialize_us: Ray's serializer (SerializationContext.serialize, what `.remote()` runs per argument) on the
  message as a task argument: the dataclass (Ray's cloudpickle fallback) or its wire form (msgpack), plus
  `to_wire` for the latter;
- deserialize_us: the receiving end, as Ray's deserializer does it: msgpack (Ray's MessagePackSerializer) and,
  for what took the fallback, unpickling its pickle5 bytes; plus `from_wire` for the wire form;
- remote_us: submitting a worker call to an actor whose methods return at once, as the manager called each
  worker task before (typed message, positional and keyword arguments, `.options(num_returns=2)` per round)
  and as it calls it now (one wire message, ObjectRefs as the only other arguments);
- await_us: the manager's thread CPU time per awaited result, with and without a wrapper task around it.

Each number is the minimum over repeats of the mean over a batch (the machine is shared: the minimum is the
least disturbed). Writes bench/results/message_cost_cpu.{parquet,md}.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

NAME = "message_cost_cpu"
COLUMNS = ["measure", "message", "form", "us", "msgpack_only", "bytes", "batch", "k", "git_sha", "device"]


def messages(batch: int, k: int):
    """Typical per-step messages of a psd step at `batch` rows per batch."""
    from minedraft_ray.engine.kv_blocks import TableEdits
    from minedraft_ray.runtime.messages import (DraftRound, KVEdits, PrefillRow, PrefillTask, SamplingRow,
                                                VerifierResult, VerifyTask)
    slots = list(range(batch))
    edits = KVEdits(target=TableEdits([3, 9], [4, 4], [120, 121]))
    draft_edits = KVEdits(draft=TableEdits([3, 9], [4, 4], [80, 81]))
    rows = [PrefillRow(s, 0, list(range(100, 132)), SamplingRow(0.0, 1.0, 0, s)) for s in slots]
    return {
        "VerifyTask": VerifyTask(41, slots, 0, slots, None, None, edits),
        "DraftRound": DraftRound(40, k, slots, [60 + s for s in slots], [[7, 8]] * batch,
                                 [[(0, s)] for s in slots], [True] * batch, slots, [30] * batch, draft_edits),
        "PrefillTask": PrefillTask(2, rows, 0, edits),
        "VerifierResult": VerifierResult([[5] * (k + 1)] * batch, None, 3.2, 1.7e9, 1.7e9, 0.0),
    }


def best(fn, batch_calls: int, repeats: int) -> float:
    """min over repeats of the mean us per call of fn() over batch_calls calls."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(batch_calls):
            fn()
        out.append((time.perf_counter() - t0) / batch_calls * 1e6)
    return min(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16, help="rows per message (psd: requests per batch)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--calls", type=int, default=200, help="calls per repeat")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--note", default="", help="what else ran on the machine")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]

    import pickle

    import ray
    from ray._raylet import MessagePackSerializer

    from bench.common import command_line, git_sha, write_results
    from minedraft_ray.runtime.actors import wait_for

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="r", dir="/tmp"))
    context = ray._private.worker.global_worker.get_serialization_context()
    sha, device = git_sha(), f"cpu ({os.cpu_count()} cores)"
    rows = []

    def row(measure, message, form, us, **extra):
        rows.append({"measure": measure, "message": message, "form": form, "us": round(us, 2), "batch": args.batch,
                     "k": args.k, "git_sha": sha, "device": device, **extra})
        print(rows[-1], flush=True)

    for name, message in messages(args.batch, args.k).items():
        cls = type(message)
        for form in ("typed", "wire"):
            value = message if form == "typed" else message.to_wire()
            serialized = context.serialize(value)
            # OBJECT_METADATA_TYPE_PYTHON: something went through the pickle fallback
            msgpack_only = serialized.metadata != ray._private.ray_constants.OBJECT_METADATA_TYPE_PYTHON
            if form == "typed":
                ser = best(lambda: context.serialize(message), args.calls, args.repeats)
                # Ray packs the fallback's objects as one pickle5 payload, a msgpack ext pointing into it
                packed = MessagePackSerializer.dumps(message, lambda obj: 0)
                pickled = ray.cloudpickle.dumps([message], protocol=5)

                def decode():
                    objects = pickle.loads(pickled)
                    return MessagePackSerializer.loads(packed, lambda index: objects[index])
            else:
                ser = best(lambda: context.serialize(message.to_wire()), args.calls, args.repeats)
                packed = MessagePackSerializer.dumps(message.to_wire(), None)

                def decode():
                    return cls.from_wire(MessagePackSerializer.loads(packed, None))
            assert decode() == message
            row("serialize_us", name, form, ser, msgpack_only=msgpack_only, bytes=serialized.total_bytes)
            row("deserialize_us", name, form, best(decode, args.calls, args.repeats), msgpack_only=msgpack_only,
                bytes=serialized.total_bytes)

    @ray.remote
    class Worker:
        """The worker calls' signatures, before and now; every method returns at once."""
        def verify_typed(self, seq, slots, draft_index, num_logprobs, tokens_to=None, *drafts, tables=None,
                         chunks=None):
            return 0

        def verify(self, task, *drafts):
            return 0

        def draft(self, round_, *sources):
            return 0, 0.0

        @ray.method(num_returns=2)
        def draft_declared(self, round_, *sources):
            return 0, 0.0

    worker = Worker.remote()
    source = worker.verify.remote([])
    ray.get(source)
    msg = messages(args.batch, args.k)
    verify, round_ = msg["VerifyTask"], msg["DraftRound"]
    calls = {
        ("VerifyTask", "typed: 5 positional + ref + tables="): lambda: worker.verify_typed.remote(
            verify.seq, verify.slots, verify.draft_index, 0, None, source, tables=verify.tables),
        ("VerifyTask", "wire: message + ref"): lambda: worker.verify.remote(verify.to_wire(), source),
        ("DraftRound", "typed, options(num_returns=2)"): lambda: worker.draft.options(num_returns=2).remote(
            round_, source),
        ("DraftRound", "wire, options(num_returns=2)"): lambda: worker.draft.options(num_returns=2).remote(
            round_.to_wire(), source),
        ("DraftRound", "wire, num_returns declared"): lambda: worker.draft_declared.remote(round_.to_wire(), source),
    }
    for (name, form), call in calls.items():
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            refs = [call() for _ in range(args.calls // 4)]
            times.append((time.perf_counter() - t0) / len(refs) * 1e6)
            ray.get([r[0] if isinstance(r, list) else r for r in refs])
        row("remote_us", name, form, min(times))

    async def awaits():
        async def wrapped(ref):   # a task per awaited result, as the manager awaited them before
            async def get():
                return await ref
            return await asyncio.wait_for(get(), 60)

        for form, fn in (("wrapper task + asyncio.wait_for", wrapped), ("actors.wait_for", lambda r: wait_for(r, "x", 60))):
            times = []
            for _ in range(args.repeats):
                refs = [worker.verify.remote([]) for _ in range(args.calls // 4)]
                ray.get(refs)   # all done: the await path alone
                t0 = time.thread_time()
                for r in refs:
                    await fn(r)
                times.append((time.thread_time() - t0) / len(refs) * 1e6)
            row("await_us", "result", form, min(times))
    asyncio.run(awaits())
    ray.shutdown()

    notes = ["each number: min over repeats of the mean over a batch of calls (a shared 2-core machine)",
             "serialize_us, deserialize_us: the wire form's to_wire, from_wire included",
             "remote_us: `.remote()` until it returns (the task submitted), not its execution",
             "await_us: thread CPU time of the awaiting thread per result already there",
             f"1-minute load average before the run: {load:.2f} (other sessions share the cores)"]
    if args.note:
        notes.append(args.note)
    write_results(rows, args.out, NAME, COLUMNS, "Manager <-> worker messages in Ray: typed dataclass vs wire form",
                  command_line("bench.message_cost", argv), device, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
