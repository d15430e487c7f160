"""Every dotted ``edge.*``, ``cloud.*`` and ``shared.*`` name in a docstring or a comment names a
real module or attribute (docs/design.md cites modules the same way; STYLE habit 10).

A name is resolved as the longest importable ``specsplit.`` module prefix, then attributes from
there. An attribute of a class also counts when the class declares it without a class-level
value: an annotation, a dataclass field, or ``self.<name> =`` in its source.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import io
import re
import subprocess
import textwrap
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Not preceded by a word, a dot or a slash (file paths such as edge/cloud_led.py are not names).
NAME = re.compile(r"(?<![\w./-])(?:specsplit\.)?((?:edge|cloud|shared)(?:\.[A-Za-z_]\w*)+)")


def _sources() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / f for f in out]


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every docstring (any string statement) and comment in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        # Docstrings, and the string statements that document an attribute after it.
        value = node.value if isinstance(node, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            found.append((node.lineno, value.value))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found.append((tok.start[0], tok.string))
    return found


def names_in(text: str) -> list[str]:
    # A sentence may end right after a name ("... in cloud.capacity."): the regex stops there.
    return [m.group(1) for m in NAME.finditer(text)]


def _declares(cls: type, attr: str) -> bool:
    for klass in inspect.getmro(cls):
        if attr in getattr(klass, "__annotations__", {}):
            return True
        if attr in getattr(klass, "__dataclass_fields__", {}):
            return True
        try:
            src = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        if attr in _self_assigned(src):
            return True
    return False


def _self_assigned(src: str) -> set[str]:
    """Attributes a class's methods assign on ``self`` (tuple targets included)."""
    out = set()
    for node in ast.walk(ast.parse(src)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        while targets:
            t = targets.pop()
            if isinstance(t, ast.Tuple | ast.List):
                targets.extend(t.elts)
            elif isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self":
                out.add(t.attr)
    return out


@functools.cache
def resolves(name: str) -> bool:
    parts = name.split(".")
    obj = None
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module("specsplit." + ".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        rest = parts[i:]
        break
    if obj is None:
        return False
    for attr in rest:
        if not hasattr(obj, attr):
            # An instance attribute of a class: nothing further to follow.
            return inspect.isclass(obj) and _declares(obj, attr)
        obj = getattr(obj, attr)
    return True


def test_names_in_prose_are_found():
    """The scanner itself: names in docstrings and comments, not paths or other words."""
    src = (
        '"""Uses cloud.gateway.admission and specsplit.edge.rounds.run_rounds."""\n'
        "# see edge/cloud_led.py and shared.acceptance.VerificationRule's values\n"
        "x = 'cloud.not_prose'\n"
    )
    got = [n for _, text in prose(src) for n in names_in(text)]
    assert got == [
        "cloud.gateway.admission",
        "edge.rounds.run_rounds",
        "shared.acceptance.VerificationRule",
    ]


def test_resolver_accepts_real_and_refuses_moved_names():
    assert resolves("shared.acceptance.VerificationRule.GREEDY")
    assert resolves("edge.session_plan.SessionPlan.may_lead")  # a dataclass field
    assert resolves("cloud.gateway.round.Round.lease")  # set in __init__
    assert not resolves("cloud.ragged.RaggedForward")  # moved to cloud.engine.ragged
    assert not resolves("edge.families")  # moved to edge.export.families


def test_every_dotted_name_in_docstrings_and_comments_resolves():
    stale = []
    for path in _sources():
        for line, text in prose(path.read_text()):
            for name in names_in(text):
                if not resolves(name):
                    stale.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not stale, "names that are no module or attribute:\n" + "\n".join(stale)


@pytest.mark.parametrize("text", ["cloud.", "edge. The", "shared_x.y"])
def test_non_names_are_ignored(text):
    assert names_in(text) == []


def test_every_dotted_name_in_the_design_doc_resolves():
    text = (ROOT / "docs" / "design.md").read_text()
    stale = [name for name in names_in(text) if not resolves(name)]
    assert not stale, f"docs/design.md names that are no module or attribute: {stale}"
