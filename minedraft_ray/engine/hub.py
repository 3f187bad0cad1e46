"""Models by Hugging Face Hub id ("Qwen/Qwen3-8B"): a local snapshot through huggingface_hub.snapshot_download.

Only what the engine reads is fetched (`ALLOW_PATTERNS`: config and tokenizer files, safetensors, the chat
template). The cache is huggingface_hub's own layout (models--org--name/snapshots/<commit>/, refs/<branch>), so a
cache filled by `hf download`, transformers or vLLM is reused. HF_HUB_OFFLINE, HF_HUB_CACHE and HF_HOME are read at
each call (not when huggingface_hub was imported), so a process that sets them late still gets them.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..config import EngineConfig, is_hub_id

ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class ModelNotFoundError(FileNotFoundError):
    """A Hub model that cannot be had: not cached, and the Hub unreachable, offline, or without it."""


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")   # huggingface_hub's reading


def hub_cache_dir(download_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder in use: download_dir, else HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if download_dir:
        return Path(download_dir)
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def missing_files(folder: Path) -> list[str]:
    """What the engine needs that a snapshot lacks: config.json, a tokenizer, safetensors weights."""
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        missing.append("tokenizer files (" + " or ".join(TOKENIZER_FILES[:3]) + ")")
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    return missing


def download_model(repo_id: str, revision: str | None = None, download_dir: str | os.PathLike | None = None) -> str:
    """The local snapshot folder of `repo_id` at `revision`, downloaded unless cached (or offline)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    cache = hub_cache_dir(download_dir)
    offline = _truthy(os.environ.get("HF_HUB_OFFLINE"))
    what = f"model {repo_id!r} (revision {revision or 'main'})"
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=str(cache), local_files_only=offline,
                                        allow_patterns=ALLOW_PATTERNS))
    except GatedRepoError as e:
        raise ModelNotFoundError(f"{what} is gated on the Hub: accept its terms and log in (hf auth login) or "
                                 f"set HF_TOKEN ({e.__class__.__name__})") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"{what}: no such repository on the Hub (or it is private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{what}: the repository has no such revision") from None
    except LocalEntryNotFoundError:
        why = ("HF_HUB_OFFLINE is set" if offline else
               "the Hugging Face Hub is unreachable")
        raise ModelNotFoundError(
            f"{what} is not in the Hugging Face cache at {cache} and {why}. Missing: its snapshot "
            f"({cache / ('models--' + repo_id.replace('/', '--'))}/snapshots/<commit>/ with config.json, tokenizer "
            f"files and *.safetensors). Download it where the Hub is reachable (hf download {repo_id}"
            f"{' --revision ' + revision if revision else ''} --cache-dir {cache}), or pass a local folder."
        ) from None
    missing = missing_files(folder)
    if missing:
        raise ModelNotFoundError(f"{what}: the cached snapshot {folder} lacks {', '.join(missing)}"
                                 + (" (HF_HUB_OFFLINE is set: nothing was downloaded)" if offline else ""))
    return str(folder)


def resolve_hub_model(spec: str | os.PathLike | None, revision: str | None = None,
                      download_dir: str | os.PathLike | None = None) -> str | None:
    """A local folder for a Hub id; anything else is returned unchanged (str), None stays None."""
    if spec is None:
        return None
    return download_model(str(spec), revision, download_dir) if is_hub_id(spec) else str(spec)


def model_dirs(config: EngineConfig) -> tuple[str, str | None]:
    """The local folders of `config`'s target and draft on this node: Hub ids at their revisions, downloaded to
    (or found in) its download_dir, random:<preset> materialised, paths as they are."""
    from .presets import resolve_model

    return (resolve_model(config.target, config.revision, config.download_dir),
            resolve_model(config.draft, config.draft_revision, config.download_dir))


def with_local_models(config: EngineConfig) -> EngineConfig:
    """`config` with its target and draft resolved to local folders (model_dirs), served under the same model id
    as before. Runs on each node that loads the models: a folder of one node's cache is not a path on another."""
    target, draft = model_dirs(config)
    return config.model_copy(update={"target": target, "draft": draft, "model_name": config.served_model_name})


HUB_ENV = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT")


def hub_env_vars() -> dict:
    """The Hugging Face settings of the process that starts an engine, as Ray actor options for the processes
    that resolve its Hub ids: they run in Ray workers, whose environment is the cluster's. Tokens are not
    forwarded (the cluster's own apply)."""
    env = {name: os.environ[name] for name in HUB_ENV if name in os.environ}
    return {"runtime_env": {"env_vars": env}} if env else {}
