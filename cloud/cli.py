"""specsplit-cloud: serve the target model (Triton + gateway); pull it and build the CPU kernels
ahead of time."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import faulthandler
import ipaddress
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path

# Only what parsing needs is imported here, so `specsplit-cloud --help` works on an install
# without the cloud extra; serve() imports the gateway (tritonclient, prometheus_client).
from specsplit.cloud.gateway.admission import RECLAIM_AFTER_S, Admission
from specsplit.cloud.gateway.security import Security, load_tokens
from specsplit.cloud.gateway.stream_policy import StreamPolicy
from specsplit.cloud.kv_growth import KV_PER_CLIENT_SHARE, KVShape, default_budget_bytes
from specsplit.cloud.supervision.triton import TritonError, TritonServer
from specsplit.shared.build_steps import install_hint
from specsplit.shared.cli_help import HelpFormatter, add_version, deprecated_alias
from specsplit.shared.weights.sources import (
    SOURCES,
    TARGET_DEFAULT,
    SourceError,
    resolve_model,
)

log = logging.getLogger("specsplit.cloud")
DEFAULT_TARGET = TARGET_DEFAULT.name


def resolve_target(spec: str) -> Path:
    """--target as a model directory: a Hugging Face directory or a default name as
    ``resolve_model`` takes them, or a GGUF file converted once in the cache
    (``shared.weights.local_gguf``); anything else is refused with what it takes."""
    from specsplit.shared.weights import local_gguf

    path = Path(spec).expanduser()
    if (path / "config.json").is_file() or spec in SOURCES:
        return resolve_model(spec)
    if local_gguf.looks_like_gguf(spec) or path.is_dir():
        return local_gguf.resolve_gguf(path)  # a precise error for a directory or non-GGUF
    raise ValueError(f"unknown target {spec!r}: {local_gguf.TAKES} (one of {sorted(SOURCES)})")


async def _start_tritons(servers: list[TritonServer], stop: asyncio.Event) -> bool:
    """Starts every server unless a stop signal comes first; False when interrupted."""
    starting = asyncio.gather(*(asyncio.to_thread(s.start) for s in servers))
    stopping = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if starting in done:
        stopping.cancel()
        starting.result()  # raises TritonError with the log tail
        return True
    for server in servers:  # kills the half-started servers; their start threads then fail
        server.stop()
    with contextlib.suppress(Exception):
        await starting
    return False


def _core_sets(n: int) -> list[set[int] | None]:
    """Splits this process's cores among ``n`` replicas; no pinning when there are too few."""
    cores = sorted(os.sched_getaffinity(0))
    if n == 1 or len(cores) < n:
        return [None] * n
    per = len(cores) // n
    return [set(cores[i * per : (i + 1) * per]) for i in range(n)]


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on ``port``, from /proc/net/tcp{,6} (Linux; empty elsewhere)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                # local_address is HEXADDR:HEXPORT; state 0A is LISTEN; field 9 is the inode
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    return inodes


def _port_holder(port: int) -> str | None:
    """``pid N (command)`` of a process listening on ``port``, where /proc lets us see it."""
    inodes = {f"socket:[{i}]" for i in _listening_inodes(port)}
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # gone, or another user's: not cheaply known
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
                command = " ".join(argv.decode(errors="replace").split())  # one line
                command = command if len(command) <= 80 else command[:79] + "…"
                return f"pid {proc.name} ({command or (proc / 'comm').read_text().strip()})"
    return None


def _port_in_use(host: str, port: int) -> bool:
    """Whether another socket listens on ``host:port``, tried with a bind as the gateway's
    (SO_REUSEADDR, like gRPC's and http.server's listeners: a stopped serve's TIME_WAIT is no
    conflict). Only EADDRINUSE counts: other bind errors are the server's own to report."""
    if port == 0:
        return False
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
    return False


def _port_conflict(args: argparse.Namespace) -> str | None:
    """The message for the first port serve would bind that is taken, or None: checked before
    the target loads, which takes minutes on a first serve (issue 41)."""
    ports = [(args.host, args.port, "--port")]
    if args.metrics_port is not None:
        ports.append((args.metrics_host or "127.0.0.1", args.metrics_port, "--metrics-port"))
    for host, port, flag in ports:
        if _port_in_use(host, port):
            holder = _port_holder(port)
            by = f" by {holder}" if holder else ""
            return (
                f"port {port} on {host} is in use{by}: stop that process or choose another "
                f"{flag} (0 = any free port)"
            )
    return None


def _security(args: argparse.Namespace) -> Security:
    security = Security(
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        tokens=load_tokens(args.auth_tokens) if args.auth_tokens else None,
    )
    if _loopback(args.host):
        return security
    if security.tokens is None and not args.insecure:
        raise ValueError(
            f"--host {args.host} without --auth-tokens: anyone who reaches the port could "
            "generate; give --auth-tokens FILE, or --insecure to serve it open anyway"
        )
    if security.tls_cert is None:
        log.warning("serving %s without TLS: use --tls-cert/--tls-key on a public port", args.host)
    return security


def _loopback(host: str) -> bool:
    """Whether ``host`` binds this host's own interface only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _stream_policy(args: argparse.Namespace) -> StreamPolicy:
    return StreamPolicy(
        start_timeout_s=args.start_deadline,
        idle_timeout_s=args.idle_timeout,
        max_message_bytes=args.max_message_bytes,
        max_streams_per_connection=(
            2 * args.max_sessions
            if args.streams_per_connection is None
            else args.streams_per_connection
        ),
    )


def _start_metrics(args: argparse.Namespace, registry):
    if args.metrics_port is None:
        return None
    from specsplit.cloud.gateway.metrics import serve_metrics

    # Not --host: the metrics name every replica's URL, and a public gateway's scrapers are
    # told where to look (--metrics-host) rather than finding the port open by default.
    host = args.metrics_host or "127.0.0.1"
    server = serve_metrics(registry, host, args.metrics_port)
    print(f"metrics on http://{host}:{server.server_port}/metrics", flush=True)
    return server


def _admission(args: argparse.Namespace, target: Path) -> Admission:
    # Until a target reports its own (Admission.observe_kv): the quantised kernels keep float32
    # KV, the float path its --dtype; auto counts float32, the largest the target may choose.
    kv = KVShape.from_dir(
        target, "float32" if args.weights in ("int8", "int4", "gguf") else args.dtype
    )
    if args.kv_budget_mib is not None and args.kv_budget_mib <= 0:
        raise ValueError("--kv-budget-mib must be > 0")
    if args.kv_budget_mib is not None:
        budget = int(args.kv_budget_mib * 2**20)
    else:
        # Targets elsewhere (--triton-url) report their KV capacity with every start, and the
        # gateways sharing them admit against it (Admission.limit_bytes): this host's memory
        # says nothing of theirs. Targets serve starts on this host: half its memory, as theirs.
        budget = None if args.triton_url else default_budget_bytes()
    if budget is None:
        log.info("KV budget: the capacity the targets report, shared with their other gateways")
    else:
        log.info(
            "KV budget %.0f MiB, counted at %d bytes a position until the target reports its own",
            budget / 2**20,
            kv.bytes_per_token,
        )
    if args.reclaim_idle_after < 0:
        raise ValueError("--reclaim-idle-after must be >= 0")
    kv_per_client, kv_per_client_share = _kv_per_client(args, budget)
    return Admission(
        kv,
        budget,
        per_client=_per_client(args),
        max_sessions=args.max_sessions,
        reclaim_after_s=args.reclaim_idle_after,
        kv_per_client=kv_per_client,
        kv_per_client_share=kv_per_client_share,
    )


def _kv_per_client(args: argparse.Namespace, budget: int | None) -> tuple[int | None, float | None]:
    """The per-client KV quota: (bytes, None) from the flag, 0 off; by default a quarter of the
    budget, or without one (None, a quarter) of the capacity the targets report."""
    if args.kv_per_client_mib is None:
        if budget is None:
            return None, KV_PER_CLIENT_SHARE
        return max(1, int(budget * KV_PER_CLIENT_SHARE)), None
    if args.kv_per_client_mib < 0:
        raise ValueError("--kv-per-client-mib must be >= 0")
    return int(args.kv_per_client_mib * 2**20) or None, None


def _target_kv_share(args: argparse.Namespace, budget: int | None) -> float | None:
    """The share of its KV capacity one client may hold on the targets serve starts: with
    --kv-per-client-mib, the gateway's quota as a share of its budget (0: off, as the gateway's);
    else None, the target's default, a quarter like the gateway's (docs/operations.md, "What one
    client may hold")."""
    if args.kv_per_client_mib is None or not budget:
        return None
    return min(1.0, args.kv_per_client_mib * 2**20 / budget)


def _per_client(args: argparse.Namespace) -> int | None:
    """The per-client quota: the flag's value, 0 off; by default a quarter of the places, so
    one client (token or address) can hold no more than that, however many streams it opens."""
    if args.sessions_per_client is None:
        return max(1, args.max_sessions // 4)
    if args.sessions_per_client < 0:
        raise ValueError("--sessions-per-client (was --sessions-per-token) must be >= 0")
    return args.sessions_per_client or None


# What the target reports at load about its weights (cloud.engine.precision, kernel_library,
# target), read back from its tritonserver's log: the format chosen, the calibration behind it,
# why the kernels were missing.
_REPORTED = re.compile(
    r" specsplit\.cloud\.engine\.(?:precision|kernel_library|target) (?:INFO|WARNING) "
    r"((?:target weights by calibration|CPU kernels unavailable|target \S+ on ).*)$"
)


def target_report(log_text: str) -> list[str]:
    """The target's report of its weights' format and why, from a tritonserver log."""
    found = (_REPORTED.search(line) for line in log_text.splitlines())
    return [m.group(1) for m in found if m]


def _print_target_report(servers: list[TritonServer], args: argparse.Namespace) -> None:
    asked = (
        f"--weights {args.weights} asked for it (or $SPECSPLIT_TARGET_WEIGHTS)"
        if args.weights != "auto"
        else f"--dtype {args.dtype} asks for the float path"
    )
    for s in servers:
        try:
            lines = target_report(s.log_path.read_text(errors="replace"))
        except OSError:
            lines = []
        if args.weights != "auto" or args.dtype != "auto":
            lines.append(f"({asked})")
        for line in lines or ["(no report in its log)"]:
            print(f"target {s.url}: {line}", file=sys.stderr, flush=True)


async def serve(args: argparse.Namespace) -> int:
    from specsplit.cloud.gateway.replicas import parse_urls
    from specsplit.cloud.gateway.service import ModelIdentity, start_gateway
    from specsplit.cloud.supervision.supervisor import TritonSupervisor

    security, policy = _security(args), _stream_policy(args)  # bad flags fail before Triton starts
    if args.replicas < 1:
        raise ValueError("--replicas must be >= 1")
    if args.failover_wait <= 0:
        raise ValueError("--failover-wait must be > 0")
    if args.triton_url:
        parse_urls(args.triton_url)
    if not 0 <= args.port < 65536:
        raise ValueError("--port must be in [0, 65535]")
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        raise ValueError("--metrics-port must be in [0, 65535]")
    conflict = _port_conflict(args)
    if conflict is not None:
        print(f"specsplit-cloud: {conflict}", file=sys.stderr)
        return 2
    target = resolve_target(args.target)  # fetched or converted on first use
    identity = ModelIdentity.from_dir(target, name=args.target_name)
    admission = _admission(args, target)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    servers: list[TritonServer] = []
    supervisors: list[asyncio.Task] = []
    metrics = None
    try:
        if args.triton_url:
            urls = parse_urls(args.triton_url)
        else:
            print(
                f"starting {args.replicas} Triton replica(s) with target {target} ...",
                file=sys.stderr,
                flush=True,
            )
            servers = [
                TritonServer(
                    target,
                    threads=args.threads,
                    dtype=args.dtype,
                    weights=args.weights,
                    startup_timeout_s=args.startup_timeout,
                    cpus=cpus,
                    log_dir=args.triton_log_dir,
                    kv_per_client_share=_target_kv_share(args, admission.budget_bytes),
                )
                for cpus in _core_sets(args.replicas)
            ]
            if not await _start_tritons(servers, stop):
                return 130
            urls = [s.url for s in servers]
            _print_target_report(servers, args)
            for s in servers:
                print(f"triton {s.url} metrics on {s.metrics_url}", file=sys.stderr, flush=True)
            supervisors = [asyncio.create_task(TritonSupervisor(s).run()) for s in servers]
        server, port, service = await start_gateway(
            urls,
            identity,
            args.host,
            args.port,
            policy=policy,
            security=security,
            failover_wait_s=args.failover_wait,
            admission=admission,
        )
        metrics = _start_metrics(args, service.metrics.registry)
        print(
            f"specsplit-cloud ready on {args.host}:{port} "
            f"(model {identity.name}, triton {','.join(urls)})",
            flush=True,
        )
        await stop.wait()
        print("stopping ...", file=sys.stderr, flush=True)
        await server.stop(grace=2.0)
        await service.close()
    finally:
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
        for task in supervisors:  # before the servers stop: no restart of what we stop
            task.cancel()
        await asyncio.gather(*supervisors, return_exceptions=True)
        await asyncio.gather(*(asyncio.to_thread(s.stop) for s in servers))
    return 0


def kernels(args: argparse.Namespace) -> int:
    """Builds the CPU kernels if they are not built, and reports them (``kernel_probe``)."""
    if args.threads is not None and args.threads < 1:
        raise ValueError("--threads must be >= 1")
    import torch

    from specsplit.cloud.engine import kernel_probe
    from specsplit.cloud.engine.kernel_library import SLOW_FALLBACK, KernelsUnavailable

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        r = kernel_probe.run()
    except KernelsUnavailable as e:
        print(f"specsplit-cloud kernels: unavailable: {e}\n({SLOW_FALLBACK})", file=sys.stderr)
        return 1
    built = "built already" if r.built_s is None else f"built now in {r.built_s:.1f} s"
    flags = " ".join(r.features) or "unknown (no /proc/cpuinfo)"
    print(f"library   {r.library} ({built})")
    print(f"compiler  {r.compiler}")
    print(f"cpu       {r.cpu}: {flags}")
    print(f"backend   {r.backend} (this CPU runs: {', '.join(r.backends)})")
    print(
        f"gemm      one row x int4 {kernel_probe.PROBE_N} x {kernel_probe.PROBE_K}: "
        f"{r.gemm_bytes / 1e6:.0f} MB in {r.gemm_s * 1e3:.2f} ms = "
        f"{r.bytes_per_s / 1e9:.1f} GB/s on {r.threads} thread(s)"
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specsplit-cloud", description=__doc__, formatter_class=HelpFormatter
    )
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    target_help = (
        "Hugging Face model dir, a GGUF file (converted once, its blocks served as they are where "
        "--weights chooses gguf) or a default model name "
        f"(default: {DEFAULT_TARGET}, fetched and converted on first use, cached)"
    )
    s = sub.add_parser(
        "serve",
        help="start Triton with the target model and the gRPC gateway",
        formatter_class=HelpFormatter,
    )
    s.add_argument("--target", default=DEFAULT_TARGET, help=target_help)
    s.add_argument(
        "--host", default="127.0.0.1", help="gateway address; 0.0.0.0 listens on every interface"
    )
    s.add_argument("--port", type=int, default=50051, help="gateway port (0 = any free port)")
    s.add_argument(
        "--triton-url",
        help="use running Triton replicas (host:port[,host:port...]) instead of starting them",
    )
    s.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="tritonservers to start and supervise, each on its own cores where cores allow",
    )
    s.add_argument(
        "--failover-wait",
        type=float,
        default=30.0,
        help="seconds a session waits for a Triton replica to come back before UNAVAILABLE",
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off; 0 = any port)",
    )
    s.add_argument(
        "--metrics-host", help="address the metrics port binds (default: 127.0.0.1, any --host)"
    )
    s.add_argument(
        "--target-name",
        help="the name clients give in Start.model (specsplit-edge serve --target-name) "
        "(default: the target directory's name)",
    )
    deprecated_alias(s, "--model-name", "--target-name")
    s.add_argument(
        "--threads", type=int, help="torch threads for the target (default: torch's choice)"
    )
    s.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="float dtype of the target's float path (auto: float32 on CPU and GPU; "
        "any other value means --weights float)",
    )
    s.add_argument(
        "--weights",
        # cloud.engine.precision.WEIGHTS, spelt out: the CLI imports no torch
        choices=("auto", "float", "gguf", "int8", "int4"),
        default=os.environ.get("SPECSPLIT_TARGET_WEIGHTS", "auto"),
        help="how the target's weights are served: float (torch, --dtype); on our batch-invariant "
        "CPU kernels: gguf (a GGUF source's own blocks, each tensor at the file's width: Q4_K, "
        "Q6_K, Q8_0, ...), int8 or int4 (quantised from the float copy; int4 keeps a 4-bit "
        "source's 4-bit tensors, others int8); auto: float on GPU, on CPU the fastest by a "
        "calibration at load, gguf being the quantised candidate where the target has a GGUF "
        "source (default: $SPECSPLIT_TARGET_WEIGHTS or auto)",
    )
    s.add_argument("--max-sessions", type=int, default=64, help="concurrent streams (default 64)")
    s.add_argument(
        "--sessions-per-client",
        type=int,
        help="concurrent streams one bearer token may hold (without --auth-tokens: one client "
        "address; loopback clients are not counted); 0: no quota (default: a quarter of "
        "--max-sessions)",
    )
    deprecated_alias(s, "--sessions-per-token", "--sessions-per-client", type=int)
    s.add_argument(
        "--kv-budget-mib",
        type=float,
        help="KV memory this gateway's admitted sessions may reserve; each reserves the KV slot "
        "it holds, growing as it generates. The targets' reported KV capacity, less what other "
        "gateways hold there, caps it in any case (default: with --triton-url that alone; else "
        "half of this host's available memory)",
    )
    s.add_argument(
        "--kv-per-client-mib",
        type=float,
        help="KV memory one client's sessions may reserve together (clients as "
        "--sessions-per-client counts them); 0: no quota (default: a quarter of the KV budget, "
        "or without one of the capacity the targets report)",
    )
    s.add_argument(
        "--start-deadline",
        type=float,
        default=10.0,
        help="seconds a new stream may take to send its Start (default 10)",
    )
    s.add_argument(
        "--idle-timeout",
        type=float,
        default=60.0,
        help="seconds a split stream may stay silent between rounds (default 60)",
    )
    s.add_argument(
        "--reclaim-idle-after",
        type=float,
        default=RECLAIM_AFTER_S,
        help="when the server is full (--max-sessions or the KV budget), end streams idle for "
        "longer than this many seconds to make room, the least recently active first; their "
        f"edges re-open from their committed sequence (default {RECLAIM_AFTER_S:g})",
    )
    s.add_argument(
        "--max-message-bytes",
        type=int,
        default=1 << 20,
        help="largest client message accepted (default 1 MiB)",
    )
    s.add_argument(
        "--streams-per-connection",
        type=int,
        help="streams one client connection may hold open; more wait in the client, never "
        "reaching admission (default: twice --max-sessions)",
    )
    s.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve TLS")
    s.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    s.add_argument(
        "--tls-client-ca", type=Path, help="PEM CA: require client certificates it signed (mTLS)"
    )
    s.add_argument(
        "--auth-tokens",
        type=Path,
        help="file of bearer tokens, one a line (# comments): calls must carry one",
    )
    s.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for each tritonserver to load the target (raise it for 7B/8B "
        "targets or a first quantisation)",
    )
    s.add_argument(
        "--triton-log-dir",
        type=Path,
        help="write each tritonserver's log here, kept after stop (default: a temporary dir)",
    )
    s.add_argument(
        "--insecure",
        action="store_true",
        help="serve a --host off this host without --auth-tokens (default: refused)",
    )
    s.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    p = sub.add_parser(
        "pull",
        help="fetch and convert the target ahead of time (with progress)",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help=target_help)
    k = sub.add_parser(
        "kernels",
        help="build the target's CPU kernels ahead of time (make setup and the Docker image do), "
        "print the backend, the CPU features seen and the bytes/second a gemm streams; exits "
        "non-zero where the kernels cannot run",
    )
    k.add_argument("--threads", type=int, help="threads for the gemm probe (default: torch's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # `kill -USR1 <pid>` prints every thread's stack to stderr: where a stuck server sits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "pull":
            print(resolve_target(args.target))
            return 0
        if args.command == "kernels":
            return kernels(args)
        return asyncio.run(serve(args))
    except ImportError as e:  # an install without the cloud extra
        hint = (
            ""
            if "pip install" in str(e)
            else f"; serve needs the cloud extra: {install_hint('cloud')}"
        )
        print(f"specsplit-cloud: {e}{hint}", file=sys.stderr)
        return 1
    except (TritonError, SourceError, OSError, ValueError) as e:
        print(f"specsplit-cloud: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
