"""How clients reach the OpenAI ingress: through Serve's HTTP proxy, or at the ingress replicas themselves (Serve's
direct ingress), `ingress_http` in the settings.

proxy: Serve's proxy process takes every connection and hands each request to an ingress replica through a handle;
the replica fetches the request's body from the proxy (an actor call per request) and sends every chunk of every
stream back to the proxy as a Ray streaming item, which the proxy writes to the socket. At a few hundred streams one
proxy process does as much work as the ingress replicas behind it, and its event loop's turns add to every chunk's
gap.

direct (Ray 2.58's RAY_SERVE_ENABLE_DIRECT_INGRESS, marked experimental there): each ingress replica runs its own HTTP
server (uvicorn, with the ingress guard of serve/guard.py in front, as in the proxy) on a port of its own, on
Serve's HTTP host, and a chunk goes from the replica's event loop to its socket. Serve still starts one proxy, on
the head node, which serves the same app through handles; clients do not need it. With several ingress replicas
there are as many URLs: clients (or a load balancer) spread over them, Serve does not.

It is a setting of the Ray instance, not of an application: the Serve controller and every replica read it when they
import Ray. `minedraft serve` sets it on the private instance it starts (`direct_ingress_environ`); a cluster
needs it in the environment of `ray start` on every node (docs/deploy.md).
"""
from __future__ import annotations

import os
import time

DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
INGRESS_DEPLOYMENT = "OpenAIServer"


def direct_ingress_environ(port: int, replicas: int) -> dict[str, str]:
    """What a private Ray instance's environment needs for its ingress replicas to serve HTTP on ports `port`,
    `port` + 1, ... (one each, the lowest free port first; twice as many as `replicas`, so replacements started
    while old ones stop find one)."""
    return {DIRECT_INGRESS_ENV: "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 2 * replicas),
            # no load balancer has to take a stopping replica out of rotation: stop as soon as its requests end
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
            # a replacement replica takes the port of the one it replaces, so the URLs stay the same
            "RAY_SERVE_PORT_QUARANTINE_S": "0"}


def direct_ingress_on(environ=os.environ) -> bool:
    """Whether Ray processes started with this environment run direct ingress."""
    return environ.get(DIRECT_INGRESS_ENV) == "1"


def private_instance_runs_direct(config) -> bool:
    """Whether a Ray instance started for `config` (`minedraft serve`, the benchmarks) runs direct ingress: when
    asked, and by default (auto) for a single fixed ingress replica, whose one URL is then the API's; several ingress
    replicas keep Serve's proxy by default, the one URL that spreads the clients over them."""
    if config.ingress_http == "auto":
        return config.ingress_replicas == 1 and config.ingress_max_replicas is None
    return config.ingress_http == "direct"


def check_ingress_http(ingress_http: str, environ=os.environ) -> None:
    """`ingress_http: direct` in an environment whose Ray does not run direct ingress: a clear error, not an app that
    answers only through the proxy. (auto takes what the instance runs.)"""
    if ingress_http == "direct" and not direct_ingress_on(environ):
        raise ValueError(f"ingress_http: direct needs a Ray instance started with {DIRECT_INGRESS_ENV}=1 (every "
                         "node's `ray start`; `minedraft serve` sets it on its own instance); or ingress_http: proxy")


def ingress_urls(app_name: str, replicas: int, timeout_s: float = 30.0) -> list[str]:
    """Base URLs of a running app (Serve connected): each ingress replica's own when the instance runs direct
    ingress (the app's targets are then its ingress replicas), else Serve's proxy."""
    from ray import serve
    from ray.serve.schema import ServeInstanceDetails

    client = serve.context._get_global_client()
    proxy = [f"http://{_url_host(client.http_config.host)}:{client.http_config.port}"]
    deadline = time.monotonic() + timeout_s
    while True:
        details = ServeInstanceDetails(**client.get_serve_details())
        replicas_at = sorted({(t.ip, t.port) for g in details.target_groups if g.app_name == app_name
                              and g.protocol == "HTTP" for t in g.targets if INGRESS_DEPLOYMENT in t.name},
                             key=lambda target: target[1])
        if len(replicas_at) >= replicas:
            return [f"http://{_url_host(ip)}:{port}" for ip, port in replicas_at]
        if details.target_groups and not any(INGRESS_DEPLOYMENT in t.name for g in details.target_groups
                                             for t in g.targets):   # every way in is a proxy
            return proxy
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(replicas_at)} of the app's {replicas} ingress replicas have an HTTP port after "
                               f"{timeout_s:g} s")
        time.sleep(0.5)


def _url_host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip
