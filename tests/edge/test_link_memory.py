"""edge.link_memory: a client's link per server, remembered across processes in the cache."""

from __future__ import annotations

import json
import logging

import pytest

from specsplit.edge.link_memory import STALE_AFTER_S, VERSION, links_path, load_link, save_link
from specsplit.edge.mode_switch import Link, Yield

SERVER, OTHER = "cloud.example:50051", "127.0.0.1:50051"
SLOW = Link(rtt_ms=212.5, step_ms=88.0, led=True, cloud_led=Yield(1.25, 52.0))


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path))
    return tmp_path


def test_a_saved_link_comes_back_in_a_later_process(cache):
    save_link(SERVER, SLOW, now=1000.0)
    assert links_path() == cache / "edge" / "links.json"
    assert load_link(SERVER, now=1001.0) == SLOW
    # read as another process reads it: from the file alone
    data = json.loads(links_path().read_text())
    assert data["version"] == VERSION and set(data["links"]) == {SERVER}
    unmeasured = Link(rtt_ms=None, step_ms=0.0)
    save_link(SERVER, unmeasured, now=1002.0)
    assert load_link(SERVER, now=1003.0) == unmeasured
    assert [p.name for p in links_path().parent.iterdir()] == ["links.json"]  # no temp left


def test_each_server_keeps_its_own_link():
    fast = Link(rtt_ms=0.4, step_ms=90.0, led=False)
    save_link(SERVER, SLOW, now=1000.0)
    save_link(OTHER, fast, now=1000.0)
    assert load_link(SERVER, now=1000.0) == SLOW
    assert load_link(OTHER, now=1000.0) == fast
    assert load_link("elsewhere:1", now=1000.0) is None


def test_a_stale_link_is_ignored_with_a_debug_log(caplog):
    save_link(SERVER, SLOW, now=1000.0)
    assert load_link(SERVER, now=1000.0 + STALE_AFTER_S) == SLOW
    with caplog.at_level(logging.DEBUG, logger="specsplit.edge.link_memory"):
        assert load_link(SERVER, now=1001.0 + STALE_AFTER_S) is None
        assert load_link(SERVER, now=999.0) is None  # saved "in the future": a clock moved
    assert "saved 21601 s ago" in caplog.text and "saved -1 s ago" in caplog.text


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("{not json", "unreadable"),
        ("", "unreadable"),
        ('{"version": 99, "links": {}}', "version 99"),
        ("[1, 2]", "version None"),
        ('{"version": 2, "links": []}', "no links table"),
        ('{"version": 2, "links": {"S": "fast"}}', "is not an object"),
        (
            '{"version": 2, "links": {"S": {"rtt_ms": 1, "step_ms": "9", "led": false, '
            '"saved_at": 1000}}}',
            "must be numbers",
        ),
        (
            '{"version": 2, "links": {"S": {"rtt_ms": 1, "step_ms": 9, "saved_at": 1000}}}',
            "led not a bool",
        ),
        (
            '{"version": 2, "links": {"S": {"rtt_ms": -5, "step_ms": 9, "led": true, '
            '"saved_at": 1000}}}',
            "negative or non-finite",
        ),
        (
            '{"version": 2, "links": {"S": {"rtt_ms": 1, "step_ms": 9, "led": true, '
            '"saved_at": 1000, "cloud_led": [1.5]}}}',
            "must be [tokens_per_pass, ms_per_pass]",
        ),
        (
            '{"version": 2, "links": {"S": {"rtt_ms": 1, "step_ms": 9, "led": true, '
            '"saved_at": 1000, "lock_step": [2.5, -1]}}}',
            "negative or non-finite",
        ),
        (
            '{"version": 2, "links": {"S": {"rtt_ms": NaN, "step_ms": 9, "led": true, '
            '"saved_at": 1000}}}',
            "negative or non-finite",
        ),
    ],
)
def test_a_corrupt_file_or_entry_is_ignored_with_a_debug_log(caplog, content, why):
    links_path().parent.mkdir(parents=True)
    links_path().write_text(content.replace('"S"', json.dumps(SERVER)))
    with caplog.at_level(logging.DEBUG, logger="specsplit.edge.link_memory"):
        assert load_link(SERVER, now=1000.0) is None
    assert why in caplog.text
    save_link(SERVER, SLOW, now=1000.0)  # and the next save writes a good file over it
    assert load_link(SERVER, now=1000.0) == SLOW


def test_an_unwritable_cache_costs_only_a_cold_start(cache, caplog):
    (cache / "edge").write_text("a file where the directory should be")
    with caplog.at_level(logging.DEBUG, logger="specsplit.edge.link_memory"):
        save_link(SERVER, SLOW, now=1000.0)
        assert load_link(SERVER, now=1000.0) is None
    assert "not written" in caplog.text


def test_a_save_keeps_the_latest_good_links_only(monkeypatch):
    import specsplit.edge.link_memory as memory

    monkeypatch.setattr(memory, "MAX_LINKS", 3)
    for i in range(5):
        save_link(f"s{i}:1", SLOW, now=1000.0 + i)
    assert set(json.loads(links_path().read_text())["links"]) == {"s2:1", "s3:1", "s4:1"}
    save_link("s5:1", SLOW, now=1003.0 + STALE_AFTER_S)  # s2 has gone stale meanwhile
    assert set(json.loads(links_path().read_text())["links"]) == {"s3:1", "s4:1", "s5:1"}


def test_what_each_mode_yielded_comes_back():
    both = SLOW._replace(lock_step=Yield(2.75, 120.5))
    save_link(SERVER, both, now=1000.0)
    assert load_link(SERVER, now=1000.0) == both
    entry = json.loads(links_path().read_text())["links"][SERVER]
    assert entry["lock_step"] == [2.75, 120.5] and entry["cloud_led"] == [1.25, 52.0]


def test_a_version_1_file_without_yields_is_a_cold_start(caplog):
    assert VERSION == 2
    links_path().parent.mkdir(parents=True)
    old = {"rtt_ms": 0.5, "step_ms": 50.0, "led": True, "saved_at": 1000.0}
    links_path().write_text(json.dumps({"version": 1, "links": {SERVER: old}}))
    with caplog.at_level(logging.DEBUG, logger="specsplit.edge.link_memory"):
        assert load_link(SERVER, now=1000.0) is None
    assert "version 1, this edge reads 2" in caplog.text
