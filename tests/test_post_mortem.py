"""The suite's post-mortem of a dead Ray worker (tests/ray_cluster.py): a failure naming a worker process that
died carries that worker's own last words and the raylet's lines on it, so a CI log says why it died."""
import os
import signal
import sys

import pytest


def test_a_dead_workers_logs_come_with_the_failure(ray_cluster):
    from ray_cluster import post_mortem

    @ray_cluster.remote(num_cpus=0, max_restarts=0)
    class DiesAtStart:
        def __init__(self):
            print("last words before SIGKILL", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        def ping(self):
            return "never"

    actor = DiesAtStart.remote()
    with pytest.raises(ray_cluster.exceptions.ActorDiedError) as died:
        ray_cluster.get(actor.ping.remote(), timeout=120)
    failure = str(died.value)
    assert "worker process has died" in failure
    found = post_mortem(failure)
    assert "last words before SIGKILL" in found, found
    assert "--- raylet.out: lines naming them" in found and "oom_kill" in found, found
    assert post_mortem("AssertionError: 1 != 2") == ""
