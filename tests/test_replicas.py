"""Several Triton replicas behind one gateway (`serve --replicas 2`), on real processes: sessions
spread by load, a replica SIGKILLed mid-generation loses no session and changes no output, and a
replica that comes back is used again."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import tritonclient.grpc as grpcclient

from specsplit.cloud.supervision.process import CloudProcess
from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.edge.onnx_drafter import OnnxDrafter
from specsplit.shared.tiny import reference_greedy
from tests.test_restarts import KillOnce, _triton_pid

pytestmark = pytest.mark.slow

PROMPTS = [[1, 2, 3, 4, 5], [42], [7, 7, 7, 100, 200, 13, 9, 250], [9, 8]]
N_NEW = 100


def _inferences(url: str) -> int:
    """Requests the replica's target has executed since it started."""
    with grpcclient.InferenceServerClient(url) as client:
        stats = client.get_inference_statistics("target", as_json=True)
    return sum(int(m.get("inference_count", 0)) for m in stats["model_stats"])


async def _generate_all(address, drafter_dir, prompts, on_tokens=None) -> list[list[int]]:
    cfg = GenerationConfig(max_new_tokens=N_NEW, max_draft_tokens=3, follow_hint=False)

    async def one(prompt, hook):
        async with SplitClient(address, OnnxDrafter(drafter_dir)) as client:
            gen = client.generate(prompt, cfg)
            async for _ in gen:
                if hook is not None:
                    hook(len(gen.token_ids))
            return gen.token_ids

    hooks = [on_tokens] + [None] * (len(prompts) - 1)
    return await asyncio.gather(*(one(p, h) for p, h in zip(prompts, hooks, strict=True)))


def _inferences_once_back(cloud: CloudProcess, url: str, timeout_s: float = 180.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return _inferences(url)
        except Exception:  # still restarting
            time.sleep(0.5)
    os.kill(cloud.proc.pid, signal.SIGUSR1)  # serve prints its threads' stacks: where it sits
    time.sleep(1.0)
    port = url.rsplit(":", 1)[1]
    triton_log = cloud.log_path.with_name(f"tritonserver-{port}.log")
    raise AssertionError(
        f"replica {url} did not come back\n--- serve ---\n{cloud.log_path.read_text()[-6000:]}"
        f"\n--- tritonserver ---\n{triton_log.read_text(errors='replace')[-4000:]}"
    )


def test_replicas_spread_fail_over_and_come_back(tiny, tmp_path):
    expected = [reference_greedy(tiny.target, p, N_NEW) for p in PROMPTS]
    with CloudProcess(
        "--target",
        str(tiny.target),
        "--replicas",
        "2",
        "--triton-log-dir",
        str(tmp_path),
        log_dir=tmp_path,
    ) as cloud:
        urls = cloud.triton_url.split(",")
        assert len(urls) == 2
        # 1. Four sessions at once are placed on both replicas.
        got = asyncio.run(_generate_all(cloud.address, tiny.draft_onnx, PROMPTS))
        assert got == expected
        assert all(_inferences(url) > 0 for url in urls), "a replica got no session"
        # 2. The first replica dies under its session (placed there: it has the fewest).
        victim = _triton_pid(urls[0].rsplit(":", 1)[1])
        killer = KillOnce(lambda: os.kill(victim, signal.SIGKILL))
        got = asyncio.run(_generate_all(cloud.address, tiny.draft_onnx, PROMPTS[:2], killer))
        assert killer.at is not None and killer.at < N_NEW
        assert got == expected[:2], "a failover changed the output"
        log = cloud.log_path.read_text()
        assert f"session moved from replica {urls[0]}" in log, log[-3000:]
        # 3. Restarted by serve, it is used again.
        before = _inferences_once_back(cloud, urls[0])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "is up" not in log.split("moved from")[-1]:
            time.sleep(0.5)
            log = cloud.log_path.read_text()
        got = asyncio.run(_generate_all(cloud.address, tiny.draft_onnx, PROMPTS[:2]))
        assert got == expected[:2]
        assert _inferences(urls[0]) > before, "the restarted replica gets no sessions"
