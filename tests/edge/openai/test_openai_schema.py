"""OpenAI requests -> generation plans: OpenAI's defaults, and refusals that name the parameter."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specsplit.edge.client import GenerationConfig
from specsplit.edge.openai.schema import (
    MAX_STOP_CHARS,
    UNLIMITED,
    APIError,
    ChatRequest,
    CompletionRequest,
    chat_plan,
    completion_plan,
)


class Codec:
    """One id per character; a template that joins the turns."""

    chat_template = "x"

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self.encode("".join(f"{m['role']}:{m['content']};" for m in messages))


BASE = GenerationConfig(max_draft_tokens=5, retry_window_s=3.0)


def chat(**kw) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_defaults_are_openais():
    plan = chat_plan(chat(), Codec(), BASE)
    assert plan.config.sampling.temperature == 1.0 and plan.config.sampling.top_p == 1.0
    assert plan.config.max_new_tokens == UNLIMITED and plan.config.seed is None
    assert (plan.config.max_draft_tokens, plan.config.retry_window_s) == (
        5,
        3.0,
    )  # the server's own
    assert plan.stops == () and not plan.stream and not plan.include_usage


def test_chat_request_becomes_the_templated_prompt():
    req = chat(temperature=0, max_tokens=9, max_completion_tokens=7, stop="\n", seed=3)
    plan = chat_plan(req, Codec(), BASE)
    assert plan.prompt_ids == Codec().encode("user:hi;")
    assert plan.config.sampling.greedy and plan.config.seed == 3
    assert plan.config.max_new_tokens == 7  # max_completion_tokens wins over max_tokens
    assert plan.stops == ("\n",)


def test_text_parts_are_joined():
    req = ChatRequest(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]
    )
    assert chat_plan(req, Codec(), BASE).prompt_ids == Codec().encode("user:a;")


@pytest.mark.parametrize("prompt", ["abc", ["abc"], [97, 98, 99], [[97, 98, 99]]])
def test_completion_prompt_forms(prompt):
    plan = completion_plan(CompletionRequest(prompt=prompt, max_tokens=4), Codec(), BASE)
    assert plan.prompt_ids == [97, 98, 99] and plan.config.max_new_tokens == 4


@pytest.mark.parametrize(
    "make, param",
    [
        (lambda: chat(n=3), "n"),
        (lambda: chat(frequency_penalty=1.0), "frequency_penalty"),
        (lambda: chat(logit_bias={"5": 1.0}), "logit_bias"),
        (lambda: chat(tools=[{"type": "function"}]), "tools"),
        (lambda: chat(response_format={"type": "json_object"}), "response_format"),
        (lambda: chat(stop=["a", "b", "c", "d", "e"]), "stop"),
        (
            lambda: ChatRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content",
        ),  # fmt: skip
        (lambda: CompletionRequest(prompt=["a", "b"]), None),
        (lambda: CompletionRequest(prompt=""), "prompt"),
        (lambda: CompletionRequest(prompt=[-1]), "prompt"),
    ],
)
def test_unsupported_requests_are_refused_naming_the_parameter(make, param):
    req = make()
    plan = chat_plan if isinstance(req, ChatRequest) else completion_plan
    with pytest.raises(APIError) as e:
        plan(req, Codec(), BASE)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def refusal(req) -> APIError:
    plan = chat_plan if isinstance(req, ChatRequest) else completion_plan
    with pytest.raises(APIError) as e:
        plan(req, Codec(), BASE)
    assert e.value.status == 400
    assert e.value.body()["error"]["type"] == "invalid_request_error"
    return e.value


@pytest.mark.parametrize(
    "field, value",
    [
        ("min_p", 0.05),
        ("repetition_penalty", 1.1),
        ("stop_token_ids", [2]),
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", "auto"),
        ("tool_choice", "none"),
        ("top_logprobs", 2),
        ("reasoning_effort", "low"),
    ],
)
def test_fields_that_would_change_the_output_are_refused_by_name(field, value):
    e = refusal(chat(**{field: value}))
    assert e.param == field and field in e.message


def test_every_unknown_field_is_named_and_harmless_ones_pass():
    harmless = dict(
        user="u", metadata={"k": "v"}, store=False, service_tier="auto", prompt_cache_key="c"
    )
    req = dict(stream_options={"include_usage": True}, min_p=None, **harmless)  # null is unset
    plan = chat_plan(chat(**req), Codec(), BASE)
    assert plan.include_usage and plan.prompt_ids == Codec().encode("user:hi;")
    e = refusal(chat(**{**req, "min_p": 0.1, "repetition_penalty": 1.2}))
    assert e.param == "min_p" and "min_p, repetition_penalty" in e.message
    assert not any(name in e.message for name in harmless)
    # /v1/completions has no max_completion_tokens: ignoring it would run past the app's limit
    e = refusal(CompletionRequest(prompt="a", max_completion_tokens=2))
    assert e.param == "max_completion_tokens"


def test_top_k_reaches_the_sampling_of_both_sides():
    """top_k is the protocol's own (SamplingParams.top_k), applied alike to q and p."""
    assert chat_plan(chat(top_k=5), Codec(), BASE).config.sampling.top_k == 5
    for off in (None, 0, -1):  # -1 is vLLM's "off"
        assert chat_plan(chat(top_k=off), Codec(), BASE).config.sampling.top_k == 0
    with pytest.raises(ValidationError, match="top_k"):  # FastAPI answers it with a 400
        chat(top_k=-2)


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    "message, param",
    [
        ({"role": "assistant", "content": None, "tool_calls": [CALL]}, "messages[1].tool_calls"),
        ({"role": "tool", "content": "42", "tool_call_id": "call_1"}, "messages[1].tool_call_id"),
        ({"role": "user", "content": "hi", "name": "ann"}, "messages[1].name"),
    ],
)
def test_message_fields_the_template_would_drop_are_refused_by_name(message, param):
    req = ChatRequest(messages=[{"role": "user", "content": "q"}, message])
    e = refusal(req)
    assert e.param == param and param in e.message


def test_a_message_echoed_back_with_null_and_empty_fields_passes():
    """The SDKs' own assistant messages carry tool_calls None, annotations [] and the like."""
    echoed = {"role": "assistant", "content": "a", "tool_calls": None, "annotations": []}
    req = ChatRequest(messages=[{"role": "user", "content": "q"}, echoed])
    assert chat_plan(req, Codec(), BASE).prompt_ids == Codec().encode("user:q;assistant:a;")


def test_stop_strings_longer_than_the_cap_are_refused():
    e = refusal(chat(stop=["ok", "x" * (MAX_STOP_CHARS + 1)]))
    assert e.param == "stop" and str(MAX_STOP_CHARS) in e.message
    assert chat_plan(chat(stop="x" * MAX_STOP_CHARS), Codec(), BASE).stops == ("x" * 256,)
