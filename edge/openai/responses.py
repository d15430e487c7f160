"""The JSON the OpenAI endpoint answers with: completions, streamed chunks, usage, and the
``specsplit`` extension field with the request's speculation statistics."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from specsplit.edge.generation import GenerationStats

# The cloud's finish reasons (FinishReason without its prefix) as OpenAI names them.
FINISH = {"EOS": "stop", "STOP_TOKEN": "stop", "LENGTH": "length", "CANCELLED": "stop"}
STOP_STRING = "STOP_STRING"  # ours: a stop string matched on the edge


@dataclass(frozen=True)
class Reply:
    """What every object of one response shares."""

    chat: bool  # /v1/chat/completions, else /v1/completions
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.chat else "cmpl"
        object.__setattr__(self, "id", self.id or f"{prefix}-{uuid.uuid4().hex}")

    def _envelope(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def complete(self, text: str, finish: str, usage: dict, speculation: dict) -> dict:
        """The whole answer of a request that was not streamed."""
        if self.chat:
            message = {"role": "assistant", "content": text, "refusal": None}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion" if self.chat else "text_completion"
        return {
            **self._envelope(obj),
            "choices": [choice],
            "usage": usage,
            "specsplit": speculation,
        }

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> dict:
        """One streamed event carrying a text delta (or, with ``finish``, the last one)."""
        if self.chat:
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._envelope("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._envelope("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        """The extra last event ``stream_options.include_usage`` asks for: no choices."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj), "choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_reason(stats: GenerationStats, stopped_by_string: bool) -> str:
    return "stop" if stopped_by_string else FINISH.get(stats.finish, "stop")


def speculation(stats: GenerationStats, stopped_by_string: bool) -> dict:
    """The request's statistics (``GenerationStats.summary``: acceptance rate, tokens per round,
    target forward passes, mode, ...)."""
    s = stats.summary()
    if stopped_by_string:
        s["finish"] = STOP_STRING
        # The cloud reports its passes in Finished, which a stream we cancelled never gets; each
        # verdict (a split round, or one cloud-only token) is one target pass.
        s["target_forward_passes"] = max(s["target_forward_passes"], stats.rounds)
    return s


def sse(obj: dict | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
