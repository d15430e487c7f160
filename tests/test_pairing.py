"""A draft pairs with a target only if they share a tokenizer (issue 28's pairing checks).

The gateway refuses a Start whose draft names another tokenizer before any work; the edge
refuses what an older server would not; differently padded vocabularies of one tokenizer pair,
and neither side ever proposes or emits one of the padding ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import grpc
import numpy as np
import pytest

from specsplit.cloud.gateway.service import start_gateway
from specsplit.edge.rounds import _check_pair
from specsplit.edge.stream import SpecsplitError
from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc
from specsplit.shared.tokenizer_fingerprint import token_count, tokenizer_fingerprint
from tests.fakes import MODEL, NOWHERE, FakeTriton

OURS = "v1:" + "a" * 64
THEIRS = "v1:" + "b" * 64


def write_tokenizer(path: Path, tokens: int, pad_to: int = 0) -> Path:
    """A word-level tokenizer.json defining ids [0, tokens), padded with GGUF's [PAD<id>] rows
    up to ``pad_to``."""
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(tokens)}
    vocab.update({f"[PAD{i}]": i for i in range(tokens, pad_to)})
    path.mkdir(parents=True, exist_ok=True)
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def test_padding_rows_change_neither_the_fingerprint_nor_the_token_count(tmp_path):
    small = write_tokenizer(tmp_path / "small", 200, pad_to=224)
    large = write_tokenizer(tmp_path / "large", 200, pad_to=256)
    other = write_tokenizer(tmp_path / "other", 201)
    assert tokenizer_fingerprint(small) == tokenizer_fingerprint(large)
    assert tokenizer_fingerprint(small) != tokenizer_fingerprint(other)
    assert token_count(small) == token_count(large) == 200


async def _start(draft_tokenizer: str) -> tuple[grpc.StatusCode, str, list]:
    model = dataclasses.replace(MODEL, tokenizer_fingerprint=OURS, token_count=200)
    server, port, service = await start_gateway(NOWHERE, model, sequence_factory=FakeTriton)
    start = pb.Start(
        protocol_version=PROTOCOL_VERSION,
        prompt_ids=[1, 2, 3],
        sampling=pb.SamplingParams(max_new_tokens=2),
        draft_tokenizer=draft_tokenizer,
    )
    replies = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.SpeculativeDecodingStub(channel).Generate(
                iter([pb.ClientMessage(start=start)]), timeout=20
            )
            try:
                async for msg in call:
                    replies.append(msg)
                    break  # Started (or the status) is all this test needs
                return grpc.StatusCode.OK, "", replies
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details(), replies
    finally:
        await server.stop(grace=None)
        await service.close()


def test_the_gateway_refuses_a_draft_of_another_tokenizer_before_any_work():
    code, details, replies = asyncio.run(_start(THEIRS))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and not replies
    assert "tokenizer" in details and OURS[:19] in details and THEIRS[:19] in details


@pytest.mark.parametrize("draft", [OURS, ""])
def test_the_same_tokenizer_or_an_unnamed_one_is_served(draft):
    code, _, replies = asyncio.run(_start(draft))
    assert code == grpc.StatusCode.OK
    started = replies[0].started
    assert started.model.tokenizer_fingerprint == OURS and started.model.token_count == 200


@dataclasses.dataclass
class Draft:
    vocab_size: int
    tokenizer_fingerprint: str | None
    token_count: int | None


def model_info(vocab: int, fingerprint: str) -> pb.ModelInfo:
    return pb.ModelInfo(name="t", vocab_size=vocab, tokenizer_fingerprint=fingerprint)


def test_the_edge_refuses_another_tokenizer_and_pairs_padded_vocabularies():
    with pytest.raises(SpecsplitError, match="tokenizer"):
        _check_pair(Draft(151936, OURS, 151665), model_info(151936, THEIRS))
    # Qwen2.5-0.5B's 151,936 rows beside 7B's 152,064, and the other way round: one tokenizer
    _check_pair(Draft(151936, OURS, 151665), model_info(152064, OURS))
    _check_pair(Draft(152064, OURS, 151665), model_info(151936, OURS))
    with pytest.raises(SpecsplitError, match="beyond"):  # could propose ids the target lacks
        _check_pair(Draft(152064, None, None), model_info(151936, ""))


def test_the_target_never_emits_a_padding_id(tmp_path):
    """A tiny target whose tokenizer defines 128 of its 256 rows: greedy steps never pick a
    padding id (without the tokenizer file the same model picks some)."""
    import torch

    from specsplit.cloud.engine.target import Open, SessionParams, TargetModel, Verify
    from specsplit.shared.acceptance import VerificationRule
    from specsplit.shared.sampling import SamplingConfig
    from specsplit.shared.tiny import make_tiny_qwen2

    greedy = SessionParams(SamplingConfig(), VerificationRule.GREEDY)
    sampled = SessionParams(SamplingConfig(temperature=1.0), VerificationRule.TOKEN_ONLY, seed=3)

    def tokens(model_dir: Path, params) -> list[int]:
        target = TargetModel(model_dir, device="cpu", calibrate=False, weights="float")
        target.run([Open(1, [5, 9, 2], params)])
        out = [2]
        for i in range(40):
            [v], _ = target.run([Verify(1, 3 + i, [out[-1]])])
            out.append(v.result.token)
        return out[1:]

    torch.manual_seed(0)
    plain = make_tiny_qwen2(tmp_path / "plain", seed=4)
    assert any(t >= 128 for t in tokens(plain, greedy) + tokens(plain, sampled))
    write_tokenizer(plain, 128)
    assert all(t < 128 for t in tokens(plain, greedy) + tokens(plain, sampled))


def test_the_draft_never_proposes_a_padding_id(tmp_path):
    from specsplit.edge.export.exporter import export_onnx
    from specsplit.edge.onnx_drafter import OnnxDrafter
    from specsplit.shared.tiny import make_tiny_qwen2

    model = make_tiny_qwen2(tmp_path / "m", seed=5)
    write_tokenizer(model, 128)
    drafter = OnnxDrafter(export_onnx(model, tmp_path / "onnx"))
    meta = json.loads((tmp_path / "onnx" / "specsplit_draft.json").read_text())
    assert meta["token_count"] == 128 and drafter.token_count == 128
    logits = drafter.forward([5, 9, 2, 77])
    assert np.isneginf(logits[:, 128:]).all() and np.isfinite(logits[:, :128]).all()


def test_a_real_serve_pairs_drafts_by_tokenizer(tmp_path):
    """On real parts (`specsplit-cloud serve` with a tiny target that has a tokenizer, ONNX
    Runtime drafts): a draft exported with the target's tokenizer is served, and its output
    stays inside the tokenizer's ids; one exported with another tokenizer is refused with
    FAILED_PRECONDITION before any token."""
    from specsplit.cloud.supervision.process import CloudProcess
    from specsplit.edge.client import GenerationConfig, SplitClient
    from specsplit.edge.export.exporter import export_onnx
    from specsplit.edge.onnx_drafter import OnnxDrafter
    from specsplit.shared.tiny import make_tiny_qwen2

    target = make_tiny_qwen2(tmp_path / "target", seed=0)
    other = make_tiny_qwen2(tmp_path / "other", seed=1)
    write_tokenizer(target, 200, pad_to=256)
    write_tokenizer(other, 201)
    same = OnnxDrafter(export_onnx(target, tmp_path / "same-onnx"))
    foreign = OnnxDrafter(export_onnx(other, tmp_path / "foreign-onnx"))
    assert same.tokenizer_fingerprint != foreign.tokenizer_fingerprint

    async def generate(address: str, drafter) -> list[int]:
        config = GenerationConfig(max_new_tokens=12)
        async with SplitClient(address, drafter) as client:
            gen = client.generate([5, 9, 2], config)
            await gen.collect()
            return gen.token_ids

    with CloudProcess("--target", str(target), log_dir=tmp_path / "cloud") as cloud:
        tokens = asyncio.run(generate(cloud.address, same))
        assert len(tokens) == 12 and all(t < 200 for t in tokens)
        with pytest.raises(SpecsplitError, match="tokenizer") as refused:
            asyncio.run(generate(cloud.address, foreign))
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
