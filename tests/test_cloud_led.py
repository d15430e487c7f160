"""Cloud-led sessions on real parts (tritonserver + gateway + ONNX Runtime): lossless whatever
the timing, including a link slow enough to make most drafts stale on arrival.

Greedy: the output equals transformers' greedy output of the target. Sampled: every verification
mode completes with the requested length (its exactness is the chi-square test in
tests/cloud/gateway/test_cloud_led_distribution.py, which runs the gateway's own draft pool), and in
the token-only rule the output is the target's own sampled output for the seed, token for token,
whatever the drafter, the session mode and the link: every token is the cloud's draw with the
session's shared numbers (shared/coupling.py), which drafts can only match, never change.
"""

from __future__ import annotations

import asyncio

import pytest

from bench.proxy import DelayProxy
from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.edge.onnx_drafter import OnnxDrafter
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.sampling import SamplingConfig
from specsplit.shared.tiny import reference_greedy

pytestmark = pytest.mark.slow

PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7, 100, 200, 13, 9, 250]]
N_NEW = 24


async def _generate(port: int, rtt_ms: float, drafter, prompt, session_mode="cloud-led", **cfg):
    # follow_hint=False: the tiny target's cost model asks for k = 0 (its pass cost is all
    # lm_head rows); these tests are about verifying drafts
    cfg.setdefault("follow_hint", False)
    config = GenerationConfig(max_new_tokens=N_NEW, session_mode=session_mode, **cfg)
    async with DelayProxy(port, rtt_ms) as proxy:
        client = SplitClient(f"127.0.0.1:{proxy.port}", drafter)
        async with client:
            gen = client.generate(prompt, config)
            await gen.collect()
            return gen


def port_of(cloud) -> int:
    return int(cloud.address.rsplit(":", 1)[1])


@pytest.fixture
def lead_at_round_2(monkeypatch):
    """Session mode auto hands over to cloud-led with its second Draft, whatever its
    measurements say (and despite follow_hint False, which alone keeps auto lock-step); the
    cloud never leads first (the tiny target's steps are shorter than any first Draft takes)."""
    from specsplit.edge.mode_switch import LeadChoice
    from specsplit.edge.session_plan import SessionPlan

    monkeypatch.setattr(SessionPlan, "follows_lead", property(lambda plan: False))

    auto = property(lambda cfg: cfg.session_mode == "auto")
    monkeypatch.setattr(GenerationConfig, "may_lead", auto)
    monkeypatch.setattr(LeadChoice, "should_lead", lambda choice, k: choice.idle_ms is not None)
    monkeypatch.setattr(LeadChoice, "lead_at_start", staticmethod(lambda rtt, step: False))


@pytest.fixture(scope="module")
def target_greedy(tiny):
    return {tuple(p): reference_greedy(tiny.target, p, N_NEW) for p in PROMPTS}


@pytest.mark.parametrize("rtt_ms", [0, 150])
@pytest.mark.parametrize("draft", ["same", "unrelated"])
def test_greedy_cloud_led_equals_target_greedy(cloud, tiny, target_greedy, draft, rtt_ms):
    drafter = OnnxDrafter(tiny.target_onnx if draft == "same" else tiny.draft_onnx)
    port = port_of(cloud)
    for prompt in PROMPTS:
        # branch_ahead: branch Drafts (edge.cloud_led) verified by the real gateway too
        gen = asyncio.run(
            _generate(port, rtt_ms, drafter, prompt, max_draft_tokens=4, branch_ahead=True)
        )
        s = gen.stats
        assert gen.token_ids == target_greedy[tuple(prompt)], (prompt, draft, rtt_ms)
        assert s.finish == "LENGTH"
        # one verdict per target step, each emitting its accepted drafts plus one token
        assert s.target_forward_passes == s.rounds
        assert s.new_tokens == s.accepted + s.rounds
        if draft == "same":  # whatever drafts the cloud verified, it accepted them all
            assert s.accepted == s.drafted
        else:
            assert s.acceptance_rate < 0.5


@pytest.mark.parametrize("rtt_ms", [0, 150])
@pytest.mark.usefixtures("lock_step_first")
def test_greedy_auto_switching_mid_stream_equals_target_greedy(
    cloud, tiny, target_greedy, lead_at_round_2, rtt_ms
):
    for draft in ("same", "unrelated"):
        drafter = OnnxDrafter(tiny.target_onnx if draft == "same" else tiny.draft_onnx)
        for prompt in PROMPTS:
            gen = asyncio.run(
                _generate(port_of(cloud), rtt_ms, drafter, prompt, "auto", max_draft_tokens=4)
            )
            s = gen.stats
            assert gen.token_ids == target_greedy[tuple(prompt)], (prompt, draft, rtt_ms)
            assert s.lead_round == 2 and s.rounds > 2, s.summary()  # cloud-led steps followed
            assert s.start_rtt_ms is not None and s.start_rtt_ms >= 0.9 * rtt_ms
            assert s.target_forward_passes == s.rounds
            assert s.new_tokens == s.accepted + s.rounds


@pytest.mark.usefixtures("lock_step_first")
def test_auto_leads_with_its_first_draft_when_the_round_trip_is_many_steps(
    cloud, tiny, target_greedy
):
    """Unforced: the tiny target's step is a few ms, so a 150 ms link is dozens of steps; the
    client's next generation then starts cloud-led. The lead Draft reaches the cloud 75 ms
    after Started, and the cloud, which would leave the target idle for dozens of steps, has
    led itself by then (Verdict.led): the target never waited for the link.
    (follow_hint: the default; the tiny target's hint of k = 0 then empties later blocks, but
    the first is drafted before any hint.)"""
    drafter = OnnxDrafter(tiny.target_onnx)
    prompt = PROMPTS[0]
    warm = asyncio.run(_generate(port_of(cloud), 0, drafter, prompt, "lock-step"))
    assert warm.token_ids == target_greedy[tuple(prompt)]  # the gateway has measured steps now

    async def twice():  # one client, as an app keeps it: the second remembers the link
        link = DelayProxy(port_of(cloud), 150)
        async with link as proxy, SplitClient(f"127.0.0.1:{proxy.port}", drafter) as client:
            gens = []
            for _ in range(2):
                gens.append(client.generate(prompt, GenerationConfig(max_new_tokens=N_NEW)))
                await gens[-1].collect()
            return gens

    gen, again = asyncio.run(twice())
    assert gen.token_ids == target_greedy[tuple(prompt)]
    assert gen.stats.lead_round == 1 and gen.stats.cloud_took_lead, gen.stats.summary()
    assert not gen.stats.led_at_start
    # The next generation starts cloud-led (Start.session_mode): no lock-step round at all.
    assert again.token_ids == target_greedy[tuple(prompt)]
    s = again.stats
    assert s.led_at_start and s.lead_round == 0, s.summary()
    assert s.target_forward_passes == s.rounds and s.new_tokens == s.accepted + s.rounds


@pytest.mark.parametrize("verification", [VerificationRule.REJECTION, VerificationRule.TOKEN_ONLY])
def test_sampled_cloud_led_completes(cloud, tiny, verification):
    drafter = OnnxDrafter(tiny.target_onnx)
    port = port_of(cloud)
    cfg = dict(sampling=SamplingConfig(temperature=0.9), verification=verification, seed=3)
    for rtt_ms in (0, 150):
        gen = asyncio.run(_generate(port, rtt_ms, drafter, PROMPTS[0], **cfg))
        assert len(gen.token_ids) == N_NEW and gen.stats.finish == "LENGTH"
        assert gen.stats.new_tokens == gen.stats.accepted + gen.stats.rounds


def test_token_only_sampled_output_is_the_targets_own_for_the_seed(cloud, tiny, lead_at_round_2):
    port = port_of(cloud)
    sampling = SamplingConfig(temperature=0.9)

    async def cloud_only(prompt):
        async with SplitClient(cloud.address, None) as client:
            cfg = GenerationConfig(max_new_tokens=N_NEW, sampling=sampling, seed=11)
            gen = client.generate(prompt, cfg, route="cloud-only")
            await gen.collect()
            return gen.token_ids

    cfg = dict(
        sampling=sampling, verification=VerificationRule.TOKEN_ONLY, seed=11, max_draft_tokens=4
    )
    for prompt in PROMPTS:
        want = asyncio.run(cloud_only(prompt))
        assert len(want) == N_NEW
        for draft in ("same", "unrelated"):
            drafter = OnnxDrafter(tiny.target_onnx if draft == "same" else tiny.draft_onnx)
            for mode in ("lock-step", "cloud-led", "auto"):
                for rtt_ms in (0, 150):
                    gen = asyncio.run(_generate(port, rtt_ms, drafter, prompt, mode, **cfg))
                    assert gen.token_ids == want, (prompt, draft, mode, rtt_ms)
                    if (draft, mode) == ("same", "lock-step"):  # every round verifies drafts
                        assert gen.stats.accepted > 0, (prompt, rtt_ms)


@pytest.mark.parametrize("pause_s", [0.0, 0.3])
def test_a_draft_sent_as_the_stream_finishes_does_not_break_it(cloud, pause_s):
    """A cloud-led edge may still be writing a Draft when Finished leaves the cloud. The call
    must stay open for it until the client half-closes: a write on an ended call makes grpc.aio
    fail the whole call as INTERNAL, losing the final Verdict and Finished the client had not
    read yet. (``pause_s``: the Draft is still on its way a while after Finished.)"""
    import grpc

    from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc

    async def call():
        async with grpc.aio.insecure_channel(cloud.address) as channel:
            call = pb_grpc.SpeculativeDecodingStub(channel).Generate()
            start = pb.Start(
                protocol_version=PROTOCOL_VERSION,
                prompt_ids=[1, 2, 3],
                sampling=pb.SamplingParams(max_new_tokens=3),
                session_mode=pb.SESSION_MODE_CLOUD_LED,
            )
            await call.write(pb.ClientMessage(start=start))
            kinds = []
            while (msg := await call.read()) is not grpc.aio.EOF:
                kinds.append(msg.WhichOneof("msg"))
                if kinds[-1] == "started":  # a Draft the cloud reads while it generates
                    draft = pb.Draft(round=1, base_len=3, tokens=[5])
                    await call.write(pb.ClientMessage(draft=draft))
                if kinds[-1] == "finished":
                    break
            await asyncio.sleep(pause_s)
            # the late Draft: after the last token, from the prompt's end
            await call.write(pb.ClientMessage(draft=pb.Draft(round=1, base_len=3, tokens=[5])))
            await call.done_writing()
            return kinds, await call.code()

    kinds, code = asyncio.run(call())
    assert kinds[0] == "started" and kinds[-1] == "finished", kinds
    assert code == grpc.StatusCode.OK


@pytest.mark.parametrize("draft", ["same", "unrelated"])
@pytest.mark.usefixtures("lock_step_first")
def test_a_late_first_draft_the_cloud_leads_and_the_output_is_cloud_onlys(
    cloud, tiny, target_greedy, monkeypatch, draft
):
    """The edge never leads here (its choice is forced off), and its first Draft comes 75 ms
    after Started (a 150 ms link): dozens of the tiny target's steps, past the cloud's bound
    (Started.lead_after_ms). The cloud leads itself (Verdict.led), the edge goes on cloud-led
    from that Verdict, and no token is lost or doubled: greedy output equals cloud-only's."""
    from specsplit.edge.mode_switch import LeadChoice

    auto = property(lambda cfg: cfg.session_mode == "auto")  # despite follow_hint False
    monkeypatch.setattr(GenerationConfig, "may_lead", auto)
    monkeypatch.setattr(LeadChoice, "should_lead", lambda choice, k: False)
    monkeypatch.setattr(LeadChoice, "lead_at_start", staticmethod(lambda rtt, step: False))
    drafter = OnnxDrafter(tiny.target_onnx if draft == "same" else tiny.draft_onnx)
    port = port_of(cloud)
    asyncio.run(_generate(port, 0, drafter, PROMPTS[0], "lock-step"))  # a step measured

    async def cloud_only(prompt):
        async with SplitClient(cloud.address, None) as client:
            gen = client.generate(
                prompt, GenerationConfig(max_new_tokens=N_NEW), route="cloud-only"
            )
            return await gen.collect()

    for prompt in PROMPTS:
        want = asyncio.run(cloud_only(prompt))
        assert want == target_greedy[tuple(prompt)]
        gen = asyncio.run(_generate(port, 150, drafter, prompt, "auto", max_draft_tokens=4))
        s = gen.stats
        assert gen.token_ids == want, (prompt, draft)
        assert s.cloud_took_lead and s.lead_round == 1, s.summary()
        assert s.target_forward_passes == s.rounds
        assert s.new_tokens == s.accepted + s.rounds


@pytest.mark.usefixtures("lock_step_first")
@pytest.mark.parametrize("verification", [VerificationRule.TOKEN_ONLY, VerificationRule.REJECTION])
def test_a_late_first_draft_the_cloud_leads_when_sampling_too(
    cloud, tiny, monkeypatch, verification
):
    """Sampled, the cloud's lead is as lossless: under the token-only rule each token is the cloud's
    draw with the session's shared numbers, so the output is cloud-only's for the seed, token
    for token; under the rejection rule the lock-step block (drafted with its q) becomes a cloud-led
    Draft, and the generation completes (its exactness is the pool's chi-square test in
    tests/cloud/gateway/test_cloud_led_distribution.py: the pool is the same)."""
    from specsplit.edge.mode_switch import LeadChoice

    auto = property(lambda cfg: cfg.session_mode == "auto")
    monkeypatch.setattr(GenerationConfig, "may_lead", auto)
    monkeypatch.setattr(LeadChoice, "should_lead", lambda choice, k: False)
    monkeypatch.setattr(LeadChoice, "lead_at_start", staticmethod(lambda rtt, step: False))
    drafter = OnnxDrafter(tiny.target_onnx)
    port = port_of(cloud)
    asyncio.run(_generate(port, 0, drafter, PROMPTS[0], "lock-step"))  # a step measured
    sampling = SamplingConfig(temperature=0.9)

    async def cloud_only(prompt):
        async with SplitClient(cloud.address, None) as client:
            cfg = GenerationConfig(max_new_tokens=N_NEW, sampling=sampling, seed=5)
            return await client.generate(prompt, cfg, route="cloud-only").collect()

    cfg = dict(sampling=sampling, verification=verification, seed=5, max_draft_tokens=4)
    for prompt in PROMPTS:
        gen = asyncio.run(_generate(port, 150, drafter, prompt, "auto", **cfg))
        s = gen.stats
        assert s.cloud_took_lead and s.lead_round == 1, s.summary()
        assert len(gen.token_ids) == N_NEW and s.new_tokens == s.accepted + s.rounds
        if verification is VerificationRule.TOKEN_ONLY:
            assert gen.token_ids == asyncio.run(cloud_only(prompt)), prompt
