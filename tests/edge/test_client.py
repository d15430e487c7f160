"""SplitClient against an in-process gateway with a fake Triton: client-side behaviour."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from specsplit.edge.client import GenerationConfig, SplitClient
from tests.fakes import SlowDrafter, gateway


def test_cancel_leaves_the_drafter_idle():
    """A generation cancelled while its draft-ahead worker runs returns only once the worker has
    left the drafter; nobody touches the drafter afterwards."""
    drafter = SlowDrafter(delay_s=0.05)

    async def run() -> tuple[int, int, int]:
        async with gateway() as address, SplitClient(address, drafter) as client:
            cfg = GenerationConfig(max_new_tokens=50, max_draft_tokens=4)
            task = asyncio.create_task(client.generate([1, 2, 3], cfg).collect())
            while not drafter.worker_seen.is_set():
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.03)  # the verdict arrives while the worker still drafts
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            active, calls = drafter.active, drafter.calls
            await asyncio.sleep(0.3)
            return active, calls, drafter.calls

    active, calls_at_cancel, calls_later = asyncio.run(run())
    assert active == 0
    assert calls_later == calls_at_cancel


def test_drafting_never_blocks_the_event_loop():
    """Every draft forward pass (the first block while the cloud prefills, fresh blocks after a
    missed guess, blocks drafted ahead) runs in a worker thread: other generations' streams in
    the same process (`specsplit-edge serve`) are never held up by one generation's drafting."""
    drafter = SlowDrafter(delay_s=0.001)

    async def run():
        async with gateway() as address, SplitClient(address, drafter) as client:
            results = []
            for draft_ahead in (True, False):
                cfg = GenerationConfig(
                    max_new_tokens=24,
                    max_draft_tokens=3,
                    follow_hint=False,
                    draft_ahead=draft_ahead,
                )
                results.append(await client.generate([1, 2, 3], cfg).collect())
            return results

    with_ahead, without = asyncio.run(run())
    assert with_ahead == without and len(without) == 24
    assert drafter.calls > 0 and drafter.loop_calls == 0


def test_a_prompt_past_the_drafts_limit_is_refused_before_any_work():
    """Refused when generate is called: no stream opened (no server listens there), no pass of
    the draft; the draft must feed one position past the prompt. Cloud-only needs no draft."""
    drafter = SlowDrafter(delay_s=0.0)
    drafter.max_positions = 8

    async def run() -> None:
        async with SplitClient("127.0.0.1:1", drafter) as client:
            cfg = GenerationConfig(max_new_tokens=4)
            with pytest.raises(ValueError, match="prompt of 8 tokens: the draft runs at most 8"):
                client.generate([1] * 8, cfg)
            with pytest.raises(ValueError, match="prompt of 9 tokens"):
                client.generate([1] * 9, cfg, route="edge-only")
            client.generate([1] * 9, cfg, route="cloud-only")  # lazy: nothing sent yet
            client.generate([1] * 7, cfg)

    asyncio.run(run())
    assert drafter.calls == 0


def test_a_sampled_request_with_no_seed_sends_one_of_the_edges_own(monkeypatch):
    """edge.client._own_seed: a sampled split request with no seed sends the edge's own pick in
    Start (its draft rule needs it before Started, so that the first block drafts while the
    cloud prefills), a different one per request, reported as the seed in force; a greedy or
    cloud-only request, or one with a seed, leaves the seed as it was (the server picks)."""
    from specsplit.edge import client as client_module
    from specsplit.shared.sampling import SamplingConfig

    sent: list[int | None] = []

    class Recording(client_module.Stream):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            sent.append(self.seed)

    monkeypatch.setattr(client_module, "Stream", Recording)
    sampled = GenerationConfig(max_new_tokens=6, sampling=SamplingConfig(temperature=0.8))
    asks = [
        (sampled, "split"),
        (sampled, "split"),
        (GenerationConfig(max_new_tokens=6), "split"),
        (sampled, "cloud-only"),
        (GenerationConfig(max_new_tokens=6, seed=11, sampling=sampled.sampling), "split"),
    ]

    async def run():
        async with gateway() as address, SplitClient(address, SlowDrafter(0.0)) as client:
            gens = [client.generate([1, 2, 3], cfg, route=route) for cfg, route in asks]
            for gen in gens:
                await gen.collect()
            return [gen.stats.seed for gen in gens]

    in_force = asyncio.run(run())
    assert sent[0] is not None and sent[1] is not None and sent[0] != sent[1]
    assert sent[2:] == [None, None, 11]
    assert in_force[:2] == sent[:2] and in_force[4] == 11
