"""Resident memory of a `specsplit-cloud serve` process tree, read from /proc (Linux).

The tree is the serve process (the gateway), its tritonserver(s) and their Python backend
stubs; each is labelled by role so a soak or a test can tell which one grows.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

PROC = Path("/proc")


def _stat(pid: int) -> tuple[str, int] | None:
    """(comm, parent pid), None when the process is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]  # comm may hold spaces and parentheses
    return comm, int(text[text.rindex(")") + 2 :].split()[1])


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children[stat[1]].append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (0 when it is gone)."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def role(pid: int, root: int) -> str:
    if pid == root:
        return "gateway"
    comm = (_stat(pid) or ("?", 0))[0]
    if comm.startswith("triton_python"):
        return "stub"
    return "tritonserver" if comm.startswith("tritonserver") else comm


def tree_rss(root: int) -> dict[str, int]:
    """Bytes resident per role (gateway, tritonserver, stub, ...), summed over replicas."""
    by_role: dict[str, int] = defaultdict(int)
    for pid in descendants(root):
        by_role[role(pid, root)] += rss_bytes(pid)
    return dict(by_role)
