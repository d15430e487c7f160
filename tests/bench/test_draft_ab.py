"""bench.draft_ab's arithmetic, without a server: sums over a group's generations, and the check
that both drafts' splits gave the same greedy tokens."""

from __future__ import annotations

import pytest

from bench.draft_ab import differing, main, summarise, take_turns


def record(draft, mode="auto", prompt="code-00", repeat=0, tokens=(1, 2, 3), **kw):
    one = {"new_tokens": 64, "wall_s": 2.0, "passes": 16, "cpu_s": 1.6, "forwards": 80}
    one.update(arm=draft, mode=mode, prompt=prompt, repeat=repeat, token_ids=list(tokens))
    one["class"] = prompt.split("-")[0]
    one.update(kw)
    return one


def test_summarise_sums_a_groups_generations_instead_of_averaging_their_ratios():
    rows = summarise([record("a"), record("a", repeat=1, wall_s=6.0, passes=48), record("b")])
    assert rows[0][:4] == ("auto", "code", "a", 2)
    tps, ppt, cpu, fwd = rows[0][4:]
    assert tps == pytest.approx(128 / 8.0) and ppt == pytest.approx(64 / 128)
    assert cpu == pytest.approx(3.2e3 / 128) and fwd == pytest.approx(160 / 128)
    assert rows[1][:4] == ("auto", "code", "b", 1)


def test_differing_counts_pairs_whose_greedy_tokens_disagree():
    same = [record("a"), record("b")]
    assert differing(same) == (0, 1)
    other = [record("a", prompt="prose-00"), record("b", prompt="prose-00", tokens=(1, 2, 4))]
    assert differing(same + other) == (1, 2)
    assert differing([record("a")]) == (0, 0)  # no pair yet


def test_unknown_prompt_ids_are_refused_before_any_work(capsys):
    with pytest.raises(SystemExit) as e:
        main(["/nonexistent/a", "/nonexistent/b", "--server", "x:1", "--prompt", "nope-99"])
    assert e.value.code == 2 and "unknown prompt ids ['nope-99']" in capsys.readouterr().err


def test_the_arms_take_turns_in_alternating_order_and_each_record_says_which():
    asked = []

    async def ask(drafter, ids, mode):
        asked.append((drafter, mode))
        return {"new_tokens": 4, "wall_s": 1.0}

    class Codec:
        def chat_prompt(self, text):
            return [len(text)]

    rows = {"code-00": {"prompt": "x", "class": "code"}}
    records = take_turns(ask, {"a": "A", "b": "B"}, Codec(), rows, ["code-00"], ["auto"], 3, None)
    assert [d for d, _ in asked] == ["A", "B", "B", "A", "A", "B"]
    assert [(r["arm"], r["repeat"], r["class"]) for r in records[:2]] == [
        ("a", 0, "code"),
        ("b", 0, "code"),
    ]
