"""The collective channel's link (runtime/link.py) between two real processes: messages matched by tag in any
order, sends that never block their sender, drains for messages nobody takes, and a peer's death seen at once."""
import multiprocessing as mp
import os
import tempfile
import time

import pytest
import torch

from minedraft_ray.runtime.link import PeerLink

HOST = "127.0.0.1"


def _store(path: str):
    # a file both processes open: the link takes any torch.distributed store (the workers pass Ray's GCS)
    return torch.distributed.FileStore(path, 2)


def _peer(path: str, script: str, done) -> None:
    link = PeerLink.join(1, HOST, _store(path), 20.0)
    if script == "echo_reversed":   # receive tags 1, 2, 3 in reverse order; send each back under tag + 10
        for tag in (3, 2, 1):
            got = link.recv((2, 3), torch.int64, tag)
            link.send(got + 100, tag + 10)
        done.wait(20)
    elif script == "send_unwanted":   # a message the other end will only drain; `done` once it is taken
        link.send(torch.arange(6).reshape(2, 3), 7)
        if _until(lambda: link.in_flight == 0):
            done.set()
    elif script == "die":
        time.sleep(0.5)
        os._exit(1)


def _start(script: str):
    ctx = mp.get_context("spawn")
    path = os.path.join(tempfile.mkdtemp(), "rendezvous")
    link = PeerLink.listen(1, HOST, _store(path), 20.0)
    done = ctx.Event()
    proc = ctx.Process(target=_peer, args=(path, script, done), daemon=True)
    proc.start()
    link.wait_ready()
    return link, proc, done


def _until(check, timeout_s=10.0) -> bool:
    deadline = time.time() + timeout_s
    while not check() and time.time() < deadline:
        time.sleep(0.02)
    return check()


def test_messages_match_by_tag_and_sends_never_block():
    link, proc, done = _start("echo_reversed")
    try:
        t0 = time.perf_counter()
        for tag in (1, 2, 3):   # the peer takes 3 first: the sends of 1 and 2 must not hold up this thread
            link.send(torch.full((2, 3), tag, dtype=torch.int64), tag)
        # a send that waited for its taker would wait here for the peer's 20 s link timeout (or forever)
        assert time.perf_counter() - t0 < 10.0
        for tag in (1, 2, 3):
            assert link.recv((2, 3), torch.int64, tag + 10).tolist() == [[tag + 100] * 3] * 2
        assert _until(lambda: link.in_flight == 0), link.in_flight   # every send taken
    finally:
        done.set()
        proc.join(10)


def test_a_drained_message_is_taken_and_dropped():
    link, proc, done = _start("send_unwanted")
    link.drain((2, 3), torch.int64, 7)
    assert done.wait(10)   # the sender saw its message taken
    assert _until(lambda: link.in_flight == 0), link.in_flight
    proc.join(10)


def test_a_dead_peer_fails_a_waiting_receive_at_once():
    link, proc, done = _start("die")
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="(?i)closed|reset|peer"):
        link.recv((2, 3), torch.int64, 1)   # the peer dies without sending
    assert time.perf_counter() - t0 < 10.0   # long before the link's 20 s timeout
    proc.join(10)
    with pytest.raises(RuntimeError):
        link.recv((2, 3), torch.int64, 2)   # and the link stays failed

