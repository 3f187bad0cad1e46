"""What the batch manager raises to its callers, importable without the manager (and torch): the Serve ingress
tells these apart in the answers of an engine replica."""


class EngineOverloadedError(RuntimeError):
    """The bounded queue is full: the caller should retry later (HTTP 429/503)."""


class EngineDeadError(RuntimeError):
    """The verifier (target model) is gone: no request can complete."""
