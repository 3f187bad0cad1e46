"""`minedraft`: serve the OpenAI-compatible API, generate offline, run benchmarks.

Engine flags map 1:1 onto `EngineConfig` fields (--max-batch is max_batch, ...). Settings are read from
MINEDRAFT_<FIELD> environment variables first, then flags on top; everything validates through
EngineConfig, like the `args` of a Serve config file. With no flags the default model pair is served.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import typing
from pathlib import Path

from pydantic.fields import FieldInfo

from .config import EngineConfig

EXAMPLES = """\
examples:
  minedraft serve                                   # default pair, http://127.0.0.1:8000/v1
  minedraft serve --target T --draft D --mode psd --k 4 --max-batch 32 --port 8001
  MINEDRAFT_API_KEY=secret minedraft serve --host 0.0.0.0
  minedraft generate "def fibonacci(n):" --max-tokens 64 --temperature 0
  minedraft bench psd_vs_sd --smoke                 # python -m bench.psd_vs_sd --smoke
  serve run deployments/minedraft.yaml              # the same app from a Serve config file
  minedraft grafana push --url http://grafana:3000 --token $GRAFANA_TOKEN   # provision the dashboard

Every engine flag can also be set as MINEDRAFT_<FIELD> (e.g. MINEDRAFT_MAX_BATCH=32); flags win.
MINEDRAFT_API_KEY, when set, makes the API require 'Authorization: Bearer <key>' (all but /health).
A private Ray instance listens on 127.0.0.1 only, with Ray token authentication (docs/security.md).
"""


# ---------------------------------------------------------------- EngineConfig <-> flags

def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_optional(annotation) -> bool:
    return type(None) in typing.get_args(annotation)


def _choices(annotation):
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is typing.Literal:
            return list(typing.get_args(arg))
    return None


def _help(name: str, field: FieldInfo) -> str:
    text = field.description or name.replace("_", " ")
    if field.default_factory is not None:
        default = "the embedded default pair (the tiny test pair until it is installed)"
    else:
        default = field.default
    if default is not None:
        text += f" (default: {default})"
    if _is_optional(field.annotation):
        text += "; 'none' unsets it"
    return text.replace("%", "%%")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (EngineConfig fields; also MINEDRAFT_<FIELD>)")
    for name, field in EngineConfig.model_fields.items():
        if field.annotation is bool:
            group.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=_help(name, field))
        else:
            group.add_argument(_flag(name), dest=name, default=None, choices=_choices(field.annotation),
                               metavar=None if _choices(field.annotation) else name.upper(), help=_help(name, field))


def engine_overrides(ns: argparse.Namespace) -> dict:
    """The engine flags that were given, as EngineConfig field values (None for 'none' on optional fields)."""
    overrides = {}
    for name, field in EngineConfig.model_fields.items():
        value = getattr(ns, name, None)
        if value is None:
            continue
        if _is_optional(field.annotation) and isinstance(value, str) and value.lower() in ("none", "null"):
            value = None
        overrides[name] = value
    return overrides


def load_engine_config(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[EngineConfig, dict]:
    from .serve.app import load_config

    overrides = engine_overrides(ns)
    try:
        return load_config(overrides), overrides
    except ValueError as e:
        parser.error(str(e))


# ---------------------------------------------------------------- Ray

def add_ray_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ray")
    group.add_argument("--address", default=None,
                       help="join this Ray cluster (e.g. 127.0.0.1:6379); default: start a private local one")
    group.add_argument("--temp-dir", default=None, help="temp dir of a private Ray instance (default: Ray's)")
    group.add_argument("--num-cpus", type=float, default=None, help="CPUs of a private Ray instance")
    group.add_argument("--num-gpus", type=int, default=None,
                       help="GPUs of a private Ray instance (logical ones work on CPU machines)")


def lock_down_ray(ns: argparse.Namespace) -> None:
    """Before anything imports Ray: a private instance gets loopback-only listeners and token authentication
    (Ray reads both at import). Joining --address leaves the cluster's own settings alone."""
    if not ns.address:
        from .ray_local import lock_down
        lock_down()


def start_ray(ns: argparse.Namespace, dashboard: bool = False):
    """A private local Ray instance, or the cluster at --address; never a plain ray.init(), which attaches
    silently to whatever cluster the default temp dir names."""
    import ray

    if ns.address:
        return ray.init(address=ns.address, log_to_driver=False)
    from .ray_local import start_local_ray

    kwargs = {"num_cpus": ns.num_cpus, "num_gpus": ns.num_gpus, "_temp_dir": ns.temp_dir}
    if dashboard:   # on 127.0.0.1 unless asked: it runs jobs for whoever holds the token
        kwargs.update(dashboard_host=ns.dashboard_host, dashboard_port=ns.dashboard_port)
    return start_local_ray(include_dashboard=dashboard, log_to_driver=False,
                           **{k: v for k, v in kwargs.items() if v is not None})


# ---------------------------------------------------------------- commands

def cmd_serve(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    lock_down_ray(ns)
    config, overrides = load_engine_config(ns, parser)   # fail on bad flags before starting anything
    import ray
    from ray import serve

    from .serve.app import API_KEY_ENV, build_app_with_key, http_options
    from .serve.ingress_http import direct_ingress_environ, ingress_urls, private_instance_runs_direct

    # the key leaves this process's environment before Ray starts: Ray's processes (and any job they run)
    # inherit it; only its SHA-256 travels to the ingress replica
    api_key = os.environ.pop(API_KEY_ENV, None) or None
    direct = not ns.address and private_instance_runs_direct(config)
    if not ns.address:   # a private instance: its Serve proxy (or ingress replicas) run the ingress guard
        from .serve.guard import IngressLimits, guard_environ
        os.environ.update(guard_environ(IngressLimits.from_config(config)))
    if direct:   # the ingress replicas serve HTTP from --port on: taken already, say so now
        try:
            free_port(ns.host, ns.port)
        except OSError as e:
            parser.error(f"--port {ns.port} on {ns.host}: {e.strerror}")
        os.environ.update(direct_ingress_environ(ns.port, config.ingress_max_replicas or config.ingress_replicas))
    context = start_ray(ns, dashboard=not ns.no_dashboard)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        # under direct ingress Serve still starts a proxy (on the head node): off --port, which is the replicas'
        proxy_port = free_port(ns.host) if direct else ns.port
        serve.start(http_options=http_options(config, host=ns.host, port=proxy_port))
        serve.run(build_app_with_key(overrides, api_key), name=ns.app_name, route_prefix="/")
        urls = ingress_urls(ns.app_name, config.ingress_replicas)
        url = urls[0]
        dashboard = getattr(context, "dashboard_url", None)
        print(f"minedraft: serving '{config.served_model_name}' ({config.mode}, k={config.k}, "
              f"max_batch={config.max_batch})", flush=True)
        print(f"minedraft: API       {url}/v1  (health: {url}/health)", flush=True)
        for other in urls[1:]:
            print(f"minedraft: API       {other}/v1  (another ingress replica: spread clients over them)", flush=True)
        print(f"minedraft: dashboard {'http://' + dashboard if dashboard else 'off'}", flush=True)
        if not ns.address and os.environ.get("RAY_AUTH_TOKEN_PATH"):
            print(f"minedraft: Ray token {os.environ['RAY_AUTH_TOKEN_PATH']}  (Ray token authentication: "
                  "RAY_AUTH_TOKEN_PATH=<that file> ray job list ...)", flush=True)
        if api_key is None and ns.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"minedraft: WARNING: the API on {ns.host} has no key; set {API_KEY_ENV}", flush=True)
        print("minedraft: Ctrl-C to stop", flush=True)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        print("minedraft: shutting down", flush=True)
        if ns.address:   # a shared cluster: remove only our application
            serve.delete(ns.app_name)
        else:
            serve.shutdown()
        ray.shutdown()
    return 0


def free_port(host: str, port: int = 0) -> int:
    """`port` on `host` if it is free (OSError if not), or any free one."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, port))
        return s.getsockname()[1]


def cmd_generate(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    lock_down_ray(ns)
    config, _ = load_engine_config(ns, parser)
    from . import LLM, SamplingParams

    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, max_tokens=ns.max_tokens,
                            seed=ns.seed, ignore_eos=ns.ignore_eos)
    try:
        params.validate()
    except ValueError as e:
        parser.error(str(e))
    import ray

    start_ray(ns)
    llm = LLM(config=config)
    try:
        prompts = ns.prompts
        if ns.chat:
            prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                         tokenize=False) for p in prompts]
            prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        for i, out in enumerate(llm.generate(prompts, params)):
            s = out.stats or {}
            print(f"=== {i}: {ns.prompts[i]!r}")
            print(out.text)
            print(f"--- {len(out.token_ids)} tokens, finish_reason={out.finish_reason}, "
                  f"acceptance_rate={s.get('acceptance_rate', 0):.3f}, "
                  f"acceptance_length={s.get('acceptance_length', 1):.3f}, "
                  f"verify_steps={s.get('verify_steps', 0)}, latency={s.get('latency') or 0:.3f}s", flush=True)
    finally:
        llm.shutdown()
        ray.shutdown()
    return 0


def bench_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "bench"


def cmd_bench(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    folder = bench_dir()
    names = sorted(p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "common"))
    if not folder.is_dir():
        parser.error(f"no bench/ folder next to the package ({folder}): run from a source checkout")
    if ns.name is None or ns.name not in names:
        if ns.name is not None:
            print(f"minedraft bench: unknown benchmark {ns.name!r}", file=sys.stderr)
        print("benchmarks: " + ", ".join(names) + "   (minedraft bench NAME --help)")
        return 0 if ns.name is None else 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder.parent), env.get("PYTHONPATH")]))
    return subprocess.call([sys.executable, "-m", f"bench.{ns.name}", *ns.args], env=env)


# ---------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minedraft", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="MineDraft batch-parallel speculative decoding on Ray: an OpenAI-compatible server, "
                    "offline generation and benchmarks.")
    sub = parser.add_subparsers(dest="command", metavar="{serve,generate,bench,grafana}")

    serve = sub.add_parser("serve", help="deploy the OpenAI-compatible API on Ray Serve and block until Ctrl-C",
                           formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
                           description="Start a private Ray instance (or join --address), deploy the API "
                                       "(/v1/completions, /v1/chat/completions, /v1/models, /health), print its URL "
                                       "and the dashboard URL, and serve until Ctrl-C or SIGTERM.")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    serve.add_argument("--app-name", default="minedraft", help="Serve application name (default: minedraft)")
    serve.add_argument("--dashboard-host", default="127.0.0.1",
                       help="Ray dashboard bind address (default: 127.0.0.1; it accepts jobs from token holders)")
    serve.add_argument("--dashboard-port", type=int, default=8265, help="Ray dashboard port (default: 8265)")
    serve.add_argument("--no-dashboard", action="store_true", help="start the private Ray instance without it")
    add_ray_flags(serve)
    add_engine_flags(serve)
    serve.set_defaults(func=cmd_serve, parser=serve)

    gen = sub.add_parser("generate", help="offline generation with minedraft_ray.LLM; prints texts and stats",
                         description="Generate for the given prompts with the Ray runtime (no HTTP) and print each "
                                     "text with its speculative-decoding stats.")
    gen.add_argument("prompts", nargs="+", help="prompt texts")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user message")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true", help="generate max_tokens tokens regardless of EOS")
    add_ray_flags(gen)
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate, parser=gen)

    bench = sub.add_parser("bench", help="run a benchmark: python -m bench.NAME [ARGS...]",
                           description="Run one of the scripts in bench/ (from a source checkout) with the given "
                                       "arguments. Without NAME, list them.")
    bench.add_argument("name", nargs="?", help="benchmark module in bench/")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    bench.set_defaults(func=cmd_bench, parser=bench)
    from .observability.grafana import add_grafana_commands
    add_grafana_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return 2
    return ns.func(ns, ns.parser)


if __name__ == "__main__":
    sys.exit(main())
