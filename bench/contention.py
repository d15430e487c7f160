"""`python -m bench.contention`: how much one core's work slows another core's, by kind of work.

The split's benchmarks pin the draft to one core and the target to another, as separate machines
would be. On a VM whose vCPUs share the host's memory bandwidth they are not separate: a draft
step streams its weights (~200 MB) while a target pass streams its own (~1 GB), and each gets
part of the bandwidth. This tool measures that share, with nothing of specsplit in it:

- the victim, pinned to core ``--victim``, times a streaming read (a sum over ``--mib`` MiB of
  float64: memory-bound) and a small float32 matrix product (compute-bound, in cache);
- meanwhile the neighbour, pinned to core ``--neighbour``, is idle, runs a compute-bound loop
  (a 128 x 128 product, over and over), or streams (a sum over twice the victim's array).

Where streaming next door halves the victim's read rate and computing next door leaves it alone,
the cores share memory bandwidth, and a split measured on them pays for its draft's reads in the
target's pass (docs/benchmarks.md's profile notes). One process per role, one thread each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

NEIGHBOURS = ("idle", "compute", "stream")
ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

_VICTIM = """
import json, sys, time
import numpy as np
mib, repeats = int(sys.argv[1]), int(sys.argv[2])
a = np.ones(mib * 1024 * 1024 // 8)
b = np.random.default_rng(0).random((256, 256), dtype=np.float32)
a.sum(); b @ b  # first touch
reads, products = [], []
for _ in range(repeats):
    t = time.perf_counter(); a.sum(); reads.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(50):
        b @ b
    products.append(time.perf_counter() - t)
reads.sort(); products.sort()
print(json.dumps({"read_s": reads[len(reads) // 2], "product_s": products[len(products) // 2]}))
"""

_NEIGHBOUR = """
import sys
import numpy as np
kind, mib = sys.argv[1], int(sys.argv[2])
print("ready", flush=True)
if kind == "compute":
    b = np.random.default_rng(0).random((128, 128), dtype=np.float32)
    while True:
        b @ b
a = np.ones(2 * mib * 1024 * 1024 // 8)
while True:
    a.sum()
"""


def _pinned(core: int):
    def pin() -> None:
        os.sched_setaffinity(0, {core})

    return pin


def _spawn(code: str, core: int, *args: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=stdout,
        text=True,
        env={**os.environ, **ENV},
        preexec_fn=_pinned(core),
    )


def measure(victim: int, neighbour: int, mib: int = 256, repeats: int = 9) -> list[dict]:
    """One row per neighbour kind: the victim's read rate (GB/s) and product time (ms)."""
    usable = os.sched_getaffinity(0)
    missing = sorted({victim, neighbour} - usable)
    if victim == neighbour or missing:
        raise ValueError(
            f"need two different usable cores, got victim {victim}, neighbour {neighbour} "
            f"(usable: {sorted(usable)})"
        )
    rows = []
    for kind in NEIGHBOURS:
        other = None
        try:
            if kind != "idle":
                other = _spawn(_NEIGHBOUR, neighbour, kind, str(mib))
                other.stdout.readline()  # "ready": allocated and running
                time.sleep(0.5)
            run = _spawn(_VICTIM, victim, str(mib), str(repeats))
            out, _ = run.communicate(timeout=600)
            if run.returncode != 0:
                raise RuntimeError(f"the victim process failed (exit {run.returncode})")
            got = json.loads(out)
        finally:
            if other is not None:
                other.kill()
                other.wait()
        rows.append(
            {
                "neighbour": kind,
                "read_gb_s": mib * 1024 * 1024 / got["read_s"] / 1e9,
                "product_ms": got["product_s"] * 1e3,
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    idle = rows[0]
    lines = [
        "| neighbour core | victim's streaming read, GB/s | x idle | victim's matrix products, ms "
        "| x idle |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['neighbour']} | {r['read_gb_s']:.1f} | {r['read_gb_s'] / idle['read_gb_s']:.2f} "
            f"| {r['product_ms']:.1f} | {r['product_ms'] / idle['product_ms']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.contention", description=__doc__)
    p.add_argument("--victim", type=int, default=1, help="the core timed (the cloud's: 1)")
    p.add_argument("--neighbour", type=int, default=0, help="the core beside it (the edge's: 0)")
    p.add_argument("--mib", type=int, default=256, help="the victim's array (MiB)")
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    if args.mib < 1 or args.repeats < 1:
        p.error("--mib and --repeats must be >= 1")
    try:
        rows = measure(args.victim, args.neighbour, args.mib, args.repeats)
    except ValueError as e:
        p.error(str(e))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
