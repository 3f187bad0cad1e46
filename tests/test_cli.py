"""The `minedraft` CLI and the Serve config file: flags <-> EngineConfig, and real end-to-end runs: `minedraft
serve` against its own private Ray instance (killed by its process group), `minedraft generate` and `serve run` of
the YAML joining the session's cluster (--address)."""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from minedraft_ray.cli import build_parser, engine_overrides, main
from minedraft_ray.config import EngineConfig
from minedraft_ray.serve.app import load_config, serve_limits

REPO = Path(__file__).resolve().parent.parent
MINEDRAFT = str(Path(sys.executable).parent / "minedraft")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- flags and settings

def test_help_explains_every_command_and_field(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    top = capsys.readouterr().out
    assert all(cmd in top for cmd in ("serve", "generate", "bench", "MINEDRAFT_API_KEY"))
    for command in ("serve", "generate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        for name in EngineConfig.model_fields:
            assert "--" + name.replace("_", "-") in text, (command, name)


def test_flags_map_one_to_one_onto_engine_config(monkeypatch):
    monkeypatch.setenv("MINEDRAFT_MAX_QUEUED", "7")
    monkeypatch.setenv("MINEDRAFT_K", "5")
    ns = build_parser().parse_args(["serve", "--mode", "ar", "--draft", "none", "--k", "2", "--max-batch", "3",
                                    "--no-cuda-graphs", "--step-timeout-s", "5.5", "--device", "cpu", "--tp", "2"])
    overrides = engine_overrides(ns)
    assert overrides == {"draft": None, "mode": "ar", "k": "2", "max_batch": "3", "device": "cpu",
                         "cuda_graphs": False, "step_timeout_s": "5.5", "tp": "2"}
    config = load_config(overrides)
    assert (config.mode, config.draft, config.k, config.max_batch, config.cuda_graphs, config.step_timeout_s,
            config.max_queued, config.tp) == ("ar", None, 2, 3, False, 5.5, 7, 2)   # flags win over MINEDRAFT_*, env fills in


def test_bad_settings_fail_clearly(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--k", "99"])
    assert e.value.code == 2 and "k: Input should be less than or equal to 8" in capsys.readouterr().err
    with pytest.raises(ValueError, match="mdoe"):
        load_config({"mdoe": "psd"})     # a Serve YAML typo
    with pytest.raises(ValueError, match="needs a draft model"):
        load_config({"mode": "psd", "draft": None})


def test_serve_limits_follow_the_engine():
    config = EngineConfig(max_batch=16, max_queued=100, mode="psd")
    limits = serve_limits(config)
    assert limits["max_ongoing_requests"] >= 2 * 16 + 100 and limits["max_queued_requests"] > 0


def test_embedded_default_pair_is_the_default():
    config = EngineConfig()
    assert Path(config.target, "config.json").is_file() and Path(config.draft, "model.safetensors").is_file()
    assert config.served_model_name == "minedraft-default"


def test_bench_runs_the_bench_module(capsys):
    assert main(["bench"]) == 0
    assert "psd_vs_sd" in capsys.readouterr().out
    out = subprocess.run([MINEDRAFT, "bench", "plot", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout


# ---------------------------------------------------------------- real runs (own Ray, own process group)

@pytest.fixture(scope="module")
def run_env(tmp_path_factory):
    """Environment for commands that start their own Ray: short private temp dir, own model cache."""
    ray_tmp = tempfile.mkdtemp(prefix="mdcli-", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "MINEDRAFT_CACHE": str(tmp_path_factory.mktemp("cache")), "PYTHONUNBUFFERED": "1"}
    for name in list(env):
        if name.startswith("MINEDRAFT_") and name not in ("MINEDRAFT_CACHE",) or name == "RAY_ADDRESS":
            env.pop(name)
    yield env
    subprocess.run(["rm", "-rf", ray_tmp])


def _default_sigint() -> None:
    # a test run started in the background (`cmd &` in a script) ignores SIGINT, and children inherit that,
    # so the Ctrl-C these tests send would be ignored: give the command the default disposition back
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Command:
    """A command in its own session, so that it and the Ray processes it starts can be ended as a group."""

    def __init__(self, args, env, log: Path):
        self.log = log
        self.proc = subprocess.Popen(args, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=REPO, preexec_fn=_default_sigint)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = self.output()
            if text in out:
                return out
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise AssertionError(f"{text!r} did not appear; output:\n{self.output()[-4000:]}")

    def interrupt(self, timeout: float = 90) -> int:
        """Ctrl-C, then the whole process group if it does not exit in time."""
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"no clean exit after Ctrl-C; output:\n{self.output()[-4000:]}") from None
        finally:
            with_leftovers = subprocess.run(["pgrep", "-g", str(self.proc.pid)], capture_output=True, text=True)
            if with_leftovers.stdout.strip():
                os.killpg(self.proc.pid, signal.SIGKILL)


def wait_ready(url: str, cmd: Command, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if "failed with exception" in cmd.output() or cmd.proc.poll() is not None:
            break
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} did not become healthy; output:\n{cmd.output()[-4000:]}")


def default_model_name(run_env) -> str:
    """What `EngineConfig()` serves: the embedded pair."""
    return EngineConfig().served_model_name


@dataclass
class Served:
    cmd: "Command"
    out: str
    urls: list[str]
    dashboard_port: int


KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(run_env, tmp_path_factory):
    """One `minedraft serve` for the tests below (suite time: one private Ray start for them all): no engine
    flags (the embedded default pair, as `make serve` runs it), an API key, and two ingress replicas serving HTTP
    directly (`--ingress-http direct`: on --port and the next port, on 127.0.0.1 like every other listener of the
    instance, Serve's remaining proxy too, on a port of its own)."""
    import re

    port, dashboard_port = free_port(), free_port()
    cmd = Command([MINEDRAFT, "serve", "--port", str(port), "--dashboard-port", str(dashboard_port),
                   "--ingress-http", "direct", "--ingress-replicas", "2", "--header-timeout-s", "2"],
                  {**run_env, "MINEDRAFT_API_KEY": KEY}, tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        out = cmd.wait_for("Ctrl-C to stop", timeout=300)
        urls = re.findall(r"API\s+(http://\S+)/v1", out)
        assert urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"], out[-2000:]
        assert f"http://127.0.0.1:{dashboard_port}" in out
        yield Served(cmd, out, urls, dashboard_port)
    finally:
        cmd.interrupt()   # a no-op signal where it has exited (the Ctrl-C test, or on its own); its group is killed


def test_minedraft_serve_is_locked_down(served):
    check_locked_down(served.cmd, served.out, served.dashboard_port)


def test_minedraft_serve_with_no_engine_flags_serves_the_default_pair(served, run_env):
    model = default_model_name(run_env)
    url = served.urls[0]
    models = requests.get(url + "/v1/models", headers=AUTH, timeout=30).json()
    assert [m["id"] for m in models["data"]] == [model]
    r = requests.post(url + "/v1/completions", timeout=120, headers=AUTH,
                      json={"model": model, "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0,
                            "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    # no max_tokens: up to the engine's context limit (which may be below the config's max_len), from a prompt
    # that leaves a few tokens of it, so the run is short
    limit = models["data"][0]["max_model_len"]
    messages = [{"role": "user", "content": content_of_tokens(limit - 8)}]
    chat = requests.post(url + "/v1/chat/completions", timeout=120, headers=AUTH,
                         json={"model": model, "messages": messages})
    assert chat.status_code == 200, chat.text
    usage = chat.json()["usage"]
    assert chat.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert limit - 16 < usage["prompt_tokens"] and usage["prompt_tokens"] + usage["completion_tokens"] <= limit


def test_minedraft_serve_with_direct_ingress(served, run_env):
    """Each ingress replica serves HTTP itself: its port is held by the replica, not by Serve's proxy; through
    each, the official client streams, the key is required, errors are OpenAI's JSON, /metrics answers, and the
    ingress guard closes a client that never finishes its headers; a client that leaves mid-stream frees its
    slot."""
    import re

    import openai

    model, urls = default_model_name(run_env), served.urls
    group = _descendants(served.cmd.proc.pid)   # Ray's workers have sessions of their own: not in the group
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
    ours = [(line.split()[3], line.split()[-1]) for line in lines
            if {int(p) for p in re.findall(r"pid=(\d+)", line)} & group]
    assert not [(a, p) for a, p in ours if a.rsplit(":", 1)[0] not in ("127.0.0.1", "[::ffff:127.0.0.1]")], ours
    for url in urls:   # held by the ingress replicas, not by Serve's proxy
        api_port = url.rsplit(":", 1)[1]
        assert [p for a, p in ours if a.endswith(f":{api_port}")] and \
            all("ServeRepli" in p for a, p in ours if a.endswith(f":{api_port}")), ours
    assert any("ProxyActor" in p for _, p in ours), ours
    for url in urls:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=120, max_retries=0)
        stream = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=12, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert chunks[-1].usage.completion_tokens == 12 and "".join(c.choices[0].text for c in chunks[:-1])
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="nope", prompt="hi", max_tokens=2)
        assert missing.value.body["code"] == "model_not_found"
        bad = requests.post(url + "/v1/completions", data=b"{", timeout=30,
                            headers={**AUTH, "Content-Type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        assert "Traceback" not in bad.text
        assert requests.get(url + "/metrics", timeout=30).status_code == 401
        metrics = requests.get(url + "/metrics", headers=AUTH, timeout=30)
        assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")   # never ends its headers
            t = time.time()
            # closed by the guard's header timeout (2 s; a wide margin for a loaded machine): never closed, recv
            # would raise at the socket's 10 s
            assert slow.recv(1024) == b"" and time.time() - t < 8
    # a client that goes away mid-stream: the replica sees the disconnect itself and the engine drops the request
    info = lambda: requests.get(urls[1] + "/v1/minedraft/info", headers=AUTH, timeout=30).json()  # noqa: E731
    before = info()["aborted"]
    r = requests.post(urls[1] + "/v1/completions", stream=True, timeout=60, headers=AUTH,
                      json={"model": model, "prompt": "def fibonacci(n):", "max_tokens": 200, "ignore_eos": True,
                            "stream": True})
    lines = r.iter_lines()
    while not next(lines).startswith(b"data: "):
        pass
    r.close()
    deadline = time.time() + 30
    while (info()["aborted"] == before or info()["slots_in_use"]) and time.time() < deadline:
        time.sleep(0.2)
    state = info()
    assert state["aborted"] == before + 1 and state["slots_in_use"] == 0 and state["running"] == 0


def test_minedraft_serve_exits_cleanly_on_ctrl_c(served):
    code = served.cmd.interrupt()
    assert code == 0 and "shutting down" in served.cmd.output()


def content_of_tokens(n: int) -> str:
    """A user message that the default pair's chat template makes a prompt of at most n tokens, and more than
    n - 8."""
    from minedraft_ray.engine.loader import load_tokenizer

    tok = load_tokenizer(EngineConfig().target)

    def prompt_len(words: int) -> int:
        text = tok.apply_chat_template([{"role": "user", "content": "hi " * words}], add_generation_prompt=True,
                                       tokenize=False)
        return len(tok.encode(text, add_special_tokens=False))

    per_word = prompt_len(101) - prompt_len(100)
    words = (n - prompt_len(0)) // per_word
    assert n - 8 < prompt_len(words) <= n, (n, words, prompt_len(words))
    return "hi " * words


def check_locked_down(cmd: "Command", out: str, dashboard_port: int) -> None:
    """Every listener of the command's Ray on 127.0.0.1; the dashboard's and the agent's job APIs refuse
    requests without the Ray token (they run shell commands), and take the one in the printed file."""
    import re

    token = Path(re.search(r"Ray token (\S+)", out).group(1)).read_text().strip()
    group = {int(p) for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == cmd.proc.pid}
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
    ours = [(line.split()[3], line.split()[-1]) for line in lines if {int(p) for p in re.findall(r"pid=(\d+)", line)} & group]
    assert any("gcs_server" in p for _, p in ours) and any("DashboardA" in p for _, p in ours), ours
    assert not [(a, p) for a, p in ours if a.rsplit(":", 1)[0] not in ("127.0.0.1", "[::ffff:127.0.0.1]")], ours
    dashboard = f"http://127.0.0.1:{dashboard_port}"
    assert requests.get(dashboard + "/api/version", timeout=30).status_code == 401
    bearer = {"Authorization": f"Bearer {token}"}
    assert requests.get(dashboard + "/api/version", headers=bearer, timeout=30).status_code == 200
    job = {"entrypoint": "id"}
    assert requests.post(dashboard + "/api/jobs/", json=job, timeout=30).status_code == 401
    for address, process in ours:
        if "DashboardA" in process:
            try:
                r = requests.post(f"http://127.0.0.1:{address.rsplit(':', 1)[1]}/api/job_agent/jobs/", json=job,
                                  timeout=5)
            except requests.RequestException:
                continue   # its gRPC port
            assert r.status_code in (401, 404, 405), (address, r.status_code)   # never runs the job


def _descendants(root: int) -> set[int]:
    """`root` and every process below it."""
    parent = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent[int(p)] = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    found, frontier = {root}, {root}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def _pgid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, ValueError, IndexError):
        return None


def test_serve_run_of_the_yaml(ray_cluster, run_env, tmp_path):
    """`serve run --address <cluster> minedraft.yaml` (the file's way onto a running cluster) on the session's
    cluster, its token in the environment; its Ctrl-C shuts down Serve there. The private instance the file's
    other recipe starts (RAY_ADDRESS=local) is Ray's own; `minedraft serve` above covers ours (suite time: one
    Ray start fewer)."""
    from ray import serve

    config = yaml.safe_load((REPO / "deployments" / "minedraft.yaml").read_text())
    assert config["http_options"]["host"] == "127.0.0.1"
    port = free_port()
    config["http_options"]["port"] = port          # the file as shipped, on a free port
    path = tmp_path / "minedraft.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_cli = str(Path(sys.executable).parent / "serve")
    serve.shutdown()   # a Serve instance an earlier module started would keep its own HTTP port
    address = ray_cluster.get_runtime_context().gcs_address
    cmd = Command([serve_cli, "run", "--address", address, str(path)], run_env, tmp_path / "run.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, cmd, timeout=300)
        r = requests.post(url + "/v1/chat/completions", timeout=120,   # no MINEDRAFT_API_KEY: open
                          json={"model": default_model_name(run_env), "max_tokens": 6,
                                "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] <= 6 and body["minedraft"]["mode"] == "psd"
    finally:
        cmd.interrupt()
        serve.shutdown()   # forget the client of the instance the command shut down


def test_minedraft_generate_joins_a_cluster(ray_cluster, run_env, tmp_path, tiny_llama, tiny_llama_draft):
    """`minedraft generate --address` on the session's cluster (its token in the environment, as an operator
    would pass it): the engine runs there and is removed after; `minedraft serve` above covers the private
    instance both commands start without --address (suite time: one Ray start fewer)."""
    address = ray_cluster.get_runtime_context().gcs_address
    groups_before = set(ray_cluster.util.placement_group_table())
    args = [MINEDRAFT, "generate", "The quick brown fox", "def fibonacci(n):", "--max-tokens", "8", "--ignore-eos",
            "--target", str(tiny_llama), "--draft", str(tiny_llama_draft), "--max-batch", "2",
            "--address", address, "--torch-threads", "1"]
    out = subprocess.run(args, env=run_env, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("--- 8 tokens, finish_reason=length, acceptance_rate=") == 2
    assert "=== 1: 'def fibonacci(n):'" in out.stdout
    created = {pg: state for pg, state in ray_cluster.util.placement_group_table().items() if pg not in groups_before}
    assert created and all(state["state"] == "REMOVED" for state in created.values()), created


def test_grafana_export_through_the_cli(tmp_path):
    import json
    from minedraft_ray.cli import main
    out = tmp_path / "dash.json"
    assert main(["grafana", "export", "--out", str(out)]) in (0, None)
    shipped = Path(__file__).parents[1] / "deployments" / "grafana" / "minedraft-dashboard.json"
    assert json.loads(out.read_text()) == json.loads(shipped.read_text())
