"""The package as a user gets it: sdist and wheel built without make, installed per side into
empty venvs (pip's cache is fine), and working there against real processes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from specsplit.cloud.supervision.process import CloudProcess
from specsplit.shared.tiny import reference_greedy

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the pinned CPU build, installed first as the README says
PROMPT = [1, 2, 3, 4, 5]


def run(*cmd: str | Path, cwd: Path, env: dict | None = None, check: bool = True, timeout=600):
    r = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    if check:
        assert r.returncode == 0, (
            f"{cmd} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    return r


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """`python -m build`: the sdist, then the wheel built from that sdist (build hook included)."""
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--outdir", out, ROOT, cwd=out)
    return out


def venv(path: Path, *requirements: str) -> Path:
    """A fresh venv with ``requirements`` installed, each argument one pip call; its bin dir."""
    run(sys.executable, "-m", "venv", path, cwd=path.parent)
    for requirement in requirements:
        run(path / "bin" / "python", "-m", "pip", "install", "-q", requirement, cwd=path.parent)
    return path / "bin"


def test_wheel_has_one_namespace_with_stubs_and_data(dist):
    wheel = zipfile.ZipFile(next(dist.glob("*.whl")))
    names = wheel.namelist()
    assert {n.split("/")[0] for n in names} == {"specsplit", "specsplit-0.1.0.dist-info"}
    for needed in (
        "specsplit/__init__.py",
        "specsplit/v1/speculative.proto",
        "specsplit/v1/speculative_pb2.py",
        "specsplit/v1/speculative_pb2_grpc.py",
        "specsplit/cloud/model_repository/target/config.pbtxt",
        "specsplit/cloud/model_repository/target/1/model.py",
        "specsplit/edge/cli.py",
        "specsplit/edge/export/token_freq_qwen2.npz",  # ranks a partial LM head's rows
        "specsplit/shared/acceptance.py",
        "specsplit/cloud/engine/cpu_rowwise.c",  # the kernels build from the installed sources
    ):
        assert needed in names
    engine = Path(__file__).resolve().parent.parent / "cloud" / "engine"
    for kernel_source in (*engine.glob("cpu_*.c"), engine / "cpu_kernels.h"):  # compiled there
        assert f"specsplit/cloud/engine/{kernel_source.name}" in names
    grpc_stub = wheel.read("specsplit/v1/speculative_pb2_grpc.py").decode()
    assert "from specsplit.v1 import speculative_pb2" in grpc_stub  # protoc's own path
    entry_points = wheel.read("specsplit-0.1.0.dist-info/entry_points.txt").decode()
    assert "specsplit.edge.cli:main" in entry_points and "specsplit.cloud.cli:main" in entry_points
    with tarfile.open(next(dist.glob("*.tar.gz"))) as sdist:
        members = sdist.getnames()
    assert not [n for n in members if "_pb2" in n or "/bench/" in n]  # sources only


def test_edge_extra_works_without_torch(dist, cloud, tiny, tmp_path):
    wheel = next(dist.glob("*.whl"))
    bin_dir = venv(tmp_path / "venv", f"{wheel}[edge]")
    code = (
        "import importlib.util, sys\n"
        "from specsplit import GenerationConfig, OnnxDrafter, SpecsplitError, SplitClient\n"
        "from specsplit import TextCodec\n"
        "import specsplit.edge.cli\n"
        "import specsplit.edge.openai.app\n"  # serve: FastAPI and uvicorn come with the extra
        "absent = ('torch', 'transformers', 'onnx', 'rich')\n"
        "assert not [m for m in absent if importlib.util.find_spec(m)], 'installed'\n"
        "assert not [m for m in absent if m in sys.modules], 'imported'\n"
        "print(specsplit.edge.cli.__file__)\n"
    )
    r = run(bin_dir / "python", "-c", code, cwd=tmp_path)
    assert str(tmp_path / "venv") in r.stdout  # the installed wheel, not the checkout
    assert "generate" in run(bin_dir / "specsplit-edge", "--help", cwd=tmp_path).stdout
    # The cloud's CLI is installed too: its help works without the cloud extra.
    assert "--weights" in run(bin_dir / "specsplit-cloud", "serve", "--help", cwd=tmp_path).stdout

    # The wheel's generated stubs speak the protocol to the real gateway.
    args = ["generate", "--server", cloud.address, "--draft", tiny.draft_onnx, "--json"]
    args += ["--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "8"]
    r = run(bin_dir / "specsplit-edge", *args, cwd=tmp_path)
    assert json.loads(r.stdout)["token_ids"] == reference_greedy(tiny.target, PROMPT, 8)

    # No draft cached and no build-step packages: a clear way forward, not a traceback.
    env = {**os.environ, "SPECSPLIT_CACHE": str(tmp_path / "empty-cache")}
    r = run(
        bin_dir / "specsplit-edge", "generate", "--prompt", "hi", cwd=tmp_path, env=env, check=False
    )
    assert r.returncode == 2 and "pip install -e '.[export]'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_cloud_extra_serves_from_the_installed_model_repository(dist, tiny, tmp_path):
    from specsplit.edge.client import GenerationConfig, SplitClient
    from specsplit.edge.onnx_drafter import OnnxDrafter

    wheel = next(dist.glob("*.whl"))
    bin_dir = venv(tmp_path / "venv", TORCH, f"{wheel}[cloud]")
    code = "import specsplit.cloud.supervision.triton as t; print(t.MODEL_REPOSITORY)"
    repo = run(bin_dir / "python", "-c", code, cwd=tmp_path).stdout.strip()
    assert (
        repo.startswith(str(tmp_path / "venv")) and Path(repo, "target", "config.pbtxt").is_file()
    )

    async def generate(address: str) -> tuple[list[int], list[int]]:
        cfg = GenerationConfig(max_new_tokens=8, max_draft_tokens=3)
        async with SplitClient(address, OnnxDrafter(tiny.draft_onnx)) as client:
            split = client.generate(PROMPT, cfg)
            cloud_only = client.generate(PROMPT, cfg, route="cloud-only")
            return await split.collect(), await cloud_only.collect()

    with CloudProcess(
        "--target", str(tiny.target), log_dir=tmp_path, python=str(bin_dir / "python")
    ) as cloud:
        split, cloud_only = asyncio.run(generate(cloud.address))
    assert split == cloud_only == reference_greedy(tiny.target, PROMPT, 8)
