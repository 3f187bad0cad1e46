"""OpenAI wire format: request models, the field policy, the error JSON, logprobs formatting.

Known fields are validated strictly from the raw body (`parse`): malformed JSON or a wrong type ("5" for an
int, 2.0 for n) is a 400 naming the parameter. Everything else follows one policy, the table in
docs/openai-compat.md, so that clients written for OpenAI's API or vLLM's server work unchanged:

- implemented: the sampling fields, stop strings and `stop_token_ids`, logprobs, n, seed, streaming;
- accepted at their no-op values only (`NEUTRAL`): penalties 0, repetition_penalty 1, min_p 0, min_tokens 0,
  logit_bias {}, echo false, ... Any other value would silently change the answer: a 400 names the field;
- meaning-changing features not implemented (tools that are actually requested, JSON output, guided decoding,
  vLLM's per-request chat template ...): a 400 naming the field;
- harmless (`IGNORED`: user, store, metadata, service_tier, a message's name, ...) and unknown fields: accepted
  and ignored. `ignored_fields` lists them; the server logs each name once per process and counts it.
"""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.sampling_params import MAX_LOGPROBS
from .guard import RETRY_AFTER_S

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
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
        err = errors[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        code = ("missing_required_parameter" if err["type"] == "missing"
                else "invalid_type" if err["type"].endswith("_type") else "invalid_value")
        where = f"{param}: " if param else ""
        raise APIError(400, f"Invalid request: {where}{err['msg']}", param=param, code=code) from None


# field -> the values at which an unimplemented parameter changes nothing (None: the field is absent)
NEUTRAL: dict[str, tuple] = {
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "min_p": (None, 0), "min_tokens": (None, 0), "logit_bias": (None, {}), "best_of": (None, 1),
    "echo": (None, False), "suffix": (None, ""), "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True), "prompt_logprobs": (None,), "allowed_token_ids": (None,),
    "bad_words": (None, []), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "structured_outputs": (None,), "chat_template": (None,), "truncate_prompt_tokens": (None,),
    "use_beam_search": (None, False), "length_penalty": (None, 1), "logits_processors": (None,),
}
# accepted and ignored: no effect on the output of this server (documented per field in docs/openai-compat.md)
IGNORED = ("user", "store", "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key",
           "safety_identifier", "spaces_between_special_tokens", "add_special_tokens", "priority",
           "cache_salt", "kv_transfer_params", "vllm_xargs", "modalities", "prediction", "reasoning_effort",
           "documents", "return_tokens_as_token_ids", "return_token_ids", "request_id")


# transformers' apply_chat_template parameters (and the template's own inputs) that a client may not set
RESERVED_TEMPLATE_KWARGS = frozenset((
    "chat_template", "conversation", "messages", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"))
UNSUPPORTED_HINT = (" (not implemented by this server, and ignoring them would change the answer: penalties, min_p, "
                    "min_tokens and logit_bias are accepted at their no-op values only (0; 1 for repetition_penalty; "
                    "{}), tools with tool_choice \"none\", response_format {\"type\": \"text\"}; see "
                    "docs/openai-compat.md)")


class _Strict(BaseModel):
    # extra="allow": unknown fields are kept in model_extra and reported by `ignored_fields`, never a 400
    model_config = ConfigDict(strict=True, extra="allow", protected_namespaces=())


def _is_neutral(value, neutrals: tuple) -> bool:
    for neutral in neutrals:
        if neutral is None or isinstance(neutral, bool) or isinstance(value, bool):
            if value is neutral:   # true is not 1 here, nor false 0
                return True
        elif value == neutral:
            return True
    return False


class StreamOptions(_Strict):
    include_usage: bool = False


class _CommonRequest(_Strict):
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="extension (vLLM): 0 or -1 = off")
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="extension (vLLM): token ids that end the output")
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="extension (vLLM): generate through EOS up to max_tokens")
    # parameters without an implementation: accepted only at values that change nothing (NEUTRAL)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
        if any(not s for s in stop):
            raise APIError(400, "stop: stop strings must not be empty", param="stop")
        return stop

    def stop_token_id_set(self, vocab_size: int) -> tuple[int, ...]:
        ids = tuple(dict.fromkeys(self.stop_token_ids or ()))
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise APIError(400, f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                           param="stop_token_ids")
        if any(not 0 <= t < vocab_size for t in ids):
            raise APIError(400, f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")
        return ids

    def _fields(self) -> dict[str, Any]:
        """Every field the client sent, declared or not, with its value."""
        # in the order the fields are declared: the first unsupported one named in an error is the same every time
        sent = {name: getattr(self, name) for name in type(self).model_fields if name in self.model_fields_set}
        return {**sent, **(self.model_extra or {})}

    def unsupported(self) -> list[str]:
        """Fields whose value this server cannot honour, so ignoring them would change the answer."""
        return [name for name, value in self._fields().items()
                if name in NEUTRAL and not _is_neutral(value, NEUTRAL[name])]

    def ignored_fields(self) -> list[str]:
        """Fields accepted and ignored: the harmless ones and unknown ones (`IGNORED`, model_extra), plus
        neutral-only ones sent at their no-op value."""
        names = [name for name in self._fields() if name in IGNORED or name in NEUTRAL
                 or name not in type(self).model_fields]
        return sorted(names)

    def check(self) -> None:
        names = self.unsupported()
        if names:
            raise unsupported_error(names, UNSUPPORTED_HINT)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")


class CompletionRequest(_CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None   # a participant's name: not passed to the chat template (as vLLM)

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
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extension (vLLM): extra variables for the chat template, e.g. enable_thinking")

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        if (self.response_format or {}).get("type", "text") != "text":   # json_object, json_schema
            names.append("response_format")
        # tool definitions change nothing while the model may not call them (tool_choice "none")
        for tools, choice in (("tools", "tool_choice"), ("functions", "function_call")):
            offered, chosen = getattr(self, tools), getattr(self, choice)
            if offered and chosen != "none":
                names.append(tools)
            elif chosen not in (None, "none", "auto"):   # a forced call or "required"
                names.append(choice)
        return names

    def ignored_fields(self) -> list[str]:
        names = set(super().ignored_fields())
        for tools, choice in (("tools", "tool_choice"), ("functions", "function_call")):
            if getattr(self, tools) or getattr(self, choice) is not None:
                names.update(n for n in (tools, choice) if n in self.model_fields_set)
        if self.response_format is not None:
            names.add("response_format")
        for message in self.messages:
            names.update(f"messages.{name}" for name in message.model_fields_set | set(message.model_extra or {})
                         if name not in ("role", "content"))
        return sorted(names)

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree; send one", param="max_tokens")

    def chat_template_variables(self) -> dict[str, Any]:
        """chat_template_kwargs as template variables. Names of apply_chat_template's own parameters are refused:
        they would replace the server's template (chat_template), offer tools, or change what is rendered."""
        variables = self.chat_template_kwargs or {}
        reserved = sorted(set(variables) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise APIError(400, f"chat_template_kwargs: {', '.join(reserved)} cannot be set per request",
                           param="chat_template_kwargs")
        return variables

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
