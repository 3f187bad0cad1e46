"""A point-to-point link between the drafter and the verifier actors: a two-rank gloo process group
(torch.distributed's, the backend Ray's collective groups use for host tensors), one tag per message.

Why not a Ray call: a Ray message costs about a millisecond per hop (docs/transport.md), and psd's chain
verify -> tokens -> draft -> drafts -> verify crosses two of them per cycle. A gloo message is a TCP write
the receiving thread is already waiting for.

Semantics that shape the callers:
- a send completes only once the peer posts the matching receive (same tag): sends never wait here, a
  thread of the link waits for them (keeping their buffers alive), so neither actor stalls on the other;
  a message nobody will receive must be drained by the peer, or that thread waits for it until the timeout;
- the receiver knows every message's shape in advance (the manager's keys carry it);
- when the peer process dies, every pending and later operation fails at once ("connection closed by
  peer"): a link is for one drafter generation, and a restarted drafter gets a new one.
"""
from __future__ import annotations

import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist



class PeerLink:
    VERIFIER, DRAFTER = 0, 1   # ranks
    on_device = False          # payloads cross through host memory

    def __init__(self, rank: int, generation: int, timeout_s: float):
        self.rank, self.peer, self.generation = rank, 1 - rank, generation
        self.timeout_s = timeout_s
        self._pg = None
        self._store = None            # the verifier's: it clears the rendezvous keys when the link closes
        self._error: Exception | None = None
        self._ready = threading.Event()
        # sends and drains in flight: (work, buffer), waited for in order by the reaper thread
        self._pending: queue.Queue = queue.Queue()
        self._waiting = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._reap, daemon=True, name=f"peer-link-reaper-{generation}").start()

    @classmethod
    def listen(cls, generation: int, host: str, store: dist.Store, timeout_s: float) -> "PeerLink":
        """The verifier's end: connects in the background through `store` (the drafter joins after this
        returns); its gloo pair binds `host`."""
        link = cls(cls.VERIFIER, generation, timeout_s)
        link._store = store
        threading.Thread(target=link._connect, args=(store, host), daemon=True,
                         name=f"peer-link-{generation}").start()
        return link

    @classmethod
    def join(cls, generation: int, host: str, store: dist.Store, timeout_s: float) -> "PeerLink":
        """The drafter's end: connects through the verifier's `store` and waits until the link is up; its gloo
        pair binds `host` (this node's address)."""
        link = cls(cls.DRAFTER, generation, timeout_s)
        link._connect(store, host)
        link.wait_ready()
        return link

    def _connect(self, store, host: str) -> None:
        try:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            options._timeout = timedelta(seconds=self.timeout_s)
            self._pg = dist.ProcessGroupGloo(store, self.rank, 2, options)
        except Exception as e:  # noqa: BLE001 - reported to whoever waits for the link
            self._error = e
        self._ready.set()

    def wait_ready(self) -> None:
        if not self._ready.wait(self.timeout_s):
            raise TimeoutError(f"the drafter-verifier link {self.generation} was not up within {self.timeout_s:.0f} s")
        if self._error is not None:
            raise ConnectionError(f"the drafter-verifier link {self.generation} failed: {self._error}")

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        """Queue `tensor` (host, contiguous) for the peer's receive of `tag`; never waits for it."""
        self.wait_ready()
        self._keep(self._pg.send([tensor], self.peer, tag), tensor)

    def recv(self, shape: tuple, dtype: torch.dtype, tag: int) -> torch.Tensor:
        """Wait for the peer's message `tag` (the link's timeout at most)."""
        self.wait_ready()
        buf = torch.empty(shape, dtype=dtype)
        self._pg.recv([buf], self.peer, tag).wait()
        return buf

    def drain(self, shape: tuple, dtype: torch.dtype, tag: int) -> None:
        """Take message `tag` whenever it comes, and drop it (its sender would otherwise keep it forever)."""
        self.wait_ready()
        buf = torch.empty(shape, dtype=dtype)
        self._keep(self._pg.recv([buf], self.peer, tag), buf)

    def _keep(self, work, buf) -> None:
        with self._lock:
            self._waiting += 1
        self._pending.put((work, buf))

    def _reap(self) -> None:
        while (item := self._pending.get()) is not None:
            try:
                item[0].wait()
            except Exception:  # noqa: BLE001 - the peer died or the message timed out: nothing waits for it
                pass
            with self._lock:
                self._waiting -= 1

    def close(self) -> None:
        """Stop the reaper once what it holds is done (or failed); the link is not used again."""
        self._pending.put(None)
        clear = getattr(self._store, "clear", None)
        if clear is not None:
            try:
                clear()
            except Exception:  # noqa: BLE001 - keys of a store that is already gone
                pass

    @property
    def in_flight(self) -> int:
        """Sends not yet received by the peer, and drains not yet matched."""
        with self._lock:
            return self._waiting
