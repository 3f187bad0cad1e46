"""A Hugging Face model folder's config.json and generation_config.json, read without torch: the engine builds its
ModelConfig (engine/model.py) from them, and the Serve ingress, which runs no model, takes the EOS ids."""
from __future__ import annotations

import json
from pathlib import Path


def read_hf_config(path) -> tuple[dict, dict]:
    """(config.json, generation_config.json or {}) of model folder `path`."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json (expected a Hugging Face model folder)")
    hf = json.loads((path / "config.json").read_text())
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    return hf, gen


def as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def eos_token_ids(hf: dict, gen: dict | None = None) -> tuple[int, ...]:
    """The union of config.json's and generation_config.json's EOS ids, in that order."""
    return tuple(dict.fromkeys(as_ids(hf.get("eos_token_id")) + as_ids((gen or {}).get("eos_token_id"))))
