"""`import specsplit`: the public edge API, loaded lazily (no torch, no ONNX Runtime up front)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import specsplit


def test_public_names_resolve_to_their_definitions():
    from specsplit.edge.client import GenerationConfig, SpecsplitError, SplitClient
    from specsplit.edge.onnx_drafter import OnnxDrafter
    from specsplit.edge.text import TextCodec

    expected = [GenerationConfig, OnnxDrafter, SpecsplitError, SplitClient, TextCodec]
    assert [getattr(specsplit, name) for name in specsplit.__all__] == expected
    assert set(specsplit.__all__) <= set(dir(specsplit))


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        specsplit.Nope  # noqa: B018


def test_import_loads_no_model_runtime_until_a_name_is_used():
    code = (
        "import sys, specsplit\n"
        "heavy = ('torch', 'onnxruntime', 'tokenizers', 'specsplit.edge')\n"
        "assert not [m for m in heavy if m in sys.modules], sorted(sys.modules)\n"
        "specsplit.GenerationConfig\n"
        "assert 'specsplit.edge.client' in sys.modules and 'onnxruntime' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
