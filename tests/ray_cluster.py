"""One private Ray cluster per test session (per worker under `make test`'s `-n 2`), shared by its Ray test modules.

tests/conftest.py imports this module first (`from ray_cluster import ray_cluster  # noqa: F401`), before any
test module imports Ray: the cluster is locked down like every instance the project starts
(minedraft_ray/ray_local.py: listeners on 127.0.0.1, Ray token authentication with a fresh token), which Ray
only honours when set before its import. Its Serve proxy runs the ingress guard (serve/guard.py) with short
timeouts, so the tests of slow clients take seconds. Logical GPUs (8: psd at tp 2 takes three, and the shared
engines of tests/engines.py hold three while their files start others; 6 CPUs for the same reason) let placement
groups with GPU bundles schedule on a CPU machine; the actors still run torch on the CPU. Never
`ray stop`: it kills every Ray process on the host.
"""
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from minedraft_ray.ray_local import lock_down
from minedraft_ray.serve.guard import IngressLimits, guard_environ

# the body timeout gives test_security's 300 slow clients a window that a loaded 2-core machine answers probes in
TEST_LIMITS = IngressLimits(max_body_bytes=16 * 1024 * 1024, body_timeout_s=5.0, header_timeout_s=2.0)

lock_down()

SESSION_TEMP_DIRS: list[str] = []   # this process's cluster's temp dir, while it runs


def post_mortem(failure: str, tail_lines: int = 25) -> str:
    """What the session's Ray logs and the kernel say of each worker process a failure names as dead: the raylet's
    lines on that pid, the tails of the worker's own logs (a crash's faulthandler trace goes to its .err), and the
    kernel's OOM kill count. CI keeps only the test output, and the cluster's logs go with the session."""
    if "worker process has died" not in failure or not SESSION_TEMP_DIRS:
        return ""
    pids = sorted(set(re.findall(r"\bpid[:=] ?(\d+)", failure)))
    logs = Path(SESSION_TEMP_DIRS[-1], "session_latest", "logs")
    out = [f"Ray logs in {logs} on pids {', '.join(pids)}"]
    # the kernel's OOM kills: the host's, and this container's cgroup's (v2, v1) with its limit and peak
    for path in ("/proc/vmstat", "/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        if Path(path).exists():
            out += [f"{path}: {line}" for line in Path(path).read_text().splitlines() if line.startswith("oom_kill")]
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.peak", "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                 "/sys/fs/cgroup/memory/memory.max_usage_in_bytes"):
        if Path(path).exists():
            out.append(f"{path}: {Path(path).read_text().strip()}")
    for name in ("raylet.out", "gcs_server.out"):
        path = logs / name
        if path.exists():
            hits = [line for line in path.read_text(errors="replace").splitlines()
                    if any(re.search(rf"\b{pid}\b", line) for pid in pids)]
            out += [f"--- {name}: lines naming them"] + hits[-tail_lines:]
    for pid in pids:
        for path in sorted(p for p in logs.iterdir() if re.search(rf"[-_]{pid}\.(err|out|log)$", p.name)):
            lines = path.read_text(errors="replace").splitlines()
            if path.suffix == ".log":   # the core worker's own log: its warnings and errors only
                lines = [line for line in lines if re.match(r"\[\S+ \S+ [WEF] ", line)]
            out += [f"--- {path.name} (last {tail_lines} lines)"] + lines[-tail_lines:]
    return "\n".join(out)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from minedraft_ray.ray_local import start_local_ray

    temp_dir = tempfile.mkdtemp(prefix="mdray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    SESSION_TEMP_DIRS.append(temp_dir)
    guard = guard_environ(TEST_LIMITS)
    os.environ.update(guard)    # inherited by Ray's processes (Serve's proxy) only
    try:
        start_local_ray(num_cpus=6, num_gpus=8, _temp_dir=temp_dir, log_to_driver=False)
    finally:
        for name in guard:
            os.environ.pop(name, None)
    try:
        yield ray
    finally:
        try:
            from ray import serve
            serve.shutdown()
        finally:
            ray.shutdown()
            SESSION_TEMP_DIRS.remove(temp_dir)
            if not os.environ.get("MINEDRAFT_KEEP_RAY_LOGS"):   # set: the session's logs stay, for a post-mortem
                shutil.rmtree(temp_dir, ignore_errors=True)
