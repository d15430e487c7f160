"""A lock-step stream whose first Draft is late goes on cloud-led when the cloud takes the lead
(Verdict.led), even before that Draft is drafted: SplitClient against an in-process gateway
with a fake Triton that verifies by a fixed rule, so the output is known."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from bench.proxy import DelayProxy
from specsplit.cloud.gateway.messages import Echoes
from specsplit.cloud.gateway.triton_client import StepReply
from specsplit.edge.client import GenerationConfig, SplitClient
from tests.fakes import VOCAB, FakeTriton, SlowDrafter, gateway

PROMPT = [1, 2, 3]
N_NEW = 24
STEP_MS = 5.0  # reported: the server leads 7.5 ms after Started, long before a Draft is due


def target(prev: int) -> int:
    """The fake target's greedy next token after ``prev``."""
    return (3 * prev + 1) % VOCAB


class RuleTarget(FakeTriton):
    """Accepts the leading drafts that follow ``target`` and answers its next token."""

    async def step(self, base_len: int, tokens: Sequence[int], q=None) -> StepReply:
        await asyncio.sleep(0.002)
        accepted = 0
        while accepted + 1 < len(tokens) and tokens[accepted + 1] == target(tokens[accepted]):
            accepted += 1
        nxt = target(tokens[accepted])
        return StepReply(accepted=accepted, token=nxt, verify_ms=STEP_MS, roundtrip_ms=STEP_MS)


class RuleDrafter(SlowDrafter):
    """Drafts ``target``'s token except after every ``wrong``-th input, slowly (``delay_s``)."""

    def __init__(self, delay_s: float, wrong: int) -> None:
        super().__init__(delay_s)
        self.wrong = wrong

    def forward(self, tokens: Sequence[int]) -> np.ndarray:
        super().forward(tokens)
        logits = np.zeros((len(tokens), VOCAB), dtype=np.float32)
        for i, t in enumerate(tokens):
            guess = target(t) if t % self.wrong else (t + 1) % VOCAB
            logits[i, guess] = 5.0
        return logits


def expected(n: int) -> list[int]:
    out, prev = [], PROMPT[-1]
    for _ in range(n):
        prev = target(prev)
        out.append(prev)
    return out


def _run(delay_s: float):
    drafter = RuleDrafter(delay_s, wrong=5)

    async def run():
        async with gateway(RuleTarget) as address, SplitClient(address, drafter) as client:
            # a forced mode's generation: the gateway measures a step, the next auto one sees it
            await client.generate(
                PROMPT, GenerationConfig(max_new_tokens=2, session_mode="lock-step")
            ).collect()
            gen = client.generate(PROMPT, GenerationConfig(max_new_tokens=N_NEW))
            await gen.collect()
            return gen

    return asyncio.run(run())


@pytest.mark.usefixtures("lock_step_first")
def test_a_late_first_draft_goes_on_cloud_led_from_the_clouds_lead():
    gen = _run(delay_s=0.05)  # the first block: five 50 ms passes, the bound 7.5 ms
    s = gen.stats
    assert gen.token_ids == expected(N_NEW)
    # the cloud led while the first block drafted: followed at once, that block never sent
    # (edge.rounds reads the first Verdict meanwhile), so no lock-step round led
    assert s.cloud_took_lead and s.lead_round == 0 and not s.led_at_start, s.summary()
    assert s.finish == "LENGTH"
    # one verdict per target step, none lost or doubled across the switch
    assert s.target_forward_passes == s.rounds
    assert s.new_tokens == s.accepted + s.rounds


class SlowPrefill(RuleTarget):
    """Prefills in 0.2 s: long enough for the Probe's Echo to come back over the link."""

    async def start(self, prompt, sampling, verification, seed, speculative=True) -> None:
        await super().start(prompt, sampling, verification, seed, speculative)
        await asyncio.sleep(0.2)


@pytest.mark.usefixtures("lock_step_first")
def test_over_a_long_link_the_edge_echoes_the_probe_and_goes_on_from_the_clouds_lead(
    monkeypatch,
):
    """A cold auto client over a 100 ms link (the bound: 7.5 ms): it asks for a Probe and
    echoes it while the target prefills, the cloud leads on that round trip, the edge goes on
    cloud-led from its first Verdict, and the output is the target's."""
    echoes: list[float] = []
    timed = Echoes._echo

    def spy(self) -> None:
        timed(self)
        echoes.append(self.echo_at - self.sent_at)

    monkeypatch.setattr(Echoes, "_echo", spy)
    drafter = RuleDrafter(0.0, wrong=5)

    async def run():
        async with gateway(SlowPrefill) as address:
            port = int(address.rsplit(":", 1)[1])
            proxy = DelayProxy(port, 100)
            async with proxy, SplitClient(f"127.0.0.1:{proxy.port}", drafter) as client:
                warm = GenerationConfig(max_new_tokens=2, session_mode="lock-step")
                await client.generate(PROMPT, warm).collect()  # no Probe: a forced mode
                assert echoes == []
                gen = client.generate(PROMPT, GenerationConfig(max_new_tokens=N_NEW))
                await gen.collect()
                return gen

    gen = asyncio.run(run())
    s = gen.stats
    assert gen.token_ids == expected(N_NEW)
    assert len(echoes) == 1  # the auto stream's, timed at the gateway
    assert s.cloud_took_lead and s.lead_round == 1, s.summary()
    assert s.target_forward_passes == s.rounds
