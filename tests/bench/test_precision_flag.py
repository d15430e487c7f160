"""bench/'s `--precision` (`make demo`, `make bench`) takes the names the CLIs take (float32,
float16, int4-float16, ...) and the old export tags (fp32, ...) as aliases with a warning, and
hands the export its tag."""

from __future__ import annotations

import pytest

import bench.demo
import bench.run
from specsplit.edge.export import ensure
from specsplit.shared.weights import sources


class Exported(Exception):
    """Raised where the bench would export the draft: the flags have been read by then."""


@pytest.fixture
def asked(monkeypatch, tmp_path):
    """The tags the bench asks the export for; nothing is fetched, exported or run."""
    tags = []

    def ensure_draft_onnx(draft, precision):
        tags.append(precision)
        raise Exported

    monkeypatch.setattr(ensure, "ensure_draft_onnx", ensure_draft_onnx)
    monkeypatch.setattr(sources, "resolve_model", lambda spec: tmp_path)
    for module in (bench.demo, bench.run):
        monkeypatch.setattr(module, "interrupt_on_sigterm", lambda: None)
    return tags


MAINS = {"make demo": bench.demo.main, "make bench": lambda argv: bench.run.main(argv)}


@pytest.mark.parametrize("prog", MAINS)
@pytest.mark.parametrize(
    ("value", "tag"),
    [("float32", "fp32"), ("float16", "fp16"), ("int4-float16", "int4-fp16"), ("int8", "int8")],
)
def test_the_new_names_reach_the_export_as_its_tags(asked, prog, value, tag, tmp_path, capsys):
    with pytest.raises(Exported):
        MAINS[prog](
            ["--precision", value, *(["--out", str(tmp_path)] if prog == "make bench" else [])]
        )
    assert asked == [tag]
    assert "deprecated" not in capsys.readouterr().err


@pytest.mark.parametrize("prog", MAINS)
def test_an_old_tag_is_an_alias_with_a_warning_naming_the_new_name(asked, prog, tmp_path, capsys):
    with pytest.raises(Exported):
        MAINS[prog](
            [
                "--precision",
                "int4-fp16",
                *(["--out", str(tmp_path)] if prog == "make bench" else []),
            ]
        )
    assert asked == ["int4-fp16"]
    err = capsys.readouterr().err
    assert f"{prog}: warning: --precision int4-fp16 is deprecated" in err
    assert "use --precision int4-float16" in err


@pytest.mark.parametrize("prog", MAINS)
def test_the_default_is_the_edges_and_help_lists_only_new_names(asked, prog, tmp_path, capsys):
    with pytest.raises(Exported):
        MAINS[prog](["--out", str(tmp_path)] if prog == "make bench" else [])
    assert asked == ["int4"]
    with pytest.raises(SystemExit) as e:
        MAINS[prog](["--precision", "fp8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "float32" in err and "int4-float16" in err and "'fp32'" not in err
