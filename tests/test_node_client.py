"""The Node.js client (clients/node) drives the real gateway from the .proto alone.

It runs where `node` is installed and `make node-client` has installed its npm packages (make test
does both when npm is there); elsewhere it skips. Expected outputs come from transformers running
the tiny target; the drafts it sends are the Python drafter's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from specsplit.edge.drafting import draft_block
from specsplit.edge.onnx_drafter import OnnxDrafter
from specsplit.shared.sampling import SamplingConfig
from specsplit.shared.tiny import reference_greedy

NODE_DIR = Path(__file__).resolve().parents[1] / "clients" / "node"
NODE = shutil.which("node")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(NODE is None, reason="node is not installed"),
    pytest.mark.skipif(
        not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(),
        reason="the Node client's packages are not installed (make node-client)",
    ),
]
PROMPT = [1, 2, 3, 4, 5]
N = 24


def node(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [NODE, str(NODE_DIR / "generate.js"), *args], capture_output=True, text=True, timeout=60
    )


def python_drafts(draft_onnx: Path, prompt: list[int], target: list[int], k: int):
    """The blocks the Python edge sends in a greedy split run, and how many drafts the cloud
    accepts: each round commits the drafts that match the target's greedy tokens, plus one."""
    drafter = OnnxDrafter(draft_onnx)
    committed, blocks, accepted = list(prompt), [], 0
    while len(committed) - len(prompt) < len(target):
        done = len(committed) - len(prompt)
        k_round = min(k, len(target) - done - 1)  # never past the length limit, as the edge
        block = draft_block(drafter, committed, k_round, SamplingConfig(), noise=None)
        n = 0
        while n < len(block.tokens) and block.tokens[n] == target[done + n]:
            n += 1
        committed += target[done : done + n + 1]
        blocks.append(block.tokens)
        accepted += n
    return blocks, accepted


@pytest.fixture(scope="module")
def target_greedy(tiny) -> list[int]:
    return reference_greedy(tiny.target, PROMPT, N)


def test_node_cloud_only_equals_target_greedy(cloud, target_greedy):
    r = node("--server", cloud.address, "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", str(N),
             "--cloud-only")  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == target_greedy
    assert out["finish"] == "LENGTH" and out["rounds"] == out["target_forward_passes"] == N


@pytest.mark.parametrize("draft", ["same", "unrelated"])
def test_node_split_with_python_drafts_equals_target_greedy(
    cloud, tiny, target_greedy, tmp_path, draft
):
    draft_onnx = tiny.target_onnx if draft == "same" else tiny.draft_onnx
    blocks, accepted = python_drafts(draft_onnx, PROMPT, target_greedy, k=3)
    drafts = tmp_path / "drafts.json"
    drafts.write_text(json.dumps({"blocks": blocks}))
    r = node("--server", cloud.address, "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", str(N),
             "--drafts", str(drafts))  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == target_greedy
    # The cloud judged each block where the Python edge would have sent it.
    assert (out["rounds"], out["accepted"]) == (len(blocks), accepted)
    assert out["drafted"] == sum(map(len, blocks))
    assert out["target_forward_passes"] == out["rounds"]
    if draft == "same":
        assert out["accepted"] == out["drafted"] > 0
    else:
        assert out["accepted"] < out["drafted"]


def test_node_client_reports_the_status_of_a_bad_request(cloud):
    r = node("--server", cloud.address, "--prompt-ids", "1,99999")
    assert r.returncode == 2
    assert "INVALID_ARGUMENT" in r.stderr and "vocabulary" in r.stderr
