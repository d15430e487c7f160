"""specsplit-edge: export a draft model to ONNX, and generate with it against a cloud."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from specsplit.edge.client import MODES, GenerationConfig, SpecsplitError, SplitClient
from specsplit.shared.acceptance import Mode
from specsplit.shared.sampling import SamplingConfig

VERIFICATION = {"auto": None, "rejection": Mode.REJECTION, "token-only": Mode.TOKEN_ONLY}


def _prompt_ids(args, codec) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise SystemExit("--prompt-ids must be comma-separated integers") from None
    return codec.chat_prompt(args.prompt) if args.chat else codec.encode(args.prompt)


def _config(args) -> GenerationConfig:
    try:
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        raise SystemExit(f"specsplit-edge: {e}") from None
    return GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        seed=args.seed,
        draft_tokens=args.draft_tokens,
        verification=VERIFICATION[args.verification],
    )


def _codec(args):
    """The draft dir's tokenizer: required for --prompt text, else used when present."""
    from specsplit.edge.text import TextCodec

    if args.prompt is not None:
        if not args.draft:
            raise ValueError("--prompt needs a tokenizer: pass --draft DIR, or use --prompt-ids")
        return TextCodec(args.draft)
    if args.draft and (Path(args.draft) / "tokenizer.json").is_file():
        return TextCodec(args.draft)
    return None  # token ids in, token ids out


async def _generate(args) -> int:
    codec = _codec(args)
    prompt = _prompt_ids(args, codec)
    drafter = None
    if args.mode != "cloud-only":
        from specsplit.edge.drafter import OnnxDrafter

        drafter = OnnxDrafter(Path(args.draft), threads=args.threads)
    server = None if args.mode == "edge-only" else args.server
    async with SplitClient(server, drafter) as client:
        gen = client.generate(prompt, _config(args), mode=args.mode)
        stream = codec.stream() if codec and not args.json else None
        async for chunk in gen:
            if args.json:
                continue
            sys.stdout.write(stream.push(chunk) if stream else "".join(f"{t} " for t in chunk))
            sys.stdout.flush()
    s = gen.stats
    if args.json:
        out = {"text": codec.decode(gen.token_ids) if codec else None, "token_ids": gen.token_ids}
        out.update(s.summary())
        print(json.dumps(out))
    else:
        print(
            f"\n[{s.mode}] {s.new_tokens} tokens in {s.wall_s:.2f}s ({s.tokens_per_s:.1f} tok/s), "
            f"acceptance {s.acceptance_rate:.2f}, {s.tokens_per_round:.2f} tokens/round, "
            f"finish {s.finish}",
            file=sys.stderr,
        )
    return 0


def _export(args) -> int:
    from specsplit.edge.export import export_onnx

    out = export_onnx(Path(args.model), Path(args.out), precision=args.precision, progress=True)
    print(out)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specsplit-edge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="Hugging Face causal LM -> ONNX draft with a KV cache")
    e.add_argument("--model", required=True, help="Hugging Face model directory")
    e.add_argument("--out", required=True, help="output directory")
    e.add_argument("--precision", choices=("fp32", "int8"), default="fp32")
    g = sub.add_parser("generate", help="generate text (split, cloud-only or edge-only)")
    g.add_argument("--server", default="127.0.0.1:50051", help="gateway HOST:PORT")
    g.add_argument("--draft", help="exported ONNX draft directory (not needed for cloud-only)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenised with the draft's tokenizer)")
    src.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    g.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--draft-tokens", type=int, default=4, help="k, tokens drafted per round")
    g.add_argument("--verification", choices=tuple(VERIFICATION), default="auto")
    g.add_argument("--mode", choices=MODES, default="split")
    g.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads")
    g.add_argument("--json", action="store_true", help="print one JSON object at the end")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "export":
        return _export(args)
    if args.mode != "cloud-only" and not args.draft:
        raise SystemExit(f"specsplit-edge: --draft is required in {args.mode} mode")
    if args.max_new_tokens < 1 or args.draft_tokens < 0:
        raise SystemExit("specsplit-edge: --max-new-tokens must be >= 1, --draft-tokens >= 0")
    try:
        return asyncio.run(_generate(args))
    except SpecsplitError as e:
        print(f"specsplit-edge: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"specsplit-edge: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
