"""The stamp on every generated benchmark page: when it was measured, at which commit, on which
CPU (issue 41: figures shown without them went stale unnoticed).

A run records ``stamp()`` in its meta at measurement time; its report prints ``stamp_line(meta)``,
so a page regenerated later from the raw records keeps the run's own date, commit and CPU.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

UNKNOWN = "unknown"


def cpu_model() -> str:
    """The CPU's name: ``specsplit.cloud.engine.kernel_library.cpu_model`` where the cloud is
    installed, else /proc/cpuinfo's model name."""
    try:
        from specsplit.cloud.engine.kernel_library import cpu_model as kernels_cpu_model
    except ImportError:
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
        except OSError:
            pass
        return UNKNOWN
    return kernels_cpu_model() or UNKNOWN


def commit(cwd: Path = Path(__file__).parent) -> str:
    """``git rev-parse --short HEAD`` of the checkout holding ``cwd``; "unknown" outside one."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=cwd,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):  # no git, or no such directory
        return UNKNOWN
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else UNKNOWN


def stamp() -> dict[str, str]:
    """This moment's date (UTC), commit and CPU, under the keys a run's meta keeps them."""
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return {"date": date, "commit": commit(), "cpu": cpu_model()}


def stamp_line(meta: dict) -> str:
    """The line every generated page carries; "unknown" for what an older run did not record."""
    date, sha, cpu = (meta.get(k) or UNKNOWN for k in ("date", "commit", "cpu"))
    return f"Measured {date} at commit `{sha}` on {cpu}."
