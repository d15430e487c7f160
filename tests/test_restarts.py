"""Nothing lost when a process dies or the link drops (docs/design.md#failure), on real processes:
tritonserver or its Python backend stub SIGKILLed under `serve`, the gateway SIGKILLed and started
again on its port, a 2 s outage in the delay proxy. Each generation must come out exactly as an
uninterrupted one: the target's greedy output, or the same seeded sample."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.cloud.supervision.process import CloudProcess
from specsplit.cloud.supervision.triton import TritonServer
from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.edge.onnx_drafter import OnnxDrafter
from specsplit.shared.sampling import SamplingConfig
from specsplit.shared.tiny import reference_greedy

pytestmark = pytest.mark.slow

PROMPT = [1, 2, 3, 4, 5]
N_NEW = 120
KILL_AFTER = 12  # tokens received before the kill: mid-generation


def _proc_children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _triton_pid(port: str) -> int:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if args[0].endswith(b"tritonserver") and f"--grpc-port={port}".encode() in args:
            return int(cmdline.parent.name)
    raise AssertionError(f"no tritonserver on port {port}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


async def _serving(address: str, within_s: float = 10.0) -> bool:
    """True once health says SERVING (it follows Triton every 2 s); False after ``within_s``."""
    deadline = time.monotonic() + within_s
    async with grpc.aio.insecure_channel(address) as channel:
        while True:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.2)


async def _generate(address, drafter, cfg: GenerationConfig, route="split", on_tokens=None):
    """The generation's tokens and stats; ``on_tokens(n)`` runs as tokens arrive."""
    async with SplitClient(address, drafter) as client:
        gen = client.generate(PROMPT, cfg, route=route)
        async for _ in gen:
            if on_tokens is not None:
                on_tokens(len(gen.token_ids))
        return gen.token_ids, gen.stats


class KillOnce:
    """Calls ``kill`` once, after ``KILL_AFTER`` tokens; remembers how many had arrived, and the
    longest wait between two chunks (printed: `pytest -s` shows each scenario's stall)."""

    def __init__(self, kill, name: str = "") -> None:
        self.kill, self.name, self.at = kill, name, None
        self.stall_s = 0.0
        self._last: float | None = None

    def __call__(self, n: int) -> None:
        now = time.monotonic()
        if self._last is not None:
            self.stall_s = max(self.stall_s, now - self._last)
        self._last = now
        if self.at is None and n >= KILL_AFTER:
            self.at = n
            self.kill()

    def report(self) -> None:
        print(f"\n{self.name}: killed after {self.at} tokens; longest stall {self.stall_s:.1f} s")


def test_triton_sigkill_mid_generation_is_survived(tiny, tmp_path):
    greedy = GenerationConfig(max_new_tokens=N_NEW, max_draft_tokens=3, follow_hint=False)
    sampled = GenerationConfig(
        max_new_tokens=N_NEW,
        max_draft_tokens=3,
        follow_hint=False,
        seed=1234,
        sampling=SamplingConfig(temperature=0.8),
    )
    expected = reference_greedy(tiny.target, PROMPT, N_NEW)
    drafter = OnnxDrafter(tiny.draft_onnx)
    with CloudProcess("--target", str(tiny.target), log_dir=tmp_path) as cloud:
        port = cloud.triton_url.rsplit(":", 1)[1]
        sample_ref, _ = asyncio.run(_generate(cloud.address, drafter, sampled))
        # A dead stub leaves tritonserver running, its model "ready", and every request failing.
        scenarios = ((greedy, expected, "tritonserver"), (sampled, sample_ref, "tritonserver"))
        for cfg, want, victim in (*scenarios, (greedy, expected, "Python backend stub")):
            triton = _triton_pid(port)
            stubs = _proc_children(triton)
            assert stubs, "the Python backend stub should run under tritonserver"
            pid = triton if victim == "tritonserver" else stubs[0]
            name = f"{victim} SIGKILL ({'greedy' if cfg.sampling.greedy else 'sampled'})"
            killer = KillOnce(lambda pid=pid: os.kill(pid, signal.SIGKILL), name)
            tokens, stats = asyncio.run(_generate(cloud.address, drafter, cfg, on_tokens=killer))
            assert killer.at is not None and killer.at < N_NEW, "the kill came too late"
            killer.report()
            assert tokens == want, "output differs from an uninterrupted run"
            assert stats.finish == "LENGTH"
            assert _triton_pid(port) != triton, "tritonserver was not restarted"
            assert not any(_alive(pid) for pid in stubs), "the crashed server's stub lives on"
            assert asyncio.run(_serving(cloud.address))


class Gateways:
    """Gateway processes in front of one Triton, each started on the first one's port."""

    def __init__(self, triton_url: str, target: Path, log_dir: Path) -> None:
        self.args = ("--target", str(target), "--triton-url", triton_url)
        self.log_dir = log_dir
        self.procs = [CloudProcess(*self.args, log_dir=log_dir / "0").start()]
        self.port = self.procs[0].address.rsplit(":", 1)[1]
        self.starting: list[asyncio.Future] = []

    def kill_and_restart(self) -> None:
        """SIGKILL the live gateway; start the next in the background (the edge retries)."""
        self.procs[-1].proc.kill()
        self.procs[-1].stop()
        fresh = CloudProcess(
            *self.args, "--port", self.port, log_dir=self.log_dir / str(len(self.procs))
        )
        self.procs.append(fresh)
        self.starting.append(asyncio.ensure_future(asyncio.to_thread(fresh.start)))

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


def test_gateway_killed_and_restarted_on_its_port_is_survived(tiny, tmp_path):
    expected = reference_greedy(tiny.target, PROMPT, N_NEW)
    drafter = OnnxDrafter(tiny.draft_onnx)
    cfg = GenerationConfig(max_new_tokens=N_NEW, max_draft_tokens=3, follow_hint=False)
    with TritonServer(tiny.target) as triton:
        gateways = Gateways(triton.url, tiny.target, tmp_path)

        async def scenario():
            address = f"127.0.0.1:{gateways.port}"
            try:
                for mode in ("split", "cloud-only"):
                    killer = KillOnce(gateways.kill_and_restart, f"gateway SIGKILL ({mode})")
                    tokens, stats = await _generate(address, drafter, cfg, mode, killer)
                    assert killer.at is not None and killer.at < N_NEW, "the kill came too late"
                    killer.report()
                    assert stats.retries >= 1, "the stream should have broken"
                    assert tokens == expected, mode
                    await asyncio.gather(*gateways.starting)
            finally:
                await asyncio.gather(*gateways.starting, return_exceptions=True)

        try:
            asyncio.run(scenario())
        finally:
            gateways.stop()


@pytest.mark.parametrize("reset", [False, True], ids=["stall", "reset"])
def test_link_outage_of_two_seconds_is_survived(cloud, tiny, reset):
    """The delay proxy cuts the link for 2 s mid-generation: a stalled link resumes as it was, a
    reset one makes the edge re-open from its committed sequence."""
    from bench.proxy import DelayProxy

    expected = reference_greedy(tiny.target, PROMPT, N_NEW)
    drafter = OnnxDrafter(tiny.draft_onnx)
    cfg = GenerationConfig(max_new_tokens=N_NEW, max_draft_tokens=3, follow_hint=False)

    async def scenario():
        port = int(cloud.address.rsplit(":", 1)[1])
        async with DelayProxy(port, rtt_ms=10) as proxy:
            name = f"2 s link outage ({'reset' if reset else 'stall'})"
            killer = KillOnce(lambda: proxy.outage(2.0, reset=reset), name)
            tokens, stats = await _generate(
                f"127.0.0.1:{proxy.port}", drafter, cfg, "split", killer
            )
        assert killer.at is not None and killer.at < N_NEW, "the outage came too late"
        killer.report()
        assert tokens == expected
        assert killer.stall_s >= 1.5, "the outage did not hold the stream up"
        if reset:
            assert stats.retries >= 1

    asyncio.run(scenario())
