"""Text in and out on the edge: tokenizer, chat template, streaming detokenisation.

Uses the ``tokenizers`` library (no transformers on the edge) and renders the model's own chat
template (from tokenizer_config.json) with jinja2, as transformers does.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


class TextCodec:
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
        self.chat_template = (
            jinja.read_text() if jinja.is_file() else self.config.get("chat_template")
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat_prompt(self, user: str, system: str | None = None) -> list[int]:
        """Token ids of a one-turn chat, rendered with the model's chat template."""
        template = self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template; use a plain prompt")
        import jinja2

        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}
        ]
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        text = env.from_string(template).render(
            messages=messages,
            add_generation_prompt=True,
            tools=None,
            bos_token=self.config.get("bos_token") or "",
            eos_token=self.config.get("eos_token") or "",
        )
        return self.encode(text)

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


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
