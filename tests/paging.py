"""A contiguous per-slot KV cache laid out as a paged one, for comparing the paged kernels with references
that read the contiguous layout."""
import math

import torch


def paginate(k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int, seed: int = 0):
    """[S, R, Hkv, D] caches -> (k_pool, v_pool [NB, block_size, Hkv, D], block_tables [S, W]) holding the same
    K/V: each slot's positions in blocks scattered over the pool in a shuffled order (block 0, the null block,
    unused and NaN, as are the rows past R), so a kernel that ignores the table or reads past a slot's blocks
    reads the wrong keys or NaN."""
    S, R, H, D = k_cache.shape
    W = math.ceil(R / block_size)
    gen = torch.Generator().manual_seed(seed)
    order = (torch.randperm(S * W, generator=gen) + 1).to(k_cache.device)  # physical ids, never 0
    tables = order.view(S, W)
    pools = []
    for cache in (k_cache, v_cache):
        pool = torch.full((S * W + 1, block_size, H, D), float("nan"), dtype=cache.dtype, device=cache.device)
        padded = torch.full((S, W * block_size, H, D), float("nan"), dtype=cache.dtype, device=cache.device)
        padded[:, :R] = cache
        pool[tables.flatten()] = padded.view(S * W, block_size, H, D)
        pools.append(pool)
    return pools[0], pools[1], tables
