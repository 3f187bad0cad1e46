"""minedraft-ray: batch-parallel speculative decoding (MineDraft) served on Ray.

    from minedraft_ray import LLM, SamplingParams
    llm = LLM(target_dir, draft_dir, mode="psd", k=4, max_batch=16)
"""
__version__ = "0.1.0"

_LAZY = {
    "LLM": ("minedraft_ray.runtime.llm", "LLM"),
    "SamplingParams": ("minedraft_ray.engine.sampling", "SamplingParams"),
    "Engine": ("minedraft_ray.engine.engine", "Engine"),
    "EngineConfig": ("minedraft_ray.config", "EngineConfig"),
}


def __getattr__(name):  # imports ray/torch only when the API is used
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'minedraft_ray' has no attribute {name!r}")


__all__ = list(_LAZY)
