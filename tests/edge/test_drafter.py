"""OnnxDrafter's contract (forward, truncate, the in-place cache) against transformers' Qwen2."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import specsplit.edge.onnx_drafter as onnx_drafter
from specsplit.edge.drafting import Interrupted
from specsplit.edge.onnx_drafter import OnnxDrafter
from specsplit.shared.tiny import reference_greedy
from tests.edge.reference import CPU, PROMPT, assert_logits_close, drafter_greedy, hf_logits

KINDS = ["tied", "untied", "bf16_sharded"]
COPY_WARNING = "in-place optimization not activated"  # ORT's TensorScatter, copying a buffer


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_then_incremental_steps_match_transformers(qwen_dirs, draft_exports, kind):
    drafter = OnnxDrafter(draft_exports[kind, "fp32"], providers=CPU)
    ids = PROMPT + [11, 250, 0, 42, 42, 9, 1]
    # prompt, three single-token steps, then a block of four (a verify-sized chunk)
    chunks = [ids[:9], ids[9:10], ids[10:11], ids[11:12], ids[12:]]
    got = np.concatenate([drafter.forward(chunk, all_logits=True) for chunk in chunks])
    assert_logits_close(got, hf_logits(qwen_dirs[kind], ids))
    assert drafter.cached == ids


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_greedy_matches_transformers_generate(qwen_dirs, draft_exports, kind):
    drafter = OnnxDrafter(draft_exports[kind, "fp32"], providers=CPU)
    assert drafter_greedy(drafter, PROMPT, 24) == reference_greedy(qwen_dirs[kind], PROMPT, 24)


def test_truncate_then_forward_equals_fresh_run(draft_exports):
    drafter = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    fresh = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    drafter.forward(PROMPT)
    drafter.forward([1, 2, 3, 4])  # a rejected draft block
    for n, x in [(len(PROMPT) + 2, [77]), (len(PROMPT), [1, 2]), (4, [9, 8, 7]), (0, [5])]:
        prefix = drafter.cached[:n]
        drafter.truncate(n)
        assert drafter.cached == prefix
        fresh.reset()
        expected = fresh.forward(prefix + x, all_logits=True)[n:]
        np.testing.assert_allclose(drafter.forward(x, True), expected, rtol=0, atol=1e-5)
        assert drafter.cached == prefix + x


def test_the_cache_outgrows_its_buffers_and_stays_exact(qwen_dirs, draft_exports, monkeypatch):
    """Buffers of 4 positions grown by 2 (GROWTH) to 8, 16, 32 while a prompt, steps, a
    truncate and a block go through: every logit still transformers'."""
    monkeypatch.setattr(onnx_drafter, "INITIAL_CAPACITY", 4)
    monkeypatch.setattr(onnx_drafter, "GROWTH", 2.0)
    drafter = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    ids = PROMPT + [11, 250, 0, 42, 42, 9, 1, 3, 3, 5, 8, 13, 21, 34, 55]  # 24 tokens
    got = [drafter.forward(ids[:3], all_logits=True)]
    capacities = [drafter._kv.capacity]
    for token in ids[3:12]:
        got.append(drafter.forward([token]))
        capacities.append(drafter._kv.capacity)
    drafter.forward([7, 7, 7])  # rejected
    drafter.truncate(12)
    got.append(drafter.forward(ids[12:], all_logits=True))  # a 12-token block grows it once more
    capacities.append(drafter._kv.capacity)
    assert sorted(set(capacities)) == [4, 8, 16, 32]
    assert_logits_close(np.concatenate(got), hf_logits(qwen_dirs["tied"], ids))


def test_the_cache_shrinks_once_a_sequence_needs_far_less_and_stays_exact(
    draft_exports, monkeypatch
):
    """A 33-token sequence grows the buffers to 33 positions; rolled back to 2 tokens, a pass to 5
    gets room for twice that, its prefix copied (attention reads every position of the
    buffers); a step within it keeps them; after a reset, a 2-token pass gets the initial room
    again. Every logit is a fresh drafter's."""
    monkeypatch.setattr(onnx_drafter, "INITIAL_CAPACITY", 4)
    drafter = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    fresh = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    long = PROMPT + list(range(100, 124))
    drafter.forward(long)
    assert drafter._kv.capacity == 33
    for n, x, room in [(2, [8, 9, 10], 10), (5, [11], 10), (0, [5, 6], 4)]:
        prefix = drafter.cached[:n]
        drafter.truncate(n)
        fresh.reset()
        expected = fresh.forward(prefix + x, all_logits=True)[n:]
        np.testing.assert_allclose(drafter.forward(x, True), expected, rtol=0, atol=1e-5)
        assert drafter.cached == prefix + x
        assert drafter._kv.capacity == room


def test_a_growth_that_fails_halfway_leaves_an_empty_cache_that_works(draft_exports, monkeypatch):
    """Out of memory while the buffers grow (some replaced, their old ones freed): the error
    reaches the caller, the drafter holds nothing, and the next pass feeds the whole sequence
    into new buffers with a fresh drafter's logits."""
    monkeypatch.setattr(onnx_drafter, "INITIAL_CAPACITY", 4)
    drafter = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    drafter.forward(PROMPT[:3])
    zeros, made = np.zeros, []

    def failing(*args, **kwargs):
        made.append(args)
        if len(made) == 3:  # the third new buffer of the growth
            raise MemoryError("no room")
        return zeros(*args, **kwargs)

    monkeypatch.setattr(onnx_drafter.np, "zeros", failing)
    with pytest.raises(MemoryError, match="no room"):
        drafter.forward(PROMPT[3:])
    monkeypatch.setattr(onnx_drafter.np, "zeros", zeros)
    assert drafter.cached == [] and drafter._kv.capacity == 0
    fresh = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    expected = fresh.forward(PROMPT, all_logits=True)
    np.testing.assert_allclose(drafter.forward(PROMPT, True), expected, rtol=0, atol=1e-5)
    assert drafter.cached == PROMPT


def test_a_step_writes_its_positions_in_place(draft_exports, capfd):
    """The buffers bound before a step are the buffers after it: positions before the step keep
    their bytes, the step's own are written there, none after it is touched; and ONNX Runtime's
    TensorScatter never copies a whole buffer (it warns when it must, as without IO binding)."""
    drafter = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    drafter.forward(PROMPT)
    buffers = list(drafter._kv.values)
    before = [v.numpy().copy() for v in buffers]  # [1, kv, capacity, hd] each
    n = len(PROMPT)
    drafter.forward([42, 43])
    assert all(a is b for a, b in zip(drafter._kv.values, buffers, strict=True))
    for value, old in zip(buffers, before, strict=True):
        now = value.numpy()
        np.testing.assert_array_equal(now[:, :, :n], old[:, :, :n])
        assert np.abs(now[:, :, n : n + 2]).min() > 0  # the new keys and values
        assert not now[:, :, n + 2 :].any()  # zeros, never written
    after = [v.numpy().copy() for v in buffers]
    drafter.truncate(n - 1)  # rollback: only the length moves, not a byte
    assert len(drafter.cached) == n - 1
    for value, old in zip(buffers, after, strict=True):
        np.testing.assert_array_equal(value.numpy(), old)
    drafter.forward([44])
    assert COPY_WARNING not in capfd.readouterr().err
    session = drafter._session  # the control: plain run() hands ORT separate buffers
    feeds = {"input_ids": np.array([[1]]), "past_len": np.array([0]), "logits_from": np.array([0])}
    feeds |= {i.name: np.zeros((1, 2, 8, 16), np.float32) for i in session.get_inputs()[3:]}
    session.run(["logits"], feeds)
    assert COPY_WARNING in capfd.readouterr().err


def test_reset_and_truncate_bounds(draft_exports):
    drafter = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    first = drafter.forward(PROMPT, all_logits=True)
    drafter.truncate(len(PROMPT))  # no-op
    with pytest.raises(ValueError):
        drafter.truncate(len(PROMPT) + 1)
    with pytest.raises(ValueError):
        drafter.truncate(-1)
    with pytest.raises(ValueError):
        drafter.forward([])
    drafter.reset()
    assert drafter.cached == []
    np.testing.assert_array_equal(drafter.forward(PROMPT, all_logits=True), first)


def test_a_long_prompt_goes_in_chunks_with_the_same_logits(draft_exports, monkeypatch):
    whole = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU).forward(PROMPT)
    monkeypatch.setattr(onnx_drafter, "PREFILL_CHUNK", 4)
    chunked = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    np.testing.assert_allclose(chunked.forward(PROMPT), whole, rtol=0, atol=1e-5)
    assert chunked.cached == PROMPT


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_a_prefill_returns_its_last_position_only_as_transformers_computes_it(
    qwen_dirs, draft_exports, kind, monkeypatch
):
    """The graph's LM head runs on the last prompt position only ([1, 1, vocab] out of ONNX
    Runtime), whole or in chunks, with the very logits of an all-positions pass."""
    drafter = OnnxDrafter(draft_exports[kind, "fp32"], providers=CPU)
    ref = hf_logits(qwen_dirs[kind], PROMPT)  # [len, vocab]
    last = drafter.forward(PROMPT)
    assert drafter._binding.get_outputs()[0].shape() == [1, 1, 256]
    assert_logits_close(last, ref[-1:])
    drafter.reset()
    np.testing.assert_allclose(drafter.forward(PROMPT, True)[-1:], last, rtol=0, atol=1e-5)
    monkeypatch.setattr(onnx_drafter, "PREFILL_CHUNK", 4)
    monkeypatch.setattr(onnx_drafter, "MIN_PREFILL_CHUNK", 1)
    chunked = OnnxDrafter(draft_exports[kind, "fp32"], providers=CPU)
    assert_logits_close(chunked.forward(PROMPT), ref[-1:])
    assert chunked.cached == PROMPT


def test_a_long_prompt_prefills_in_chunks_sized_to_the_cache(draft_exports, monkeypatch):
    """A pass's attention scores, [heads, chunk, capacity] float32, stay under SCORES_BYTES:
    the longer the cache, the shorter the chunk; the cache grows as the chunks go, to where
    the next chunk ends or by GROWTH, whichever is more, so that no chunk reads a buffer more
    than GROWTH times the room it asked for."""
    assert onnx_drafter.prefill_chunk(14, 2048) == 146  # Qwen2.5-0.5B: 14 heads
    assert onnx_drafter.prefill_chunk(14, 512) == onnx_drafter.PREFILL_CHUNK
    assert onnx_drafter.prefill_chunk(14, 32768) == onnx_drafter.MIN_PREFILL_CHUNK
    # a chunk ending the cache: 137 x (2048 + 137) scores fit 16 MiB / (4 x 14), 138 would not
    assert onnx_drafter.chunk_after(14, 2048) == 137
    assert onnx_drafter.chunk_after(14, 0) == onnx_drafter.PREFILL_CHUNK
    assert onnx_drafter.chunk_after(14, 32768) == onnx_drafter.MIN_PREFILL_CHUNK
    monkeypatch.setattr(onnx_drafter, "INITIAL_CAPACITY", 4)
    monkeypatch.setattr(onnx_drafter, "MIN_PREFILL_CHUNK", 1)
    drafter = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    ids = (PROMPT * 7)[:60]
    rows = 180  # room for 3 query rows of every head over 60 positions
    monkeypatch.setattr(onnx_drafter, "SCORES_BYTES", 4 * drafter._num_heads * rows)
    seen, step = [], drafter._step  # (chunk, the capacity it ran in)
    monkeypatch.setattr(
        drafter,
        "_step",
        lambda t, *a: (seen.append((len(t), drafter._kv.capacity)), step(t, *a))[1],
    )
    moves = []
    monkeypatch.setattr(drafter._kv, "reserve", _spy(drafter._kv, moves))
    got = drafter.forward(ids)
    sizes = [size for size, _ in seen]
    assert sum(sizes) == 60 and sizes == sorted(sizes, reverse=True) and len(set(sizes)) > 1
    assert sizes[0] == 13  # 13 x 13 <= 180 < 14 x 14: the first chunk ends the cache it needs
    assert all(size * capacity <= rows for size, capacity in seen)
    assert moves
    for before, total, capacity in moves:  # what it needs, or grown by GROWTH
        grown = math.ceil(onnx_drafter.GROWTH * before)
        assert capacity == max(onnx_drafter.INITIAL_CAPACITY, grown, total)
    fresh = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    np.testing.assert_allclose(got, fresh.forward(ids, all_logits=True)[-1:], rtol=0, atol=1e-5)


def _spy(kv, moves):
    """kv.reserve, recording (capacity before, total asked, capacity after) where it moved."""
    reserve = kv.reserve

    def spied(total, valid, *args):
        before = kv.capacity
        moved = reserve(total, valid, *args)
        if moved:
            moves.append((before, total, kv.capacity))
        return moved

    return spied


def test_a_context_past_the_drafts_limit_is_refused_before_any_pass(draft_exports, monkeypatch):
    drafter = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    drafter.forward(PROMPT)
    monkeypatch.setattr(drafter, "_step", None)  # any pass would fail differently
    too_long = drafter.max_positions - len(PROMPT) + 1
    match = f"context of {drafter.max_positions + 1} tokens exceeds the draft's limit of "
    with pytest.raises(ValueError, match=match + f"{drafter.max_positions} positions"):
        drafter.forward([1] * too_long)
    assert drafter.cached == PROMPT


def test_drafter_attributes(draft_exports):
    drafter = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU, threads=1)
    assert (drafter.vocab_size, drafter.precision, drafter.provider) == (
        256,
        "fp32",
        "CPUExecutionProvider",
    )
    assert drafter.eos_token_ids == ()
    assert drafter.forward([1, 2]).shape == (1, 256)
    assert drafter.forward([1, 2], all_logits=True).shape == (2, 256)


@pytest.mark.parametrize("graph_format", [1, 2])
def test_an_export_of_another_graph_format_is_refused_clearly(
    draft_exports, tmp_path, graph_format
):
    """An export made by an older version is never misread: 1 returned concat(past, new), 2
    computed every prompt position's logits (and has no logits_from input)."""
    old = shutil.copytree(draft_exports["tied", "fp32"], tmp_path / "old")
    meta = json.loads((old / "specsplit_draft.json").read_text())
    meta["graph_format"] = graph_format
    (old / "specsplit_draft.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=f"graph format {graph_format}.*Export it again"):
        OnnxDrafter(old, providers=CPU)


def test_cached_exports_are_keyed_by_graph_format(tmp_path, monkeypatch):
    """A cached export made for another graph format is never found: it is exported again."""
    from specsplit.edge.models import GRAPH_FORMAT, export_dir

    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path))
    from specsplit.shared.weights.sources import DRAFT_DEFAULT

    assert export_dir(DRAFT_DEFAULT, "int8").name.endswith(f"-int8-g{GRAPH_FORMAT}")
    (tmp_path / "hf").mkdir()
    assert export_dir(tmp_path / "hf", "int8").name.endswith(f"-int8-g{GRAPH_FORMAT}")


def test_drafter_does_not_import_torch():
    code = (
        "import sys, specsplit.edge.onnx_drafter; "
        "bad = [m for m in ('torch', 'transformers', 'onnx') if m in sys.modules]; "
        "assert not bad, bad"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_drafters_on_one_session_keep_their_own_sequences(draft_exports, monkeypatch):
    """``another`` shares the session (one copy of the weights), not the cache: two sequences
    interleaved, in the same thread or at once from two, each give a lone drafter's logits,
    through a truncate and buffers that outgrow their size at different times."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(onnx_drafter, "INITIAL_CAPACITY", 4)
    first = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    second = first.another()
    assert second._session is first._session and second.cached == []
    lone = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    a = [PROMPT, [11, 250], [0], [42, 42, 9, 1, 3]]
    b = [[5, 8, 13, 21, 34, 55, 89, 2, 3, 1, 4, 1, 5], [9], [2, 6]]

    def expected(chunks):
        lone.reset()
        return [lone.forward(c, all_logits=True) for c in chunks]

    want_a, want_b = expected(a), expected(b)
    first.forward(a[0])  # interleaved in one thread
    got_b = [second.forward(b[0], all_logits=True)]
    first.truncate(len(a[0]) - 1)  # only first's length moves
    got_a = [first.forward(a[0][-1:], all_logits=True)]
    for x, y in zip(a[1:], b[1:], strict=False):
        got_a.append(first.forward(x, all_logits=True))
        got_b.append(second.forward(y, all_logits=True))
    got_a.append(first.forward(a[3], all_logits=True))
    np.testing.assert_allclose(got_a[0], want_a[0][-1:], rtol=0, atol=1e-5)
    for got, want in zip(got_a[1:] + got_b, want_a[1:] + want_b, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert first.cached == sum(a, []) and second.cached == sum(b, [])

    def run(drafter, chunks):  # at once: each thread its own sequence, 20 times over
        out = []
        for _ in range(20):
            drafter.reset()
            out.append([drafter.forward(c, all_logits=True) for c in chunks])
        return out

    with ThreadPoolExecutor(2) as pool:
        runs_a, runs_b = pool.submit(run, first, a), pool.submit(run, second, b)
        for got, want in [(r, want_a) for r in runs_a.result()] + [
            (r, want_b) for r in runs_b.result()
        ]:
            for g, w in zip(got, want, strict=True):
                np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)


def test_an_interrupted_pass_raises_and_caches_nothing_of_it(draft_exports):
    """``interrupt()`` sets ONNX Runtime's terminate flag for the pass running in another thread:
    here set as the pass starts, the pass raises Interrupted, the cache is as before, and the
    next pass is exact (a fresh drafter's logits)."""
    drafter = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    fresh = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    drafter.forward(PROMPT)
    session = drafter._session
    run = session.run_with_iobinding

    def cut_short(binding, run_options=None):
        drafter.interrupt()  # as if from the event loop's thread while this pass runs
        return run(binding, run_options)

    session.run_with_iobinding = cut_short
    with pytest.raises(Interrupted):
        drafter.forward([1, 2, 3])
    assert drafter.cached == PROMPT
    session.run_with_iobinding = run
    expected = fresh.forward(PROMPT + [7, 8], all_logits=True)[len(PROMPT) :]
    np.testing.assert_allclose(drafter.forward([7, 8], True), expected, rtol=0, atol=1e-5)


def test_an_interrupt_between_passes_leaves_the_next_pass_alone(draft_exports):
    drafter = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    fresh = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    drafter.interrupt()  # the pass it was meant for had ended
    np.testing.assert_allclose(drafter.forward(PROMPT), fresh.forward(PROMPT), rtol=0, atol=0)
    assert drafter.cached == PROMPT


def _held_load(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Background loads that start (``started`` set) and then wait for ``release``."""
    started, release = threading.Event(), threading.Event()
    create = onnx_drafter._create_session

    def held(*args):
        started.set()
        assert release.wait(30), "the test never released the load"
        return create(*args)

    monkeypatch.setattr(onnx_drafter, "_create_session", held)
    return started, release


def test_a_drafter_loading_in_the_background_answers_as_one_loaded_at_once(
    draft_exports, monkeypatch
):
    """``background=True`` returns before the session exists: the export's metadata is there,
    nothing is cached, an interrupt or a truncate to 0 does not wait; the first forward waits for
    the load and gives exactly the logits of a drafter loaded at once."""
    path = draft_exports["tied", "fp32"]
    at_once = OnnxDrafter(path, providers=CPU, threads=1)
    started, release = _held_load(monkeypatch)
    drafter = OnnxDrafter(path, providers=CPU, threads=1, background=True)
    try:
        assert started.wait(30)
        loading = drafter._loading  # the load's future, held unfinished by the test
        assert (drafter.vocab_size, drafter.max_positions) == (
            at_once.vocab_size,
            at_once.max_positions,
        )
        assert drafter.cached == []
        drafter.interrupt()  # no pass runs yet: nothing to stop, and the first pass runs whole
        drafter.truncate(0)
        assert not loading.done()  # none of that waited for the load
    finally:
        release.set()
    expected = at_once.forward(PROMPT + [5, 6], all_logits=True)
    got = np.concatenate([drafter.forward(PROMPT, all_logits=True), drafter.forward([5, 6], True)])
    np.testing.assert_array_equal(got, expected)
    assert drafter._loading is None  # opened by the first forward
    assert drafter.cached == PROMPT + [5, 6]
    assert drafter.provider == "CPUExecutionProvider"
    other = drafter.another()  # on the same session, its own sequence
    np.testing.assert_array_equal(other.forward(PROMPT), expected[len(PROMPT) - 1 : len(PROMPT)])


def test_a_background_load_that_fails_raises_where_the_model_is_needed(draft_exports, monkeypatch):
    """The load's error is not lost on its thread: every call that needs the model raises it."""

    def broken(*args):
        raise RuntimeError("ONNX Runtime could not load it")

    monkeypatch.setattr(onnx_drafter, "_create_session", broken)
    with pytest.raises(RuntimeError, match="could not load"):
        OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU)
    drafter = OnnxDrafter(draft_exports["tied", "fp32"], providers=CPU, background=True)
    with pytest.raises(RuntimeError, match="could not load"):
        drafter.forward(PROMPT)
    with pytest.raises(RuntimeError, match="could not load"):
        drafter.provider  # noqa: B018 (the property is the call under test)
