"""Cluster deployment: both cluster YAMLs pass Ray's own schema and validation, Serve runs two data-parallel
engine replicas (each with its own placement group) that both serve requests, and `ray up` with the local
provider brings up a head over SSH that deploys the app and answers HTTP."""
import copy
import ctypes
import getpass
import secrets
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest
import requests
import yaml

from minedraft_ray.config import EngineConfig
from minedraft_ray.serve.app import replica_options

REPO = Path(__file__).resolve().parent.parent
CLUSTER_YAMLS = [REPO / "cluster.yaml", REPO / "deployments" / "cluster-local.yaml"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- offline validation

def ray_validate(cfg: dict) -> dict:
    """What `ray up` checks before it contacts a provider: Ray's JSON schema, then the provider defaults
    merged in (prepare_config) and validate_config."""
    import ray
    from ray.autoscaler._private.util import prepare_config, validate_config

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(cfg, schema)
    full = prepare_config(copy.deepcopy(cfg))
    validate_config(full)
    return full


def all_commands(cfg: dict) -> list[str]:
    keys = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
            "head_start_ray_commands", "worker_start_ray_commands")
    return [c for key in keys for c in cfg.get(key, [])]


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_cluster_yaml_validates_and_never_stops_ray(path):
    cfg = yaml.safe_load(path.read_text())
    full = ray_validate(cfg)
    commands = all_commands(full)   # after the provider defaults (whose start commands begin with `ray stop`)
    assert full["head_start_ray_commands"] and full["worker_start_ray_commands"]
    assert not [c for c in commands if "ray stop" in c]
    assert any("ray start --head" in c for c in full["head_start_ray_commands"])
    assert any("serve deploy" in c or "minedraft serve" in c for c in full["head_start_ray_commands"])
    # Ray's validation can fail: an unknown key and a head type that does not exist are refused
    with pytest.raises(jsonschema.ValidationError, match="bogus_key"):
        ray_validate({**cfg, "bogus_key": 1})
    if "available_node_types" in cfg:
        with pytest.raises(ValueError, match="head_node_type"):
            ray_validate({**cfg, "head_node_type": "nope"})


PLACEHOLDER = re.compile(r"ami-0123456789abcdef0|ami-0+\b|ami-x+|<[^<>\n]*>|\bTODO\b|\bFIXME\b|CHANGE_?ME|REPLACE_?ME|"
                         r"\bxxx+\b|your[-_ ](?:ami|image|key|token|region)", re.IGNORECASE)


def strings(node) -> list[str]:
    if isinstance(node, dict):
        return [s for k, v in node.items() for s in strings(k) + strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return [node] if isinstance(node, str) else []


def test_aws_cluster_comes_up_as_written():
    """No placeholder left (the old `ImageId: ami-0123456789abcdef0` made `ray up` fail): the autoscaler's
    default Deep Learning AMI, Ray's GPU image at the installed Ray version, the project installed into it."""
    import ray

    cfg = yaml.safe_load((REPO / "cluster.yaml").read_text())
    found = [s for s in strings(cfg) if PLACEHOLDER.search(s)]
    assert not found, found
    for name, node_type in cfg["available_node_types"].items():
        assert node_type["node_config"].get("ImageId", "latest_dlami") == "latest_dlami", name
    image = cfg["docker"]["image"]
    assert image.startswith(f"rayproject/ray:{ray.__version__}-") and image.endswith("-gpu"), image
    assert any("minedraft_ray-" in c and "pip install" in c for c in cfg["setup_commands"])
    # the check itself: the old placeholder is caught
    bad = copy.deepcopy(cfg)
    bad["available_node_types"]["head"]["node_config"]["ImageId"] = "ami-0123456789abcdef0"
    assert [s for s in strings(bad) if PLACEHOLDER.search(s)]


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_cluster_ray_runs_with_a_deploy_time_token(path):
    """Every Ray command runs with token authentication; the token is a file made at deploy time, copied by
    file_mounts from a git-ignored path; the dashboard stays on 127.0.0.1."""
    cfg = ray_validate(yaml.safe_load(path.read_text()))
    token_mounts = {remote: local for remote, local in cfg["file_mounts"].items() if "token" in remote}
    assert len(token_mounts) == 1, cfg["file_mounts"]
    (remote, local), = token_mounts.items()
    ignored = subprocess.run(["git", "check-ignore", "-q", local], cwd=REPO)
    assert ignored.returncode == 0, f"{local} is not git-ignored"
    for cmd in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]:
        if "ray start" in cmd or "serve deploy" in cmd or "minedraft serve" in cmd:
            assert "RAY_AUTH_MODE=token" in cmd and "RAY_AUTH_TOKEN_PATH=" in cmd, cmd
        if "ray start" in cmd:
            assert "minedraft_ray.serve.guard:proxy_middlewares" in cmd, cmd
        assert "--dashboard-host=0.0.0.0" not in cmd


def test_aws_cluster_shape():
    cfg = ray_validate(yaml.safe_load((REPO / "cluster.yaml").read_text()))
    types = cfg["available_node_types"]
    assert types[cfg["head_node_type"]]["resources"] == {"CPU": 0}
    gpu = types["gpu_worker"]
    assert gpu["resources"]["GPU"] >= 2 and gpu["resources"]["GPU"] % 2 == 0   # whole psd replicas per node
    assert 1 <= gpu["min_workers"] <= gpu["max_workers"] <= cfg["max_workers"]
    setup = " ".join(cfg["setup_commands"])
    assert "minedraft_ray-" in setup


def test_local_cluster_uses_private_temp_dir():
    cfg = ray_validate(yaml.safe_load((REPO / "deployments" / "cluster-local.yaml").read_text()))
    assert cfg["provider"]["type"] == "local"
    for cmd in cfg["head_start_ray_commands"][:1] + cfg["worker_start_ray_commands"]:
        assert "--temp-dir=" in cmd


# ---------------------------------------------------------------- replica settings

def test_replica_settings():
    from ray.serve.config import AutoscalingConfig

    assert replica_options(EngineConfig(num_replicas=3)) == {"num_replicas": 3}
    config = EngineConfig(mode="psd", max_batch=16, min_replicas=2, max_replicas=6)
    opts = replica_options(config)["autoscaling_config"]
    assert opts == {"min_replicas": 2, "initial_replicas": 2, "max_replicas": 6, "target_ongoing_requests": 32}
    AutoscalingConfig(**opts)   # Serve accepts it
    with pytest.raises(ValueError, match="needs max_replicas"):
        EngineConfig(min_replicas=2)
    with pytest.raises(ValueError, match="min_replicas"):
        EngineConfig(min_replicas=3, max_replicas=2)
    assert EngineConfig.from_env(environ={"MINEDRAFT_MAX_REPLICAS": "4"}).max_replicas == 4


# ---------------------------------------------------------------- two engine replicas

DP_APP, DP_ROUTE, DP_MODEL = "minedraft-dp", "/dp", "tiny-dp"


@pytest.fixture(scope="module")
def dp_server(ray_cluster, tiny_llama):
    from ray import serve

    from minedraft_ray.serve.app import build_app

    # ar: one (logical) GPU per replica, so two replicas fill the session cluster's two GPUs
    args = {"target": str(tiny_llama), "draft": None, "model_name": DP_MODEL, "mode": "ar", "max_batch": 4,
            "max_len": 512, "max_queued": 16, "num_replicas": 2, "torch_threads": 1}
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    http = serve.context._get_global_client().http_config
    serve.run(build_app(args), name=DP_APP, route_prefix=DP_ROUTE)
    yield f"http://{http.host}:{http.port}{DP_ROUTE}", serve.get_deployment_handle("MineDraftEngine", DP_APP)
    serve.delete(DP_APP)


def replica_states(engine, calls: int = 40) -> dict[str, dict]:
    """info() of every engine replica, by replica id (calls are routed to either replica)."""
    states = {}
    for _ in range(calls):
        state = engine.info.remote().result(timeout_s=30)
        states[state["replica"]] = state
    return states


def complete(url: str, **body) -> dict:
    r = requests.post(url + "/v1/completions", json={"model": DP_MODEL, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_engine_replicas_share_the_load(dp_server):
    url, engine = dp_server
    before = replica_states(engine)
    assert len(before) == 2
    # Serve's router picks between two sampled replicas by their (cached) queue lengths, so one burst may
    # still land on one replica: send bursts until both have served, at most 4
    sent = 0
    for _ in range(4):
        prompts = [f"Request number {sent + i} says" for i in range(12)]
        with ThreadPoolExecutor(12) as pool:
            outs = list(pool.map(lambda p: complete(url, prompt=p, max_tokens=24, ignore_eos=True), prompts))
        assert all(o["usage"]["completion_tokens"] == 24 for o in outs)
        sent += len(prompts)
        after = replica_states(engine)
        served = {rid: after[rid]["finished"] - before[rid]["finished"] for rid in after}
        if min(served.values()) > 0:
            break
    assert sum(served.values()) == sent and min(served.values()) > 0, served
    # each replica placed its verifier on its own (logical) GPU
    gpus = [tuple(w.get("gpu_ids") or ()) for s in after.values() for w in s["workers"].values() if w]
    assert len(set(gpus)) == 2, after


def test_stop_string_aborts_on_the_replica_that_runs_the_request(dp_server):
    """The abort after a stop string may be routed to the other replica; the request must still stop early."""
    url, engine = dp_server
    free = complete(url, prompt="Once upon a time", max_tokens=20, ignore_eos=True)["choices"][0]["text"]
    stop = free[8:12]
    expected = free[:free.index(stop)]
    before = replica_states(engine)
    # Serve routes the abort call to the less busy replica: under this light load the one that does not run
    # the request (the old abort-by-call then let every request run to max_tokens: 0 aborted)
    for _ in range(6):
        out = complete(url, prompt="Once upon a time", max_tokens=400, ignore_eos=True, stop=[stop])
        assert out["choices"][0]["text"] == expected and out["choices"][0]["finish_reason"] == "stop"
    deadline = time.time() + 30
    while True:
        after = replica_states(engine)
        idle = all(s["running"] == 0 and s["slots_in_use"] == 0 for s in after.values())
        if idle or time.time() > deadline:
            break
        time.sleep(0.5)
    assert idle, after
    # aborted, not run to max_tokens (400 tokens) on some replica
    assert sum(after[r]["aborted"] - before[r]["aborted"] for r in after) == 6, (before, after)


# ---------------------------------------------------------------- ray up (local provider, private sshd)

PR_SET_CHILD_SUBREAPER = 36


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def kill_pids(pids: list[int]) -> None:
    """SIGTERM, then SIGKILL what is left; reap our own children. Most of the tree outlasts SIGTERM (Ray's actors,
    the GCS, the raylet, `minedraft serve` deleting its app from the dying cluster: all of it still there after 5 s
    here), so it gets a second, not the five SIGKILL's reaping may take."""
    for sig, wait_s in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait_s
        while time.time() < deadline:
            for pid in pids:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
            if not [p for p in pids if Path(f"/proc/{p}").exists() and "(Z)" not in _state(p)]:
                break
            time.sleep(0.2)
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "(Z)"
    return f"({stat.rsplit(')', 1)[1].split()[0]})"


def ensure_ssh_tools() -> str | None:
    """None when sshd, ssh and rsync are there (installed with apt if missing), else why not."""
    needed = {"/usr/sbin/sshd": "openssh-server", "ssh": "openssh-client", "rsync": "rsync"}
    missing = [pkg for tool, pkg in needed.items() if not shutil.which(tool)]
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", *missing], capture_output=True, timeout=300)
        missing = [pkg for tool, pkg in needed.items() if not shutil.which(tool)]
    return f"cannot install {missing} (needs root and apt-get)" if missing else None


def start_sshd(home: Path, port: int) -> subprocess.Popen:
    """A private sshd on 127.0.0.1:port: key-only, its own host key and authorized_keys."""
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(home / name)], check=True)
    shutil.copy(home / "client_key.pub", home / "authorized_keys")
    (home / "sshd_config").write_text(f"""\
Port {port}
ListenAddress 127.0.0.1
HostKey {home}/host_key
AuthorizedKeysFile {home}/authorized_keys
PidFile {home}/sshd.pid
AllowUsers {getpass.getuser()}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
""")
    os.makedirs("/run/sshd", exist_ok=True)   # sshd's privilege-separation directory
    proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(home / "sshd_config")],
                            stdout=subprocess.DEVNULL, stderr=open(home / "sshd.log", "w"))
    deadline = time.time() + 10
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        assert proc.poll() is None, (home / "sshd.log").read_text()
        time.sleep(0.1)
    raise AssertionError("sshd did not listen: " + (home / "sshd.log").read_text())


def local_cluster_copy(home: Path, sshd_port: int, ports: dict[str, int]) -> Path:
    """deployments/cluster-local.yaml with the head on 127.0.0.1 over the private sshd, this checkout and its
    .venv, and nothing shared with other Ray users of this machine: free ports, a private temp dir, every
    listener on 127.0.0.1, no dashboard (1 GB and ~10 s on a 2-core machine)."""
    cfg = yaml.safe_load((REPO / "deployments" / "cluster-local.yaml").read_text())
    cfg["cluster_name"] = f"minedraft-test-{os.getpid()}"
    cfg["provider"].update(head_ip="127.0.0.1", worker_ips=[])
    relay = home / "relay.sh"   # ProxyCommand: the launcher's ssh has no port option
    relay.write_text('#!/bin/bash\nexec 3<>"/dev/tcp/$1/$2"\ncat <&3 &\nexec cat >&3\n')
    relay.chmod(0o755)
    cfg["auth"] = {"ssh_user": getpass.getuser(), "ssh_private_key": str(home / "client_key"),
                   "ssh_proxy_command": f"{relay} %h {sshd_port}"}
    (home / ".ray_auth_token").write_text(secrets.token_urlsafe(32))   # made at deploy time, as documented
    (home / ".ray_auth_token").chmod(0o600)
    swaps = {"/opt/minedraft-ray": str(REPO), "/tmp/minedraft-ray": str(home / "r"), "6379": str(ports["gcs"]),
             "8000": str(ports["http"]), "8080": str(ports["metrics"]), "0.0.0.0": "127.0.0.1",
             "--include-dashboard=true": f"--include-dashboard=false --ray-client-server-port={ports['client']}"}

    def swap(cmd: str) -> str:
        for old, new in swaps.items():
            cmd = cmd.replace(old, new)
        return "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; " + cmd

    for key in ("setup_commands", "head_start_ray_commands", "worker_start_ray_commands"):
        cfg[key] = [swap(c) for c in cfg[key]]
    cfg["file_mounts"] = {swap(remote).split("; ", 1)[1]: local for remote, local in cfg["file_mounts"].items()}
    path = home / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    ray_validate(cfg)
    return path


def test_ray_up_local_provider_serves_http():
    """`ray up deployments/cluster-local.yaml` against a private sshd on this machine: the head comes up,
    the default CPU app is deployed and answers; everything is torn down by PID (never `ray stop`/`ray down`)."""
    why = ensure_ssh_tools()
    if why:
        pytest.skip(why)
    home = Path(tempfile.mkdtemp(prefix="mdup-", dir="/tmp"))   # short: Ray's socket paths have a length limit
    ports = {name: free_port() for name in ("sshd", "gcs", "http", "metrics", "client")}
    user_home = Path(os.path.expanduser("~"))
    ssh_dirs_before = set(Path(tempfile.gettempdir()).glob("ray_ssh_*"))
    bootstrap_before = set(user_home.glob("ray_bootstrap_*"))
    libc = ctypes.CDLL(None, use_errno=True)
    known = set(children(os.getpid()))
    # Orphans (the Ray daemons `ray start` leaves behind under sshd) become our children, so we find them
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    config = None
    try:
        start_sshd(home, ports["sshd"])
        config = local_cluster_copy(home, ports["sshd"], ports)
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
            env.pop(name, None)   # the cluster's own token, from its file_mounts, is the one that counts
        t0 = time.time()
        up = subprocess.run([str(Path(sys.executable).parent / "ray"), "up", str(config), "-y", "--no-config-cache",
                             "--disable-usage-stats", "--log-color", "false"], cwd=home, env=env,
                            capture_output=True, text=True, timeout=180)
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        url = f"http://127.0.0.1:{ports['http']}"
        deadline = time.time() + 120
        while True:
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:   # not listening yet, or the app still deploying
                pass
            log = home / "r-serve.log"
            assert time.time() < deadline, log.read_text()[-4000:] if log.exists() else "no serve log"
            time.sleep(0.25)
        r = requests.post(url + "/v1/completions", timeout=120, json={
            "model": "minedraft-default", "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] >= 1 and body["minedraft"]["mode"] == "psd"
        print(f"ray up -> HTTP answer in {time.time() - t0:.1f} s")
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        ours = [p for p in children(os.getpid()) if p not in known]
        kill_pids([d for p in ours for d in descendants(p)] + ours)
        for path in set(user_home.glob("ray_bootstrap_*")) - bootstrap_before:
            path.unlink(missing_ok=True)
        for path in set(Path(tempfile.gettempdir()).glob("ray_ssh_*")) - ssh_dirs_before:
            shutil.rmtree(path, ignore_errors=True)
        if config is not None:
            name = yaml.safe_load(config.read_text())["cluster_name"]
            for path in Path(tempfile.gettempdir(), "ray").glob(f"cluster-{name}.*"):
                path.unlink(missing_ok=True)
        shutil.rmtree(home, ignore_errors=True)
