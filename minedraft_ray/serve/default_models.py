"""The models `EngineConfig()` points at when no flags are given.

Defaults are the embedded pair under minedraft_ray/assets/. While that folder is absent, the tiny random
test pair (`minedraft_ray.testing.tiny`) is built once into a cache folder and used instead, so that
`minedraft serve` and `serve run deployments/minedraft.yaml` work out of the box. The cache folder is
$MINEDRAFT_CACHE (default ~/.cache/minedraft), as for the random-weight presets.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..config import EngineConfig, default_draft, default_target
from ..engine.presets import cache_root

TINY_NAME = "minedraft-tiny"


def tiny_pair(root: Path | None = None) -> tuple[Path, Path]:
    """(target, draft) folders of the tiny pair, built on first use. Concurrent callers are safe: each builds
    in its own folder and the first rename wins."""
    root = Path(root) if root is not None else cache_root()
    pair = root / "tiny-pair"
    if not (pair / "draft" / "config.json").is_file():
        from ..testing.tiny import make_noised_draft, make_tiny_model

        root.mkdir(parents=True, exist_ok=True)
        work = root / f"tiny-pair.tmp-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        make_tiny_model(work / "target", "llama")
        make_noised_draft(work / "target", work / "draft")
        try:
            os.rename(work, pair)
        except OSError:  # another process got there first
            shutil.rmtree(work, ignore_errors=True)
    return pair / "target", pair / "draft"


def resolve_models(config: EngineConfig, root: Path | None = None) -> EngineConfig:
    """Swap the default (embedded) pair for the tiny pair while the embedded one is not installed."""
    if config.target != default_target() or Path(config.target).is_dir():
        return config
    target, draft = tiny_pair(root)
    update = {"target": str(target), "model_name": config.model_name or TINY_NAME}
    if config.draft == default_draft():
        update["draft"] = str(draft)
    return config.model_copy(update=update)
