"""What both CLIs (``specsplit-edge``, ``specsplit-cloud``) share in their argument parsing:
defaults shown in every ``--help``, ``--version``, and old flag names and values kept as
deprecated aliases.

Imports nothing beyond the standard library, so ``--help`` works on any install.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless its help already says its default, or it
    has none worth showing (None, False: a flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        # identity, not ==: a default of 0 or 0.0 equals False and is still worth showing
        off = any(action.default is v for v in (None, False, argparse.SUPPRESS))
        if "(default" in help or off:
            return help
        if not action.option_strings:
            return help
        return f"{help} (default: %(default)s)" if help else "(default: %(default)s)"


def version() -> str:
    """The installed package's version (``pyproject.toml``'s, for a checkout installed -e)."""
    try:
        return metadata.version("specsplit")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--version",
        action="version",
        version=f"{parser.prog} {version()}",
        help="print the version and exit",
    )


class _Deprecated(argparse.Action):
    """An old flag name: stores into the new flag's dest after a warning that names the new one."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(
            f"{parser.prog}: warning: {option_string} is deprecated and goes in the next "
            f"release; use {self.new}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str, **kwargs) -> None:
    """Accepts ``old`` as ``new`` for one release (hidden from --help; a warning when used).
    ``kwargs`` are the new flag's ``type``/``choices``, so the old name parses the same."""
    dest = new.lstrip("-").replace("-", "_")
    parser.add_argument(
        old,
        dest=dest,
        action=_Deprecated,
        new=new,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
        **kwargs,
    )


def renamed_values(prog: str, flag: str, renamed: dict[str, str]):
    """An argparse ``type`` for a flag whose values were renamed: an old value is accepted as its
    new name for one release, with a warning that names the new one. Give the flag
    ``choices`` of the new names only, so ``--help`` and a bad value's error list those."""

    def parse(value: str) -> str:
        new = renamed.get(value)
        if new is None:
            return value
        print(
            f"{prog}: warning: {flag} {value} is deprecated and goes in the next release; "
            f"use {flag} {new}",
            file=sys.stderr,
        )
        return new

    return parse
