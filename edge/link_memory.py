"""The edge's memory of its links across processes: per server, what the last generation learnt.

``SplitClient`` keeps the ``Link`` of its last Started (edge.mode_switch: the round trip, the
server's one-row step, and whether the last auto generation, having judged its acceptance and
rates, ran cloud-led), but only while the process lives: each ``specsplit-edge generate`` is a
new process, so every invocation started cold, lock-step, and spent its first round trip learning
what the previous one already knew. This module writes that ``Link`` to a small file in the cache
directory and reads it back, so an invocation after the first starts as the last one ended.

The file, ``<cache>/edge/links.json``::

    {"version": 2, "links": {"<server address>": {"rtt_ms": 212.0, "step_ms": 88.5,
                                                  "led": true, "saved_at": 1764112345.6,
                                                  "lock_step": [2.6, 118.0],
                                                  "cloud_led": [1.3, 55.2]}}}

``lock_step`` and ``cloud_led``: what each mode yielded in the last auto generation that ran it
(edge.mode_switch.Yield: tokens per target pass, ms per pass), null where none did. Version 1
files, which lacked them, are ignored like any other version: the next invocation starts cold.

A link is the server's as the client names it (``--server``). One older than ``STALE_AFTER_S``
is ignored (a device moves between networks; a server is redeployed), as is a file of another
version or one that cannot be read: each with a debug log, never an error, since a cold start
is only slower. Writes replace the file atomically and keep the other servers' links that are
still good, the MAX_LINKS latest.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path

from specsplit.edge.mode_switch import Link, Yield
from specsplit.shared.build_steps import cache_dir

log = logging.getLogger(__name__)

VERSION = 2
STALE_AFTER_S = 6 * 3600.0  # a remembered link older than this is not trusted
MAX_LINKS = 32  # servers remembered at most (the latest saved): the file never grows unbounded


def links_path() -> Path:
    return cache_dir() / "edge" / "links.json"


def _read(path: Path) -> dict:
    """The file's links by server; {} (logged) when it is missing, unreadable or of another
    version."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.debug("link memory %s ignored: unreadable (%s)", path, e)
        return {}
    if not isinstance(data, dict) or data.get("version") != VERSION:
        version = data.get("version") if isinstance(data, dict) else None
        log.debug("link memory %s ignored: version %r, this edge reads %d", path, version, VERSION)
        return {}
    links = data.get("links")
    if not isinstance(links, dict):
        log.debug("link memory %s ignored: no links table", path)
        return {}
    return links


def _numbers(entry: dict, numbers: list) -> None:
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in numbers):
        raise ValueError(f"entry {entry!r}: rtt_ms, step_ms, saved_at, yields must be numbers")
    if not all(math.isfinite(x) and x >= 0 for x in numbers):
        raise ValueError(f"entry {entry!r}: negative or non-finite number")


def _yield(entry: dict, key: str) -> Yield | None:
    """A mode's stored yield ([tokens per pass, ms per pass] or null); ValueError if malformed."""
    value = entry.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"entry {entry!r}: {key} must be [tokens_per_pass, ms_per_pass]")
    _numbers(entry, value)
    return Yield(float(value[0]), float(value[1]))


def _link(entry: object) -> tuple[Link, float]:
    """A stored entry as (Link, saved_at); ValueError when any field is malformed."""
    if not isinstance(entry, dict):
        raise ValueError(f"entry {entry!r} is not an object")
    rtt, step, led, saved_at = (entry.get(k) for k in ("rtt_ms", "step_ms", "led", "saved_at"))
    _numbers(entry, [step, saved_at] + ([] if rtt is None else [rtt]))
    if not isinstance(led, bool):
        raise ValueError(f"entry {entry!r}: led not a bool")
    lock_step, cloud_led = _yield(entry, "lock_step"), _yield(entry, "cloud_led")
    rtt = None if rtt is None else float(rtt)
    return Link(rtt, float(step), led, lock_step, cloud_led), float(saved_at)


def load_link(server: str, path: Path | None = None, now: float | None = None) -> Link | None:
    """The link remembered for ``server``; None (logged at debug) when there is none, it is
    stale, or the file or the entry is corrupt."""
    path = path or links_path()
    entry = _read(path).get(server)
    if entry is None:
        return None
    try:
        link, saved_at = _link(entry)
    except ValueError as e:
        log.debug("link memory %s: %s ignored: %s", path, server, e)
        return None
    age = (time.time() if now is None else now) - saved_at
    if not 0 <= age <= STALE_AFTER_S:
        log.debug("link memory %s: %s ignored: saved %.0f s ago", path, server, age)
        return None
    return link


def save_link(server: str, link: Link, path: Path | None = None, now: float | None = None) -> None:
    """Remembers ``link`` for ``server`` beside the other servers' links; a cache that cannot
    be written only costs the next invocation a cold start (logged at debug)."""
    path = path or links_path()
    now = time.time() if now is None else now
    kept = []  # (saved_at, server, entry) of the others' links still good
    for other, entry in _read(path).items():
        try:
            saved_at = _link(entry)[1]
        except ValueError:
            continue
        if other != server and 0 <= now - saved_at <= STALE_AFTER_S:
            kept.append((saved_at, other, entry))
    kept.sort(key=lambda t: t[0])
    links = {other: entry for _, other, entry in kept[-(MAX_LINKS - 1) :]}
    links[server] = {
        "rtt_ms": link.rtt_ms,
        "step_ms": link.step_ms,
        "led": link.led,
        "saved_at": now,
        "lock_step": None if link.lock_step is None else list(link.lock_step),
        "cloud_led": None if link.cloud_led is None else list(link.cloud_led),
    }
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": VERSION, "links": links}))
        os.replace(tmp, path)
    except OSError as e:
        log.debug("link memory %s not written: %s", path, e)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
