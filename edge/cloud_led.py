"""Cloud-led rounds (placeholder until the loop lands)."""

from __future__ import annotations


async def cloud_led_rounds(s, started):
    raise NotImplementedError
    yield []
