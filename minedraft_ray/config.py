"""One schema for the engine settings: CLI flags, MINEDRAFT_* environment variables and the
`applications[].args` of Serve config YAMLs all validate through `EngineConfig`."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MODES = ("ar", "sd", "sd_split", "psd")
Mode = Literal["ar", "sd", "sd_split", "psd"]
ASSETS = Path(__file__).parent / "assets"
ENV_PREFIX = "MINEDRAFT_"
DEFAULT_MODEL_NAME = "minedraft-default"  # the id the embedded pair is served under


def default_target() -> str:
    return str(ASSETS / "default-target")


def default_draft() -> str:
    return str(ASSETS / "default-draft")


_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9_.-]{1,96}")


def is_hub_id(spec: str | os.PathLike | None) -> bool:
    """A Hugging Face Hub repo id ("org/name") that is not an existing local path (a local folder wins, as in
    transformers and vLLM)."""
    if spec is None:
        return False
    spec = str(spec)
    return bool(_HUB_ID.fullmatch(spec)) and ".." not in spec and not os.path.exists(spec)


ChunkGapReference = Literal["recent", "typical"]   # what chunk_gap_ratio multiplies (runtime/chunk_budget.py)


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    target: str = Field(default_factory=default_target, description="target model: a folder (HF format) or a "
                        "Hugging Face Hub id such as Qwen/Qwen3-8B")
    draft: str | None = Field(default_factory=default_draft, description="draft model: a folder or a Hub id")
    model_name: str | None = Field(None, description="model id served by the API (default: the target's Hub id, or "
                                   "its folder name)")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of a target given by Hub id "
                                 "(default: main)")
    draft_revision: str | None = Field(None, description="Hub revision of a draft given by Hub id (default: main)")
    download_dir: str | None = Field(None, description="Hugging Face cache folder for Hub ids (default: HF_HUB_CACHE, "
                                     "else HF_HOME/hub); HF_HUB_OFFLINE=1 uses only what is there")
    chat_template: str | None = Field(None, description="chat template overriding the tokenizer's: a file path or "
                                      "the Jinja text itself")
    cors_allow_origins: list[str] = Field([], description="origins allowed to call the API from a "
                                          "browser (CORS), comma-separated; '*' any; empty: CORS off")
    mode: Mode = Field("psd", description="ar | sd | sd_split | psd")
    k: int = Field(4, ge=1, le=8, description="draft tokens per verify step")
    max_batch: int = Field(8, ge=1, le=512, description="requests per verify step (psd holds 2x)")
    tp: int = Field(1, ge=1, le=8, description="the target's tensor-parallel size: GPUs its ranks span, on one node "
                    "(psd and sd_split add one for the drafter, which always runs on one GPU)")
    max_len: int | None = Field(None, ge=16, description="tokens per request: prompt + output (default: the target's "
                                "context, max_position_embeddings, lowered to what the KV pools hold)")
    num_slots: int | None = Field(None, ge=1, description="KV slots per model (default: what the mode holds)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="share of each GPU's memory the worker may "
                                          "fill (weights, KV pool, activations); the KV pool takes what is left")
    block_size: int = Field(16, ge=1, le=256, description="tokens per KV block (a power of two)")
    num_kv_blocks: int | None = Field(None, ge=2, description="KV blocks per model's pool (default: from memory, "
                                      "gpu_memory_utilization)")
    prefix_caching: bool = Field(False, description="share the KV blocks of common prompt prefixes across "
                                 "requests, in both models")
    draft_temperature: float = Field(0.0, ge=0.0, description="0 = greedy drafting (only ids travel)")
    draft_top_k: int = Field(64, ge=0, description="probabilistic drafting proposes from the drafter's most "
                             "likely tokens, this many (renormalised; still lossless), and only their (prob, id) "
                             "pairs cross between the GPUs, not the vocabulary's probabilities; 0 (or 2 x this >= the "
                             "vocabulary): the whole vocabulary")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    cuda_graphs: bool = True
    packed_prefill: bool = Field(True, description="prefill prompts packed back to back in one varlen launch; off: "
                                 "each padded to the longest (the older engine, kept for comparison)")
    prefill_chunk_tokens: int | None = Field(
        None, ge=0, description="the per-step token budget: prompt tokens prefilled per verifier step (with "
        "fused_prefill, while requests decode: the tokens of the step's whole launch, the verify's included). Prompts "
        "are cut into chunks that ride along with the decode/verify steps, so a long prompt delays a running "
        "request's next token by at most one chunk (default: 512 on a GPU, 256 on a CPU); 0: whole prompts at once "
        "(unchunked)")
    fused_prefill: bool = Field(True, description="while requests decode, a step's prompt chunk runs inside its "
                                "verify's launch (one launch, not two), and the budget bounds the whole launch: the "
                                "verify's tokens plus the chunk's; off: the chunk is a launch of its own before the "
                                "verify (needs packed_prefill and a budget)")
    prefill_order: Literal["shortest", "arrival"] = Field(
        "shortest", description="who takes the step's prefill budget first among the prompts being prefilled: the "
        "fewest tokens left (shortest; a prompt that later ones have overtaken by its own length goes first, so "
        "none starves) or admission order (arrival)")
    chunk_gap_ratio: float = Field(
        0.0, ge=0, description="while requests decode, size each step's prompt chunk from the engine's measured step "
        "times so that a step with a chunk takes at most this many times one without (2: a running request's time "
        "between tokens at most doubles while prompts prefill; a long prompt's own first token comes later), "
        "within prefill_chunk_tokens; 0: the fixed budget (runtime/chunk_budget.py)")
    chunk_gap_reference: ChunkGapReference = Field(
        "recent", description="the step without a chunk that chunk_gap_ratio multiplies: the recent ones' moving "
        "average (recent, which grows with the batch while prompts arrive), or the shorter of that and the median "
        "of those over the last few hundred steps (typical: what a running request usually waits; smaller chunks "
        "while the batch is larger than usual)")
    transport: Literal["auto", "object_store", "collective", "ray_collective"] = Field(
        "auto", description="draft channel (runtime/transport.py, docs/transport.md); auto: collective where the "
        "workers compute on GPUs, object_store on CPUs; ray_collective: Ray's collective groups (NCCL on GPUs)")
    psd_min_requests: int = Field(2, ge=2, description="psd runs one sequential batch below this load")
    psd_low_load: Literal["auto", "psd", "seq"] = Field(
        "seq", description="psd at loads one batch holds (<= max_batch running): one sequential batch (seq, "
        "the default: the split did not shorten the per-request cadence there, docs/design.md), the split (psd), "
        "or measure both (auto)")
    psd_high_load: Literal["auto", "psd", "seq"] = Field(
        "auto", description="psd when more requests want to run than one batch holds: split them into two "
        "batches (up to 2x max_batch running), or keep one sequential batch and queue the rest (seq); auto "
        "queues until the demand fills both batches, then measures the verifier's time per row in both and "
        "takes the split only where it is cheaper")
    verifier_overlap: bool | None = Field(None, description="the verifier's next queued step launches while the "
                                          "current one runs on the device (default: on a GPU, off on a CPU)")
    drafter_overlap: bool | None = Field(None, description="the drafter's next queued round waits for its tokens "
                                         "and launches while the current one runs (default: as verifier_overlap)")
    step_timeout_s: float = Field(120.0, gt=0, description="longest wait for any actor call")
    stream_interval_ms: float = Field(20.0, ge=0, le=1000, description="least time between two streamed outputs "
                                      "of a request (first and last go at once); 0: one per step")
    max_queued: int = Field(256, ge=0, description="new requests waiting beyond the running ones "
                            "(preempted ones keep their place); then 429/503")
    torch_threads: int | None = Field(None, ge=1, description="torch threads per actor (CPU)")
    # scale-out (Serve): data-parallel engine replicas, each with its own drafter+verifier placement group
    num_replicas: int = Field(1, ge=1, description="engine replicas (autoscaling: the initial count)")
    min_replicas: int | None = Field(None, ge=1, description="autoscaling floor (default 1; needs max_replicas)")
    max_replicas: int | None = Field(None, ge=1, description="autoscale engine replicas up to this many")
    # the OpenAI ingress (tokenize, detokenize, SSE) scales on its own: it serves every engine replica's streams
    ingress_replicas: int = Field(1, ge=1, description="OpenAI ingress replicas (autoscaling: the initial count)")
    ingress_max_replicas: int | None = Field(None, ge=1, description="autoscale ingress replicas up to this many")
    ingress_cpus: float = Field(0.1, gt=0, description="CPUs reserved per ingress replica (a Ray reservation, "
                                "not a cap: what it takes from the cluster's schedulable CPUs)")
    ingress_http: Literal["auto", "proxy", "direct"] = Field(
        "auto", description="how clients reach the ingress: 'proxy' (Serve's HTTP proxy: one URL for all ingress "
        "replicas), 'direct' (each ingress replica serves HTTP itself, a URL each, no proxy hop; the Ray instance "
        "needs RAY_SERVE_ENABLE_DIRECT_INGRESS=1, which `minedraft serve` sets on its own) or 'auto' (direct on "
        "`minedraft serve`'s own instance with one fixed ingress replica, else what the Ray instance runs)")
    # ingress and failure handling (serve/guard.py, serve/app.py, docs/security.md)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="largest request body in bytes; a larger "
                                "one is answered 413")
    body_timeout_s: float = Field(30.0, gt=0, description="time a request's body has to arrive after its headers; "
                                  "then 408 and the connection is closed")
    header_timeout_s: float = Field(10.0, gt=0, description="time a request's headers have to arrive; then the "
                                    "connection is closed")
    health_check_period_s: float = Field(1.0, gt=0, description="Serve's health check of an engine replica: a "
                                         "dead engine is replaced at the next one")
    graceful_shutdown_s: float = Field(20.0, ge=0, description="on shutdown, running requests get this long to "
                                       "finish before their streams end with an error")

    @field_validator("target", "draft", mode="before")
    @classmethod
    def _path_to_str(cls, value):
        return str(value) if isinstance(value, os.PathLike) else value

    @field_validator("cors_allow_origins", mode="before")
    @classmethod
    def _split_origins(cls, value):   # a flag or MINEDRAFT_CORS_ALLOW_ORIGINS: "https://a.example,https://b.example"
        return [o.strip() for o in value.split(",") if o.strip()] if isinstance(value, str) else value

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value):
        if value & (value - 1):
            raise ValueError(f"block_size must be a power of two, got {value}")
        return value

    @model_validator(mode="after")
    def _check(self):
        if self.mode != "ar" and not self.draft:
            raise ValueError(f"mode {self.mode!r} needs a draft model")
        if self.max_replicas is None:
            if self.min_replicas is not None:
                raise ValueError("min_replicas needs max_replicas (autoscaling)")
        elif (self.min_replicas or 1) > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        if 0 < self.chunk_gap_ratio <= 1:
            raise ValueError(f"chunk_gap_ratio is 0 (a fixed budget) or above 1, not {self.chunk_gap_ratio}")
        if self.chunk_gap_ratio and self.prefill_chunk_tokens == 0:
            raise ValueError("chunk_gap_ratio sizes chunks within a budget: prefill_chunk_tokens 0 has none")
        if self.chunk_gap_reference != "recent" and not self.chunk_gap_ratio:
            raise ValueError("chunk_gap_reference is what chunk_gap_ratio multiplies: set the ratio too")
        if self.ingress_max_replicas is not None and self.ingress_replicas > self.ingress_max_replicas:
            raise ValueError(f"ingress_replicas ({self.ingress_replicas}) > ingress_max_replicas "
                             f"({self.ingress_max_replicas})")
        return self

    @property
    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        if self.target == default_target():
            return DEFAULT_MODEL_NAME
        return self.target if is_hub_id(self.target) else Path(self.target).name

    @property
    def uses_drafter(self) -> bool:
        return self.mode != "ar"

    @property
    def max_running(self) -> int:
        """Requests held in flight: psd keeps two batches of max_batch."""
        return 2 * self.max_batch if self.mode == "psd" else self.max_batch

    @classmethod
    def from_env(cls, overrides: dict[str, Any] | None = None, environ: dict[str, str] | None = None) -> "EngineConfig":
        """Settings from MINEDRAFT_<FIELD> variables, then `overrides` (CLI flags / YAML args) on top."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is not None:
                nullable = ("draft", "max_len", "num_slots", "num_kv_blocks", "prefill_chunk_tokens", "min_replicas",
                            "max_replicas", "ingress_max_replicas")
                values[name] = None if raw.lower() in ("", "none", "null") and name in nullable else raw
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls.model_validate(values)
