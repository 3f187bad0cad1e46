"""Private local Ray instances, locked down: every listener on 127.0.0.1 and Ray's token authentication on.

Ray reads both settings from the environment when it is imported (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0:
loopback only; RAY_AUTH_MODE=token: every RPC and dashboard/agent HTTP call needs the token). So entry points
that start Ray call `lock_down()` before `import ray`; this module never imports Ray at import time.

Each instance gets a fresh token from `secrets`, written to a 0600 file in a private 0700 directory and
named by RAY_AUTH_TOKEN_PATH, which the GCS, raylet, dashboard and workers inherit. It is never printed and
never stored in the repository; `minedraft serve` prints the file's path so an operator can use the dashboard
or `ray job submit` (RAY_AUTH_TOKEN_PATH=<path> ray job list ...).
"""
from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("minedraft.ray")

LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"   # "0": Ray's node address is 127.0.0.1
AUTH_MODE_ENV = "RAY_AUTH_MODE"
AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


def new_token_file() -> Path:
    """A fresh random token in a 0600 file of a new 0700 directory (removed when this process exits)."""
    folder = Path(tempfile.mkdtemp(prefix="minedraft-ray-auth-"))   # mkdtemp: mode 0700
    atexit.register(shutil.rmtree, folder, True)
    path = folder / "auth_token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    return path


_locked: Path | None = None   # the token file lock_down made for this process


def lock_down(environ=os.environ) -> Path:
    """Environment for a private instance started from this process: loopback listeners and a new token.
    Must run before `import ray` for the token to apply to this process (Ray fixes its auth mode at import)."""
    global _locked
    environ[LOOPBACK_ONLY_ENV] = "0"
    environ[AUTH_MODE_ENV] = "token"
    environ.pop(AUTH_TOKEN_ENV, None)   # it would take precedence over the file
    path = new_token_file()
    environ[AUTH_TOKEN_PATH_ENV] = str(path)
    _locked = path
    return path


def prepare_token_auth() -> None:
    """Called by modules that import Ray (runtime/llm.py) just before they do: a process that has not
    imported Ray yet and has not chosen an auth mode gets token authentication, which Ray fixes at import.
    Its private instances get a token at start (start_local_ray); joining a cluster then needs that
    cluster's token (RAY_AUTH_TOKEN_PATH), or RAY_AUTH_MODE=disabled for a cluster without authentication."""
    if "ray" not in sys.modules:
        os.environ.setdefault(AUTH_MODE_ENV, "token")


def start_local_ray(**init_kwargs):
    """ray.init of a private local instance, locked down. Returns Ray's context; its token file's path is
    in os.environ[RAY_AUTH_TOKEN_PATH] (absent when token authentication could not be turned on)."""
    if _locked is None or os.environ.get(AUTH_TOKEN_PATH_ENV) != str(_locked) or not _locked.exists():
        lock_down()
    import ray
    import ray._private.ray_constants as ray_constants
    from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode

    # Ray imported earlier (by the caller) read the loopback setting already; the node address comes from
    # this constant, and the processes started below inherit the variable
    ray_constants.ENABLE_RAY_CLUSTER = False
    if get_authentication_mode() == AuthenticationMode.TOKEN:
        AuthenticationTokenLoader.instance().reset_cache()   # an earlier instance of this process had another
    else:   # the GCS would demand a token this process does not send: start it without
        for name in (AUTH_MODE_ENV, AUTH_TOKEN_PATH_ENV):
            os.environ.pop(name, None)
        log.warning("Ray token authentication is off for this instance: Ray was imported before %s=token was "
                    "set (import minedraft_ray's entry point first, or export %s=token)", AUTH_MODE_ENV,
                    AUTH_MODE_ENV)
    init_kwargs.setdefault("include_dashboard", False)
    return ray.init(address="local", **init_kwargs)
