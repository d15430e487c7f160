"""How a session's rounds run, spelt once for the wire, both sides, the CLIs and the metrics.

- ``lock-step``: the edge drafts a block, the cloud verifies it in one target step and answers;
  each waits for the other (docs/design.md#lock-step).
- ``cloud-led``: the target steps continuously and verifies whatever Drafts arrived in time
  (docs/design.md#cloud-led).
- ``cloud-only``: no Drafts; the target generates alone (the baseline).

The edge's ``auto`` is not a session mode but a plan: start lock-step (or cloud-led when the
last round trip said so) and hand over to cloud-led once that is faster (edge/mode_switch.py).
"""

from __future__ import annotations

import enum


class SessionMode(enum.Enum):
    LOCK_STEP = "lock-step"
    CLOUD_LED = "cloud-led"
    CLOUD_ONLY = "cloud-only"

    def __str__(self) -> str:
        return self.value

    @property
    def drafts(self) -> bool:
        """The edge sends Drafts in this mode."""
        return self is not SessionMode.CLOUD_ONLY
