"""bench.interrupt_ab without a server: the sums per group, the arm whose passes run out, and
unknown prompt ids refused before any work."""

from __future__ import annotations

import pytest

from bench.interrupt_ab import RunOut, main, summarise


def record(arm, mode="cloud-led", prompt="prose-00", **kw):
    one = {"new_tokens": 64, "wall_s": 2.0, "passes": 32, "after_correction": 10}
    one.update(draftless=2, cut=5, arm=arm, mode=mode, prompt=prompt, repeat=0, token_ids=[1])
    one["class"] = prompt.split("-")[0]
    one.update(kw)
    return one


def test_summarise_sums_each_arms_generations():
    rows = summarise([record("cut"), record("cut", wall_s=6.0, draftless=0), record("run out")])
    mode, cls, arm, n, tps, ppt, after, draftless, cuts = rows[0]
    assert (mode, cls, arm, n) == ("cloud-led", "prose", "cut", 2)
    assert tps == pytest.approx(128 / 8.0) and ppt == pytest.approx(0.5)
    assert (after, draftless, cuts) == (20, 2, 10)
    assert rows[1][2:4] == ("run out", 1)


def test_the_run_out_arm_is_the_drafter_with_interrupt_doing_nothing():
    class Drafter:
        cached = [1, 2]
        interrupted = 0

        def interrupt(self):
            self.interrupted += 1

    drafter = Drafter()
    arm = RunOut(drafter)
    arm.interrupt()
    assert drafter.interrupted == 0 and arm.cached == [1, 2]


def test_unknown_prompt_ids_are_refused_before_any_work(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--server", "x:1", "--prompt", "nope-99"])
    assert e.value.code == 2 and "unknown prompt ids ['nope-99']" in capsys.readouterr().err
