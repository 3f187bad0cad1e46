"""Ingress guard in Serve's HTTP proxy: body limit, header and body read timeouts, OpenAI-style errors.

Serve's proxy hands a request to the ingress replica as soon as its headers arrive; the replica then pulls
the body from the proxy. A client that trickles its body would hold one of the replica's
max_ongoing_requests slots the whole time, and enough of them starve every route (/health included). This
guard runs in the proxy, in front of Serve's router (Serve's proxy callback hook,
RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH): it reads the whole body first, within body_timeout_s and
max_body_bytes, so only complete requests reach a replica. It also closes connections whose request
headers do not arrive within header_timeout_s (uvicorn has no such timeout), and turns the plain-text
408/429/503 that Serve's proxy itself answers (backpressure, timeouts) into OpenAI's error JSON with
Retry-After.

The proxy reads the hook and the limits from its own environment (MINEDRAFT_MAX_BODY_BYTES,
MINEDRAFT_BODY_TIMEOUT_S, MINEDRAFT_HEADER_TIMEOUT_S): `guard_environ()` gives the variables for a Ray
instance or cluster. The ingress replica checks the body limit and timeout again (serve/app.py), so a
deployment without the hook is still bounded, only with slots held meanwhile.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

log = logging.getLogger("minedraft.serve")

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "minedraft_ray.serve.guard:proxy_middlewares"
RETRY_AFTER_S = 1   # seconds (429, 503): overload and engine restarts clear within seconds


def error_json(status: int, message: str, type: str, code: str | None = None) -> tuple[bytes, list]:
    body = json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status in (429, 503):
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    if status in (408, 413):   # the rest of the request is not read: the connection cannot be reused
        headers.append((b"connection", b"close"))
    return body, headers


@dataclass(frozen=True)
class IngressLimits:
    max_body_bytes: int
    body_timeout_s: float
    header_timeout_s: float

    @classmethod
    def from_config(cls, config) -> "IngressLimits":
        return cls(config.max_body_bytes, config.body_timeout_s, config.header_timeout_s)

    @classmethod
    def from_env(cls) -> "IngressLimits":
        from ..config import EngineConfig

        return cls.from_config(EngineConfig.from_env())


def guard_environ(limits: IngressLimits) -> dict[str, str]:
    """What a Ray instance's processes need in their environment for the proxy to run the guard."""
    return {PROXY_CALLBACK_ENV: PROXY_CALLBACK, "MINEDRAFT_MAX_BODY_BYTES": str(limits.max_body_bytes),
            "MINEDRAFT_BODY_TIMEOUT_S": str(limits.body_timeout_s),
            "MINEDRAFT_HEADER_TIMEOUT_S": str(limits.header_timeout_s)}


class BodyTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    pass


async def read_body(receive, max_bytes: int, timeout_s: float) -> tuple[bytes, bool]:
    """The whole request body from an ASGI receive, or BodyTooLarge / BodyTimeout. Returns (body,
    disconnected)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    chunks, size = [], 0
    while True:
        try:
            message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
        except asyncio.TimeoutError:
            raise BodyTimeout from None
        if message["type"] == "http.disconnect":
            return b"", True
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), False


def declared_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def too_large_message(limit: int) -> str:
    return f"The request body exceeds this server's limit of {limit} bytes."


def timeout_message(timeout_s: float) -> str:
    return f"The request body did not arrive within {timeout_s:g} s."


class ProxyGuard:
    """Pure ASGI middleware for Serve's proxy app (see the module docstring)."""

    def __init__(self, app, limits: IngressLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limits.max_body_bytes
        if (declared_length(scope) or 0) > limit:
            return await self._error(send, 413, too_large_message(limit), "invalid_request_error",
                                     "request_too_large")
        try:
            body, disconnected = await read_body(receive, limit, self.limits.body_timeout_s)
        except BodyTooLarge:
            return await self._error(send, 413, too_large_message(limit), "invalid_request_error",
                                     "request_too_large")
        except BodyTimeout:
            log.info("closed a connection whose request body did not arrive in %g s", self.limits.body_timeout_s)
            return await self._error(send, 408, timeout_message(self.limits.body_timeout_s),
                                     "invalid_request_error", "request_timeout")
        if disconnected:
            return None
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()   # then only the disconnect, which Serve's proxy watches for

        await self.app(scope, replay, self._openai_errors(send))

    @staticmethod
    async def _error(send, status: int, message: str, type: str, code: str) -> None:
        body, headers = error_json(status, message, type, code)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    def _openai_errors(send):
        """Serve's own plain-text 408/429/503 (backpressure, request timeout) as OpenAI error JSON."""
        replacing = False

        async def wrapped(message):
            nonlocal replacing
            if message["type"] == "http.response.start" and message["status"] in (408, 429, 503):
                types = [v for k, v in message.get("headers", ()) if k.lower() == b"content-type"]
                if not types or types[0].startswith(b"text/plain"):
                    replacing = True
                    status = message["status"]
                    text = ("The server is overloaded. Retry later." if status != 408
                            else "The request timed out.")
                    kind = "server_error" if status == 503 else (
                        "rate_limit_error" if status == 429 else "invalid_request_error")
                    code = {503: "overloaded", 429: "queue_full", 408: "request_timeout"}[status]
                    body, headers = error_json(status, text, kind, code)
                    await send({"type": "http.response.start", "status": status, "headers": headers})
                    await send({"type": "http.response.body", "body": body})
                    return None
            if replacing:   # Serve's own body for the replaced response: dropped
                return None
            return await send(message)
        return wrapped


def limit_header_time(timeout_s: float) -> None:
    """Close connections whose request headers take longer than timeout_s (slowloris). uvicorn has no such
    timeout: its httptools protocol gets a timer from the first byte of each request (and from the
    connection's start) to its headers' end."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    if getattr(HttpToolsProtocol, "_minedraft_header_timeout", None) is not None:
        HttpToolsProtocol._minedraft_header_timeout = timeout_s
        return
    HttpToolsProtocol._minedraft_header_timeout = timeout_s
    connection_made, on_message_begin = HttpToolsProtocol.connection_made, HttpToolsProtocol.on_message_begin
    on_headers_complete, connection_lost = HttpToolsProtocol.on_headers_complete, HttpToolsProtocol.connection_lost

    def arm(self):
        timer = getattr(self, "_minedraft_header_timer", None)
        if timer is not None:
            timer.cancel()
        self._minedraft_header_timer = self.loop.call_later(self._minedraft_header_timeout, self.transport.close)

    def disarm(self):
        timer = getattr(self, "_minedraft_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._minedraft_header_timer = None

    def patched_connection_made(self, transport):
        connection_made(self, transport)
        arm(self)

    def patched_on_message_begin(self):
        on_message_begin(self)
        if getattr(self, "_minedraft_header_timer", None) is None:
            arm(self)

    def patched_on_headers_complete(self):
        disarm(self)
        on_headers_complete(self)

    def patched_connection_lost(self, exc):
        disarm(self)
        connection_lost(self, exc)

    HttpToolsProtocol.connection_made = patched_connection_made
    HttpToolsProtocol.on_message_begin = patched_on_message_begin
    HttpToolsProtocol.on_headers_complete = patched_on_headers_complete
    HttpToolsProtocol.connection_lost = patched_connection_lost


def proxy_middlewares():
    """Serve's proxy callback (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH): runs in each proxy actor before
    its HTTP server starts."""
    from starlette.middleware import Middleware

    limits = IngressLimits.from_env()
    limit_header_time(limits.header_timeout_s)
    log.info("minedraft ingress guard: body <= %d bytes within %g s, headers within %g s", limits.max_body_bytes,
             limits.body_timeout_s, limits.header_timeout_s)
    return [Middleware(ProxyGuard, limits=limits)]



def bind_replica_grpc_to_node_ip() -> None:
    """Called by this app's replica constructors, which run before Serve starts the replica's
    inter-deployment gRPC server. Serve binds that server on every interface ("[::]:0", fixed in Ray 2.58);
    bind it on the node's own address instead: 127.0.0.1 on a private instance, the address the other nodes
    use on a cluster."""
    import ray
    from ray.serve._private import replica

    node_ip = ray.util.get_node_ip_address()
    add_port = replica.add_port_to_grpc_server
    if getattr(add_port, "_minedraft_node_ip", None) is not None:
        return

    def add_port_on_node_ip(server, address):
        if address.startswith("[::]:"):
            host = f"[{node_ip}]" if ":" in node_ip else node_ip
            address = f"{host}:{address.rsplit(':', 1)[1]}"
        return add_port(server, address)

    add_port_on_node_ip._minedraft_node_ip = node_ip
    replica.add_port_to_grpc_server = add_port_on_node_ip
