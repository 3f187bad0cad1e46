"""Ray layer: drafter/verifier actors, the batch manager, the LLM API."""

_LAZY = {
    "LLM": "llm", "RequestOutput": "llm", "BatchManager": "manager", "EngineDeadError": "errors",
    "EngineOverloadedError": "errors", "StepOutput": "streams", "make_bundles": "placement",
}


def __getattr__(name):  # a light module of this package (errors, streams) must not import the manager and torch
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_LAZY)
