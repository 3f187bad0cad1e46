#!/usr/bin/env bash
# `uv pip install ARGS...` with this machine's pip sources: the installs of .venv (Makefile) and .venv-vllm
# (setup-vllm-venv.sh) go through here. uv downloads in parallel and the two venvs share its cache (torch, triton
# and most of their dependencies are in both), where pip fetched one file at a time: the installs were a large
# part of a fresh clone's CI run. uv's own cache (~/.cache/uv, or UV_CACHE_DIR) outlives a clone, so a later clone
# on the same machine installs from disk.
# uv reads no pip configuration, so the package sources and constraints pip would use (`pip config list`: the
# machine's find-links, where torch's CPU build lies, its index URLs and constraint files; PIP_* variables
# included) are passed on as uv's flags, with pip's index strategy (the best version over all indexes).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
UV_VERSION=0.13.9
UV=.uv/tool/bin/uv

mkdir -p .uv
(   # both venvs install side by side (make -j2): one of them installs uv, the other waits for it
    flock 9
    if ! [ -x "$UV" ]; then
        $PYTHON -m pip install -q --disable-pip-version-check --root-user-action=ignore --target .uv/tool "uv==$UV_VERSION"
    fi
) 9>.uv/.lock

mapfile -t PIP_SOURCES < <($PYTHON - <<'PY'
import ast
import shlex
import subprocess
import sys

listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
settings = {}
# pip's precedence for `pip install`: [global], then [install], then PIP_* variables (":env:")
for section in ("global", "install", ":env:"):
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        where, _, name = key.rpartition(".")
        if where == section and value:
            settings[name] = ast.literal_eval(value)
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
for name, flag in flags.items():
    for value in shlex.split(settings.get(name, "")):
        print(flag)
        print(value)
if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
    print("--no-index")
PY
)

exec "$UV" pip install "$@" "${PIP_SOURCES[@]}" --index-strategy unsafe-best-match
