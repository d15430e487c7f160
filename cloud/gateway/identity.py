"""What clients must know of the target model, read from its Hugging Face directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specsplit.cloud.gateway.session import ModelLimits
from specsplit.shared.protocol import pb
from specsplit.shared.tokenizer_fingerprint import token_count, tokenizer_fingerprint


@dataclass(frozen=True)
class ModelIdentity:
    name: str
    architecture: str
    limits: ModelLimits
    tokenizer_fingerprint: str = ""  # shared.tokenizer_fingerprint; "" when not known
    token_count: int = 0  # ids the tokenizer defines; 0 when not known

    @classmethod
    def from_dir(cls, model_dir: str | Path, name: str | None = None) -> ModelIdentity:
        """Reads what clients must know from a Hugging Face model directory."""
        d = Path(model_dir)
        config = json.loads((d / "config.json").read_text())
        eos = config.get("eos_token_id")
        gen = d / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        tok = d / "tokenizer.json"
        fingerprint, count = "", 0
        if tok.exists():
            fingerprint, count = tokenizer_fingerprint(tok), token_count(tok)
        limits = ModelLimits(
            vocab_size=int(config["vocab_size"]),
            max_context=int(config.get("max_position_embeddings", 4096)),
            eos_token_ids=eos_ids,
        )
        architecture = config.get("model_type", "")
        return cls(name or d.name, architecture, limits, fingerprint, count)

    def to_pb(self) -> pb.ModelInfo:
        return pb.ModelInfo(
            name=self.name,
            architecture=self.architecture,
            vocab_size=self.limits.vocab_size,
            eos_token_ids=list(self.limits.eos_token_ids),
            tokenizer_fingerprint=self.tokenizer_fingerprint,
            token_count=self.token_count,
        )
