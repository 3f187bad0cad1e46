"""The `ray_collective` draft channel's ends: drafter and verifier exchange drafts and tokens over two
`ray.util.collective` groups per drafter generation, NCCL between GPU actors and gloo on CPUs, through the same
calls (init_collective_group, send, recv, destroy_collective_group), so the CPU tests run the GPU's code path.

`ChannelEnd` has the interface of the gloo link (runtime/link.py: send / recv / drain by tag, in_flight, close),
so the workers use either. What Ray's API does not give, and how it is made up for (docs/transport.md):

- **No tags.** A group's point-to-point messages match in the order they are posted, and psd's rounds are not
  taken in the order they are drafted (a verify names its batch's round drafted ahead and a fresh one drafted
  after the other batch's). So each message is preceded by a small header (tag, dtype, shape) and a receiving
  thread at each end takes every message as it comes and files it by tag; `recv` waits for its tag there.
  Sends go through one sending thread per end, so a header and its payload are never split by another send.
- **One direction per group.** Each group carries one direction (drafts: drafter -> verifier; tokens: verifier
  -> drafter) and is used by one thread at each end: NCCL communicators are not thread-safe, and a send queued
  behind a pending receive on the group's one stream would wait for it.
- **No timeouts that leave a group usable.** NCCL ops never time out, and a gloo op that times out closes its
  connection, which an idle receiver would hit. The transfers wait without a limit in the channel's threads;
  callers wait for the mailbox with `step_timeout_s`, and `close` releases them at once: when the manager learns
  from Ray that the drafter died or is replaced (`RayCollectiveChannel.drafter_gone`), or on a new generation.
  On GPUs `close` also aborts the NCCL communicators, so no kernel keeps waiting for a dead peer.
- **Ray's gloo backend is not used.** It makes the process's default torch.distributed group (once per process,
  which a restarted drafter cannot rejoin, and which another use of torch.distributed in the process would
  collide with), sends over that default group, and its ops wait 30 minutes. `PairGlooGroup`, registered with
  `register_collective_backend`, is a two-rank gloo group of its own whose addresses are exchanged through
  Ray's GCS key-value store: nothing new listens but gloo's pair sockets, bound to the node IP (torch's
  TCPStore would listen on every interface).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from datetime import timedelta

import ray
import torch
import torch.distributed as dist
from ray.util import collective
from ray.util.collective.backend_registry import register_collective_backend
from ray.util.collective.collective_group.base_collective_group import BaseGroup

from .gcs_store import GcsStore
from .messages import GLOO_PAIR, NCCL, ChannelSpec

log = logging.getLogger("minedraft.runtime")

# a transfer waits this long at most: gloo ends a connection whose wait times out, and an idle receiver must
# not; the callers' own waits are bounded (step_timeout_s)
UNBOUNDED = timedelta(days=365)
HELLO = -1          # the tag of the message each end sends first: both directions carry one before use
HEADER_LEN = 6      # tag, dtype code, ndim, up to 3 dims
DTYPES = (torch.int64, torch.float32)


# ---- the CPU backend -------------------------------------------------------------------------------------
class PairGlooGroup(BaseGroup):
    """A Ray collective backend for two ranks on CPUs: a gloo process group of its own (never the process's
    default group), its connection bounded by the group's connect timeout, its transfers unbounded."""
    # Ray constructs a backend from (world_size, rank, group_name) only: the opener sets the timeout here first
    connect_timeout_s: dict[str, float] = {}

    def __init__(self, world_size: int, rank: int, group_name: str):
        super().__init__(world_size, rank, group_name)
        if world_size != 2:
            raise ValueError(f"{GLOO_PAIR} joins two ranks, not {world_size}")
        timeout_s = self.connect_timeout_s.pop(group_name, 60.0)
        self.store = GcsStore(f"{group_name}/", timeout_s)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=ray.util.get_node_ip_address())]
        options._timeout = timedelta(seconds=timeout_s)   # the connection; transfers pass UNBOUNDED
        self._pg = dist.ProcessGroupGloo(self.store, rank, world_size, options)

    @classmethod
    def backend(cls):
        return GLOO_PAIR

    @classmethod
    def check_backend_availability(cls) -> bool:
        return dist.is_gloo_available()

    def send(self, tensor, send_options) -> None:
        self._pg.send([tensor[0]], send_options.dst_rank, 0).wait(UNBOUNDED)

    def recv(self, tensor, recv_options) -> None:
        self._pg.recv([tensor[0]], recv_options.src_rank, 0).wait(UNBOUNDED)

    def destroy_group(self) -> None:
        # a transfer still waiting holds its own reference; it ends when the peer's process does
        self._pg = None
        if self.rank == 0:
            self.store.clear()

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError(f"{GLOO_PAIR} carries point-to-point messages only")

    allreduce = barrier = reduce = allgather = broadcast = reducescatter = _unsupported


def register_backend() -> None:
    """In every process that opens an end (Ray constructs a group's backend in the process that joins it)."""
    try:
        register_collective_backend(GLOO_PAIR, PairGlooGroup)
    except ValueError:   # registered already
        pass


register_backend()


# ---- one end ---------------------------------------------------------------------------------------------
class ChannelEnd:
    VERIFIER, DRAFTER = 0, 1   # ranks in both groups

    def __init__(self, spec: ChannelSpec, rank: int, timeout_s: float):
        self.spec, self.rank, self.peer, self.generation = spec, rank, 1 - rank, spec.generation
        self.timeout_s = timeout_s
        # NCCL moves GPU memory: payloads stay on the device, with no copy through the host
        self.on_device = spec.backend == NCCL
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.on_device else torch.device("cpu")
        sends, receives = ("tokens", "drafts") if rank == self.VERIFIER else ("drafts", "tokens")
        self._out, self._in = spec.group(sends), spec.group(receives)
        self._cond = threading.Condition()
        self._mailbox: dict[int, torch.Tensor] = {}   # received, not yet taken
        self._unwanted: set[int] = set()              # drained before they came
        self._sending = 0                             # queued or being sent
        self._down: str | None = None                 # why the end is down (closed, or a transfer failed)
        self._outbox: queue.Queue = queue.Queue()

    @classmethod
    def open(cls, spec: ChannelSpec, rank: int, timeout_s: float) -> "ChannelEnd":
        """Join both groups (the peer joins at the same time) and exchange a first message each way -> the end."""
        if spec.backend == NCCL and not collective.nccl_available():
            raise RuntimeError("the ray_collective channel on GPUs needs Ray's NCCL backend, which needs cupy "
                               "(pip install cupy-cuda12x)")
        end = cls(spec, rank, timeout_s)
        try:
            for name in sorted((end._out, end._in)):   # the same order at both ends: gloo connects here
                PairGlooGroup.connect_timeout_s[name] = timeout_s
                collective.init_collective_group(2, rank, spec.backend, name)
            for target, what in ((end._send_loop, "send"), (end._recv_loop, "recv")):
                threading.Thread(target=target, daemon=True, name=f"draft-channel-{what}-{spec.generation}").start()
            # NCCL builds a group's communicator at its first message: before any round waits on it
            end.send(torch.zeros(1, dtype=torch.int64), HELLO)
            end.recv((1,), torch.int64, HELLO)
        except Exception:
            end.close("the channel did not open")   # whatever was created goes
            raise
        if rank == cls.VERIFIER and spec.backend == GLOO_PAIR:   # both ends are connected: the addresses can go
            for name in (end._out, end._in):
                GcsStore(f"{name}/", timeout_s).clear()
        return end

    # -- the link's interface --
    def send(self, tensor: torch.Tensor, tag: int) -> None:
        """Queue `tensor` for the peer's recv of `tag`; never waits for it."""
        with self._cond:
            if self._down is not None:
                raise ConnectionError(f"draft channel {self.generation} is down: {self._down}")
            self._sending += 1
        tensor = tensor.to(self.device).contiguous()
        ready = None
        if self.on_device:   # the sending thread waits for the work that makes the tensor, not for all work
            ready = torch.cuda.Event()
            ready.record()
        self._outbox.put((tag, tensor, ready))

    def recv(self, shape: tuple, dtype: torch.dtype, tag: int) -> torch.Tensor:
        """The peer's message `tag` (on the device with NCCL); fails at once when the end goes down, and after
        the end's timeout."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while tag not in self._mailbox:
                if self._down is not None:
                    raise ConnectionError(f"draft channel {self.generation} is down: {self._down}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"draft channel {self.generation}: no message {tag} within "
                                       f"{self.timeout_s:.0f} s")
                self._cond.wait(left)
            tensor = self._mailbox.pop(tag)
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(f"draft channel {self.generation}: message {tag} is {tuple(tensor.shape)} "
                             f"{tensor.dtype}, expected {tuple(shape)} {dtype}")
        return tensor

    def drain(self, shape: tuple, dtype: torch.dtype, tag: int) -> None:
        """Drop message `tag`, now or when it comes."""
        with self._cond:
            if self._mailbox.pop(tag, None) is None and self._down is None:
                self._unwanted.add(tag)

    @property
    def in_flight(self) -> int:
        """Sends not yet taken by the peer, messages not yet taken here, and drains not yet matched."""
        with self._cond:
            return self._sending + len(self._mailbox) + len(self._unwanted)

    def close(self, reason: str = "closed") -> None:
        """Release every caller waiting on this end at once; the end is not used again."""
        self._go_down(reason)
        self._outbox.put(None)
        if self.on_device:
            for name in (self._out, self._in):
                _abort_nccl(name)
        threading.Thread(target=self._destroy, daemon=True, name=f"draft-channel-close-{self.generation}").start()

    # -- the threads --
    def _go_down(self, reason: str) -> None:
        with self._cond:
            if self._down is None:
                self._down = reason
                self._unwanted.clear()
            self._cond.notify_all()

    def _transfer(self, op, tensor: torch.Tensor, group: str) -> None:
        op(tensor, self.peer, group)
        if self.on_device:   # Ray queues NCCL's transfer on the group's stream: wait for it here
            _nccl_stream(group).synchronize()

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            tag, tensor, ready = item
            try:
                if ready is not None:
                    ready.synchronize()
                if self._down is None:
                    header = torch.tensor(_header(tag, tensor), dtype=torch.int64).to(self.device)
                    self._transfer(collective.send, header, self._out)
                    self._transfer(collective.send, tensor, self._out)
            except Exception as e:  # noqa: BLE001 - the peer died or the end was closed: recv callers learn it
                self._go_down(f"a send failed ({e})")
            finally:
                with self._cond:
                    self._sending -= 1
                    self._cond.notify_all()

    def _recv_loop(self) -> None:
        try:
            while self._down is None:
                header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
                self._transfer(collective.recv, header, self._in)
                tag, dtype, shape = _parse_header(header.tolist())
                payload = torch.empty(shape, dtype=dtype, device=self.device)
                self._transfer(collective.recv, payload, self._in)
                with self._cond:
                    if tag in self._unwanted:
                        self._unwanted.discard(tag)
                    elif self._down is None:
                        self._mailbox[tag] = payload
                    self._cond.notify_all()
        except Exception as e:  # noqa: BLE001 - the peer died or the end was closed
            self._go_down(f"the peer's messages stopped ({e})")

    def _destroy(self) -> None:
        for name in (self._out, self._in):
            try:
                collective.destroy_collective_group(name)
            except Exception as e:  # noqa: BLE001 - a group already gone
                log.debug("draft channel group %s: %s", name, e)


def _header(tag: int, tensor: torch.Tensor) -> list[int]:
    if tensor.dim() > HEADER_LEN - 3 or tensor.dtype not in DTYPES:
        raise ValueError(f"the draft channel carries int64/float32 tensors of up to 3 dims, not {tensor.dtype} "
                         f"{tuple(tensor.shape)}")
    dims = list(tensor.shape) + [0] * (HEADER_LEN - 3 - tensor.dim())
    return [tag, DTYPES.index(tensor.dtype), tensor.dim(), *dims]


def _parse_header(header: list[int]) -> tuple[int, torch.dtype, tuple]:
    tag, dtype, ndim, *dims = header
    return tag, DTYPES[dtype], tuple(dims[:ndim])


def _nccl_stream(group: str):
    """The CUDA stream Ray's NCCL group queues its point-to-point transfers on (one peer, one GPU: one
    communicator). Ray's API returns once a transfer is queued and exposes no handle to wait on."""
    handle = collective.get_group_handle(group)
    (streams,) = handle._dev_streams_map.values()
    return torch.cuda.ExternalStream(streams[0].ptr)


def _abort_nccl(group: str) -> None:
    """Abort the group's NCCL communicators: a transfer waiting for a dead or hung peer returns."""
    try:
        handle = collective.get_group_handle(group)
        for key, comms in list(handle._dev_comm_map.items()):
            for comm in comms or ():
                comm.abort()
            handle._dev_comm_map[key] = []   # aborted: destroy_group must not destroy them again
    except Exception as e:  # noqa: BLE001 - never built, or already gone
        log.debug("draft channel group %s: abort: %s", group, e)


# ---- run in the workers (open_channel_end / close_channel_end, in their actors' channel thread) -----------
def open_end(worker, spec: ChannelSpec, rank: int) -> None:
    """A worker's end of `spec`'s channel; the end of an earlier generation is closed first."""
    old, worker.link = worker.link, None
    if old is not None:
        old.close(f"replaced by generation {spec.generation}")
    worker.link = ChannelEnd.open(spec, rank, worker.config.step_timeout_s)


def close_end(worker, generation: int, reason: str) -> None:
    link = worker.link
    if isinstance(link, ChannelEnd) and link.generation == generation:
        link.close(reason)
