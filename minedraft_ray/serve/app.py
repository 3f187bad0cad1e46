"""Ray Serve application: an OpenAI-compatible FastAPI ingress in front of one engine deployment.

    serve run deployments/minedraft.yaml          # import_path: minedraft_ray.serve.app:build_app
    serve.run(build_app({"mode": "psd", "max_batch": 16}))

EngineServer (serve/engine_replica.py): its replica owns the MineDraft placement group (bundle 0 is the replica
itself, the other bundles hold the drafter/verifier actors the BatchManager creates) and the BatchManager; the
StepOutputs (token ids, logprobs, stats) of all its requests reach the ingress in step batches through its mailbox
(serve/streams.py). Scale-out is data parallel: `num_replicas` (or autoscaling between
`min_replicas` and `max_replicas`) engine replicas, each with its own placement group, so each replica's
drafter and verifier stay on one node. A request lives on the replica Serve routed it to; only its own
stream reaches it again (see Choice._abort).

OpenAIServer (ingress, `ingress_replicas` of them or autoscaled): tokenizes, validates, detokenizes, cuts stop
strings and formats the responses.
Detokenizing here keeps that CPU work off the engine replica, whose event loop drives the step loop.
Streamed and non-streamed responses run the same code (`_run_choices`), so their texts are equal.

Status codes: 400 bad input or unsupported parameter, 401 missing/wrong API key, 404 unknown model or
route, 408 body too slow, 413 body too large, 429 queue full (the engine's bounded queue or Serve's), 500
an unexpected failure, 503 the engine is dead or restarting (/health too). 429 and 503 carry Retry-After.
Error bodies are OpenAI's error JSON and never carry exception text, tracebacks or Ray internals. A client
that disconnects cancels its requests; the engine frees their slots.

Tokenizing, detokenizing and request parsing run on a thread pool, not on the event loop that serves the
other clients (but a small body's parsing and token-id prompt, cheaper than the hop: INLINE_BODY_BYTES); prompts are
counted before their ids are built, so an over-long prompt costs no list of millions of ids. A burst of new
requests is admitted ADMITTING_AT_ONCE at a time (parse, tokenize, submit), so the running streams' chunks
go out between the slices of its work instead of after all of it; that loop's lag is measured
(serve/loop_lag.py, `minedraft_api_event_loop_lag_seconds` at /metrics).
"""

import asyncio
import concurrent.futures
import contextlib
import hashlib
import hmac
import json
import logging
import os
import time
import weakref
from collections import deque
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, RayError, RayTaskError, TaskCancelledError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import EngineConfig
from ..engine.hf_config import eos_token_ids, read_hf_config
from ..engine.hub import hub_env_vars, model_dirs, with_local_models
from ..engine.pair import shared_vocab
from ..engine.sampling_params import SamplingParams
from ..engine.tokenizer import load_chat_template, load_tokenizer, tokenizer_class_path
from ..observability.heap import CollectorWatch
from ..runtime.errors import EngineDeadError, EngineOverloadedError
from ..runtime.placement import STRATEGY, make_bundles
from ..runtime.streams import StepOutput
from .compat import (ClientGoneAsDisconnect, ConfiguredCORSMiddleware, IgnoredFields, configure_cors, engine_request_base,
                     request_id_of)
from .detokenize import OutputText, TokenStrings
from .loop_lag import LoopLagWatch
from .guard import (BodyTimeout, BodyTooLarge, IngressLimits, bind_replica_grpc_to_node_ip, declared_length,
                    read_body, timeout_message, too_large_message)
from .ingress_http import check_ingress_http
from .streams import Refusal, StreamRouter
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, chat_logprobs, completion_logprobs,
                       error_body, parse, spec_stats, usage)
from .vllm_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .vllm_metrics import APIMetrics, RequestTimer

log = logging.getLogger("minedraft.serve")

API_KEY_ENV = "MINEDRAFT_API_KEY"
HEALTH_TIMEOUT_S = 5.0
ENGINE_ACCEPT_TIMEOUT_S = 5.0   # longest wait for an engine replica to take a request
KEEP_ALIVE_TIMEOUT_S = 5   # idle keep-alive connections close after this (uvicorn's timer, Serve's option)
CONTROL_HEADROOM = 16    # in-flight info/abort/health calls next to the generation streams
INGRESS_TARGET_STREAMS = 128   # streams per ingress replica before autoscaling adds one
ABORT_DRAIN_S = 10.0     # wait this long for an aborted request's final stats, then cancel its stream
SHUTDOWN_RELAY_S = 5.0   # the ingress's grace period beyond the engines': time to end the cut streams cleanly
# how often a stopping replica looks whether its requests are done (Serve's default, 2 s, is a floor on every
# replica's stop, idle or not: each delete, redeploy and Ctrl-C waited it out)
SHUTDOWN_POLL_S = 0.2
STREAM_ERROR_FINISH_REASON = "error"   # a choice cut short by a failure (as vLLM reports it)
ADMITTING_AT_ONCE = 4    # requests being admitted (parsed, tokenized, submitted) at once; the others wait their
                         # turn, so a burst's admission work comes in slices between the running streams' chunks
                         # instead of ahead of all of them
INLINE_BODY_BYTES = 2048  # a body up to this size is parsed (and its token-id prompt checked) on the loop: a few
                          # tens of us, less than the CPU of a hop to the pool and back (two hops per request before)
INGRESS_HEADROOM = 1024  # ingress requests beyond the engine's capacity: cheap (async), and a burst of them
                         # must not take the slots /health and ordinary requests need


# ---------------------------------------------------------------- ingress

# no open /docs, /redoc: /openapi.json is a route of its own, behind the API key
api = FastAPI(title="minedraft", description="OpenAI-compatible API over MineDraft speculative decoding",
              docs_url=None, redoc_url=None, openapi_url=None)
api.add_middleware(ConfiguredCORSMiddleware)   # preflights are answered before anything else
api.add_middleware(ClientGoneAsDisconnect)     # outermost: every layer sees a client that left as a disconnect


@api.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError):
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)


@api.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception):
    if isinstance(exc, TaskCancelledError):
        # Serve cancels a request whose client went away, and its receive() raises this inside the streaming
        # response: an everyday event, not a fault (the engine's request is aborted by the stream's own cleanup)
        log.info("client went away: %s %s", request.method, request.url.path)
        return Response(status_code=499)
    # unexpected: the traceback goes to the replica's log, the client learns nothing about it
    log.error("unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path, exc_info=exc)
    return JSONResponse(internal_error().body(), status_code=500)


def internal_error() -> APIError:
    return APIError(500, "Internal server error.", "server_error", code="internal_error")


def queue_full() -> APIError:
    return APIError(429, "The server is overloaded: the request queue is full. Retry later.", "rate_limit_error",
                    code="queue_full")


def engine_unavailable() -> APIError:
    return APIError(503, "The engine is unavailable (restarting after a failure). Retry later.", "server_error",
                    code="engine_dead")


def engine_error(exc: BaseException) -> APIError | None:
    """An exception from the engine deployment as the API error it stands for (None: not ours). Messages
    are fixed texts: an exception's own text may carry Ray tracebacks, addresses and pids."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (EngineOverloadedError, BackPressureError)):
        return queue_full()
    if isinstance(exc, EngineDeadError):
        return engine_unavailable()
    if isinstance(exc, (RayActorError, ActorUnavailableError)):   # the engine replica itself died
        return engine_unavailable()
    if isinstance(exc, ValueError) and isinstance(exc, RayTaskError):  # the manager's own request checks
        return APIError(400, str(exc.cause if getattr(exc, "cause", None) else exc).splitlines()[0])
    if isinstance(exc, RayError):
        return internal_error()
    return None


def log_refusal(err: APIError, what: str) -> None:
    """Expected refusals (overload, dead engine) in one line, without a traceback."""
    log.warning("%s refused: %d %s", what, err.status, err.code)


@dataclass
class Event:
    """What one choice adds to the response: text, logprob entries, and on its last event why it ended."""
    index: int
    text: str
    logprobs: list[dict]
    first_token: int              # index of logprobs[0] among the choice's output tokens
    finish_reason: str | None = None
    stats: dict | None = None
    stop_reason: str | int | None = None


class Choice:
    """One output sequence: an engine stream plus the text built from it.

    The router applies each delivery of its outputs (`apply`, on the pool, with every other request of the
    delivery): tokens become text and the text an Event, queued for `events` on the loop."""

    def __init__(self, engine: DeploymentHandle, router: StreamRouter, index: int, prompt_ids: list[int],
                 params: SamplingParams, stop: list[str], request_id: str, tokenizer, timer: RequestTimer,
                 eos_token_ids: frozenset[int] = frozenset(), generate: DeploymentHandle | None = None):
        """generate: `engine`'s streaming `generate` handle, made once by the caller (made here without one)."""
        self.engine, self.router, self.index, self.prompt_ids, self.params = engine, router, index, prompt_ids, params
        self.generate = generate or engine.options(method_name="generate", stream=True)
        self.request_id = request_id
        self.text = OutputText(tokenizer, prompt_ids, stop, params.stop_token_ids)
        self.timer = timer
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.last_token: int | None = None
        self.logprobs: list[dict] = []
        self.sent_tokens = 0
        self.finish_reason: str | None = None
        self.stats: dict | None = None
        self.stream = None            # the request's Serve call: open while it runs, cancelled to abort it
        self.ready: deque[Event | Exception] = deque()   # made by `apply`, taken by `events`
        self.woken = asyncio.Event()
        self.done = False             # the engine's last output is in (or the request was given up)

    def submit(self) -> None:
        self.router.open(self.request_id, self)
        self.stream = self.generate.remote(self.prompt_ids, self.params, self.request_id, self.router.subscriber)

    async def accepted(self) -> None:
        """The engine's first answer: Accepted once queued, or the refusal as an APIError."""
        first = await self.stream.__anext__()
        if isinstance(first, Refusal):
            self.done = True
            raise queue_full() if first.reason == "queue_full" else engine_unavailable()
        self.router.watch(self.request_id, first)

    # ---- on the router's pool ------------------------------------------------------------------------
    def apply(self, outs: list[StepOutput]) -> None:
        """One delivery of outputs -> at most one Event (or the engine's error) queued."""
        try:
            for out in outs:
                if self.text.finished:   # a stop string ended the text: only the engine's last output matters
                    if out.finished or out.error:
                        self.stats, self.done = out.stats, True
                    continue
                if out.error:
                    self.ready.append(EngineDeadError(out.error))
                    return
                self._add(out)
            if not self.text.stopped:   # after a stop string `events` makes the final event, once aborted
                self._queue_event()
        except Exception as e:  # noqa: BLE001 - a bug here fails this stream only (an internal error)
            self.ready.append(e)

    def _add(self, out: StepOutput) -> None:
        if out.logprobs:
            self.logprobs += out.logprobs
        if out.new_token_ids:
            self.last_token = out.new_token_ids[-1]
            self.timer.on_tokens(len(out.new_token_ids))
        stopped = self.text.add(out.new_token_ids)
        if out.finished:
            self.stats, self.done = out.stats, True
            if not stopped:
                self.text.finish()
                # vLLM's reasons: an output that ends otherwise than by a stop or max_tokens was aborted
                self.finish_reason = out.finish_reason if out.finish_reason in ("stop", "length") else "abort"
        if stopped:
            self.finish_reason = "stop"

    def _queue_event(self) -> None:
        """The text released since the last event (the final event once the text is finished)."""
        chunk, tokens = self.text.take()
        if self.text.finished:
            tokens = self.text.num_tokens
        event = Event(self.index, chunk, self.logprobs[self.sent_tokens:tokens], self.sent_tokens)
        self.sent_tokens = tokens
        if self.text.finished:
            event.finish_reason, event.stats, event.stop_reason = self.finish_reason, self.stats, self.stop_reason
            self.ready.append(event)
        elif chunk or event.logprobs:
            self.ready.append(event)

    # ---- on the loop ---------------------------------------------------------------------------------
    def wake(self) -> None:
        self.woken.set()

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's stop_reason: the stop string or stop_token_ids entry that ended the output; None for EOS,
        max_tokens and aborts."""
        if self.finish_reason != "stop":
            return None
        if self.text.stop_string is not None:
            return self.text.stop_string
        # as vLLM: EOS first (a stop token id that is EOS too reports None)
        if self.last_token in self.eos_token_ids:
            return None
        return self.last_token if self.last_token in self.params.stop_token_ids else None

    async def _woken(self) -> None:
        self.woken.clear()
        if not self.ready:
            await self.woken.wait()

    async def events(self):
        """Yields Events until the choice ends (EOS, max_tokens or a stop string)."""
        while True:
            while self.ready:
                item = self.ready.popleft()
                if isinstance(item, Exception):
                    raise item
                # deliveries that queued up while the client's stream was busy go out as one chunk
                while self.ready and not item.finish_reason and isinstance(self.ready[0], Event):
                    later = self.ready.popleft()
                    item = Event(item.index, item.text + later.text, item.logprobs + later.logprobs, item.first_token,
                                 later.finish_reason, later.stats, later.stop_reason)
                if item.finish_reason:
                    self.timer.on_finished(item.finish_reason, item.stats)
                    yield item
                    return
                yield item
            if self.text.stopped:   # a stop string ended the text; the engine may still be generating
                if not self.done:
                    await self._abort()
                self._queue_event()   # the final one (the text no longer changes: safe on the loop)
                continue
            await self._woken()

    async def _abort(self) -> None:
        """Stop the engine request after a stop string, keeping its stats from the final output.

        The abort call is routed like any call: with several engine replicas it may reach one that does not
        hold the request. Then the stream is cancelled instead, which aborts the request on its own replica
        (EngineServer.generate closes the manager stream); only its stats are lost."""
        async def drain():
            if not await self.engine.abort.remote(self.request_id):
                raise LookupError(self.request_id)
            while not self.done:
                self.woken.clear()
                if not self.done:
                    await self.woken.wait()
        try:
            await asyncio.wait_for(drain(), ABORT_DRAIN_S)
        except (asyncio.TimeoutError, LookupError):
            self.close()
        self.done = True

    def close(self) -> None:
        if self.stream is not None and not self.done:
            self.stream.cancel()   # the engine replica sees CancelledError and aborts the request
            self.done = True
        self.router.close(self.request_id)
        self.timer.on_finished("abort", None)   # no-op after a finish; else the client went away

    @property
    def num_tokens(self) -> int:
        return self.text.num_tokens


async def _merge(choices: list[Choice]):
    """Events of all choices as they come; cancels every engine stream when done or cancelled."""
    if len(choices) == 1:
        try:
            async for event in choices[0].events():
                yield event
        finally:
            choices[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice):
        try:
            async for event in choice.events():
                queue.put_nowait(event)
        except BaseException as e:  # noqa: BLE001 - relayed to the consumer
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        remaining = len(choices)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for choice in choices:
            choice.close()


def _has_text(prompt) -> bool:
    """Whether a completion prompt has text to tokenize (else it is token ids)."""
    return isinstance(prompt, str) or (isinstance(prompt, list) and any(isinstance(p, str) for p in prompt))


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


@serve.deployment(name="OpenAIServer")
@serve.ingress(api)
class OpenAIServer:
    def __init__(self, engine: DeploymentHandle, config: dict, api_key_sha256: str | None = None,
                 tokenizer_class: str | None = None):
        """tokenizer_class: the target tokenizer's class (`tokenizer_class_path`), found by the app builder: built
        from it, the tokenizer loads without AutoTokenizer, whose import (torch) would cost every ingress start."""
        bind_replica_grpc_to_node_ip()
        # one thread per encode: the tokenizer's own thread pool would take every core from the engine
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.engine = engine
        self.generate = engine.options(method_name="generate", stream=True)   # built once, not per request
        self.config = with_local_models(EngineConfig.model_validate(config))
        self.tokenizer = load_tokenizer(self.config.target, tokenizer_class)
        self.eos_token_ids = frozenset(eos_token_ids(*read_hf_config(self.config.target)))
        if self.config.chat_template:
            self.tokenizer.chat_template = load_chat_template(self.config.chat_template)
        configure_cors(self.config.cors_allow_origins)
        self.metrics = APIMetrics(self.config.served_model_name, self.config.k, self.config.uses_drafter)
        self.ignored = IgnoredFields(self.metrics.ignored_fields)
        # engine request id -> its Choice while one exists: ids in use get no second request
        self.choices: weakref.WeakValueDictionary[str, Choice] = weakref.WeakValueDictionary()
        # prompts are encoded by a Rust tokenizer of their own, which counts tokens before any Python list
        # is built; a long encode holds its tokenizer's lock, which would stall every stream's detokenizing
        # on the shared one
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        self.encoder = None if backend is None else type(backend).from_str(backend.to_str())
        # each token stands for at most this many characters of text (its vocabulary string: bytes for
        # byte-level vocabularies, characters otherwise, both >= the characters it covers), so a prompt of
        # more characters than `limit` tokens can cover is refused without encoding it; only without a
        # normalizer, which could shrink the text
        self.chars_per_token = None
        if self.encoder is not None and self.encoder.normalizer is None:
            self.chars_per_token = max(map(len, self.encoder.get_vocab(with_added_tokens=True)))
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="minedraft-tokens")
        self.router = StreamRouter(serve.get_replica_context().replica_id.unique_id, self.pool)
        self.limits = IngressLimits.from_config(self.config)
        self.strings = TokenStrings(self.tokenizer)
        self.vocab_size = len(self.tokenizer)
        self.model_name = self.config.served_model_name
        self.api_key_sha256 = api_key_sha256
        self.created = int(time.time())
        self.max_len: int | None = None   # the engine's context limit (it may lower max_len to the model's)
        # Serve freezes what a replica's startup built once __init__ returns (RAY_SERVE_FREEZE_GC_ON_STARTUP);
        # the watch exports the collector's pauses and that frozen count
        self.collector = CollectorWatch("ingress", self.model_name, self.config.mode)
        # the constructor runs on the loop that serves the requests
        self.loop_lag = LoopLagWatch(self.metrics.loop_lag.observe)
        self.loop_lag.start()
        self.admitting = asyncio.Semaphore(ADMITTING_AT_ONCE)

    @contextlib.asynccontextmanager
    async def _admission(self):
        """One of the ADMITTING_AT_ONCE admission slots, for parsing, tokenizing and submitting a request."""
        if self.admitting.locked():
            self.metrics.admission_waits.inc()
        async with self.admitting:
            yield

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _off_loop_unless_small(self, body: bytes, fn, *args):
        """fn(*args) for a request of `body`: on the loop when the body is small (its work is too), else on the pool."""
        return fn(*args) if len(body) <= INLINE_BODY_BYTES else await self._off_loop(fn, *args)

    async def _read_body(self, request: Request) -> bytes:
        """The body within the size and time limits. Serve's proxy enforces them first where the ingress
        guard is installed (serve/guard.py); this bounds deployments without it."""
        limit = self.limits.max_body_bytes
        if (declared_length(request.scope) or 0) > limit:
            raise APIError(413, too_large_message(limit), code="request_too_large")
        try:
            body, _ = await read_body(request.receive, limit, self.limits.body_timeout_s)
        except BodyTooLarge:
            raise APIError(413, too_large_message(limit), code="request_too_large") from None
        except BodyTimeout:
            raise APIError(408, timeout_message(self.limits.body_timeout_s), code="request_timeout") from None
        return body

    async def _context_limit(self) -> int:
        if self.max_len is None:
            self.max_len = (await self.engine.info.remote())["max_len"]
        return self.max_len

    # ---- plumbing ------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self.api_key_sha256 is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        digest = hashlib.sha256(key.strip().encode()).hexdigest()
        if scheme.lower() != "bearer" or not hmac.compare_digest(digest, self.api_key_sha256):
            raise APIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                           "authentication_error", code="invalid_api_key")

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                           "not_found_error", param="model", code="model_not_found")

    def _params(self, req, prompt_len: int, max_tokens: int | None, num_logprobs: int | None, param: str,
                seed: int | None, limit: int, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        if prompt_len == 0:
            raise APIError(400, "The prompt is empty.", param=param)
        if prompt_len >= limit:
            raise APIError(400, f"The prompt has {prompt_len} tokens; the context limit is {limit} tokens "
                           "(prompt + output).", param=param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise APIError(400, f"max_tokens ({max_tokens}) + the prompt ({prompt_len} tokens) exceeds the context "
                           f"limit of {limit} tokens.", param="max_tokens", code="context_length_exceeded")
        params = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(req.top_k or 0, 0), max_tokens=max_tokens, seed=seed, ignore_eos=req.ignore_eos,
            stop_token_ids=stop_token_ids,
            # the engine is asked for >= 1 top entries so that it returns token logprobs even for top-0
            logprobs=None if num_logprobs is None else max(num_logprobs, 1))
        try:
            params.validate()
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return params

    async def _submit(self, prompts: list[list[int]], req, max_tokens: int | None, num_logprobs: int | None,
                      param: str, request_id: str, arrived: float) -> list[Choice]:
        """One Choice per (prompt, n), submitted to the engine: choice i of a prompt gets seed + i."""
        if len(prompts) * req.n > self.config.max_running:
            raise APIError(400, f"n x prompts = {len(prompts) * req.n} exceeds the {self.config.max_running} "
                           "requests this engine runs at once.", param="n")
        stop = req.stop_strings()
        stop_token_ids = req.stop_token_id_set(self.vocab_size)
        limit = await self._context_limit()
        base = engine_request_base(request_id, lambda b: any(f"{b}-{i}" in self.choices
                                                             for i in range(len(prompts) * req.n)))
        choices = []
        for p, prompt in enumerate(prompts):
            for i in range(req.n):
                seed = None if req.seed is None else req.seed + i
                params = self._params(req, len(prompt), max_tokens, num_logprobs, param, seed, limit, stop_token_ids)
                index = p * req.n + i
                choices.append(Choice(self.engine, self.router, index, prompt, params, stop, f"{base}-{index}",
                                      self.tokenizer, self.metrics.request(len(prompt), arrived), self.eos_token_ids,
                                      self.generate))
                self.choices[choices[-1].request_id] = choices[-1]
        for c in choices:   # all submitted before any await, so a refusal can close every one of them
            c.submit()
        return choices

    async def _accepted(self, choices: list[Choice]) -> list[Choice]:
        """The engine's answer to every choice: raises if it refuses any (and closes them all)."""
        try:
            # a live engine answers at once (queued, or refused); no answer means no engine replica to take
            # it (Serve is replacing a dead one): 503 now, not a request left waiting for the replacement
            await asyncio.wait_for(asyncio.gather(*(c.accepted() for c in choices)), ENGINE_ACCEPT_TIMEOUT_S)
        except asyncio.TimeoutError:
            for c in choices:
                c.close()
            err = engine_unavailable()
            log_refusal(err, "request (no engine replica answered)")
            raise err from None
        except BaseException as e:
            for c in choices:
                c.timer.refused()   # no request of vLLM's series: the client gets an error instead
                c.close()
            err = engine_error(e)
            if err is None:
                raise
            log_refusal(err, "request")
            raise err from None
        return choices

    async def _respond(self, req, choices: list[Choice], prompt_tokens: int, kind: str, request_id: str):
        rid = ("cmpl-" if kind == "text_completion" else "chatcmpl-") + request_id
        head = {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name}
        num_top = self._num_top(req)
        if req.stream:
            return StreamingResponse(self._stream(req, choices, prompt_tokens, head, num_top),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        texts = {c.index: [] for c in choices}
        finals: dict[int, Event] = {}
        try:
            async for event in _merge(choices):
                texts[event.index].append(event.text)
                if event.finish_reason:
                    finals[event.index] = event
        except Exception as e:
            err = engine_error(e)
            if err is None:
                raise
            log_refusal(err, "request")
            raise err from None
        out = []
        for c in choices:
            text = "".join(texts[c.index])
            entry = {"index": c.index, "finish_reason": finals[c.index].finish_reason,
                     "stop_reason": finals[c.index].stop_reason}
            lps = self._logprobs(c, c.logprobs[:c.num_tokens], 0, num_top, kind)
            if kind == "text_completion":
                entry.update(text=text, logprobs=lps)
            else:
                entry.update(message={"role": "assistant", "content": text}, logprobs=lps)
            out.append(entry)
        completion_tokens = sum(c.num_tokens for c in choices)
        return {**head, "choices": out, "usage": usage(prompt_tokens, completion_tokens),
                "minedraft": spec_stats([c.stats for c in choices], self.config.mode, self.config.k)}

    async def _stream(self, req, choices: list[Choice], prompt_tokens: int, head: dict, num_top: int | None):
        kind = head["object"]
        head = {**head, "object": "chat.completion.chunk" if kind == "chat.completion" else kind}
        by_index = {c.index: c for c in choices}
        started, finished = set(), set()
        tail: list[str] = []   # the last event goes out with the usage and [DONE]: one Serve item, not three
        try:
            async for ev in _merge(choices):
                choice = {"index": ev.index}
                lps = self._logprobs(by_index[ev.index], ev.logprobs, ev.first_token, num_top, kind)
                if kind == "chat.completion":
                    delta = {"content": ev.text} if ev.text or ev.index not in started else {}
                    if ev.index not in started:
                        delta["role"] = "assistant"
                        started.add(ev.index)
                    choice.update(delta=delta, logprobs=lps)
                else:
                    choice.update(text=ev.text, logprobs=lps)
                choice["finish_reason"] = ev.finish_reason
                choice["stop_reason"] = ev.stop_reason
                if ev.finish_reason:
                    finished.add(ev.index)
                chunk = {**head, "choices": [choice]}
                if ev.finish_reason:
                    chunk["minedraft"] = spec_stats([ev.stats], self.config.mode, self.config.k)
                if len(finished) == len(choices):
                    tail.append(_sse(chunk))
                else:
                    yield _sse(chunk)
            if req.stream_options is not None and req.stream_options.include_usage:
                completion_tokens = sum(c.num_tokens for c in choices)
                tail.append(_sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}))
        except Exception as e:  # the headers are sent: each open choice ends, then the error goes into the stream
            err = engine_error(e)
            if err is None:
                log.error("stream %s failed: %s", head["id"], type(e).__name__, exc_info=e)
                err = internal_error()
            else:
                log.warning("stream %s ended: %d %s", head["id"], err.status, err.code)
            for c in choices:
                if c.index not in finished:
                    end = {"index": c.index, "finish_reason": STREAM_ERROR_FINISH_REASON, "logprobs": None}
                    end.update({"delta": {}} if kind == "chat.completion" else {"text": ""})
                    tail.append(_sse({**head, "choices": [end]}))
            tail.append(_sse(err.body()))
        yield "".join(tail) + _sse("[DONE]")

    def _num_top(self, req) -> int | None:
        return req.logprobs if isinstance(req, CompletionRequest) else req.num_logprobs()

    def _logprobs(self, choice: Choice, entries: list[dict], first: int, num_top: int | None, kind: str):
        if num_top is None:
            return None
        if kind == "text_completion":
            ends = choice.text.token_ends
            offsets = [ends[i - 1] if i > 0 else 0 for i in range(first, first + len(entries))]
            return completion_logprobs(entries, offsets, num_top, self.strings)
        return chat_logprobs(entries, num_top, self.strings)

    # ---- endpoints -----------------------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        """Liveness only (no key needed, so nothing else): 200, or 503 while the engine is dead or restarting."""
        try:
            info = await asyncio.wait_for(self.engine.info.remote(), HEALTH_TIMEOUT_S)
            alive = not info.get("dead")
        except Exception as e:  # noqa: BLE001 - unreachable is unhealthy, whatever the reason
            log.warning("health: engine unreachable (%s)", type(e).__name__)
            alive = False
        if not alive:
            err = engine_unavailable()
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers())
        return {"status": "ok"}

    @api.get("/openapi.json")
    async def openapi(self, request: Request):
        self._authorize(request)
        return api.openapi()

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "minedraft", "root": self.config.target,
                                            "max_model_len": await self._context_limit()}]}

    @api.get("/v1/minedraft/info")
    async def info(self, request: Request):
        self._authorize(request)
        return await self.engine.info.remote()

    @api.get("/metrics")
    async def metrics_endpoint(self, request: Request):
        """vLLM's series in Prometheus text format (serve/vllm_metrics.py); the engine's queue state is read now."""
        self._authorize(request)
        try:
            state = await asyncio.wait_for(self.engine.info.remote(), 10)
            self.metrics.set_engine_state(state)
        except Exception as e:   # an unreachable engine must not hide the ingress's series
            log.warning("/metrics: engine state unavailable: %r", e)
        return Response(self.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        self._authorize(request)
        arrived = time.perf_counter()
        body = await self._read_body(request)   # a slow client's body holds no admission slot
        limit = await self._context_limit()     # nor does the first wait for the engine's answer (then cached)
        async with self._admission():
            req: CompletionRequest = await self._off_loop_unless_small(body, parse, CompletionRequest, body)
            req.check()
            self._check_model(req.model)
            if len(body) <= INLINE_BODY_BYTES and not _has_text(req.prompt):   # token ids: a copy and a range check
                prompts = self._completion_prompts(req.prompt, limit)
            else:   # text is tokenized on the pool
                prompts = await self._off_loop(self._completion_prompts, req.prompt, limit)
            self.ignored.note("completions", req.ignored_fields())
            request_id = request_id_of(request.scope)
            choices = await self._submit(prompts, req, req.max_tokens, req.logprobs, "prompt", request_id, arrived)
        # the engine's answer is awaited outside the slot: an engine restarting takes seconds to answer
        choices = await self._accepted(choices)
        return await self._respond(req, choices, sum(map(len, prompts)), "text_completion", request_id)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        self._authorize(request)
        arrived = time.perf_counter()
        body = await self._read_body(request)
        limit = await self._context_limit()
        async with self._admission():
            req: ChatCompletionRequest = await self._off_loop_unless_small(body, parse, ChatCompletionRequest, body)
            req.check()
            self._check_model(req.model)
            self.ignored.note("chat/completions", req.ignored_fields())
            prompt = await self._off_loop(self._chat_prompt, req, limit)
            request_id = request_id_of(request.scope)
            choices = await self._submit([prompt], req, req.max_new_tokens, req.num_logprobs(), "messages",
                                         request_id, arrived)
        choices = await self._accepted(choices)
        return await self._respond(req, choices, len(prompt), "chat.completion", request_id)

    def _encode(self, text: str, add_special_tokens: bool, limit: int, param: str) -> list[int]:
        """Token ids of a prompt text (on the pool). A prompt at or over the context limit is refused from
        its token count, before a list of its ids exists."""
        if self.chars_per_token and len(text) >= limit * self.chars_per_token:
            raise APIError(400, f"The prompt has at least {len(text) // self.chars_per_token} tokens; the context "
                           f"limit is {limit} tokens (prompt + output).", param=param, code="context_length_exceeded")
        if self.encoder is None:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            count = len(ids)
        else:
            # encode_batch: the call that releases the GIL while it runs (encode holds it)
            encoding = self.encoder.encode_batch([text], add_special_tokens=add_special_tokens)[0]
            count, ids = len(encoding), None
        if count >= limit:
            raise APIError(400, f"The prompt has {count} tokens; the context limit is {limit} tokens "
                           "(prompt + output).", param=param, code="context_length_exceeded")
        return ids if ids is not None else encoding.ids

    def _completion_prompts(self, prompt, limit: int) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [prompt]
        elif not prompt:
            raise APIError(400, "The prompt is empty.", param="prompt")
        else:
            prompts = prompt
        if isinstance(prompts[0], int):
            prompts = [prompts]
        ids = [self._encode(p, True, limit, "prompt") if isinstance(p, str) else list(p) for p in prompts]
        for p in ids:
            if any(not 0 <= t < self.vocab_size for t in p):
                raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        return ids

    def _chat_prompt(self, req: ChatCompletionRequest, limit: int) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"The model '{self.model_name}' has no chat template; use /v1/completions.",
                           param="messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
        variables = req.chat_template_variables()
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                      **variables)
        except Exception as e:  # templates raise on e.g. roles out of order
            raise APIError(400, f"The chat template rejected the messages: {str(e).splitlines()[0][:200]}",
                           param="messages") from None
        return self._encode(text, False, limit, "messages")


# ---------------------------------------------------------------- application

def load_config(args: dict | None) -> EngineConfig:
    """`applications[].args` of a Serve config (or CLI flags) over MINEDRAFT_* variables, with clear errors.
    An explicit null unsets an optional field (e.g. draft: null for mode ar)."""
    args = dict(args or {})
    nulls = {name: None for name, value in args.items() if value is None}
    try:
        config = EngineConfig.from_env(args)
        return EngineConfig.model_validate({**config.model_dump(), **nulls}) if nulls else config
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'args'}: {err['msg']}"
                             for err in e.errors(include_url=False))
        raise ValueError(f"invalid minedraft settings (args or MINEDRAFT_* variables): {problems}") from None


def serve_limits(config: EngineConfig, replicas: int = 1) -> dict:
    """Serve's per-replica limits for `replicas` engine replicas behind it. The engine holds max_running
    requests plus a bounded queue of max_queued; Serve must let all of them through (its default of 5 would
    throttle the engine). Serve's own queue only absorbs bursts (its router assigns requests one at a time) and
    is bounded too; the engine's queue is the one that answers 429 when full."""
    ongoing = (config.max_running + config.max_queued) * replicas + CONTROL_HEADROOM
    return {"max_ongoing_requests": ongoing, "max_queued_requests": ongoing}


def ingress_limits(config: EngineConfig, replicas: int) -> dict:
    """The ingress holds every request the engines may hold plus INGRESS_HEADROOM: connections still sending
    their bodies (where Serve's proxy runs no ingress guard) or being refused must not take the slots that
    /health and ordinary requests need; the engines' bounded queues answer overload (429)."""
    ongoing = serve_limits(config, replicas)["max_ongoing_requests"] + INGRESS_HEADROOM
    return {"max_ongoing_requests": ongoing, "max_queued_requests": ongoing}


def http_options(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000) -> dict:
    """Serve's HTTP options for `serve.start`; the body and header limits are the ingress guard's
    (serve/guard.py), which Serve's proxy takes from its environment."""
    return {"host": host, "port": port, "keep_alive_timeout_s": KEEP_ALIVE_TIMEOUT_S}


def replica_options(config: EngineConfig) -> dict:
    """A fixed number of engine replicas, or Serve autoscaling between min_replicas and max_replicas. A replica
    is full at max_running requests (beyond that they wait in its queue): that is its autoscaling target."""
    if config.max_replicas is None:
        return {"num_replicas": config.num_replicas}
    low = config.min_replicas or 1
    return {"autoscaling_config": {
        "min_replicas": low, "initial_replicas": min(max(config.num_replicas, low), config.max_replicas),
        "max_replicas": config.max_replicas, "target_ongoing_requests": config.max_running}}


def ingress_options(config: EngineConfig) -> dict:
    """A fixed number of ingress replicas, or autoscaling up to ingress_max_replicas. Every stream of every engine
    replica passes through an ingress replica (detokenizing and SSE framing per chunk), so it scales with the
    streams it carries: a replica is full at INGRESS_TARGET_STREAMS ongoing requests."""
    if config.ingress_max_replicas is None:
        return {"num_replicas": config.ingress_replicas}
    return {"autoscaling_config": {"min_replicas": 1, "initial_replicas": config.ingress_replicas,
                                   "max_replicas": config.ingress_max_replicas,
                                   "target_ongoing_requests": INGRESS_TARGET_STREAMS}}


def build_app(args: dict | None = None):
    """Serve application builder (`import_path: minedraft_ray.serve.app:build_app`).

    args: EngineConfig fields. The API key comes from MINEDRAFT_API_KEY where the builder runs; only its
    SHA-256 travels to the ingress replica."""
    return build_app_with_key(args, os.environ.get(API_KEY_ENV) or None)


def build_app_with_key(args: dict | None, api_key: str | None):
    # here, not at the top: the ingress replicas import this module, and they run no batch manager
    from .engine_replica import EngineServer

    config = load_config(args)
    check_ingress_http(config.ingress_http)
    # materialise random:<preset> folders and fetch Hub ids before the replicas race (and fail here, clearly)
    target, _ = model_dirs(config)
    tokenizer = load_tokenizer(target)
    tokenizer_class = tokenizer_class_path(tokenizer)   # AutoTokenizer's choice, found once here
    vocab_limit = shared_vocab(config, tokenizer)   # an incompatible draft fails here, not in every engine replica
    if config.chat_template:   # the text travels, not a path that may exist only here
        config = config.model_copy(update={"chat_template": load_chat_template(config.chat_template)})
    hub_env = hub_env_vars()
    bundles = make_bundles(config.mode, tp=config.tp)
    engine = EngineServer.options(
        placement_group_bundles=bundles, placement_group_strategy=STRATEGY,
        ray_actor_options={"num_cpus": bundles[0].get("CPU", 0), **hub_env}, **serve_limits(config),
        **replica_options(config), health_check_period_s=config.health_check_period_s,
        graceful_shutdown_timeout_s=config.graceful_shutdown_s, graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
    ).bind(config.model_dump(), vocab_limit)
    key_hash = hashlib.sha256(api_key.encode()).hexdigest() if api_key else None
    replicas = config.max_replicas or config.num_replicas
    # the ingress outlives the engines' grace period: streams still running when the engines stop end with a
    # finish_reason and an error event it sends, not cut off
    return OpenAIServer.options(ray_actor_options={"num_cpus": config.ingress_cpus, **hub_env},
                                **ingress_limits(config, replicas), **ingress_options(config),
                                graceful_shutdown_timeout_s=config.graceful_shutdown_s + SHUTDOWN_RELAY_S,
                                graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S).bind(
        engine, config.model_dump(), key_hash, tokenizer_class)
