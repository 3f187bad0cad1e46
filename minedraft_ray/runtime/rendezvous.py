"""Where a torch.distributed group of actors meets: a TCPStore hosted by one process, its address handed to the
members through Ray (as actor arguments or a call's result). The target's tensor-parallel ranks use it
(actors.py); a drafter-verifier channel can host its group's store the same way.

The store listens on the given address only (the node's IP, 127.0.0.1 on a loopback-only instance): torch's
TCPStore binds every interface by default, so the listening socket is bound here and handed over.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class Rendezvous:
    """The address members connect to, and the group's name within the store (a prefix of its keys)."""
    host: str
    port: int
    group: str
    timeout_s: float

    def join(self) -> dist.Store:
        """A member's connection to the store (blocks until it is reached, the timeout at most)."""
        store = dist.TCPStore(self.host, self.port, None, False, timeout=timedelta(seconds=self.timeout_s))
        return dist.PrefixStore(self.group, store)


def host_store(host: str, group: str, timeout_s: float) -> tuple[dist.TCPStore, Rendezvous]:
    """A store listening on host:<free port> -> (the store, which must live until every member has connected;
    the address to hand to the members)."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen()
    port = listener.getsockname()[1]
    store = dist.TCPStore(host, port, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                          master_listen_fd=listener.detach(), use_libuv=True)
    return store, Rendezvous(host, port, group, timeout_s)
