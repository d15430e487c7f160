"""Build-step helpers: a missing package is named with the extra that provides it."""

import pytest

from specsplit.shared.steps import require_extra


def test_require_extra_names_the_missing_modules_and_the_extra():
    with pytest.raises(
        ImportError, match=r"no_such_mod_1, no_such_mod_2 not installed.*\[export\]"
    ):
        require_extra("export", "json", "no_such_mod_1", "no_such_mod_2")


def test_require_extra_passes_when_everything_is_installed():
    require_extra("export", "json", "numpy")
