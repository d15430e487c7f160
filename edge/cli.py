"""specsplit-edge: generate with a draft model against a cloud; pull or export the draft."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import grpc

from specsplit.edge.client import (
    ROUTES,
    SERVE_ROUTES,
    GenerationConfig,
    SpecsplitError,
    SplitClient,
)
from specsplit.edge.export.ensure import ensure_draft_onnx
from specsplit.edge.gguf_tokenizer import gguf_tokenizer
from specsplit.edge.link_memory import load_link, save_link
from specsplit.edge.models import (
    DEFAULT_DRAFT,
    DEFAULT_HEAD_VOCAB,
    DEFAULT_PRECISION,
    PRECISIONS,
    cached_tokenizer_dir,
)
from specsplit.edge.openai.request_guard import MAX_BODY_BYTES, MAX_WAITING
from specsplit.edge.retry import DEFAULT_WINDOW_S
from specsplit.edge.session_plan import AUTO, SESSION_MODES
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.cli_help import (
    HelpFormatter,
    add_version,
    deprecated_alias,
    renamed_values,
)
from specsplit.shared.sampling import SamplingConfig
from specsplit.shared.weights.sources import SOURCES
from specsplit.shared.weights.wheels import SourceError

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
VERIFICATION = {
    "auto": None,
    "rejection": VerificationRule.REJECTION,
    "token-only": VerificationRule.TOKEN_ONLY,
}
# One default k for generate, serve and the Python API: GenerationConfig's.
DEFAULT_MAX_DRAFT_TOKENS = GenerationConfig.max_draft_tokens
# --precision's values are named as the cloud's --dtype names float formats (float32, float16);
# the export's own tags (edge.models.PRECISIONS: fp32, fp16, int4-fp16) name its cache entries.
# The tags were the flag's values before: accepted, with a warning, for one release.
PRECISION_TAGS = {tag.replace("fp", "float"): tag for tag in PRECISIONS}
PRECISION_NAMES = {tag: name for name, tag in PRECISION_TAGS.items()}
_OLD_PRECISIONS = {tag: name for name, tag in PRECISION_TAGS.items() if tag != name}


def _tag(args) -> str:
    """The export's tag for --precision (its value is a name of PRECISION_TAGS)."""
    return PRECISION_TAGS[args.precision]


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit("--prompt-ids must be comma-separated integers") from None


def _text_prompt(args, codec) -> list[int]:
    # Instruct models expect their chat template; on by default when the tokenizer has one.
    chat = codec.chat_template is not None if args.chat is None else args.chat
    return codec.chat_prompt(args.prompt) if chat else codec.encode(args.prompt)


def _config(args) -> GenerationConfig:
    try:
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        raise SystemExit(f"specsplit-edge: {e}") from None
    if args.retry_window < 0:
        raise SystemExit("specsplit-edge: --retry-window must be >= 0")
    return GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        seed=args.seed,
        max_draft_tokens=args.max_draft_tokens,
        adaptive=False if args.fixed_k else None,
        session_mode=args.session_mode,
        verification=VERIFICATION[args.verification],
        retry_window_s=args.retry_window,
    )


def _draft_dir(args) -> Path | None:
    """The ONNX draft: needed to draft, and for its tokenizer when the prompt is text.

    Cloud-only drafts nothing: with token ids and no --draft it needs no draft (ids in, ids out);
    with a text prompt, the tokenizer of a draft already on disk (``cached_tokenizer_dir``: an
    export or the converted Hugging Face directory), else for a default draft the one its cached
    GGUF holds (``edge.gguf_tokenizer``); fetched and exported only where there is none.
    """
    if args.route == "cloud-only":
        if args.prompt is None and not args.draft:
            return None
        if args.prompt is not None:
            spec = args.draft or DEFAULT_DRAFT
            found = cached_tokenizer_dir(spec)
            if found is None and spec in SOURCES:
                found = gguf_tokenizer(SOURCES[spec])
            if found is not None:
                return found
    return ensure_draft_onnx(args.draft or DEFAULT_DRAFT, _tag(args))


def _codec(args, draft_dir: Path | None):
    """The draft's tokenizer for a text prompt (--prompt): text in, text out. Token ids in
    (--prompt-ids) are token ids out, on every route (--json's "text" is null): no tokenizer is
    loaded, since a split run loaded it (~0.25 s of one AMD EPYC core) before its request, on
    the core its draft's session was loading on, for output text the cloud-only run of the same
    command did not print."""
    if args.prompt is None:
        return None
    from specsplit.edge.text import TextCodec

    if draft_dir is not None and (draft_dir / "tokenizer.json").is_file():
        return TextCodec(draft_dir)
    raise ValueError(f"--prompt needs a tokenizer, and {draft_dir} has none: use --prompt-ids")


def _no_cloud(server: str, waited_s: float) -> str:
    return (
        f"no cloud answered at {server} within {waited_s:g} s. Start it with "
        "`specsplit-cloud serve` (it prints 'specsplit-cloud ready on HOST:PORT' once it listens; "
        "a first serve fetches and loads the target, which takes minutes), or point --server at "
        "the HOST:PORT it printed; a TLS gateway also needs --tls or --tls-ca; "
        "--retry-window SECONDS waits longer"
    )


# grpc.health.v1.Health/Check with an empty HealthCheckRequest (the whole server), as bytes: the
# edge extra has no grpc_health package, and the gateway answers it without a token.
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_TIMEOUT_S = 10.0


async def _wait_for_cloud(args, channel: grpc.aio.Channel) -> None:
    """An edge started before its cloud says at once what it waits for, then waits up to
    --retry-window for the gateway to answer (``specsplit-cloud serve`` opens its port only once
    the target is loaded), instead of failing later with a bare gRPC error. A TLS mismatch is
    no outage: it fails at once, with the flags to check (edge.retry.HANDSHAKE_HINT). It asks
    over the client's own ``channel``, whose connection the generation then finds open: its
    Start's round trip is the link's, not the link's plus the connection's handshake."""
    from specsplit.edge.retry import HANDSHAKE_HINT, refused_at_handshake

    check = channel.unary_unary(HEALTH_CHECK)  # bytes in, bytes out
    deadline, announced = time.monotonic() + args.retry_window, False
    while True:
        try:
            # a new connection's handshake and the call: two round trips, on a slow link seconds
            await check(b"", timeout=HEALTH_TIMEOUT_S)
            return
        except grpc.aio.AioRpcError as e:
            if e.code() not in (UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return  # something answered: the generation reports what it says
            if refused_at_handshake(e):
                raise SpecsplitError(e.code(), f"{e.details()} ({HANDSHAKE_HINT})") from None
        left = deadline - time.monotonic()
        if left <= 0:
            waited = args.retry_window
            raise SpecsplitError(UNAVAILABLE, _no_cloud(args.server, waited)) from None
        if not announced:
            announced = True
            print(
                f"specsplit-edge: waiting for `specsplit-cloud serve` at {args.server} (up "
                f"to {args.retry_window:g} s, --retry-window): check that serve runs and has "
                "printed 'ready', and that --server names its HOST:PORT",
                file=sys.stderr,
                flush=True,
            )
        await asyncio.sleep(min(1.0, left))


async def _generate(args) -> int:
    config = _config(args)  # bad arguments fail before any model is fetched or loaded
    ids = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    draft_dir = _draft_dir(args)
    drafter = None
    if args.route != "cloud-only":
        from specsplit.edge.onnx_drafter import OnnxDrafter

        # Its session loads while the tokenizer loads, the cloud answers and prefills: the
        # first block waits for it, and a cloud that leads meanwhile steps without it.
        drafter = OnnxDrafter(
            draft_dir, threads=args.threads, provider=args.provider, background=True
        )
    codec = _codec(args, draft_dir)
    prompt = ids if ids is not None else _text_prompt(args, codec)
    server = None if args.route == "edge-only" else args.server
    # What the last invocation learnt of this server's link (edge.link_memory): a second
    # invocation starts as the first ended, cloud-led where the link is slow.
    link = None if server is None else load_link(server)
    async with SplitClient(  # checks the token's transport before any wait
        server,
        drafter,
        tls=args.tls,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        token=args.token,
        insecure=args.insecure,
        link=link,
    ) as client:
        if server is not None:
            await _wait_for_cloud(args, client.channel)
        gen = client.generate(prompt, config, route=args.route)
        stream = codec.stream() if codec and not args.json else None
        async for chunk in gen:
            if args.json:
                continue
            sys.stdout.write(stream.push(chunk) if stream else "".join(f"{t} " for t in chunk))
            sys.stdout.flush()
    if server is not None and client.link is not None:
        save_link(server, client.link)
    s = gen.stats
    if args.json:
        out = {"text": codec.decode(gen.token_ids) if codec else None, "token_ids": gen.token_ids}
        out.update(s.summary())
        print(json.dumps(out))
    else:
        print(
            f"\n[{s.route}] {s.new_tokens} tokens in {s.wall_s:.2f}s ({s.tokens_per_s:.1f} tok/s), "
            f"acceptance {s.acceptance_rate:.2f}, {s.tokens_per_round:.2f} tokens/round, "
            f"finish {s.finish}",
            file=sys.stderr,
        )
    return 0


def _serve(args) -> int:
    if args.concurrency < 1 or args.max_draft_tokens < 0 or args.retry_window < 0:
        raise SystemExit(
            "specsplit-edge: --concurrency must be >= 1, --max-draft-tokens and --retry-window >= 0"
        )
    if args.max_waiting < 0 or args.max_body_bytes < 1 or not args.send_timeout > 0:
        raise SystemExit(
            "specsplit-edge: --max-waiting must be >= 0, --max-body-bytes >= 1, --send-timeout > 0"
        )
    from specsplit.edge.openai.app import ServeConfig
    from specsplit.edge.openai.serve import check_exposure, run_server

    check_exposure(args.host, args.api_key)  # before a draft is fetched or exported
    if args.route == "split":  # a provider this runtime lacks fails now, not at the first request
        from specsplit.edge.onnx_drafter import choose_provider

        choose_provider(args.provider)

    tls = dict(tls=args.tls, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key)
    cfg = ServeConfig(
        server=args.server,
        draft_dir=ensure_draft_onnx(args.draft or DEFAULT_DRAFT, _tag(args)),
        model_name=args.served_model_name or args.target_name or "specsplit",
        route=args.route,
        concurrency=args.concurrency,
        generation=GenerationConfig(
            max_draft_tokens=args.max_draft_tokens,
            model=args.target_name,
            retry_window_s=args.retry_window,
        ),
        threads=args.threads,
        client=dict(token=args.token, insecure=args.insecure, **tls),
        api_key=args.api_key or None,
        allowed_hosts=tuple(args.allowed_host or ()),
        provider=args.provider,
        max_body_bytes=args.max_body_bytes,
        max_waiting=args.max_waiting,
        send_timeout_s=args.send_timeout,
    )
    return run_server(cfg, args.host, args.port, verbose=args.verbose)


def _info(args) -> int:
    """What the edge runs on here: the runtime, its providers, the one chosen, the draft's speed."""
    from specsplit.edge.onnx_drafter import (
        PROVIDERS,
        OnnxDrafter,
        available_providers,
        ms_per_token,
        runtime_distribution,
    )

    if args.steps < 1:
        raise SystemExit("specsplit-edge: --steps must be >= 1")
    draft_dir = ensure_draft_onnx(args.draft or DEFAULT_DRAFT, _tag(args))
    drafter = OnnxDrafter(draft_dir, threads=args.threads, provider=args.provider)
    ms = ms_per_token(drafter, args.steps)
    threads = (
        f"{drafter.threads} (intra-op)"
        if drafter.threads
        else f"ONNX Runtime's default, one per physical core ({os.cpu_count()} logical CPUs)"
    )
    fallback = ""
    if drafter.provider != PROVIDERS[drafter.chosen]:  # CUDA offered, its libraries absent
        fallback = f"; {drafter.chosen} could not start here"
    rows = [
        ("runtime", runtime_distribution()),
        ("offered", ", ".join(available_providers())),
        ("provider", f"{drafter.provider} (asked: {args.provider}{fallback})"),
        ("threads", threads),
        ("draft", f"{draft_dir} ({PRECISION_NAMES.get(drafter.precision, drafter.precision)})"),
        ("ms/token", f"{ms:.2f} (median of {args.steps} single-token steps)"),
    ]
    for name, value in rows:
        print(f"{name:<10} {value}")
    return 0


def _add_provider_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--provider",
        default="auto",
        help="ONNX Runtime execution provider for the draft: auto (the device's accelerator "
        "this runtime offers: cuda, coreml, directml, webgpu, else cpu), or one of those "
        "(default auto; `specsplit-edge info` shows what is offered)",
    )


def _pull(args) -> int:
    print(ensure_draft_onnx(args.draft, _tag(args), progress=True))
    return 0


def _export(args) -> int:
    from specsplit.edge.export.exporter import export_onnx

    if args.draft is None:
        raise SystemExit("specsplit-edge export: --draft DIR (the Hugging Face model) is required")
    out = export_onnx(
        Path(args.draft),
        Path(args.out),
        precision=_tag(args),
        progress=True,
        head_vocab=args.head_vocab,
    )
    print(out)
    return 0


def _add_draft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft",
        help="ONNX export dir, Hugging Face model dir (exported on first use), or a default "
        f"model name (default: {DEFAULT_DRAFT}, fetched and exported once, cached)",
    )
    _add_precision_arg(p, "precision when the draft has to be exported")


def _add_precision_arg(p: argparse.ArgumentParser, help: str, prog: str = "specsplit-edge") -> None:
    """--precision with its names, the old tags as warned aliases (bench/ adds it too, as
    ``prog``)."""
    p.add_argument(
        "--precision",
        type=renamed_values(prog, "--precision", _OLD_PRECISIONS),
        choices=tuple(PRECISION_TAGS),
        default=PRECISION_NAMES[DEFAULT_PRECISION],
        help=f"{help}: int8 or int4 weights (MatMulNBits) with float32 activations, float32, or "
        "for GPU providers float16 and int4-float16",
    )


def _add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default="127.0.0.1:50051", help="gateway HOST:PORT")
    p.add_argument("--tls", action="store_true", help="connect with TLS (the system's CA roots)")
    p.add_argument("--tls-ca", help="PEM CA of the server's certificate (implies --tls)")
    p.add_argument("--tls-cert", help="PEM client certificate, for a server that requires mTLS")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument(
        "--token",
        default=os.environ.get("SPECSPLIT_TOKEN"),
        help="bearer token for the gateway (default: $SPECSPLIT_TOKEN)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="send --token without TLS to a server off this host (anyone on the path can read it)",
    )


def _add_serve_parser(sub) -> None:
    s = sub.add_parser(
        "serve",
        help="serve the OpenAI API (chat, completions) over the split",
        formatter_class=HelpFormatter,
    )
    s.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="HTTP port (0 = any free port)")
    _add_connection_args(s)
    _add_draft_args(s)
    s.add_argument(
        "--route",
        choices=SERVE_ROUTES,
        default="split",
        help="split: the draft here, the target verifies; cloud-only: the target alone",
    )
    deprecated_alias(s, "--mode", "--route", choices=SERVE_ROUTES)
    s.add_argument(
        "--concurrency",
        type=int,
        default=4,
        help="generations at once, each with its own drafter (its own KV cache on one ONNX "
        "Runtime session, loaded by the first request); more requests wait (default 4)",
    )
    s.add_argument(
        "--max-waiting",
        type=int,
        default=MAX_WAITING,
        help="requests that may wait for one of the --concurrency slots; one more at once is "
        f"answered 429 with Retry-After (default {MAX_WAITING})",
    )
    s.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help=f"largest request body; larger ones are answered 413 (default {MAX_BODY_BYTES})",
    )
    s.add_argument(
        "--send-timeout",
        type=float,
        default=60.0,
        help="seconds a streamed response may wait for its client to read before it is ended "
        "and its slot freed (default 60)",
    )
    s.add_argument(
        "--max-draft-tokens",
        type=int,
        default=DEFAULT_MAX_DRAFT_TOKENS,
        help="the largest k (tokens drafted per round); k adapts per round "
        f"(default {DEFAULT_MAX_DRAFT_TOKENS})",
    )
    deprecated_alias(s, "--draft-tokens", "--max-draft-tokens", type=int)
    s.add_argument(
        "--target-name",
        default="",
        help="the target's name at the cloud, as its serve --target-name (default: its own)",
    )
    deprecated_alias(s, "--model", "--target-name")
    s.add_argument(
        "--served-model-name",
        help="the model id /v1/models lists (default: --target-name, else specsplit)",
    )
    deprecated_alias(s, "--model-name", "--served-model-name")
    s.add_argument(
        "--retry-window",
        type=float,
        default=DEFAULT_WINDOW_S,
        help="seconds to keep re-opening after UNAVAILABLE, or a busy cloud's RESOURCE_EXHAUSTED "
        f"with a retry hint, before answering 503 or 429 (default {DEFAULT_WINDOW_S:.0f})",
    )
    s.add_argument(
        "--threads",
        type=int,
        help="ONNX Runtime intra-op threads, shared by the drafters (default: one per CPU this "
        "process may use where its affinity or cgroup quota allows fewer than the machine's, "
        "else ONNX Runtime's: one per physical core)",
    )
    _add_provider_arg(s)
    s.add_argument(
        "--api-key",
        default=os.environ.get("SPECSPLIT_API_KEY"),
        help="require this key as the OpenAI API key on /v1 (default $SPECSPLIT_API_KEY); "
        "required when --host is not a loopback address",
    )
    s.add_argument(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="a Host name to answer besides localhost, IP addresses and this machine's name "
        "(repeatable; '*' answers any: only behind a proxy that checks Host). Others get 403: "
        "a defence against DNS rebinding",
    )
    s.add_argument("-v", "--verbose", action="store_true", help="log each request")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specsplit-edge", description=__doc__, formatter_class=HelpFormatter
    )
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser(
        "generate",
        help="generate text (split, cloud-only or edge-only)",
        formatter_class=HelpFormatter,
    )
    _add_connection_args(g)
    _add_draft_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenised with the draft's tokenizer)")
    src.add_argument(
        "--prompt-ids",
        help="prompt token ids, comma-separated; the output is token ids too (no tokenizer "
        "loaded; --json's text is null)",
    )
    g.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        help="wrap --prompt in the model's chat template (default: on when the model has one)",
    )
    g.add_argument(
        "--max-new-tokens", type=int, default=128, help="at most this many tokens are generated"
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 is off")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest; 0 is off")
    g.add_argument(
        "--seed",
        type=int,
        help="sampling seed (default: a fresh random one per request; --json reports it)",
    )
    g.add_argument(
        "--max-draft-tokens",
        type=int,
        default=DEFAULT_MAX_DRAFT_TOKENS,
        help="the largest k (tokens drafted per round); k adapts per round unless --fixed-k "
        f"(default {DEFAULT_MAX_DRAFT_TOKENS})",
    )
    deprecated_alias(g, "--draft-tokens", "--max-draft-tokens", type=int)
    g.add_argument(
        "--fixed-k", action="store_true", help="draft exactly --max-draft-tokens per round"
    )
    g.add_argument(
        "--session-mode",
        choices=SESSION_MODES,
        default=AUTO,
        help="with --route split, how its rounds run: lock-step rounds, "
        "cloud-led (the cloud never waits for drafts), or auto: cloud-led from the start "
        "where nothing is remembered of the server's link or it says so, else lock-step until "
        "its measurements say cloud-led is faster",
    )
    g.add_argument(
        "--verification",
        choices=tuple(VERIFICATION),
        default="auto",
        help="how the cloud accepts drafts: rejection sampling, or token-only (the draft's "
        "tokens without q); auto: greedy at temperature 0, else rejection",
    )
    g.add_argument(
        "--route",
        choices=ROUTES,
        default="split",
        help="which models generate: split: draft here, verify in the cloud (its rounds: "
        "--session-mode); cloud-only: the target alone (the baseline); edge-only: the draft "
        "alone, no cloud",
    )
    deprecated_alias(g, "--mode", "--route", choices=ROUTES)
    g.add_argument(
        "--retry-window",
        type=float,
        default=DEFAULT_WINDOW_S,
        help="seconds to keep re-opening after UNAVAILABLE, or a busy cloud's RESOURCE_EXHAUSTED "
        f"with a retry hint, per outage (default {DEFAULT_WINDOW_S:.0f}; 0 = never retry)",
    )
    g.add_argument(
        "--threads",
        type=int,
        help="ONNX Runtime intra-op threads (default: one per CPU this process may use where "
        "its affinity or cgroup quota allows fewer than the machine's, else ONNX Runtime's: one "
        "per physical core)",
    )
    _add_provider_arg(g)
    g.add_argument("--json", action="store_true", help="print one JSON object at the end")
    _add_serve_parser(sub)
    i = sub.add_parser(
        "info",
        help="the execution provider, threads and the draft's ms/token",
        formatter_class=HelpFormatter,
    )
    _add_draft_args(i)
    _add_provider_arg(i)
    i.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: ORT's)")
    i.add_argument("--steps", type=int, default=32, help="single-token steps timed")
    p = sub.add_parser(
        "pull",
        help="fetch and export the draft ahead of time (with progress)",
        formatter_class=HelpFormatter,
    )
    _add_draft_args(p)
    p.set_defaults(draft=DEFAULT_DRAFT)
    e = sub.add_parser(
        "export",
        help="Hugging Face causal LM -> ONNX draft with a KV cache",
        formatter_class=HelpFormatter,
    )
    e.add_argument("--draft", help="the draft's Hugging Face model directory (required)")
    deprecated_alias(e, "--model", "--draft")
    e.add_argument("--out", required=True, help="output directory")
    _add_precision_arg(e, "weight format of the export")
    e.add_argument(
        "--head-vocab",
        type=int,
        default=None,
        metavar="N",
        help="split the LM head after the N most frequent token ids (the shipped Qwen2.5 "
        "table; the N lowest ids for other tokenizers) + EOS and added tokens: a step reads "
        "those rows alone until the text holds another id, then all of them; 0: one head "
        f"(default {DEFAULT_HEAD_VOCAB} where the table ranks the tokenizer, else 0)",
    )
    return parser


def _hint(e: SpecsplitError, args) -> str:
    """What to check when the cloud went away mid-generation (its own message names nothing)."""
    if e.code != UNAVAILABLE or "--server" in e.details:
        return ""
    return (
        f" (the cloud at {args.server}, --server, stopped answering for --retry-window "
        f"{args.retry_window:g} s: is `specsplit-cloud serve` still running there?)"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "export":
            return _export(args)
        if args.command == "pull":
            return _pull(args)
        if args.command == "info":
            return _info(args)
        if args.command == "serve":
            return _serve(args)
        if args.max_new_tokens < 1 or args.max_draft_tokens < 0:
            raise SystemExit(
                "specsplit-edge: --max-new-tokens must be >= 1, --max-draft-tokens >= 0"
            )
        return asyncio.run(_generate(args))
    except SpecsplitError as e:
        print(f"specsplit-edge: {e}{_hint(e, args)}", file=sys.stderr)
        return 2
    except (SourceError, OSError, ValueError, ImportError) as e:
        # A download, disk or missing-extra error: the message says what to do, no traceback.
        print(f"specsplit-edge: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
