"""Report figures from synthetic raw records: the formulas, not the machine."""

import json

import matplotlib.image
import numpy as np
import pytest

from bench.report import aggregate, identical_to_target, write_report


def rec(mode="split", k=4, rtt=0.0, new=10, wall=2.0, accepted=6, drafted=8, rounds=4, **kw):
    r = {
        "mode": mode,
        "k": k,
        "temperature": 0.0,
        "rtt_ms": rtt,
        "prompt_id": "p",
        "class": "code",
        "token_ids": list(range(new)),
        "new_tokens": new,
        "wall_s": wall,
        "ttft_s": 0.5,
        "accepted": accepted,
        "drafted": drafted,
        "rounds": rounds,
        "target_forward_passes": rounds,
        "bytes_up": 40,
        "bytes_down": 100,
        "draft_ms": [20.0] * rounds,
        "round_ms": [105.0] * rounds,
        "verify_ms": [100.0] * rounds,
        "token_times_s": [0.5 + 0.1 * i for i in range(new)],
    }
    r.update(kw)
    return r


def test_aggregate_sums_over_prompts():
    a = aggregate([rec(), rec(new=30, wall=2.0, rounds=8, accepted=18, drafted=24)])
    assert a["tok_s"] == pytest.approx(40 / 4.0)
    assert a["acceptance"] == pytest.approx(24 / 32)
    assert a["passes_per_token"] == pytest.approx(12 / 40)
    assert a["tokens_per_round"] == pytest.approx(40 / 12)
    assert a["up_b_per_token"] == pytest.approx(80 / 40)
    assert a["overhead_p50_ms"] == pytest.approx(5.0)


def test_ideal_follows_design_formula():
    # 10 tokens in 4 rounds; each round ideally 20 ms drafting + 50 ms RTT + 100 ms verify
    a = aggregate([rec(rtt=50.0)])
    assert a["ideal_tok_s"] == pytest.approx(2.5 / 0.170)
    assert a["achieved_ideal"] == pytest.approx(5.0 / (2.5 / 0.170))
    assert a["overhead_p50_ms"] is None  # only measured without emulated RTT


def test_cloud_only_ideal_is_one_token_per_forward():
    a = aggregate([rec(mode="cloud-only", k=0, accepted=0, drafted=0, rounds=10)])
    assert a["ideal_tok_s"] == pytest.approx(10.0)
    assert a["acceptance"] is None


def test_identical_to_target_counts_greedy_pairs():
    cloud = rec(mode="cloud-only", k=0)
    same, other = rec(), rec(k=2, token_ids=[9] * 10)
    assert identical_to_target([cloud, same, other]) == (1, 2)


def test_write_report_from_raw_alone(tmp_path):
    raw = tmp_path / "b-raw.jsonl"
    records = [rec(mode="cloud-only", k=0, accepted=0, drafted=0, rounds=10, wall=4.0), rec()]
    raw.write_text("\n".join(json.dumps(r) for r in records))
    meta = tmp_path / "b-meta.json"
    meta.write_text(
        json.dumps(
            {
                "date": "today",
                "commit": "abc1234",
                "cpu": "Some CPU",
                "target": "/t",
                "draft": "/d",
                "draft_precision": "int8",
                "target_dtype": "auto",
                "edge_cores": [0],
                "cloud_cores": [1],
                "plan": {
                    "ks": [4],
                    "temperatures": [0.0],
                    "rtts_ms": [0.0],
                    "prompts": 1,
                    "max_new_tokens": 10,
                },
            }
        )
    )
    text = write_report(raw, meta, tmp_path, "b").read_text()
    assert "| lock-step | 4 | 5.00 | 2.00 |" in text  # 10 tokens / 2 s vs 10 / 4 s
    assert "met: split ≥ 1.5× cloud-only" in text
    png = tmp_path / "img" / "b-tok-s-vs-rtt-t0.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(png)  # [height, width, RGBA] in [0, 1]
    assert pixels.shape[0] >= 200 and pixels.shape[1] >= 300, pixels.shape
    # A drawn figure, not a blank canvas: the plotted rows leave more than the background.
    assert len(np.unique(pixels.reshape(-1, pixels.shape[2]), axis=0)) > 2
    assert "Measured today at commit `abc1234` on Some CPU." in text  # the run's, not this one's


def test_a_run_without_rtt_0_still_reports(tmp_path):
    """``make bench --rtt 100``: no RTT-0 headline, the rest of the page as usual."""
    raw = tmp_path / "b-raw.jsonl"
    records = [
        rec(mode="cloud-only", k=0, accepted=0, drafted=0, rounds=10, wall=4.0, rtt=100.0),
        rec(rtt=100.0),
    ]
    raw.write_text("\n".join(json.dumps(r) for r in records))
    meta = tmp_path / "b-meta.json"
    plan = {"ks": [4], "temperatures": [0.0], "rtts_ms": [100.0], "prompts": 1}
    machine = {"target": "/t", "draft": "/d", "draft_precision": "int8", "target_dtype": "auto"}
    cores = {"edge_cores": [0], "cloud_cores": [1], "date": "today"}
    meta.write_text(json.dumps(machine | cores | {"plan": plan | {"max_new_tokens": 10}}))
    text = write_report(raw, meta, tmp_path, "b").read_text()
    assert "no headline" in text and "MISSED: split ≥ 1.5× cloud-only" in text


def test_default_mode_targets_per_condition():
    from bench.report_modes import targets

    cloud = rec(mode="cloud-only", k=0, accepted=0, drafted=0, rounds=10, wall=4.0, link="")
    fixed = rec(mode="lock-step", k=4, wall=2.0, link="")
    led_fast = rec(mode="cloud-led", k=8, wall=1.6, link="")  # 2.5x cloud-only, 1.25x best k
    lines = targets([cloud, fixed, led_fast], "code")
    assert lines[-1].endswith("| 2.50 | 1.25 | 1.25 | met |")
    led_slow = rec(mode="cloud-led", k=8, wall=2.5, link="")  # 1.6x cloud-only < 2.3 at RTT 0
    assert targets([cloud, fixed, led_slow], "code")[-1].endswith("| MISSED |")


def test_the_rtt0_greedy_bar_of_2_3_is_codes_alone():
    """Prose at RTT 0 greedy needs 1x cloud-only, like every other condition."""
    from bench.report_modes import targets

    cloud = rec(mode="cloud-only", k=0, accepted=0, drafted=0, rounds=10, wall=4.0, link="")
    fixed = rec(mode="lock-step", k=4, wall=2.0, link="")
    auto = rec(mode="auto", k=8, wall=2.0, link="")  # 2x cloud-only, 1x best k
    assert targets([cloud, fixed, auto], "code")[-1].endswith("| MISSED |")
    prose = [dict(r, **{"class": "prose"}) for r in (cloud, fixed, auto)]
    assert targets(prose, "prose")[-1].endswith("| met |")


def test_auto_is_the_default_where_the_run_has_it():
    from bench.report_modes import targets

    cloud = rec(mode="cloud-only", k=0, accepted=0, drafted=0, rounds=10, wall=4.0, link="")
    fixed = rec(mode="lock-step", k=4, wall=2.0, link="")
    led = rec(mode="cloud-led", k=8, wall=1.6, link="")  # 1.25x best k
    auto = rec(mode="auto", k=8, wall=2.0, link="")  # 1.00x best k
    lines = targets([cloud, fixed, led, auto], "code")
    assert lines[0].startswith("Default = auto ")
    assert lines[-1].endswith("| 2.00 | 1.00 | 1.00 | MISSED |")  # RTT 0 greedy code < 2.3


def test_default_against_best_k_run_by_run():
    from bench.report_modes import targets

    c = {"rtt": 20.0, "link": ""}
    cloud = rec(mode="cloud-only", k=0, accepted=0, drafted=0, rounds=10, wall=4.0, **c)
    fixed = [rec(mode="lock-step", k=4, wall=2.0, sample=j, **c) for j in (0, 1)]
    led = [rec(mode="cloud-led", k=8, wall=w, sample=j, **c) for j, w in ((0, 2.5), (1, 1.6))]
    # Pooled: 20 tokens in 4.1 s against 4.0 s, 0.98x; run by run 0.80x and 1.25x.
    assert targets([cloud, *fixed, *led], "code")[-1].endswith("| 0.98 | 0.80–1.25 | met |")


def test_bytes_per_token_by_mode():
    from bench.report_modes import bytes_table

    lines = bytes_table([rec(mode="cloud-led", k=8, link=""), rec(mode="lock-step", link="")])
    assert "| lock-step | 0 | 4 | 10 | 0.75 |" in lines
    assert "| cloud-led | 0 | 4 | 10 | 0.75 |" in lines


def test_timing_noise_compares_auto_with_lock_step_adaptive_where_auto_never_led():
    from bench.report_modes import timing_noise

    def cell(rtt, auto_wall, lead_round=0):
        c = {"rtt": rtt, "link": ""}
        return [
            rec(mode="lock-step-adaptive", k=8, wall=2.0, **c),
            rec(mode="auto", k=8, wall=auto_wall, lead_round=lead_round, **c),
        ]

    records = [*cell(0.0, 2.0), *cell(20.0, 2.5), *cell(500.0, 1.0, lead_round=1)]
    (line,) = timing_noise(records)
    assert "in 2 greedy cells" in line  # the cell where auto led is not the same configuration
    assert "ranged 0.80–1.00" in line and "in 1 of them" in line
    sampled = [dict(r, temperature=0.7) for r in records]  # other seeds: other blocks
    assert timing_noise(sampled) == []


def test_warm_table_puts_auto_warm_beside_auto_per_condition():
    from bench.report_modes import warm_table

    c = {"rtt": 500.0, "link": ""}
    auto = rec(mode="auto", k=8, wall=2.0, ttft_s=1.5, **c)
    warm = [
        rec(mode="auto-warm", k=8, wall=1.6, ttft_s=0.6, led_at_start=True, **c),
        rec(mode="auto-warm", k=8, wall=1.6, ttft_s=0.8, led_at_start=False, **c),
    ]
    assert warm_table([auto]) == []  # a run without the row
    lines = warm_table([auto, *warm])
    assert lines[-1] == "| 500 ms | 0 | 5.00 | 6.25 | 1.25 | 1500 / 700 | 1/2 |"


def test_cold_and_warm_clients_have_their_own_rows_and_llama_cpp_its_column(tmp_path):
    from bench.report_modes import llama_cpp_tok_s, targets

    cloud = rec(mode="cloud-only", k=0, accepted=0, drafted=0, rounds=10, wall=4.0, link="")
    fixed = rec(mode="lock-step", k=4, wall=2.0, link="")
    cold = rec(mode="auto", k=8, wall=5.0, link="")  # 0.8x cloud-only
    warm = rec(mode="auto-warm", k=8, wall=2.5, link="")  # 1.6x cloud-only
    peers = tmp_path / "peers-raw.jsonl"
    rows = [
        {"row": "llama.cpp/target/t1", "class": "code", "new_tokens": 10, "wall_s": 2.0},
        {"row": "llama.cpp/target/t1", "class": "code", "new_tokens": 10, "wall_s": 3.0},
        {"row": "llama.cpp/target/t2", "class": "code", "new_tokens": 10, "wall_s": 1.0},
    ]
    peers.write_text("\n".join(json.dumps(r) for r in rows))
    llama = llama_cpp_tok_s(peers)
    assert llama == {"code": pytest.approx(4.0)}  # the one-core row only: 20 tokens in 5 s
    assert llama_cpp_tok_s(tmp_path / "none.jsonl") == {}
    lines = targets([cloud, fixed, cold, warm], "code", llama)
    assert lines[-2].startswith("| 0 ms | 0 | cold | ") and "| 2.50 | 0.50 |" in lines[-2]
    assert lines[-1].startswith("| 0 ms | 0 | warm | ") and "| 2.50 | 1.00 |" in lines[-1]
    # cold 2 tok/s, warm 4 tok/s, cloud-only 2.5, llama.cpp 4: × llama.cpp 0.50 and 1.00
    assert lines[-2].endswith("| MISSED |") and lines[-1].endswith("| MISSED |")
    no_llama = targets([cloud, fixed, cold, warm], "code", {})
    assert "| 2.50 | – |" in no_llama[-1]


def test_draftless_passes_after_a_correction_per_mode_and_condition():
    from bench.report_modes import after_rejection_table

    assert after_rejection_table([rec(mode="lock-step", link="")]) == []
    led = [
        rec(
            mode="cloud-led",
            k=8,
            link="",
            passes_after_rejection=6,
            draftless_after_rejection=2,
            draftless_none_sent=1,
            corrections=7,
            corrections_branched=3,
            branch_passes=2,
        ),
        rec(mode="cloud-led", k=8, link="", passes_after_rejection=4, draftless_after_rejection=1),
    ]
    lines = after_rejection_table([*led, rec(mode="lock-step", link="")])
    assert lines[-1] == "| 0 ms | 0 | cloud-led | 10 | 3 | 1 | 0.30 | 3/7 | 2 |"


def test_the_command_names_a_missing_raw_file(tmp_path, capsys):
    from bench.report import main

    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "none-raw.jsonl")])
    assert e.value.code == 2
    assert "none-raw.jsonl: no such file" in capsys.readouterr().err


def test_the_command_writes_the_page_beside_its_raw_records(tmp_path, capsys):
    from bench.report import main

    raw = tmp_path / "run-raw.jsonl"
    raw.write_text(json.dumps(rec(mode="cloud-only", k=0)) + "\n" + json.dumps(rec()) + "\n")
    plan = {"ks": [4], "temperatures": [0.0], "rtts_ms": [0.0], "prompts": 1, "max_new_tokens": 10}
    machine = {"target": "/t", "draft": "/d", "draft_precision": "int8", "target_dtype": "auto"}
    cores = {"edge_cores": [0], "cloud_cores": [1], "date": "today"}
    (tmp_path / "run-meta.json").write_text(json.dumps(machine | cores | {"plan": plan}))
    assert main([str(raw)]) == 0
    assert "| lock-step | 4 |" in (tmp_path / "run.md").read_text()
    assert capsys.readouterr().out.strip() == str(tmp_path / "run.md")
