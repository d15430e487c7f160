"""`specsplit-edge` flags that must agree with the Python API: parsed here, nothing started."""

from __future__ import annotations

import specsplit.edge.openai.serve
from specsplit.edge import cli
from specsplit.edge.client import GenerationConfig
from specsplit.edge.openai.app import ServeConfig


def test_serve_generate_and_the_api_draft_the_same_k_by_default(monkeypatch, tmp_path):
    served, generated = [], []
    monkeypatch.setattr(cli, "ensure_draft_onnx", lambda draft, precision: tmp_path)
    monkeypatch.setattr(
        specsplit.edge.openai.serve, "run_server", lambda cfg, *a, **kw: served.append(cfg)
    )

    async def generate(args):
        generated.append(cli._config(args))
        return 0

    monkeypatch.setattr(cli, "_generate", generate)
    cli.main(["serve"])
    cli.main(["generate", "--prompt-ids", "1,2"])
    k = GenerationConfig().max_draft_tokens
    assert served[0].generation.max_draft_tokens == k  # what the OpenAI pool's requests draft
    assert generated[0].max_draft_tokens == k
    assert ServeConfig("a", tmp_path, "m").generation.max_draft_tokens == k
