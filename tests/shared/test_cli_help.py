"""Both CLIs' help, --version and deprecated aliases, parsed in-process: nothing is started."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from specsplit.cloud import cli as cloud_cli
from specsplit.edge import cli as edge_cli
from specsplit.edge.models import DEFAULT_PRECISION
from specsplit.shared.cli_help import version

PARSERS = {"specsplit-edge": edge_cli._parser, "specsplit-cloud": cloud_cli._parser}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("prog", PARSERS)
def test_every_flag_has_help_and_shows_its_default(prog):
    for name, sub in subcommands(PARSERS[prog]()).items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            flag = f"{prog} {name} {action.option_strings[-1]}"
            assert action.help, f"{flag} has no help"
            # identity, not equality: a default of 0 or 0.0 (== False) is shown too
            if not any(action.default is v for v in (None, False, argparse.SUPPRESS)):
                shown = formatter._expand_help(action)
                assert "(default" in shown, f"{flag}: its default is not shown: {shown}"
                written = re.search(r"\(default:? (\d+(?:\.\d+)?)( MiB)?[ ;)]", shown)
                if written:  # a default written into the help by hand is the real one
                    value = float(written[1]) * (2**20 if written[2] else 1)
                    assert value == action.default, f"{flag}: {shown}"


@pytest.mark.parametrize("prog", PARSERS)
def test_both_clis_print_their_version(prog, capsys):
    with pytest.raises(SystemExit) as exit:
        PARSERS[prog]().parse_args(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.strip() == f"{prog} {version()}"
    assert version()[0].isdigit()


def _choices(parser: argparse.ArgumentParser, flag: str) -> tuple[str, ...]:
    return next(a.choices for a in parser._actions if flag in a.option_strings)


def test_one_name_per_float_format_across_both_clis():
    """The edge's --precision names its float formats as the cloud's --dtype does (float32,
    float16), not fp32/fp16: every float word either CLI offers is the cloud's spelling."""
    dtypes = set(_choices(subcommands(cloud_cli._parser())["serve"], "--dtype")) - {"auto"}
    edge = subcommands(edge_cli._parser())
    for command in ("export", "pull", "generate", "serve", "info"):
        names = _choices(edge[command], "--precision")
        floats = {part for name in names for part in name.split("-") if not part.startswith("int")}
        assert floats <= dtypes and "float32" in floats, (command, names)
        assert not any("fp" in name for name in names), (command, names)


@pytest.mark.parametrize(
    "old, new, tag",
    [
        ("fp32", "float32", "fp32"),
        ("fp16", "float16", "fp16"),
        ("int4-fp16", "int4-float16", "int4-fp16"),
    ],
)
def test_old_precision_names_still_work_with_a_warning_and_reach_the_same_export(
    old, new, tag, capsys, monkeypatch, tmp_path
):
    asked = []
    monkeypatch.setattr(
        edge_cli, "ensure_draft_onnx", lambda d, p, **kw: asked.append(p) or tmp_path
    )
    assert edge_cli.main(["pull", "--precision", old]) == 0
    assert edge_cli.main(["pull", "--precision", new]) == 0
    assert asked == [tag, tag]  # the export's own tag (edge.models.PRECISIONS), either way
    err = capsys.readouterr().err
    assert err.count("deprecated") == 1, err
    assert f"--precision {old} is deprecated" in err and f"use --precision {new}" in err
    assert old not in subcommands(edge_cli._parser())["pull"].format_help().replace(new, "")


def test_a_precision_that_is_no_name_is_refused_with_the_names(capsys):
    with pytest.raises(SystemExit) as exit:
        edge_cli._parser().parse_args(["pull", "--precision", "fp64"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'fp64'" in err and "'float32', 'int8', 'int4'" in err


def test_export_precision_defaults_to_the_other_commands_default():
    for command in ("export", "pull", "generate", "serve"):
        args = ["--draft", "m", "--out", "o"] if command == "export" else []
        args += ["--prompt-ids", "1"] if command == "generate" else []
        parsed = edge_cli._parser().parse_args([command, *args])
        assert parsed.precision == DEFAULT_PRECISION == "int4", command


def test_cloud_help_works_on_an_edge_only_install():
    """No torch, tritonclient, pytriton or prometheus_client (the cloud extra's packages):
    `specsplit-cloud --help` still answers, and serve says which extra it needs."""
    hide = ("torch", "tritonclient", "pytriton", "prometheus_client", "transformers")
    code = f"""
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {hide!r}:
            raise ImportError(f"No module named {{name!r}}")
sys.meta_path.insert(0, Hide())
from specsplit.cloud.cli import main
for argv in (["--help"], ["serve", "--help"]):
    try:
        main(argv)
    except SystemExit as e:
        assert e.code == 0, e.code
rc = main(["serve", "--target", "/nonexistent", "--triton-url", "127.0.0.1:1"])
assert rc == 1, rc
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--weights" in r.stdout and "Traceback" not in r.stderr
    assert "pip install -e '.[cloud]'" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "prog, argv, dest, value",
    [
        ("specsplit-edge", ["export", "--model", "d", "--out", "o"], "draft", "d"),
        ("specsplit-edge", ["serve", "--model", "t"], "target_name", "t"),
        ("specsplit-edge", ["serve", "--model-name", "api"], "served_model_name", "api"),
        ("specsplit-edge", ["serve", "--draft-tokens", "3"], "max_draft_tokens", 3),
        (
            "specsplit-edge",
            ["generate", "--draft-tokens", "3", "--prompt", "p"],
            "max_draft_tokens",
            3,
        ),
        (
            "specsplit-edge",
            ["generate", "--mode", "cloud-only", "--prompt", "p"],
            "route",
            "cloud-only",
        ),
        ("specsplit-edge", ["serve", "--mode", "cloud-only"], "route", "cloud-only"),
        ("specsplit-cloud", ["serve", "--model-name", "t"], "target_name", "t"),
        ("specsplit-cloud", ["serve", "--sessions-per-token", "3"], "sessions_per_client", 3),
    ],
)
def test_old_flag_names_still_work_with_a_warning_naming_the_new_one(
    prog, argv, dest, value, capsys
):
    args = PARSERS[prog]().parse_args(argv)
    assert getattr(args, dest) == value
    err = capsys.readouterr().err
    old = next(a for a in argv if a.startswith("--") and a != "--out")
    new = "--" + dest.replace("_", "-")
    assert f"{old} is deprecated" in err and f"use {new}" in err
    assert f"{old} " not in subcommands(PARSERS[prog]())[argv[0]].format_help()


def test_new_names_leave_the_old_defaults_alone():
    edge = edge_cli._parser().parse_args(["serve"])
    assert (edge.target_name, edge.served_model_name) == ("", None)
    cloud = cloud_cli._parser().parse_args(["serve"])
    assert (cloud.target_name, cloud.sessions_per_client) == (None, None)
