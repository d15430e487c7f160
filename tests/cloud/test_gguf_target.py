"""`specsplit-cloud serve --target model.gguf`: a bare GGUF file is the target's weights, converted
once into the cache as the default target's GGUF is (``shared.weights.local_gguf``), keyed by its
content, and served with the file as its GGUF source; a missing or non-GGUF file is refused with
a message that says so, before anything starts."""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import replace

import pytest

from specsplit.cloud import cli
from specsplit.shared.weights import local_gguf, sources

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tests.cloud.tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen2-Q4_K_M.gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing.gguf", "missing.gguf: no such file"),
        (lambda d: d, "is a directory without config.json, not a GGUF file"),
        (
            lambda d: (d / "w.safetensors").write_bytes(b"{}\x00") and d / "w.safetensors",
            "is not a GGUF file",
        ),
        (
            lambda d: (d / "notes.gguf").write_text("hello") and d / "notes.gguf",
            "is not a GGUF file",
        ),
        (lambda d: "qwen-7b", "unknown target 'qwen-7b'"),
    ],
    ids=["missing", "directory", "another-format", "text-named-gguf", "unknown-name"],
)
def test_a_bad_file_is_refused_with_what_target_takes(tmp_path, cache, capfd, make, message):
    spec = make(tmp_path)
    assert cli.main(["pull", "--target", str(spec)]) == 1
    err = capfd.readouterr().err
    assert err.startswith("specsplit-cloud: ") and message in err, err
    assert "--target takes a .gguf file, a Hugging Face model directory" in err
    assert "Traceback" not in err
    assert not (cache / "hf").exists() or not any((cache / "hf").iterdir())


def test_serve_refuses_a_missing_file_before_starting_anything(tmp_path, cache, capfd):
    args = cli._parser().parse_args(["serve", "--port", "0", "--target", str(tmp_path / "x.gguf")])
    with pytest.raises(ValueError, match="x.gguf: no such file"):
        asyncio.run(cli.serve(args))


def test_a_gguf_is_converted_once_into_the_cache_keyed_by_content(
    tiny_gguf, cache, tmp_path, monkeypatch
):
    from specsplit.cloud.engine.gguf_weights import source_gguf

    d = cli.resolve_target(str(tiny_gguf))
    assert d.parent == cache / "hf" and d.name.startswith("tiny-qwen2-Q4_K_M-")
    assert (d / "config.json").is_file() and (d / "model.safetensors").is_file()
    assert (d / "tokenizer.json").is_file()  # the gateway's identity reads it
    assert source_gguf(d) == d / local_gguf.LINK and (d / local_gguf.LINK).resolve() == tiny_gguf
    from specsplit.cloud.gateway.identity import ModelIdentity

    identity = ModelIdentity.from_dir(d)
    assert identity.limits.vocab_size == 256 and identity.limits.eos_token_ids == (255,)

    copy = shutil.copy(tiny_gguf, tmp_path / "elsewhere.gguf")  # moved, renamed: same content
    built = []
    monkeypatch.setattr(sources, "_build_hf_dir", lambda *a, **k: built.append(a))
    again = cli.resolve_target(str(copy))
    assert again == d and built == []  # found by content, not converted again
    assert (d / local_gguf.LINK).resolve() == copy.resolve()  # served from the file given


def test_its_blocks_are_what_the_target_serves_with_weights_gguf(tiny_gguf, cache):
    from specsplit.cloud.engine import kernel_library
    from specsplit.cloud.engine.target import TargetModel

    if not kernel_library.available():
        pytest.skip("no CPU kernels here")
    d = cli.resolve_target(str(tiny_gguf))
    target = TargetModel(d, device="cpu", calibrate=False, weights="gguf")
    assert target.weights == "gguf"


@pytest.mark.slow
def test_serve_takes_a_gguf_file_prints_its_format_and_generates(tiny_gguf, tmp_path):
    """A real `serve --target tiny.gguf` (auto: the format by calibration, the GGUF's blocks
    among the candidates), then a cloud-only generation through the gateway."""
    from specsplit.cloud.supervision.process import CloudProcess
    from specsplit.edge.client import GenerationConfig, SplitClient

    async def generate(address):
        async with SplitClient(address, None) as client:
            gen = client.generate([1, 2, 3], GenerationConfig(max_new_tokens=8), route="cloud-only")
            await gen.collect()
            return gen

    with CloudProcess("--target", str(tiny_gguf), "--weights", "auto", log_dir=tmp_path) as c:
        gen = asyncio.run(generate(c.address))
        log = c.log_path.read_text()
    assert len(gen.token_ids) == 8 and all(0 <= t < 256 for t in gen.token_ids)
    report = [line for line in log.splitlines() if "target weights by calibration" in line]
    assert report and "'gguf'" in report[0], log[-3000:]
    assert "/hf/tiny-qwen2-Q4_K_M-" in log  # Triton serves the directory converted from it


def test_the_official_gguf_by_path_is_the_default_source(tiny_gguf, cache, monkeypatch):
    """A file with a default source's content (here the tiny file stands in for it) is that
    source: placed in gguf/ as a verified entry, converted into the source's own directory."""
    digest = local_gguf._sha256(tiny_gguf)
    official = replace(
        sources.TARGET_DEFAULT,
        gguf_file="official.gguf",
        size=tiny_gguf.stat().st_size,
        sha256=digest,
    )
    monkeypatch.setitem(sources.SOURCES, official.name, official)
    monkeypatch.setattr(sources, "ensure_hf_dir", lambda source: ("converted", source))
    assert cli.resolve_target(str(tiny_gguf)) == ("converted", official)
    assert sources.cached_gguf(official) == cache / "gguf" / "official.gguf"
    assert (cache / "gguf" / "official.gguf").resolve() == tiny_gguf
