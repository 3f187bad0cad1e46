"""The engine deployment of the Serve app (serve/app.py builds it): each replica owns a MineDraft placement group
(bundle 0 is the replica itself, the other bundles hold the drafter/verifier actors its BatchManager creates) and the
BatchManager. Its own module, apart from the ingress's: Serve imports a deployment's module in every replica of it, and
this one imports the batch manager, which the ingress replicas do not run. Neither imports torch: the worker actors the
manager starts hold the models (tests/test_layering.py).
"""
from ray import serve

from ..config import EngineConfig
from ..engine.hub import with_local_models
from ..engine.sampling_params import SamplingParams
from ..runtime.errors import EngineDeadError, EngineOverloadedError
from ..runtime.manager import BatchManager
from ..runtime.telemetry import StepRecord
from .guard import bind_replica_grpc_to_node_ip
from .streams import Accepted, FlushRecord, OutputBatcher, Refusal, RequestSink, start_mailbox


MAILBOX_DRAIN_S = 1.0   # the longest a stopping replica waits for its ingress replicas to take their outputs


@serve.deployment(name="MineDraftEngine", health_check_timeout_s=30)
class EngineServer:
    async def __init__(self, config: dict, vocab_limit: int | None):
        """vocab_limit: the pair's shared_vocab, checked by the app builder."""
        bind_replica_grpc_to_node_ip()
        self.manager = BatchManager(with_local_models(EngineConfig.model_validate(config)), vocab_limit=vocab_limit)
        await self.manager.start()
        self.mailbox_key = serve.get_replica_context().replica_id.unique_id
        self.outputs = OutputBatcher(start_mailbox(), self.manager.config.stream_interval_ms / 1e3)
        # each step's end, its commit done: where the batcher sends a grid time's outputs ahead of it
        self.manager.step_listeners.append(lambda record: self.outputs.step_done(record.step_ms / 1e3))
        await self.outputs.mailbox.alive.remote()   # its process is up before the first request waits for it

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, subscriber: str):
        """One request. Its stream's only item is `Accepted` once the request is queued (so the ingress can answer
        200 and start streaming), a Refusal (queue full, engine dead), or the error of a bad request; its outputs go
        to `subscriber` (the ingress replica) through the mailbox, an engine failure as its last output's error. The
        stream stays open while the request runs: cancelling it (a disconnect, a stop string) aborts the request."""
        sink = RequestSink(self.outputs, subscriber)
        try:
            self.manager.submit(prompt_ids, params, request_id, sink)   # overload, dead engine, bad request: raise
        except (EngineOverloadedError, EngineDeadError) as e:
            # expected: answered as a value, so Serve logs no failed call with its traceback
            yield Refusal("queue_full" if isinstance(e, EngineOverloadedError) else "engine_dead")
            return
        try:
            yield Accepted(self.outputs.mailbox, self.mailbox_key)
            await sink.done.wait()
        finally:
            if not sink.done.is_set():
                await self.manager.abort(request_id)

    async def abort(self, request_id: str) -> bool:
        """Abort a request this replica holds; False when it does not know it (another replica has it, or it
        has finished)."""
        if request_id not in self.manager.requests:
            return False
        await self.manager.abort(request_id)
        return True

    async def info(self) -> dict:   # async: runs on the loop that owns the manager
        return {**self.manager.info(), "workers": self.manager.worker_info,
                "replica": serve.get_replica_context().replica_id.unique_id}

    async def steps_since(self, step: int) -> list[StepRecord]:
        """The engine's step records after step number `step` (info's `steps`): benchmarks read a run's steps.
        A handle call only, no HTTP route."""
        return self.manager.steps_since(step)

    async def flushes_since(self, t: float) -> list[FlushRecord]:
        """The output batcher's interval flushes after wall clock `t`: benchmarks read a run's flushes."""
        return [f for f in self.outputs.history if f.t > t]

    async def check_health(self) -> None:
        if self.manager.dead:
            raise RuntimeError(f"engine is dead: {self.manager.dead}")

    async def __del__(self):
        await self.manager.shutdown()   # a request still running ends with an error output
        # the mailbox dies with this process: its outputs (every request's last) are handed out first
        await self.outputs.drain(MAILBOX_DRAIN_S)
