"""Per-round overhead on loopback: round time minus model compute, and where it goes.

A tiny target (so compute is small and stable) behind the real Triton + gateway, its own ONNX
export as the draft (every block accepted), greedy, k = 4. Per round the edge measures send ->
verdict (round); the gateway reports its own time (server) and the Triton round trip minus the
model's time (triton); the model reports its forward + acceptance (verify). Then:
    overhead       = round - verify
    edge<->gateway = round - server    (edge and gateway serialisation, the gRPC hop)
    gateway        = server - triton - verify   (validation, bookkeeping, tritonclient)
    triton         = Triton queueing, transport to the Python backend stub, IPC
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import numpy as np

from specsplit.cloud.supervision.process import CloudProcess
from specsplit.edge.client import GenerationConfig, SplitClient

ROUNDS_PER_RUN = 100


def _percentiles(values: np.ndarray) -> dict:
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


async def _collect(address: str, draft_dir: Path, runs: int) -> dict[str, np.ndarray]:
    from specsplit.edge.onnx_drafter import OnnxDrafter

    drafter = OnnxDrafter(draft_dir, threads=1)
    cols = {"round": [], "verify": [], "server": [], "triton": []}
    # lock-step rounds of a fixed k: the overhead is a round's time beyond its verification
    cfg = GenerationConfig(
        max_new_tokens=5 * ROUNDS_PER_RUN,
        max_draft_tokens=4,
        adaptive=False,
        session_mode="lock-step",
    )
    async with SplitClient(address, drafter) as client:
        await client.generate([1, 2, 3], GenerationConfig(max_new_tokens=20)).collect()  # warm-up
        for run in range(runs):
            gen = client.generate([1 + run, 2, 3], cfg)
            await gen.collect()
            s = gen.stats
            cols["round"] += s.round_ms
            cols["verify"] += s.verify_ms
            cols["server"] += s.server_ms
            cols["triton"] += s.queue_ms
    return {k: np.asarray(v) for k, v in cols.items()}


def measure_overhead(edge_cores: set[int], cloud_cores: set[int], runs: int = 3) -> dict:
    from specsplit.edge.export.exporter import export_onnx
    from specsplit.shared.tiny import make_tiny_qwen2

    with tempfile.TemporaryDirectory(prefix="specsplit-overhead-") as tmp:
        tmp = Path(tmp)
        target = make_tiny_qwen2(tmp / "target", seed=0, hidden_size=64, layers=2)
        draft = export_onnx(target, tmp / "draft-onnx")
        with CloudProcess(
            "--target", str(target), "--threads", "1", log_dir=tmp, cpus=cloud_cores
        ) as cloud:
            c = asyncio.run(_collect(cloud.address, draft, runs))
    parts = {
        "round (edge: send -> verdict)": c["round"],
        "model compute (verify)": c["verify"],
        "overhead = round - verify": c["round"] - c["verify"],
        "edge <-> gateway (gRPC hop, serialisation)": c["round"] - c["server"],
        "gateway (validation, bookkeeping, client)": c["server"] - c["triton"] - c["verify"],
        "triton (queue, transport, backend IPC)": c["triton"],
    }
    return {
        "rounds": int(c["round"].size),
        "model": "tiny qwen2 (hidden 64, 2 layers), draft = target, k = 4, greedy",
        "ms": {name: _percentiles(v) for name, v in parts.items()},
    }


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import os

    from bench.demo import split_cores
    from bench.report import write_report

    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__)
    p.add_argument("--meta", type=Path, help="a run's *-meta.json: add the figures, re-report")
    args = p.parse_args(argv)
    edge, cloud = split_cores()
    os.sched_setaffinity(0, edge)
    result = measure_overhead(edge, cloud)
    print(json.dumps(result, indent=1))
    if args.meta:
        meta = json.loads(args.meta.read_text()) | {"overhead": result}
        args.meta.write_text(json.dumps(meta, indent=1))
        stem = args.meta.name.removesuffix("-meta.json")
        print(
            write_report(
                args.meta.with_name(f"{stem}-raw.jsonl"), args.meta, args.meta.parent, stem
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
