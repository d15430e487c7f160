"""A tokenizer's fingerprint: draft and target must share a tokenizer; this says if they do.

A draft proposes token ids and the target judges them by id, so the pair is only meaningful when
every id names the same token on both sides and the same ids are special (stops, chat markers).
The fingerprint hashes exactly that, computed with the ``tokenizers`` package alone (the edge has
no transformers), so the edge's export metadata and the cloud's target can each compute it from
their own ``tokenizer.json`` and compare.

Algorithm, version 1 (reimplementable in any language; the result is ``"v1:"`` + 64 hex digits):

1. Load ``tokenizer.json`` with ``tokenizers.Tokenizer.from_file``.
2. The vocabulary: ``get_vocab(with_added_tokens=True)``, a map token string → id, minus the
   placeholder rows a GGUF conversion adds to pad a vocabulary up to the model's row count (a
   token spelled exactly ``[PAD<its own id>]``), so Qwen2.5-0.5B (151,936 rows) and -7B (152,064)
   converted from GGUF still match, as their Hugging Face tokenizers do.
3. The special tokens: ``get_added_tokens_decoder()``, id → AddedToken, those with ``special``.
4. SHA-256 over these bytes: ``b"specsplit-tokenizer-v1\\n"``; then for each vocabulary entry,
   ordered by (id, token), ``f"{id} {n} "`` + the token's UTF-8 bytes + ``b"\\n"`` where ``n`` is
   that byte count; then ``b"special\\n"``; then each special token the same way, ordered by
   (id, content). Lengths prefix the bytes, so no token can be confused with a separator.

Only what ids mean counts: two tokenizer.json files that differ in merges, normalizer or
pre-tokenizer but agree on every id and every special token have the same fingerprint (the
prompt is tokenized once, on one side, and sent as ids). numpy-free and torch-free.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

FINGERPRINT_VERSION = "v1"
_HEADER = b"specsplit-tokenizer-v1\n"


def _entry(token_id: int, token: str) -> bytes:
    raw = token.encode("utf-8")
    return f"{token_id} {len(raw)} ".encode() + raw + b"\n"


def _load(tokenizer_json: str | Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_json))


def _vocab(tokenizer) -> list[tuple[int, str]]:
    """(id, token) of every token the tokenizer defines, GGUF padding rows left out."""
    return sorted(
        (token_id, token)
        for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items()
        if token != f"[PAD{token_id}]"  # a GGUF conversion's padding row
    )


def token_count(tokenizer_json: str | Path) -> int:
    """One past the largest id the tokenizer defines (padding rows left out): ids from here to a
    model's vocab_size are rows no text maps to, which neither side ever proposes or emits."""
    vocab = _vocab(_load(tokenizer_json))
    return vocab[-1][0] + 1 if vocab else 0


def tokenizer_fingerprint(tokenizer_json: str | Path) -> str:
    """The fingerprint (``"v1:<sha256 hex>"``) of a ``tokenizer.json``; see the module docstring."""
    tokenizer = _load(tokenizer_json)
    vocab = _vocab(tokenizer)
    special = sorted(
        (token_id, added.content)
        for token_id, added in tokenizer.get_added_tokens_decoder().items()
        if added.special
    )
    digest = hashlib.sha256(_HEADER)
    for token_id, token in vocab:
        digest.update(_entry(token_id, token))
    digest.update(b"special\n")
    for token_id, token in special:
        digest.update(_entry(token_id, token))
    return f"{FINGERPRINT_VERSION}:{digest.hexdigest()}"
