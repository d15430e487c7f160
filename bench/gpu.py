"""The target engine on a CUDA GPU: lossless checks and speed beside transformers, one run.

`make bench-gpu` (a machine with a CUDA GPU and torch built for it). What it measures, on the
default target's architecture (Qwen2.5-Coder-1.5B's config.json) with seeded random weights,
because that machine may not reach our weights (the lossless checks ask only that the engine
agree with itself; the speed asks only for the shapes):

- **Lossless on the GPU.** 16 prompts, 64 greedy tokens each, served four ways by one
  ``TargetModel`` on ``--weights float``: each session alone (the reference), the 16 batched
  cloud-only, a split whose drafts are the reference's own tokens (every block accepted, k 4), and
  a split whose every third draft is wrong (a correction each block). Every way must give the
  reference's tokens: the float path is not batch-invariant (README "Models"), so a session's
  logits depend on what shares its pass, and a near-tie may flip. The report counts sessions
  that differ, in bfloat16 (the GPU default) and float32.
- **Speed.** Cloud-only decode tokens/s of 1, 4, 16 and 64 concurrent sessions (prompt 128, 128
  new tokens), a pass's milliseconds by rows, and the split's ceiling (all drafts accepted, k 4),
  beside transformers' ``generate`` on the same weights (batch 1 and 16, greedy), the baseline a
  user of this GPU has without a serving stack.

    python -m bench.gpu --config CONFIG.json [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

CHECK_SESSIONS = 16
CHECK_TOKENS = 64
BLOCK = 4
SPEED_SESSIONS = (1, 4, 16, 64)
SPEED_PROMPT = 128
SPEED_TOKENS = 128
PASS_ROWS = (1, 5, 9, 17, 33, 65, 129, 257)


def random_target(config_path: Path, out_dir: Path, device: str) -> Path:
    """A model dir with ``config_path``'s architecture and seeded random bfloat16 weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(
        config_path.parent if config_path.is_file() else config_path
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    del model
    return out_dir


def prompts(n: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, int(rng.integers(*lengths)))] for _ in range(n)]


def _params(speculative: bool):
    from specsplit.cloud.engine.target import SessionParams
    from specsplit.shared.acceptance import VerificationRule
    from specsplit.shared.sampling import SamplingConfig

    return SessionParams(SamplingConfig(), VerificationRule.GREEDY, speculative=speculative)


def serve(target, batch: list[list[int]], new: int, drafts=None, wrong_every: int = 0):
    """Greedy continuations of ``batch``, served together: cloud-only steps where ``drafts`` is
    None, else blocks of up to BLOCK taken from ``drafts`` (the i-th draft of a block replaced by
    a wrong id where ``wrong_every`` divides i + 1). Returns (tokens per session, passes, s)."""
    from specsplit.cloud.engine.target import Open, Verify

    sids = list(range(1000, 1000 + len(batch)))
    committed = [list(p) for p in batch]
    target.run([Open(s, p, _params(drafts is not None)) for s, p in zip(sids, batch, strict=True)])
    out: list[list[int]] = [[] for _ in batch]
    passes = 0
    t0 = time.perf_counter()
    while any(len(o) < new for o in out):
        live = [i for i, o in enumerate(out) if len(o) < new]
        requests, blocks = [], {}
        for i in live:
            block: list[int] = []
            if drafts is not None:
                ahead = drafts[i][len(out[i]) : len(out[i]) + min(BLOCK, new - len(out[i]) - 1)]
                block = [
                    (t + 1) % target.token_count
                    if wrong_every and (j + 1) % wrong_every == 0
                    else t
                    for j, t in enumerate(ahead)
                ]
            blocks[i] = block
            requests.append(Verify(sids[i], len(committed[i]), [committed[i][-1], *block]))
        outcomes, _ = target.run(requests)
        passes += 1
        for i, outcome in zip(live, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                raise outcome
            emitted = outcome.result.emitted(blocks[i])[: new - len(out[i])]
            out[i] += emitted
            committed[i] += emitted
    sync()
    seconds = time.perf_counter() - t0
    for s in sids:
        target.end(s)
    return out, passes, seconds


def lossless(target, vocab: int) -> dict:
    batch = prompts(CHECK_SESSIONS, (64, 200), vocab, seed=1)
    alone = [serve(target, [p], CHECK_TOKENS)[0][0] for p in batch]
    ways = {
        "batched cloud-only": serve(target, batch, CHECK_TOKENS)[0],
        "split, every draft right": serve(target, batch, CHECK_TOKENS, drafts=alone)[0],
        "split, every 3rd draft wrong": serve(target, batch, CHECK_TOKENS, alone, wrong_every=3)[0],
    }
    return {
        way: {
            "sessions_differing": sum(a != b for a, b in zip(alone, got, strict=True)),
            "first_divergence": [
                next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                for a, b in zip(alone, got, strict=True)
                if a != b
            ],
        }
        for way, got in ways.items()
    }


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def pass_ms(target, rows: int, reps: int = 10) -> float:
    target._timed_pass(rows)
    sync()
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        target._timed_pass(rows)
        sync()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def engine_speed(target, vocab: int) -> dict:
    rows = {"pass_ms_by_rows": {r: round(pass_ms(target, r), 2) for r in PASS_ROWS}}
    for n in SPEED_SESSIONS:
        batch = prompts(n, (SPEED_PROMPT, SPEED_PROMPT + 1), vocab, seed=2)
        serve(target, batch[:1], 8)  # warm-up
        toks, passes, s = serve(target, batch, SPEED_TOKENS)
        rows[f"cloud_only_x{n}_tok_s"] = round(n * SPEED_TOKENS / s, 1)
        _, passes, s = serve(target, batch, SPEED_TOKENS, drafts=toks)
        rows[f"split_ceiling_x{n}_tok_s"] = round(n * SPEED_TOKENS / s, 1)
        rows[f"split_ceiling_x{n}_passes_per_token"] = round(passes / SPEED_TOKENS, 3)
    return rows


def transformers_speed(model_dir: Path, dtype, vocab: int, device: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    rows = {}
    for n in (1, 16):
        ids = torch.tensor(prompts(n, (SPEED_PROMPT, SPEED_PROMPT + 1), vocab, seed=2)).to(device)
        cfg = GenerationConfig(
            do_sample=False,
            max_new_tokens=SPEED_TOKENS,
            min_new_tokens=SPEED_TOKENS,
            pad_token_id=0,
            eos_token_id=None,
        )
        with torch.inference_mode():
            model.generate(
                ids[:, :32],
                generation_config=GenerationConfig(
                    do_sample=False, max_new_tokens=8, pad_token_id=0
                ),
            )  # warm-up
            sync()
            t0 = time.perf_counter()
            out = model.generate(ids, generation_config=cfg, attention_mask=torch.ones_like(ids))
            sync()
        s = time.perf_counter() - t0
        rows[f"transformers_x{n}_tok_s"] = round(n * (out.shape[1] - ids.shape[1]) / s, 1)
    del model
    return rows


def profile(target, vocab: int, sessions: int = 16) -> str:
    """torch.profiler's table of ``sessions`` cloud-only sessions stepping 16 tokens."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    batch = prompts(sessions, (SPEED_PROMPT, SPEED_PROMPT + 1), vocab, seed=2)
    serve(target, batch, 4)  # warm-up
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, passes, s = serve(target, batch, 16)
    head = f"{sessions} sessions x 16 tokens: {passes} passes, {s * 1e3 / passes:.1f} ms/pass\n"
    return head + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="a target's config.json")
    parser.add_argument("--out", type=Path, default=None, help="write gpu.json here")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--profile", action="store_true", help="only profile 16 sessions' steps")
    parser.add_argument("--device", default="cuda", help="cpu only to try this script itself")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.gpu needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from specsplit.cloud.engine.target import TargetModel

    report: dict = {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "torch": torch.__version__,
        "config": str(args.config),
        "weights": "seeded random (torch.manual_seed(0)), the config's architecture",
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_target(args.config, Path(tmp), args.device)
        for name in args.dtypes:
            t0 = time.perf_counter()
            target = TargetModel(
                model_dir, device=args.device, dtype=name, weights="float", calibrate=False
            )
            vocab = target.token_count
            log.info("loaded %s in %.1f s", name, time.perf_counter() - t0)
            if args.profile:
                print(profile(target, vocab))
                continue
            row = {"lossless": lossless(target, vocab)}
            log.info("%s lossless: %s", name, json.dumps(row["lossless"]))
            row.update(engine_speed(target, vocab))
            del target
            row.update(transformers_speed(model_dir, getattr(torch, name), vocab, args.device))
            log.info("%s: %s", name, json.dumps(row))
            report[name] = row
            if args.out:  # each dtype as it finishes: a run cut short keeps what it measured
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "gpu.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
