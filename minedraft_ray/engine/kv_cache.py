"""Preallocated per-request KV slots with per-slot lengths on the device.

Rolling back rejected tokens is `lengths[slot] -= n`: the stale K/V rows stay in place and are
overwritten by the next append, so no copies happen on rejection.
"""
from __future__ import annotations

import torch

MAX_K = 8  # longest draft the cache reserves headroom for (verify writes k+1 rows past the length)
HEADROOM = MAX_K + 2


class SlotsExhaustedError(RuntimeError):
    pass


class CacheSizeError(ValueError):
    pass


class KVCache:
    """K/V for `num_slots` requests of up to `max_len` tokens each.

    k[l], v[l]: [S, R, Hkv, D] with R = max_len + HEADROOM; lengths: [S] int64 (tokens valid per slot).
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.num_slots, self.max_len = num_slots, max_len
        rows = max_len + HEADROOM
        shape = (num_slots, rows, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(num_slots, dtype=torch.int64, device=device)

    @staticmethod
    def bytes_per_slot(num_layers: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * num_layers * (max_len + HEADROOM) * num_kv_heads * head_dim * elem

    @classmethod
    def fit_num_slots(cls, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device | str, requested: int | None, memory_fraction: float = 0.9,
                      reserve_bytes: int = 0) -> int:
        """Slots that fit in free device memory (or `requested`, checked against it).

        Raises CacheSizeError naming what fits when the request cannot be met.
        """
        per_slot = cls.bytes_per_slot(num_layers, max_len, num_kv_heads, head_dim, dtype)
        device = torch.device(device)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * memory_fraction) - reserve_bytes
        else:  # CPU: host memory is not the constraint we size for; honour the request
            budget = None
        if budget is not None:
            fits = max(budget // per_slot, 0)
            if requested is None:
                if fits < 1:
                    raise CacheSizeError(
                        f"no KV slot of max_len={max_len} fits in free device memory "
                        f"({budget / 2**30:.2f} GiB available, {per_slot / 2**20:.1f} MiB per slot); lower max_len")
                return int(fits)
            if requested > fits:
                raise CacheSizeError(
                    f"{requested} KV slots of max_len={max_len} need {requested * per_slot / 2**30:.2f} GiB, "
                    f"but only {fits} slots ({budget / 2**30:.2f} GiB) fit; lower num_slots or max_len")
        if requested is None:
            raise CacheSizeError("num_slots must be given explicitly on a CPU device")
        return requested


class SlotAllocator:
    """Hands out slot indices; freeing a slot makes it reusable (its length is reset by the next prefill)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    def alloc(self) -> int:
        if not self._free:
            raise SlotsExhaustedError(f"all {self.num_slots} KV slots are in use")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)
