"""`python -m bench.qbytes`: acceptance and bytes per drafted position for each q encoding.

Offline and exact in expectation: the draft samples a continuation at T=0.7 for a few prompts,
the target scores it in one teacher-forced pass, and for every position and encoding this prints
E[accept] = sum_x min(p(x), q(x)) (the acceptance probability of speculative sampling) and the
size of the SparseDistribution on the wire. It chose Q_LEVELS (shared/sampling.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

VARIANTS = {  # name: (q_entries, q_levels); q_levels 0 = float probs
    "float32 m32": (32, 0),
    "u8/255 m32": (32, 255),
    "u8/127 m32": (32, 127),
    "u8/63 m32": (32, 63),
    "u8/127 m16": (16, 127),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.qbytes", description=__doc__)
    p.add_argument("--prompts", type=int, default=4, help="per class (code, prose)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from specsplit.edge.drafting import draft_distribution, next_logits
    from specsplit.edge.export.ensure import ensure_draft_onnx
    from specsplit.edge.onnx_drafter import OnnxDrafter
    from specsplit.edge.text import TextCodec
    from specsplit.shared.protocol import sparse_to_pb
    from specsplit.shared.sampling import SamplingConfig, logits_to_probs, sample
    from specsplit.shared.weights.sources import resolve_model

    cfg = SamplingConfig(temperature=args.temperature)
    draft_dir = ensure_draft_onnx("qwen2.5-coder-0.5b-instruct")
    codec, drafter = TextCodec(draft_dir), OnnxDrafter(draft_dir, threads=1)
    target_dir = resolve_model("qwen2.5-coder-1.5b-instruct")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    lines = (Path(__file__).parent / "prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line) for line in lines]
    rng = np.random.default_rng(0)
    rows: dict[tuple[str, str], list[tuple[float, int, int]]] = {}
    for cls in ("code", "prose"):
        for prompt in [q for q in prompts if q["class"] == cls][: args.prompts]:
            seq = list(codec.chat_prompt(prompt["prompt"]))
            n0, q_logits = len(seq), []
            for _ in range(args.tokens):
                q_logits.append(next_logits(drafter, seq).copy())
                seq.append(sample(logits_to_probs(q_logits[-1], cfg), rng))
            with torch.no_grad():
                out = target(torch.tensor([seq])).logits[0].float().numpy()
            for j, lg in enumerate(q_logits):
                p_j = logits_to_probs(out[n0 - 1 + j], cfg)
                for name, (m, levels) in VARIANTS.items():
                    q = draft_distribution(lg, cfg, m, levels)
                    accept = float(np.minimum(p_j[q.ids], q.probs).sum())
                    size = sparse_to_pb(q).ByteSize() + 2  # + its tag and length in the Draft
                    rows.setdefault((cls, name), []).append((accept, size, len(q.ids)))
    print("| class | q encoding | E[accept] | bytes per position | entries |")
    print("|---|---|---|---|---|")
    for (cls, name), r in rows.items():
        accept, size, entries = np.array(r).mean(axis=0)
        print(f"| {cls} | {name} | {accept:.4f} | {size:.1f} | {entries:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
