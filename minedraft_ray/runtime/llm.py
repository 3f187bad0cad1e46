"""`LLM`: the offline / programmatic API over the Ray runtime.

    llm = LLM(target_dir, draft_dir, mode="psd", k=4, max_batch=16)
    outs = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=64))

The batch manager runs in an actor in bundle 0 of the engine's placement group; the drafter and
verifier actors it creates land in the other bundles.
"""
from __future__ import annotations

import asyncio

from ..ray_local import prepare_token_auth, start_local_ray

prepare_token_auth()   # before Ray's import, which fixes its auth mode
import ray  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..config import ChunkGapReference, EngineConfig
from ..engine.request import GenerationOutput
from ..engine.sampling_params import SamplingParams
from .actors import WorkerSet
from .manager import BatchManager, EngineDeadError, StepOutput
from .placement import create_placement_group

# one output record for the in-process engine and the Ray runtime
RequestOutput = GenerationOutput


class CollectedOutput:
    """A request's outputs gathered into one (BatchManager.submit's sink); `done` once the last is in."""

    def __init__(self):
        self.token_ids: list[int] = []
        self.logprobs: list[dict] = []
        self.last: StepOutput | None = None
        self.done = asyncio.Event()

    def put_nowait(self, out: StepOutput) -> None:
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs or []
        if out.finished:
            self.last = out
            self.done.set()


@ray.remote
class ManagerActor:
    """Async actor hosting a BatchManager (bundle 0 of the placement group)."""

    def __init__(self, config: dict, vocab_limit: int | None, workers: WorkerSet | None = None):
        self.manager = BatchManager(EngineConfig.model_validate(config), workers=workers, vocab_limit=vocab_limit)

    async def start(self) -> dict:
        await self.manager.start()
        return self.manager.worker_info

    async def generate_batch(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[dict]:
        # each request's outputs collected by a sink as the steps commit them: no task per request wakes per step
        outputs, ids = [CollectedOutput() for _ in prompts], []
        try:
            for prompt, p, out in zip(prompts, params, outputs):
                ids.append(self.manager.submit(prompt, p, None, out, bounded=False))   # a bad request raises
            await asyncio.gather(*(out.done.wait() for out in outputs))
        finally:   # refused or cancelled: nobody wants the rest
            for request_id, out in zip(ids, outputs):
                if not out.done.is_set():
                    await self.manager.abort(request_id)
        for out in outputs:
            if out.last.error:
                raise EngineDeadError(out.last.error)
        return [{"request_id": out.last.request_id, "prompt_token_ids": prompt, "token_ids": out.token_ids,
                 "finish_reason": out.last.finish_reason, "stats": out.last.stats, "logprobs": out.logprobs or None}
                for prompt, out in zip(prompts, outputs)]

    async def generate_stream(self, prompt: list[int], params: SamplingParams, request_id: str | None = None):
        async for out in self.manager.generate(prompt, params, request_id):
            yield out

    async def abort(self, request_id: str) -> None:
        await self.manager.abort(request_id)

    async def reconfigure(self, k: int | None = None, prefill_chunk_tokens: int | None = None,
                          fused_prefill: bool | None = None, chunk_gap_ratio: float | None = None,
                          chunk_gap_reference: ChunkGapReference | None = None) -> None:
        await self.manager.reconfigure(k, prefill_chunk_tokens, fused_prefill, chunk_gap_ratio, chunk_gap_reference)

    def info(self) -> dict:
        return self.manager.info()

    def history(self) -> list:
        return list(self.manager.history)

    def kill_drafter(self) -> bool:
        """Fault injection for tests and drills: kill the drafter actor."""
        if self.manager.drafter is None:
            return False
        ray.kill(self.manager.drafter, no_restart=True)
        return True

    async def shutdown(self) -> None:
        await self.manager.shutdown()


def init_local_ray(**kwargs) -> None:
    """Start a private local Ray instance unless one is connected (never attaches silently): every listener
    on 127.0.0.1 and token authentication on (minedraft_ray/ray_local.py); `address` joins a cluster."""
    if ray.is_initialized():
        return
    address = kwargs.pop("address", None)
    if address and address != "local":
        ray.init(address=address, **kwargs)
    else:
        start_local_ray(**kwargs)


class LLM:
    def __init__(self, target: str | None = None, draft: str | None = None, mode: str = "psd", k: int = 4,
                 max_batch: int = 8, config: EngineConfig | None = None, _workers: WorkerSet | None = None, **settings):
        """_workers: worker subclasses for tests and benchmarks (minedraft_ray.testing.workers)."""
        if config is None:
            fields = {"mode": mode, "k": k, "max_batch": max_batch, **settings}
            if target is not None:
                fields["target"] = target
            if draft is not None or mode == "ar":
                fields["draft"] = draft
            config = EngineConfig(**fields)
        self.config = config
        # the driver's side only (transformers): the manager's actor imports this module too
        from ..engine.hub import hub_env_vars, model_dirs
        from ..engine.pair import shared_vocab
        from ..engine.tokenizer import load_tokenizer
        self.tokenizer = load_tokenizer(model_dirs(config)[0])
        vocab_limit = shared_vocab(config, self.tokenizer)   # the pair checked here, beside the tokenizer, before anything starts
        init_local_ray()
        self.pg = create_placement_group(config.mode, tp=config.tp)
        # the manager and the workers it starts (they inherit its runtime env) resolve Hub ids with the
        # driver's Hugging Face settings, as a Serve app's replicas do
        self.manager = ManagerActor.options(
            num_cpus=self.pg.bundle_specs[0].get("CPU", 0), **hub_env_vars(),
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0,
                                                                 placement_group_capture_child_tasks=True),
        ).remote(config.model_dump(), vocab_limit, _workers)
        try:
            self.worker_info = ray.get(self.manager.start.remote())
        except Exception:   # e.g. max_len does not fit the KV pools: nothing of this engine is left behind
            ray.kill(self.manager, no_restart=True)
            ray.util.remove_placement_group(self.pg)
            raise

    def _encode(self, prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def generate(self, prompts, sampling: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
        outs = ray.get(self.manager.generate_batch.remote([self._encode(p) for p in prompts], params))
        return [RequestOutput(text=self.tokenizer.decode(o["token_ids"], skip_special_tokens=True), **o) for o in outs]

    async def stream(self, prompt, sampling: SamplingParams | None = None, request_id: str | None = None):
        """Async iterator of StepOutput for one request (per-request streaming)."""
        gen = self.manager.generate_stream.options(num_returns="streaming").remote(
            self._encode(prompt), sampling or SamplingParams(), request_id)
        async for ref in gen:
            out: StepOutput = await ref
            yield out

    def abort(self, request_id: str) -> None:
        ray.get(self.manager.abort.remote(request_id))

    def reconfigure(self, k: int | None = None, prefill_chunk_tokens: int | None = None,
                    fused_prefill: bool | None = None, chunk_gap_ratio: float | None = None,
                    chunk_gap_reference: ChunkGapReference | None = None) -> None:
        """Benchmarks: a new k, per-step prefill budget (0: unchunked), fusion of chunks into verify launches or
        adaptive chunk ratio (0: off) and reference on an idle engine, same actors and graphs."""
        ray.get(self.manager.reconfigure.remote(k, prefill_chunk_tokens, fused_prefill, chunk_gap_ratio,
                                                chunk_gap_reference))
        if chunk_gap_ratio is not None:
            self.config = self.config.model_copy(update={"chunk_gap_ratio": chunk_gap_ratio})
        if chunk_gap_reference is not None:
            self.config = self.config.model_copy(update={"chunk_gap_reference": chunk_gap_reference})
        if k is not None:
            self.config = self.config.model_copy(update={"k": k})
        if prefill_chunk_tokens is not None:
            self.config = self.config.model_copy(update={"prefill_chunk_tokens": prefill_chunk_tokens})
        if fused_prefill is not None:
            self.config = self.config.model_copy(update={"fused_prefill": fused_prefill})

    def info(self) -> dict:
        return ray.get(self.manager.info.remote())

    def history(self) -> list:
        return ray.get(self.manager.history.remote())

    def shutdown(self) -> None:
        try:
            ray.get(self.manager.shutdown.remote(), timeout=30)
        finally:
            ray.kill(self.manager, no_restart=True)
            ray.util.remove_placement_group(self.pg)
