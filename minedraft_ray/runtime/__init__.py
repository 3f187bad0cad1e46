"""Ray layer: drafter/verifier actors, the batch manager, the LLM API."""
from .llm import LLM, RequestOutput
from .manager import BatchManager, EngineDeadError, EngineOverloadedError, StepOutput
from .placement import make_bundles

__all__ = ["LLM", "RequestOutput", "BatchManager", "EngineDeadError", "EngineOverloadedError", "StepOutput",
           "make_bundles"]
