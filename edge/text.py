"""Text in and out on the edge: tokenizer, chat template, streaming detokenisation.

Uses the ``tokenizers`` library (no transformers on the edge) and renders the model's own chat
template (from tokenizer_config.json or chat_template.jinja) with jinja2 the way transformers does:
in an immutable sandbox, because the template comes with a downloaded model and must not run code.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer


class TextCodec:
    """Tokenizer and chat template of a model (or ONNX export) directory."""

    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: pass --prompt-ids, or a dir with a tokenizer"
            )
        self.tokenizer = Tokenizer.from_file(str(path))
        cfg_path = d / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        # transformers >= 4.47 saves the template beside the config instead of inside it
        jinja = d / "chat_template.jinja"
        template = jinja.read_text() if jinja.is_file() else self.config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {t.get("name"): t.get("template") for t in template}.get("default")
        self.chat_template: str | None = template or None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat_prompt(self, user: str, system: str | None = None) -> list[int]:
        """Token ids of a one-turn chat, rendered with the model's chat template."""
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}
        ]
        return self.chat_ids(messages)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation (``[{"role", "content"}, ...]``) rendered with the model's
        chat template, ending with the prompt for the assistant's turn."""
        template = self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template; use a plain prompt")
        import jinja2

        try:
            text = _compile_template(template).render(
                messages=messages,
                add_generation_prompt=True,
                tools=None,
                bos_token=_token_text(self.config.get("bos_token")),
                eos_token=_token_text(self.config.get("eos_token")),
            )
        except jinja2.exceptions.SecurityError as e:
            raise ValueError(f"the chat template tried an unsafe operation, refused: {e}") from e
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the chat template failed: {e}") from e
        return self.encode(text)

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


def _token_text(token: str | dict | None) -> str:
    """tokenizer_config.json holds special tokens as strings or as AddedToken dicts."""
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""


@cache
def _compile_template(template: str):
    """The template in jinja2's immutable sandbox, with the globals transformers provides.

    The sandbox refuses attribute access to Python internals (``__class__``, ``__globals__``,
    ...) and calls that mutate; ``raise_exception`` lets a template reject its input.
    """
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' override: jinja2's own tojson escapes HTML characters
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class StreamDecoder:
    """Turns committed token chunks into text deltas, holding back incomplete UTF-8 sequences."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, tokens: list[int]) -> str:
        self.ids += tokens
        text = self.codec.decode(self.ids)
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait
            return ""
        delta, self.emitted = text[self.emitted :], len(text)
        return delta
