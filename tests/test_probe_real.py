"""The round trip measured in band (Start.probe, Probe, Echo; docs/design.md#probe) on real parts:
tritonserver + gateway (`specsplit-cloud serve` with the tiny target) and ONNX Runtime, through
a 150 ms link. A cold auto client asks for the Probe and echoes it while the target prefills; the
cloud leads on that round trip (Verdict.led), and greedy output equals the target's."""

from __future__ import annotations

import asyncio

import pytest

from bench.proxy import DelayProxy
from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.edge.onnx_drafter import OnnxDrafter
from specsplit.edge.stream import Stream
from specsplit.shared.tiny import reference_greedy

pytestmark = pytest.mark.slow

PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7, 100, 200, 13, 9, 250]]
N_NEW = 24


@pytest.mark.usefixtures("lock_step_first")
def test_a_cold_auto_client_echoes_the_probe_and_the_cloud_leads_losslessly(
    cloud, tiny, monkeypatch
):
    from specsplit.edge.mode_switch import LeadChoice

    # auto as a cold client runs it, with the edge's own lead choices off: any lead is the cloud's
    auto = property(lambda cfg: cfg.session_mode == "auto")  # despite follow_hint False
    monkeypatch.setattr(GenerationConfig, "may_lead", auto)
    monkeypatch.setattr(LeadChoice, "should_lead", lambda choice, k: False)
    monkeypatch.setattr(LeadChoice, "lead_at_start", staticmethod(lambda rtt, step: False))
    sent: list[list[str]] = []  # per stream, the kinds of the client's messages in order
    send = Stream.send

    async def spy(self, msg) -> None:
        if msg.WhichOneof("msg") == "start":
            sent.append([])
        sent[-1].append(msg.WhichOneof("msg"))
        await send(self, msg)

    monkeypatch.setattr(Stream, "send", spy)
    drafter = OnnxDrafter(tiny.target_onnx)
    port = int(cloud.address.rsplit(":", 1)[1])

    async def generate(prompt, session_mode, rtt_ms):
        cfg = GenerationConfig(
            max_new_tokens=N_NEW, session_mode=session_mode, max_draft_tokens=4, follow_hint=False
        )
        proxy = DelayProxy(port, rtt_ms)
        async with proxy, SplitClient(f"127.0.0.1:{proxy.port}", drafter) as client:
            gen = client.generate(prompt, cfg)
            await gen.collect()
            return gen

    asyncio.run(generate(PROMPTS[0], "lock-step", 0))  # a step measured; a forced mode: no Probe
    assert "echo" not in sent[-1]
    for prompt in PROMPTS:
        gen = asyncio.run(generate(prompt, "auto", 150))
        s = gen.stats
        assert gen.token_ids == reference_greedy(tiny.target, prompt, N_NEW), prompt
        # the real cloud sent a Probe (the edge echoes only one it read), before Started
        assert sent[-1][:2] == ["start", "echo"] and sent[-1].count("echo") == 1, sent[-1]
        assert s.cloud_took_lead and s.lead_round == 1, s.summary()
        assert s.target_forward_passes == s.rounds
        assert s.new_tokens == s.accepted + s.rounds
