"""Serve layer: an OpenAI-compatible API on Ray Serve.

`build_app(args)` (minedraft_ray.serve.app) is the entry point for Serve config files
(`import_path: minedraft_ray.serve.app:build_app`) and for `minedraft serve`.
"""


def __getattr__(name):  # importing the package must not import Ray (the detokenizer is used without it)
    if name == "build_app":
        from .app import build_app
        return build_app
    raise AttributeError(f"module 'minedraft_ray.serve' has no attribute {name!r}")


__all__ = ["build_app"]
