"""The transformers rows of `make bench-peers`, in a child process pinned to their own cores.

What a user of Hugging Face transformers would run on this CPU: the target alone, float32, and
assisted generation (``model.generate(..., assistant_model=draft)``) with transformers' own
defaults for the assistant. Greedy, stopping at the models' end tokens as every row does.

A child of its own because torch's worker threads keep the CPU affinity of the moment they
start: pinning a process that already ran torch would leave its old workers where they were.

    python -m bench.peers_hf --target DIR [--draft DIR] --threads N --prompts IDS.json \
        --max-new-tokens 64      # one JSON record per line on stdout, per prompt
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)
WARMUP_TOKENS = 4


def load(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def greedy(model, prompt_ids: list[int], max_new: int, assistant=None) -> tuple[list[int], float]:
    """(new token ids, wall seconds from the call to its last token)."""
    import torch
    from transformers import GenerationConfig

    gen = model.generation_config  # the converted dir's: end tokens and pad only
    cfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=gen.eos_token_id,
        pad_token_id=gen.pad_token_id,
    )
    ids = torch.tensor([prompt_ids])
    extra = {"assistant_model": assistant} if assistant is not None else {}
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=cfg, **extra
        )
        wall = time.perf_counter() - t0
    return out[0, len(prompt_ids) :].tolist(), wall


def assistant_settings(draft) -> dict:
    """The assistant's settings in effect: the draft's own, else transformers' defaults."""
    from transformers import GenerationConfig

    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule")
    keys += ("assistant_confidence_threshold",)
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    own = {k: getattr(draft.generation_config, k, None) for k in keys}
    return {k: defaults.get(k) if v is None else v for k, v in own.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers_hf", description=__doc__)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", type=Path, help="assisted generation with this assistant model")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--prompts", type=Path, required=True, help='JSON [{"id", "ids"}, ...]')
    p.add_argument("--max-new-tokens", type=int, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    prompts = json.loads(args.prompts.read_text())
    model = load(args.target)
    draft = load(args.draft) if args.draft else None
    greedy(model, prompts[0]["ids"], WARMUP_TOKENS, draft)  # first-call costs stay out
    info = {"torch": torch.__version__, "transformers": transformers.__version__}
    if draft is not None:
        info["assistant"] = assistant_settings(draft)
    for prompt in prompts:
        new, wall = greedy(model, prompt["ids"], args.max_new_tokens, draft)
        logger.info("%s: %d tokens in %.1f s", prompt["id"], len(new), wall)
        record = {"prompt_id": prompt["id"], "token_ids": new, "wall_s": wall, **info}
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
