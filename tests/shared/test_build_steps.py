"""Build-step helpers: a missing package is named with the extra that provides it."""

import sys

import pytest

from specsplit.shared.build_steps import require_extra


def test_require_extra_names_the_missing_modules_and_the_extra():
    with pytest.raises(
        ImportError, match=r"no_such_mod_1, no_such_mod_2 not installed.*\[export\]"
    ):
        require_extra("export", "json", "no_such_mod_1", "no_such_mod_2")


def test_require_extra_finds_installed_modules_without_importing_them():
    """Installed modules pass, and are only looked up: checking an extra costs no imports (a
    step checks its extra before the slow imports it needs)."""
    sys.modules.pop("tabnanny", None)  # installed with Python, imported by nothing here
    assert require_extra("export", "json", "tabnanny") is None
    assert "tabnanny" not in sys.modules
