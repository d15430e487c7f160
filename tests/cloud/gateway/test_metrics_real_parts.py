"""Gateway metrics on real parts (tritonserver, `specsplit-cloud serve --metrics-port`, ONNX
Runtime): every counter the gateway exports equals what the edge's own stats say, in every
session mode, greedy and sampled."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from specsplit.cloud.gateway.metrics import ACCEPTANCE_LENGTHS
from specsplit.cloud.supervision.process import CloudProcess
from specsplit.cloud.supervision.triton import free_port
from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.edge.generation import GenerationStats
from specsplit.edge.mode_switch import LeadChoice
from specsplit.edge.onnx_drafter import OnnxDrafter
from specsplit.edge.session_plan import SessionPlan
from specsplit.shared.sampling import SamplingConfig
from tests.cloud.gateway.test_metrics import samples, scrape, settled, value


@dataclass(frozen=True)
class MeteredCloud:
    """`specsplit-cloud serve --metrics-port` with the tiny target, and the drafts to use."""

    address: str
    metrics_url: str
    log_path: Path
    same: OnnxDrafter  # the target as its own draft: (nearly) everything accepted
    unrelated: OnnxDrafter  # another model: next to nothing accepted

    def read(self) -> dict:
        return settled(lambda: samples(scrape(self.metrics_url)))


@pytest.fixture(scope="module")
def metered_cloud(tiny, tmp_path_factory):
    """One cloud for every real-parts test of this module, stopped after the last one."""
    port = free_port()
    args = ("--target", str(tiny.target), "--metrics-port", str(port))
    with CloudProcess(*args, log_dir=tmp_path_factory.mktemp("metered")) as cloud:
        yield MeteredCloud(
            cloud.address,
            f"http://127.0.0.1:{port}/metrics",
            cloud.log_path,
            OnnxDrafter(tiny.target_onnx),
            OnnxDrafter(tiny.draft_onnx),
        )


async def generate(address, drafter, prompt, route, **cfg) -> GenerationStats:
    async with SplitClient(address, drafter) as client:
        gen = client.generate(prompt, GenerationConfig(**cfg), route=route)
        await gen.collect()
        return gen.stats


def delta(before: dict, after: dict) -> dict:
    """What each sample grew by between two reads."""
    return {key: v - before.get(key, 0.0) for key, v in after.items()}


SPEC = "specsplit_spec_decode"


def disagreements(d: dict, stats: GenerationStats, label: str) -> dict[str, tuple]:
    """{figure: (gateway's counter delta, the client's stats)} wherever the two differ."""
    summary = stats.summary()
    pairs = {
        "drafted": (value(d, f"{SPEC}_num_draft_tokens_total"), stats.drafted),
        "accepted": (value(d, f"{SPEC}_num_accepted_tokens_total"), stats.accepted),
        "drafts": (value(d, f"{SPEC}_num_drafts_total"), summary["num_drafts"]),
        "emitted": (value(d, f"{SPEC}_num_emitted_tokens_total"), summary["num_emitted_tokens"]),
        "acceptance_length_count": (
            value(d, f"{SPEC}_acceptance_length_count"),
            len(stats.emitted_lens),
        ),
        "acceptance_length_sum": (
            value(d, f"{SPEC}_acceptance_length_sum"),
            sum(stats.emitted_lens),
        ),
        "committed": (value(d, "specsplit_tokens_committed_total", route=label), stats.new_tokens),
        "rounds": (value(d, "specsplit_rounds_total", route=label), stats.rounds),
        "verify_seconds_count": (value(d, "specsplit_round_verify_seconds_count"), stats.rounds),
        "received_bytes": (value(d, "specsplit_received_bytes_total"), stats.bytes_up),
        "sent_bytes": (value(d, "specsplit_sent_bytes_total"), stats.bytes_down),
        "sessions_length": (
            value(d, "specsplit_sessions_total", route=label, outcome="length"),
            1 if stats.finish == "LENGTH" else 0,
        ),
    }
    per_pos = summary["accepted_per_position"]
    for pos in range(16):
        gateway = value(d, f"{SPEC}_num_accepted_tokens_per_pos_total", position=str(pos))
        pairs[f"accepted_at_{pos}"] = (gateway, per_pos[pos] if pos < len(per_pos) else 0)
    for le in ACCEPTANCE_LENGTHS:
        gateway = value(d, f"{SPEC}_acceptance_length_bucket", le=f"{float(le)}")
        pairs[f"acceptance_length_le_{le}"] = (gateway, sum(e <= le for e in stats.emitted_lens))
    return {name: pair for name, pair in pairs.items() if pair[0] != pair[1]}


# Session modes as GenerationConfig asks for them. A seeded sampled run neither adapts nor leaves
# lock-step unless told to (it must repeat exactly): adaptive=True lets it, as greedy runs do.
SESSION_CONFIGS = {
    "lock-step-fixed-k": dict(session_mode="lock-step", adaptive=False),
    "lock-step-adaptive": dict(session_mode="lock-step", adaptive=True),
    # follow_hint=False: the tiny target's cost model may hint k = 0 (its pass is all lm_head
    # rows), and a cloud-led edge that obeys drafts nothing, leaving the counters untested.
    "cloud-led": dict(session_mode="cloud-led", follow_hint=False),
    "auto": dict(session_mode="auto", adaptive=True),  # switches to cloud-led mid-stream
    "cloud-only": {},
}
SAMPLINGS = {
    "greedy": {},
    "sampled": dict(sampling=SamplingConfig(temperature=0.8), seed=1234),
}


ATTEMPTS = 10  # failed 5 in a row once, with the machine under other load


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("session", SESSION_CONFIGS)
@pytest.mark.usefixtures("lock_step_first")
def test_counters_equal_the_clients_stats_on_real_parts(
    metered_cloud, session, sampling, monkeypatch
):
    cloud = metered_cloud
    cloud_only = session == "cloud-only"
    route = label = "cloud-only" if cloud_only else "split"
    if session == "auto":
        # Start lock-step whatever Start's round trip says (on loopback it may already favour
        # leading with the first Draft): the hand-over then comes mid-stream, from the rounds'
        # own measurements.
        monkeypatch.setattr(LeadChoice, "lead_at_start", staticmethod(lambda *_: False))
        # Nor does the cloud lead first (Verdict.led): the tiny target's steps are shorter than
        # the edge's first Draft takes.
        monkeypatch.setattr(SessionPlan, "follows_lead", property(lambda plan: False))
    cfg = dict(max_new_tokens=21, **SESSION_CONFIGS[session], **SAMPLINGS[sampling])
    # The target as its own draft accepts most, the unrelated draft next to nothing (its
    # cloud-led Drafts mostly go stale); cloud-only has no draft. Counters are read around each
    # generation.
    drafts = (
        {"target-only": (None, [5, 6], 4)}
        if cloud_only
        else {
            "same": (cloud.same, [1, 2, 3], 4),
            "unrelated": (cloud.unrelated, [42, 7], 3),
        }
    )
    # A cloud-led step verifies only Drafts that reach past what the cloud committed: a tiny
    # target steps about as fast as the edge drafts, so one run may verify none. Such runs are
    # repeated (each still checked) until Drafts were verified, at most ATTEMPTS times.
    attempts = ATTEMPTS if session == "cloud-led" else 1
    for _ in range(attempts):
        runs, wrong = [], {}
        for name, (drafter, prompt, k) in drafts.items():
            before = cloud.read()
            stats = asyncio.run(
                generate(cloud.address, drafter, prompt, route, max_draft_tokens=k, **cfg)
            )
            if found := disagreements(delta(before, cloud.read()), stats, label):
                wrong[name] = found
            runs.append(stats)
        assert not wrong, (
            f"gateway counter deltas != client stats, {{figure: (gateway, client)}}: {wrong}"
        )
        if sum(s.drafted for s in runs) and sum(s.drafts_dropped for s in runs):
            break
    assert all(s.finish == "LENGTH" and s.new_tokens == 21 for s in runs)
    drafted, accepted = sum(s.drafted for s in runs), sum(s.accepted for s in runs)
    if cloud_only:
        assert drafted == 0
    elif session.startswith("lock-step"):  # every Draft is verified: the unrelated one fails
        assert 0 < accepted < drafted
    else:  # cloud-led: which Drafts a step verifies depends on timing (stale ones are not)
        assert drafted > 0 and accepted <= drafted
    if session == "cloud-led":  # stale Drafts came, and were drafted on neither side
        assert sum(s.drafts_dropped for s in runs) > 0
    if session == "auto":  # lock-step rounds first, then the hand-over to cloud-led
        assert any(s.lead_round > 1 for s in runs)
    elif session.startswith("lock-step"):
        assert not any(s.lead_round or s.drafts_sent or s.drafts_dropped for s in runs)


@pytest.mark.slow
def test_triton_reports_its_own_metrics(metered_cloud):
    # Triton's own metrics are on (localhost): it counted the requests to the target.
    asyncio.run(generate(metered_cloud.address, None, [5, 6], "cloud-only", max_new_tokens=3))
    triton = re.search(
        r"triton \S+ metrics on (http://127\.0\.0\.1:\d+/metrics)",
        metered_cloud.log_path.read_text(),
    )
    assert triton, "serve must report Triton's own metrics address"
    assert re.search(
        r'nv_inference_request_success\{model="target",version="1"\} [1-9]', scrape(triton[1])
    )
    assert value(metered_cloud.read(), "specsplit_triton_replicas_up") == 1
