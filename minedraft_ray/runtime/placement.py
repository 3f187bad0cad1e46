"""The MineDraft placement group: bundle 0 for the batch manager (the Serve replica under Serve),
then one {"GPU": 1, "CPU": 0.5} bundle per GPU actor, packed on one node (STRICT_PACK) so draft
tokens and the tensor-parallel target's collectives move over NVLink/PCIe and never across nodes.

A target at tensor-parallel size tp runs as tp rank actors in bundles 1..tp (rank r in bundle 1 + r); in psd and
sd_split the drafter (always one GPU) takes bundle tp + 1; in sd it shares rank 0's actor and GPU."""
from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

MANAGER_BUNDLE = {"CPU": 0.5}
GPU_BUNDLE = {"GPU": 1, "CPU": 0.5}
CPU_BUNDLE = {"CPU": 0.5}
STRATEGY = "STRICT_PACK"

# the actor roles of each mode, rank 0 of the target first
ROLES = {
    "ar": ("verifier",),
    "sd": ("spec",),               # drafter and target (rank 0) in one actor on one GPU
    "sd_split": ("verifier", "drafter"),
    "psd": ("verifier", "drafter"),
}


def cluster_has_gpus() -> bool:
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1


def bundle_index(mode: str, role: str, tp: int = 1, rank: int = 0) -> int:
    """The bundle of `role` (rank `rank` of the target for "verifier", "spec" and "rank")."""
    if role == "drafter":
        return 1 + tp
    return 1 + rank


def make_bundles(mode: str, use_gpus: bool | None = None, tp: int = 1) -> list[dict]:
    """Bundles for one engine replica. GPU bundles are used whenever the cluster has GPU
    resources (real or logical); the torch device is chosen separately by each actor."""
    if mode not in ROLES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {tuple(ROLES)}")
    if use_gpus is None:
        use_gpus = cluster_has_gpus()
    worker = GPU_BUNDLE if use_gpus else CPU_BUNDLE
    workers = tp + (1 if "drafter" in ROLES[mode] else 0)
    return [dict(MANAGER_BUNDLE)] + [dict(worker) for _ in range(workers)]


def create_placement_group(mode: str, name: str = "", timeout_s: float = 60.0, tp: int = 1) -> PlacementGroup:
    bundles = make_bundles(mode, tp=tp)
    pg = placement_group(bundles, strategy=STRATEGY, name=name)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(f"placement group {bundles} ({STRATEGY}) could not be placed within {timeout_s:.0f} s: "
                           f"cluster resources are {ray.cluster_resources()}") from None
    return pg


def actor_options(pg: PlacementGroup | None, mode: str, role: str, tp: int = 1, rank: int = 0) -> dict:
    """Ray options placing `role` (rank `rank` of the target) in its bundle of `pg` (or anywhere when pg is None)."""
    index = bundle_index(mode, role, tp, rank)
    resources = dict(pg.bundle_specs[index]) if pg is not None else dict(CPU_BUNDLE)
    opts = {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0)}
    if pg is not None:
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
    return opts
