"""OpenAI wire format: strict request models, the error JSON, logprobs formatting.

Requests are validated strictly from the raw body (`parse`): malformed JSON, a wrong type ("5" for an
int, 2.0 for n) or an unknown field is a 400 naming the parameter. OpenAI parameters this server does not
implement are declared so that they can be accepted at values that change nothing (a zero penalty, an
empty logit_bias, echo=false, ...) and rejected, by name, at any other value (`unsupported`). `user` (an
end-user id for the provider's abuse monitoring) has no effect on the output and is accepted and ignored.
"""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.sampling import MAX_LOGPROBS
from .guard import RETRY_AFTER_S

MAX_STOP_STRINGS = 16
LOGPROB_FLOOR = -9999.0   # JSON has no -inf: tokens masked by top-k/top-p report this (as vLLM does)


class APIError(Exception):
    """An error answered with OpenAI's JSON body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        """Overload and engine restarts pass: say when to come back. A body left unread ends the connection."""
        if self.status in (429, 503):
            return {"Retry-After": str(RETRY_AFTER_S)}
        if self.status in (408, 413):
            return {"Connection": "close"}
        return {}


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def unsupported_error(names: list[str], detail: str = "") -> APIError:
    return APIError(400, f"Unsupported parameter(s): {', '.join(names)}{detail}", param=names[0],
                    code="unsupported_parameter")


def parse(model: type[BaseModel], body: bytes) -> BaseModel:
    """Validate a raw request body; any problem becomes a 400 APIError that names the parameter."""
    try:
        return model.model_validate_json(body or b"")
    except ValidationError as e:
        errors = e.errors(include_url=False)
        if any(err["type"] == "json_invalid" for err in errors):
            raise APIError(400, f"Malformed JSON body: {errors[0]['msg']}", code="invalid_json") from None
        extra = [".".join(map(str, err["loc"])) for err in errors if err["type"] == "extra_forbidden"]
        if extra:
            raise unsupported_error(extra, " (this server does not implement them)") from None
        err = errors[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        code = ("missing_required_parameter" if err["type"] == "missing"
                else "invalid_type" if err["type"].endswith("_type") else "invalid_value")
        where = f"{param}: " if param else ""
        raise APIError(400, f"Invalid request: {where}{err['msg']}", param=param, code=code) from None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", protected_namespaces=())


class StreamOptions(_Strict):
    include_usage: bool = False


class _CommonRequest(_Strict):
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="extension (vLLM): 0 or -1 = off")
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="extension (vLLM): generate through EOS up to max_tokens")
    # OpenAI parameters without an implementation: accepted only at values that change nothing
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None   # abuse-monitoring id; no effect on the output

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
        if any(not s for s in stop):
            raise APIError(400, "stop: stop strings must not be empty", param="stop")
        return stop

    def unsupported(self) -> list[str]:
        names = [name for name in ("presence_penalty", "frequency_penalty") if getattr(self, name)]
        if self.logit_bias:
            names.append("logit_bias")
        return names

    def check(self) -> None:
        names = self.unsupported()
        if names:
            raise unsupported_error(names, " (accepted only at their no-op values: 0, {}, false, null)")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")


class CompletionRequest(_CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        if self.best_of not in (None, 1):
            names.append("best_of")
        if self.echo:
            names.append("echo")
        if self.suffix:
            names.append("suffix")
        return names


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        if self.response_format not in (None, {"type": "text"}):
            names.append("response_format")
        for name in ("tools", "functions"):
            if getattr(self, name):
                names.append(name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                names.append(name)
        if self.parallel_tool_calls is not None:
            names.append("parallel_tool_calls")
        return names

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree; send one", param="max_tokens")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------- responses

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def completion_logprobs(entries: list[dict], offsets: list[int], num_top: int, strings) -> dict:
    """Legacy completions format. entries: the engine's {"token_id", "logprob", "top": [(id, logprob)]}."""
    return {"tokens": [strings.text(e["token_id"]) for e in entries],
            "token_logprobs": [finite(e["logprob"]) for e in entries],
            "top_logprobs": [{strings.text(t): finite(lp) for t, lp in e["top"][:num_top]} for e in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list[dict], num_top: int, strings) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        return {"token": strings.text(token_id), "logprob": finite(logprob), "bytes": strings.bytes(token_id)}
    return {"content": [{**item(e["token_id"], e["logprob"]),
                         "top_logprobs": [item(t, lp) for t, lp in e["top"][:num_top]]} for e in entries]}


def spec_stats(stats: list[dict | None], mode: str, k: int) -> dict:
    """The `minedraft` extension: speculative-decoding stats summed over choices (vLLM units)."""
    known = [s for s in stats if s]
    drafted = sum(s.get("drafted", 0) for s in known)
    accepted = sum(s.get("accepted", 0) for s in known)
    steps = sum(s.get("verify_steps", 0) for s in known)
    return {"mode": mode, "k": k, "verify_steps": steps, "drafted": drafted, "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "acceptance_length": 1.0 + accepted / steps if steps else 1.0,
            "choices": [_public_stats(s) for s in stats]}


def _public_stats(s: dict | None) -> dict | None:
    if not s:
        return None
    keys = ("ttft", "latency", "verify_steps", "target_only_steps", "drafted", "accepted", "acceptance_rate",
            "acceptance_length")
    return {key: s[key] for key in keys if key in s}
