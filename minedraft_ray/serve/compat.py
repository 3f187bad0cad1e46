"""HTTP conveniences that OpenAI and vLLM clients expect: request ids, CORS, a client that goes away ending its
request quietly, and a quiet log of ignored fields.

The CORS middleware is a plain ASGI class added to the module-level FastAPI app. Serve pickles that app when the
ingress class is defined, before any configuration exists, so the middleware reads its origins from this module
at the first request; `configure_cors` sets them in the ingress replica's process.
"""
from __future__ import annotations

import logging
import re
import threading
import uuid

from ray.exceptions import TaskCancelledError
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("minedraft.serve")

REQUEST_ID_HEADER = "x-request-id"
# what may go into engine request ids and logs as is; other ids are replaced there by a generated one
_PLAIN_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")


def request_id_of(scope: Scope) -> str:
    """The request's X-Request-Id. Serve's proxy puts one on every request (the client's, or one it generates)
    and returns it in the response headers, errors included; generated here only outside Serve."""
    sent = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
    return sent or uuid.uuid4().hex


def engine_request_base(request_id: str, taken) -> str:
    """The base of the engine's ids of a request's choices ("<base>-<index>"): the request id (an operator
    finds the engine request from the header alone), made unique where `taken(base)` says it is in use (the
    engine keys requests by id, and clients may reuse theirs) or replaced where it is no plain token."""
    base = request_id if _PLAIN_ID.fullmatch(request_id) else uuid.uuid4().hex
    return base if not taken(base) else f"{base}-{uuid.uuid4().hex[:8]}"


_cors_origins: list[str] = []


def configure_cors(origins: list[str]) -> None:
    """Origins allowed to call the API from a browser (EngineConfig.cors_allow_origins); empty: CORS off."""
    _cors_origins[:] = origins


class ConfiguredCORSMiddleware:
    """Starlette's CORSMiddleware with the configured origins, built at the first request; a pass-through while
    no origin is configured (the default: browsers on other origins get no CORS headers). Preflight requests
    (OPTIONS) are answered here, before the API key is checked: browsers send them without credentials."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self._cors: ASGIApp | None = None
        self._origins: tuple[str, ...] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origins = tuple(_cors_origins)
        if not origins:
            return await self.app(scope, receive, send)
        if origins != self._origins:
            self._cors = CORSMiddleware(self.app, allow_origins=list(origins), allow_methods=["*"],
                                        allow_headers=["*"], expose_headers=[REQUEST_ID_HEADER])
            self._origins = origins
        await self._cors(scope, receive, send)


class ClientGoneAsDisconnect:
    """A client that goes away reaches the app as `http.disconnect`, through Serve's proxy too.

    When a client disconnects, Serve's proxy cancels the replica's pending call for the next request message, and
    Serve's receive() raises that TaskCancelledError instead of returning the disconnect (it returns one only when
    the proxy has already forgotten the request). Raised inside a streaming response, after its headers, it fails
    the request with a traceback in the replica's log, although nothing failed. As a disconnect, the response ends
    as it does for every other client that leaves, and the stream's own cleanup aborts the engine request."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def receive_or_disconnect():
            try:
                return await receive()
            except TaskCancelledError:
                return {"type": "http.disconnect"}

        await self.app(scope, receive_or_disconnect, send)


class IgnoredFields:
    """Request fields accepted and ignored: each name is logged once per process and counted every time.

    Field names come from clients, so at most `max_names` distinct names get their own log line and metric
    label; later new names, and names that are not plain identifiers, are counted as "other"."""

    def __init__(self, counter=None, max_names: int = 64):
        self.counter = counter   # a prometheus_client Counter labelled (endpoint, field), or None
        self.max_names = max_names
        self._named: set[str] = set()
        self._lock = threading.Lock()

    def note(self, endpoint: str, names: list[str]) -> None:
        for name in names:
            label, first = self._label(name)
            if first:
                log.warning("%s: accepted and ignored the field %r (logged once per process; counted in "
                            "minedraft_api_ignored_fields_total)", endpoint, name)
            if self.counter is not None:
                self.counter.labels(endpoint=endpoint, field=label).inc()

    def _label(self, name: str) -> tuple[str, bool]:
        with self._lock:
            if name in self._named:
                return name, False
            if len(self._named) < self.max_names and _FIELD_NAME.fullmatch(name):
                self._named.add(name)
                return name, True
            return "other", False


_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,63}")
