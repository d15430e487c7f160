"""Requests of the OpenAI API the edge serves, checked and turned into a generation plan.

Only what the split can honour is accepted: one choice (``n`` = 1), text content, temperature,
top_p, top_k (the protocol's own, applied alike to p and q), seed, max_tokens /
max_completion_tokens, stop strings. Everything that would silently change the output (penalties,
logit_bias, logprobs, tools, JSON mode) is refused with a 400 that names the parameter, rather
than ignored. So is any other field that is set (not null), unless ``HARMLESS`` lists it: an
unknown field may well change the output elsewhere (min_p, repetition_penalty, functions, ...),
and ignoring it would hand back text the app did not ask for. ``model`` is accepted whatever it
says: the edge serves the one pair it was started with, so an app's existing model name works
unchanged; responses name the served model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from specsplit.edge.client import GenerationConfig
from specsplit.shared.sampling import SamplingConfig

# The cloud caps max_new_tokens to its context, so "no limit" (OpenAI's default) is a big number.
UNLIMITED = 1 << 30
MAX_STOPS = 4  # OpenAI's own limit
# Each stop string is matched against the text's tail on every delta (edge.openai.text), at a
# cost that grows with its square: a megabyte-long one would stall the endpoint.
MAX_STOP_CHARS = 256
# Fields this endpoint does not read that change no output: bookkeeping, caching and routing
# hints of OpenAI's API. Any other field we do not declare is refused when set.
HARMLESS = frozenset({"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})


class APIError(Exception):
    """An error the endpoint answers with as OpenAI error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Params(BaseModel):
    """Parameters both endpoints share."""

    model_config = ConfigDict(extra="allow")  # kept in model_extra, to be refused by name

    model: str = ""
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # not OpenAI's; 0 and -1 (vLLM's) keep every token
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept in model_extra, to be refused by name
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatRequest(_Params):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None


class CompletionRequest(_Params):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


@dataclass(frozen=True)
class RequestPlan:
    """One generation, as the endpoint runs it."""

    prompt_ids: list[int]
    config: GenerationConfig
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool


def _refuse_unknown(req: _Params) -> None:
    """Fields set that we do not declare, all named: ignoring one could change the output."""
    unknown = [k for k, v in (req.model_extra or {}).items() if v is not None and k not in HARMLESS]
    if unknown:
        names = ", ".join(unknown)
        raise bad_request(
            f"not supported by this endpoint (refused, not ignored): {names}", unknown[0]
        )


def _refuse_unsupported(req: _Params) -> None:
    _refuse_unknown(req)
    if req.n not in (None, 1):
        raise bad_request("n must be 1: this endpoint generates one choice per request", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise bad_request(f"{name} is not supported (only 0)", name)
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    for name in ("logprobs", "top_logprobs"):
        if getattr(req, name, None):
            raise bad_request(f"{name} are not supported", name)
    if getattr(req, "tools", None):
        raise bad_request("tools are not supported", "tools")
    fmt = getattr(req, "response_format", None)
    if fmt and fmt.get("type", "text") != "text":
        raise bad_request("only the text response_format is supported", "response_format")
    if getattr(req, "echo", None) or getattr(req, "suffix", None):
        raise bad_request("echo and suffix are not supported", "echo")
    if getattr(req, "best_of", None) not in (None, 1):
        raise bad_request("best_of must be 1", "best_of")


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > MAX_STOPS:
        raise bad_request(f"at most {MAX_STOPS} stop strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        longest = max(len(s) for s in stops)
        raise bad_request(
            f"a stop string may be at most {MAX_STOP_CHARS} characters long, got {longest}", "stop"
        )
    return tuple(s for s in stops if s)


def _refuse_message_fields(message: Message, i: int) -> None:
    """Fields of a message that we do not declare, set (not null, not empty): the template
    renders only role and content, so any other (an assistant's ``tool_calls``, a tool result's
    ``tool_call_id``, a ``name``) would be dropped from the prompt without a word."""
    extra = message.model_extra or {}
    unknown = [k for k, v in extra.items() if v is not None and v != [] and v != {}]
    if not unknown:
        return
    param = f"messages[{i}].{unknown[0]}"
    if unknown[0] in ("tool_calls", "tool_call_id", "function_call"):
        raise bad_request(
            f"{param}: tool calls are not supported by this endpoint (refused, not dropped)", param
        )
    names = ", ".join(f"messages[{i}].{k}" for k in unknown)
    raise bad_request(f"not supported by this endpoint (refused, not ignored): {names}", param)


def _message_text(message: Message, i: int) -> str:
    _refuse_message_fields(message, i)
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    if any(part.type != "text" for part in message.content):
        raise bad_request("only text content parts are supported", f"messages[{i}].content")
    return "".join(part.text or "" for part in message.content)


def _config(req: _Params, max_tokens: int | None, base: GenerationConfig) -> GenerationConfig:
    # OpenAI's defaults: temperature 1 and top_p 1 (sampling); 0 gives the target's greedy output.
    temperature = 1.0 if req.temperature is None else req.temperature
    top_k = max(req.top_k or 0, 0)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=req.top_p or 1.0)
    return replace(base, sampling=sampling, seed=req.seed, max_new_tokens=max_tokens or UNLIMITED)


def chat_plan(req: ChatRequest, codec, base: GenerationConfig) -> RequestPlan:
    """``codec``: the draft's ``TextCodec``; ``base`` holds the server's own settings."""
    _refuse_unsupported(req)
    messages = [
        {"role": m.role, "content": _message_text(m, i)} for i, m in enumerate(req.messages)
    ]
    if codec.chat_template is None:
        raise bad_request("the served model has no chat template: use /v1/completions")
    try:
        ids = codec.chat_ids(messages)
    except ValueError as e:  # the template rejected the conversation (raise_exception)
        raise bad_request(str(e), "messages") from None
    return _plan(req, ids, req.max_completion_tokens or req.max_tokens, base)


def completion_plan(req: CompletionRequest, codec, base: GenerationConfig) -> RequestPlan:
    _refuse_unsupported(req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("one prompt per request (a batch of prompts is not supported)")
        prompt = prompt[0]
    ids = codec.encode(prompt) if isinstance(prompt, str) else list(prompt)
    return _plan(req, ids, req.max_tokens, base)


def _plan(
    req: _Params, ids: list[int], max_tokens: int | None, base: GenerationConfig
) -> RequestPlan:
    if not ids:
        raise bad_request("the prompt is empty", "prompt")
    if min(ids) < 0:
        raise bad_request("token ids must be >= 0", "prompt")
    options = req.stream_options or StreamOptions()
    return RequestPlan(
        prompt_ids=ids,
        config=_config(req, max_tokens, base),
        stops=_stops(req.stop),
        stream=bool(req.stream),
        include_usage=options.include_usage,
    )
