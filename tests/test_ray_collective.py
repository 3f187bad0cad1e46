"""The ray_collective channel's ends (runtime/ray_collective.py) between two real actors of the session's Ray
cluster, over Ray's collective API with the CPU backend: messages filed by tag whatever order they are taken in,
sends that never block, drains, a waiting receive released at once by close (what the manager does when Ray
reports the drafter dead: NCCL would not notice) and bounded by the timeout, a dead peer seen at once, a new
generation with a restarted peer beside another user of torch.distributed's default group, which the channel never
touches, and nothing listening on a wildcard address.

The tests whose peers stay alive open their channels, each of its own name, on one pair of actors (an actor's start
imports torch): each test's open replaces the end the one before left, as a worker's end is replaced when its
peer restarts."""
import time

import pytest
import ray

from minedraft_ray.runtime.messages import GLOO_PAIR, ChannelSpec
from minedraft_ray.runtime.ray_collective import ChannelEnd
from minedraft_ray.runtime.transport import CONCURRENCY_GROUP, RayCollectiveChannel
from minedraft_ray.testing.channel import TIMEOUT_S, End


def _end():
    return ray.remote(concurrency_groups={CONCURRENCY_GROUP: 1})(End).remote()


def _open(verifier, drafter, name, generation=1, **timeout):
    spec = ChannelSpec(name, generation, GLOO_PAIR)
    ray.get([verifier.open.remote(spec, ChannelEnd.VERIFIER, **timeout),
             drafter.open.remote(spec, ChannelEnd.DRAFTER, **timeout)], timeout=60)
    return verifier, drafter


def _pair(ray_cluster, name, generation=1, verifier=None):
    return _open(verifier or _end(), _end(), name, generation)


@pytest.fixture(scope="module")
def live_pair(ray_cluster):
    """Two actors whose ends the tests with live peers open their channels on."""
    actors = _end(), _end()
    yield actors
    for actor in actors:
        ray.kill(actor)


def _until(check, timeout_s=10.0) -> bool:
    deadline = time.time() + timeout_s
    while not check() and time.time() < deadline:
        time.sleep(0.02)
    return check()


def test_messages_are_filed_by_tag_and_sends_never_block(live_pair):
    verifier, drafter = _open(*live_pair, "test-order")
    # the drafter sends 1, 2, 3; the verifier takes 3 first (psd's verifies name rounds out of draft order)
    ray.get([drafter.send.remote([[t] * 3] * 2, t) for t in (1, 2, 3)])
    for tag in (3, 1, 2):
        got, _ = ray.get(verifier.recv.remote((2, 3), tag))
        assert got == [[tag] * 3] * 2, got
    # the other direction, a message drained before it comes and one drained after
    ray.get([verifier.drain.remote((1, 2), 5), verifier.send.remote([[7, 8]], 6)])
    ray.get(drafter.send.remote([[1, 1]], 5))
    assert ray.get(drafter.recv.remote((1, 2), 6))[0] == [[7, 8]]
    ray.get(drafter.send.remote([[2, 2]], 9))
    assert _until(lambda: ray.get(verifier.in_flight.remote()) == 1)   # 9 arrived, nobody took it
    ray.get(verifier.drain.remote((1, 2), 9))
    assert _until(lambda: ray.get([verifier.in_flight.remote(), drafter.in_flight.remote()]) == [0, 0])
    # nothing on the process's default torch.distributed group, nothing listening on every interface
    assert ray.get([verifier.default_group_initialized.remote(), drafter.default_group_initialized.remote()]) \
        == [False, False]
    assert ray.get([verifier.wildcard_listeners.remote(), drafter.wildcard_listeners.remote()]) == [[], []]


def test_close_releases_a_waiting_receive_at_once(live_pair):
    verifier, drafter = _open(*live_pair, "test-close")
    # the peer is alive and silent (a hung drafter; or any drafter under NCCL, which sees no death): the
    # manager's word closes the end, from the actor's other thread, and the waiting receive fails at once
    waiting = verifier.recv.remote((2, 3), 1)
    time.sleep(0.5)
    channel = RayCollectiveChannel()
    channel.generation = 1
    channel.drafter_gone(verifier)   # the manager's call once Ray reports the drafter dead or replaced
    error, waited = ray.get(waiting, timeout=30)
    assert "ConnectionError" in error and waited < TIMEOUT_S / 2, (error, waited)   # not the link's timeout


def test_a_dead_peer_fails_a_waiting_receive_and_a_restarted_one_gets_a_new_channel(ray_cluster):
    verifier, drafter = _pair(ray_cluster, "test-restart")
    try:
        waiting = verifier.recv.remote((2, 3), 1)
        time.sleep(0.5)
        ray.kill(drafter)
        error, waited = ray.get(waiting, timeout=15)
        assert "ConnectionError" in error and waited < TIMEOUT_S / 2, (error, waited)
        assert not ray.get(verifier.default_group_initialized.remote())
        # meanwhile another torch.distributed user of the verifier's process takes the default group
        assert ray.get(verifier.use_default_group.remote()) == 1
        # the verifier (same process) and a new drafter: generation 2 over new groups
        _, drafter = _pair(ray_cluster, "test-restart-2", generation=2, verifier=verifier)
        ray.get(drafter.send.remote([[4, 5, 6]] * 2, 1))
        assert ray.get(verifier.recv.remote((2, 3), 1))[0] == [[4, 5, 6]] * 2
        assert ray.get(verifier.use_default_group.remote()) == 1   # and both keep working
    finally:
        for actor in (verifier, drafter):
            ray.kill(actor)


def test_a_receive_from_a_silent_peer_gives_up_after_the_timeout(live_pair):
    silent_s = 2.0
    verifier, drafter = _open(*live_pair, "test-timeout", timeout_s=silent_s)
    error, waited = ray.get(verifier.recv.remote((2, 3), 1), timeout=30)
    # its own timeout, not the channel's default (TIMEOUT_S, 20 s)
    assert "TimeoutError" in error and silent_s <= waited < silent_s + 8, (error, waited)
