"""README.md and clients/node/README.md as a user copies them: every `specsplit-edge` /
`specsplit-cloud` flag they name exists where they use it, every default they state in brackets
is the code's, every Python snippet compiles (the client one runs against a real cloud with tiny
models), the Node snippet parses, and every README shell block that finishes in seconds against
tiny models runs as written (SHELL_BLOCKS says which do not, and why)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specsplit.cloud import cli as cloud_cli
from specsplit.edge import cli as edge_cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
NODE_README = (ROOT / "clients" / "node" / "README.md").read_text()
CLIS = {"specsplit-edge": edge_cli._parser(), "specsplit-cloud": cloud_cli._parser()}
# Flags the README names that belong to other tools.
OTHER_TOOLS = {
    "--index-url": "pip",
    "--no-deps": "pip",
    "--local-dir": "huggingface-cli",
    "--no-repack": "llama.cpp",
    "--spec-type": "llama.cpp",
    "--engines": "python -m bench.peers",
    "--rtt": "bench.run",
    "--tokens": "python -m bench.draft_prefill",
    "--profile": "python -m bench.draft_prefill",
}


def code_blocks(text: str, *langs: str) -> list[str]:
    blocks = re.findall(r"^(```|~~~)(\w*)\n(.*?)^\1$", text, flags=re.S | re.M)
    return [body for _, lang, body in blocks if lang in langs]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The flags --help shows (deprecated aliases are hidden: the README must not use them)."""
    return {
        option: action
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for option in action.option_strings
    }


def all_flags() -> dict[str, list[argparse.Action]]:
    found: dict[str, list[argparse.Action]] = {}
    for parser in CLIS.values():
        for p in [parser, *subcommands(parser).values()]:
            for option, action in flags(p).items():
                found.setdefault(option, []).append(action)
    return found


def commands(block: str) -> list[list[str]]:
    """Each `specsplit-edge ...`/`specsplit-cloud ...` command line of a shell block, as words
    from the CLI's name on (continuation lines joined, comments dropped)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        if not any(prog in line for prog in CLIS):
            continue  # other tools' lines (curl's JSON spans lines)
        words = shlex.split(line, comments=True)
        for i, word in enumerate(words):
            if Path(word).name in CLIS:
                out.append([Path(word).name, *words[i + 1 :]])
    return out


def test_the_readmes_shell_commands_use_flags_their_subcommand_has():
    checked = 0
    for block in code_blocks(README, "bash", "sh", ""):
        for prog, *args in commands(block):
            subs = subcommands(CLIS[prog])
            if not args or args[0].startswith("-"):
                continue
            assert args[0] in subs, f"{prog} has no subcommand {args[0]!r}"
            known = flags(subs[args[0]])
            for arg in args[1:]:
                flag = arg.split("=")[0]
                if flag.startswith("--"):
                    assert flag in known, f"`{prog} {args[0]}` has no {flag}"
                    checked += 1
    assert checked >= 15  # the extraction found the commands


def _valued(block: str) -> list[tuple[str, str]]:
    """(flag, value) of every `--flag value` of a command line in ``block``."""
    pairs = []
    for _, *args in commands(block):
        pairs += [(a, b) for a, b in zip(args, args[1:], strict=False) if a.startswith("--")]
    return pairs


def test_every_value_the_readme_gives_a_flag_with_choices_is_one_of_them():
    """`--precision fp32` (an old name) or `--weights int3` in the README fails here: in its
    commands and in prose (`--flag a|b` names several)."""
    known = all_flags()
    pairs = [p for block in code_blocks(README, "bash", "sh", "") for p in _valued(block)]
    pairs += re.findall(r"`(--[a-z][a-z0-9-]*) ([\w.|-]+)`", README)
    checked = 0
    for flag, text in pairs:
        choices = [a.choices for a in known.get(flag, []) if a.choices]
        if not choices:
            continue  # free-form, or another tool's flag
        for value in text.split("|"):
            assert any(value in c for c in choices), f"README: {flag} {value}; choices {choices}"
            checked += 1
    assert checked >= 8


def test_every_flag_the_readme_names_exists():
    known = all_flags()
    for flag in set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", README)):
        assert flag in known or flag in OTHER_TOOLS, f"README names {flag}, which no CLI has"


def _number(text: str) -> float | None:
    """`60 s`, `4 MiB`, `64`, `127.0.0.1:8000` (the port) as a number; None for prose."""
    text = text.strip().split(":")[-1] if re.fullmatch(r"[\d.]+:\d+", text.strip()) else text
    m = re.fullmatch(r"\s*([\d.]+)\s*(s|MiB|KiB)?\s*", text)
    if not m:
        return None
    return float(m.group(1)) * {"MiB": 2**20, "KiB": 2**10}.get(m.group(2), 1)


def test_defaults_the_readme_states_are_the_codes():
    """`--flag` [X] and `--flag`, default X: X must be that flag's default somewhere it exists."""
    known = all_flags()
    stated = re.findall(r"`(--[a-z][a-z0-9-]*)`\s+\[([^\]]+)\]", README)
    stated += re.findall(r"`(--[a-z][a-z0-9-]*)`,? (?:\()?default:? ([\d.]+)", README)
    checked = 0
    for flag, text in stated:
        value = _number(text)
        if value is None:
            continue  # a default in words ("a quarter of `--max-sessions`")
        defaults = [a.default for a in known[flag]]
        assert value in defaults, f"README: {flag} defaults to {text}; the code: {defaults}"
        checked += 1
    assert checked >= 12


def test_every_python_snippet_compiles():
    blocks = code_blocks(README, "python")
    assert len(blocks) >= 2
    for block in blocks:
        compile(block, "README.md", "exec")


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_node_snippets_parse_as_commonjs(tmp_path):
    blocks = code_blocks(NODE_README, "js")
    assert blocks
    for i, block in enumerate(blocks):
        path = tmp_path / f"snippet{i}.js"
        path.write_text(block)
        r = subprocess.run(["node", "--check", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


NODE_DIR = ROOT / "clients" / "node"
needs_node_client = pytest.mark.skipif(
    shutil.which("node") is None or not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(),
    reason="node or the Node client's packages (make node-client) are not installed",
)


@pytest.mark.slow
@needs_node_client
def test_the_node_readmes_shell_commands_run_against_a_real_cloud(cloud, tmp_path):
    """Its shell block as written (but `make node-client`, done already), against the tiny
    cloud's address, from a scratch directory (it writes drafts.json)."""
    block = next(b for b in code_blocks(NODE_README, "bash") if "generate.js" in b)
    assert "127.0.0.1:50051" in block and "make node-client" in block
    script = "\n".join(line for line in block.splitlines() if not line.startswith("make "))
    script = script.replace("127.0.0.1:50051", cloud.address).replace(
        "clients/node/generate.js", str(NODE_DIR / "generate.js")
    )
    r = subprocess.run(
        ["bash", "-e", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    outs = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    assert [o["route"] for o in outs] == ["cloud-only", "split"], outs
    assert outs[0]["token_ids"] == outs[1]["token_ids"] and len(outs[0]["token_ids"]) == 24


@pytest.mark.slow
@needs_node_client
def test_the_node_readmes_code_snippet_runs_against_a_real_cloud(cloud, tmp_path):
    """Its `require('./specsplit')` snippet as written but for the address, and specsplit.js
    required by its path (as it says one may) from a scratch file."""
    block = next(b for b in code_blocks(NODE_README, "js") if "require('./specsplit')" in b)
    assert "'127.0.0.1:50051'" in block
    script = tmp_path / "snippet.js"
    script.write_text(
        block.replace("'127.0.0.1:50051'", repr(cloud.address)).replace(
            "require('./specsplit')", f"require({str(NODE_DIR / 'specsplit.js')!r})"
        )
    )
    r = subprocess.run(
        ["node", str(script)], cwd=NODE_DIR, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "the snippet printed nothing"


@pytest.mark.slow
def test_the_python_client_snippet_runs_against_a_real_cloud(cloud, tiny, tmp_path):
    """The README's client snippet as written, but for the address, the tiny draft's export
    and its prompt (the tiny draft has no tokenizer: its ids instead of the chat prompt)."""
    block = next(b for b in code_blocks(README, "python") if "SplitClient" in b)
    prompt = 'TextCodec(draft_dir).chat_prompt("Write a quicksort in Python")'
    for placeholder in ('draft_dir = "..."', prompt, '"127.0.0.1:50051"'):
        assert placeholder in block, placeholder
    code = (
        block.replace('draft_dir = "..."', f"draft_dir = {str(tiny.draft_onnx)!r}")
        .replace(prompt, "[1, 2, 3]")
        .replace('"127.0.0.1:50051"', repr(cloud.address))
    )
    script = tmp_path / "snippet.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "the snippet printed nothing"


GENERATED = ["benchmarks*.md", "load*.md", "soak.md", "peers*.md"]  # pages bench/ writes


def test_every_generated_page_says_when_and_where_it_was_measured_or_that_it_is_stale():
    """A figure without its date, commit and CPU went stale unnoticed (issue 41): each page
    bench/ generates opens with bench.stamp's line, a visible stale note naming its commit and
    the `make` target that regenerates it, or a note that no current figure is published (then
    naming the `make` target that writes it, and holding no figure: no table, no plot)."""
    pages = sorted({p for g in GENERATED for p in (ROOT / "docs").glob(g)})
    assert len(pages) >= 6
    for page in pages:
        text = page.read_text()
        head = "\n".join(text.splitlines()[:12])
        note = " ".join(line[1:].strip() for line in head.splitlines() if line.startswith(">"))
        stamp = re.search(r"^Measured .+ at commit `[0-9a-f]{7,}` on \S", head, flags=re.M)
        stale = re.search(r"^> \*\*Stale\.\*\* ", head, flags=re.M)
        none = re.search(r"^> \*\*No current figure is published\.\*\* ", head, flags=re.M)
        assert stamp or stale or none, f"{page.name}: no stamp, stale note or no-figure note"
        if none and not stamp:
            assert re.search(r"`make [\w-]+`", note), f"{page.name}: no command writes it"
            assert not re.search(r"^\||!\[", text, flags=re.M), f"{page.name}: has a figure"
        elif stale and not stamp:
            assert re.search(r"\b[0-9a-f]{7}\b", note), f"{page.name}: the note names no commit"
            assert re.search(r"`make [\w-]+`", note), f"{page.name}: no command regenerates it"


def test_pages_without_a_current_figure_leave_nothing_of_the_old_run_behind():
    """docs/soak.md and docs/load.md publish no current figure (issue 41): their plots and raw
    records went with their figures, and nothing links to them."""
    for name in ("soak", "load"):
        assert "No current figure is published" in (ROOT / "docs" / f"{name}.md").read_text()
        for leftover in (f"{name}.png", f"{name}-raw.jsonl", f"{name}-meta.json"):
            assert not (ROOT / "docs" / leftover).exists(), leftover
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        links = re.findall(r"\]\(([^)]+)\)", page.read_text())
        gone = [link for link in links if Path(link).name in ("soak.png", "load.png")]
        assert not gone, f"{page.name} links to {gone}"


@pytest.mark.slow
def test_the_openai_snippet_runs_against_a_real_edge_serve(cloud, tiny, tmp_path):
    """The README's OpenAI snippet as written but for the address, against `specsplit-edge
    serve` with the tiny draft (given a tokenizer, as tests/edge/openai does) and the tiny
    cloud: it streams text and ends with the request's speculation stats."""
    pytest.importorskip("openai")
    block = next(b for b in code_blocks(README, "python") if "OpenAI(" in b)
    assert '"http://127.0.0.1:8000/v1"' in block
    serve = _edge_serve(cloud, tiny, tmp_path)
    try:
        script = tmp_path / "snippet.py"
        script.write_text(block.replace('"http://127.0.0.1:8000/v1"', repr(serve.url)))
        r = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=300
        )
    finally:
        serve.stop()
    assert r.returncode == 0, r.stderr
    text, _, stats = r.stdout.rstrip().rpartition("\n")
    assert text.strip(), "the snippet streamed no text"
    assert stats.lstrip().startswith("{") and "'acceptance_rate'" in stats, r.stdout[-500:]


# Every shell block of the README, by a line only it holds: the test here that runs it, or why
# it is not run. A new block fails test_every_shell_block_is_run_or_says_why_not until it is here.
SHELL_BLOCKS = {
    "──gRPC──▶": "not run: the architecture diagram, not shell",
    "make setup ": "not run: builds .venv and runs the whole suite (minutes to an hour; `make "
    "test` runs this file)",
    "taskset -c 1": "not run: serves the real 1.5B default target (minutes to load, ~10 GB RAM)",
    "pip install -e '.[cloud]'": "not run: installs from the network, then serves the real "
    "default target (tests/test_packaging.py installs the package into empty venvs)",
    "pip install -e '.[edge,export]'": "not run: the same for the edge and the real default draft",
    "specsplit-edge serve --server": "not run: it drafts with the real default draft, whose "
    "vocabulary the tiny target does not share; the endpoint it starts is run by "
    "test_the_openai_snippet_runs_against_a_real_edge_serve and "
    "test_the_curl_block_runs_against_a_real_edge_serve",
    "--tls-cert server.pem": "not run: a template ([optional flags], `...`, certificate files "
    "to make first); TLS, mTLS and tokens run in tests/cloud/gateway/test_security.py",
    "specsplit-edge --version": "run: test_the_install_check_block_runs",
    "--target /models/my-target": "run: test_the_own_pair_block_runs_against_tiny_models",
    "curl -sN": "run: test_the_curl_block_runs_against_a_real_edge_serve",
}


def shell_block(key: str) -> str:
    return next(b for b in code_blocks(README, "bash", "sh", "") if key in b)


def test_every_shell_block_is_run_or_says_why_not():
    for block in code_blocks(README, "bash", "sh", ""):
        keys = [key for key in SHELL_BLOCKS if key in block]
        assert len(keys) == 1, f"a README block matches {keys} of SHELL_BLOCKS:\n{block}"
    for key, why in SHELL_BLOCKS.items():
        assert any(key in b for b in code_blocks(README, "bash", "sh", "")), f"no block has {key}"
        if why.startswith("run: "):
            assert callable(globals().get(why[5:])), why


def run_shell(script: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``script`` in bash -e with this environment's commands first on PATH (as `source
    .venv/bin/activate` puts them)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(
        ["bash", "-e", "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def test_the_install_check_block_runs(tmp_path):
    r = run_shell(shell_block("specsplit-edge --version"), tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    from specsplit.shared.cli_help import version

    assert f"specsplit-edge {version()}" in r.stdout and f"specsplit-cloud {version()}" in r.stdout
    assert "--startup-timeout" in r.stdout and "(default: 300.0)" in r.stdout


@pytest.mark.slow
def test_the_own_pair_block_runs_against_tiny_models(tiny, tmp_path):
    """ "Your own pair" as written, the tiny target and draft (given a tokenizer) at its paths:
    serve (through CloudProcess, on a free port rather than 50051, which may be taken), export,
    then a generation against that serve."""
    from specsplit.cloud.supervision.process import CloudProcess
    from tests.edge.openai.test_openai import write_tokenizer

    block = shell_block("--target /models/my-target").replace("\\\n", " ")
    serve, *edge = [line for line in block.splitlines() if line.strip()]
    draft = tmp_path / "my-draft"
    shutil.copytree(tiny.draft, draft)
    write_tokenizer(draft)
    paths = {
        "/models/my-target": str(tiny.target),
        "/models/my-draft-onnx": str(tmp_path / "my-draft-onnx"),
        "/models/my-draft": str(draft),
    }
    words = shlex.split(serve)
    assert words[:2] == ["specsplit-cloud", "serve"] and "--port" in words
    args = [paths.get(w, w) for w in words[2:]]
    args[args.index("--port") + 1] = "0"
    with CloudProcess(*args, log_dir=tmp_path) as cloud:
        script = "\n".join(edge).replace("127.0.0.1:50051", cloud.address)
        for path in paths:  # the longest first: my-draft-onnx before my-draft
            script = script.replace(path, paths[path])
        r = run_shell(script, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "my-draft-onnx" / "model.onnx").is_file()
    assert r.stdout.strip(), "generate printed nothing"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def _edge_serve(cloud, tiny, tmp_path: Path):
    """`specsplit-edge serve` on the tiny draft (given a tokenizer, as tests/edge/openai does)
    and the tiny cloud, started; the caller stops it."""
    from tests.edge.openai.test_openai import EdgeServe, write_tokenizer

    draft = tmp_path / "draft"
    shutil.copytree(tiny.draft_onnx, draft)
    write_tokenizer(draft)
    return EdgeServe(
        "--server", cloud.address, "--draft", str(draft), "--retry-window", "0",
        log_path=tmp_path / "serve.log",
    )  # fmt: skip


def test_the_curl_block_runs_against_a_real_edge_serve(cloud, tiny, tmp_path):
    """The curl block as written but for the address, against `specsplit-edge serve` with the
    tiny draft (given a tokenizer) and the tiny cloud: it streams chunks and ends with [DONE]."""
    block = shell_block("curl -sN")
    assert "http://127.0.0.1:8000/v1" in block
    serve = _edge_serve(cloud, tiny, tmp_path)
    try:
        r = run_shell(block.replace("http://127.0.0.1:8000/v1", serve.url), tmp_path, 120)
    finally:
        serve.stop()
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("data: {") >= 2 and "data: [DONE]" in r.stdout, r.stdout[-2000:]


def test_every_environment_variable_the_code_reads_is_in_the_table():
    """The README's environment-variable table names every SPECSPLIT_* the package reads."""
    table = README[README.index("## Environment variables") :].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(SPECSPLIT_[A-Z_]+)` \|", table, flags=re.M))
    read = {
        name
        for tier in ("cloud", "edge", "shared")
        for path in (ROOT / tier).rglob("*.py")
        for name in re.findall(r"\bSPECSPLIT_[A-Z_]+\b", path.read_text())
    }
    assert read - listed == set(), f"not in the README's table: {sorted(read - listed)}"
    assert listed - read == set(), f"in the table, read nowhere: {sorted(listed - read)}"
