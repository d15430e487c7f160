"""Starts and stops the tritonserver bundled in the nvidia-pytriton wheel (docs/design.md#triton).

The binary runs directly against our own model repository (no PyTriton proxy hop). Recipe:
copy the Python backend (libtriton_python.so, triton_python_backend_utils.py, the stub for this
Python version) into ``<work>/backends/python/``; put the running Python's LIBDIR and the wheel's
``nvidia_pytriton.libs`` on LD_LIBRARY_PATH (without the latter the stub fails to load and Triton
hangs in "loading" with no error), and this interpreter's ``bin/`` first on PATH (the stub starts
the ``python3`` it finds there).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from specsplit.shared.build_steps import install_hint

log = logging.getLogger(__name__)
_STARTING = threading.Lock()
_POLL_CHANNEL_ARGS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]
_POLL_TIMEOUT_S = 5.0

# Triton accepts a client's keepalive ping this often while no data flows: the gateway pings
# every 10 s (cloud/gateway/replicas.py) to find a dead replica fast. At Triton's default (one
# ping per 5 min, GOAWAY "Too many pings" at the third strike) a session's stream idle for 30 s
# was cut.
MIN_PING_INTERVAL_MS = 5_000
TRITON_KEEPALIVE_FLAGS = (
    f"--grpc-http2-min-recv-ping-interval-without-data={MIN_PING_INTERVAL_MS}",
    "--grpc-keepalive-permit-without-calls=1",
)

MODEL_REPOSITORY = Path(__file__).parents[1] / "model_repository"
MODEL_NAME = "target"


class TritonError(RuntimeError):
    """tritonserver could not be started or did not get ready."""


@dataclass(frozen=True)
class BundledTriton:
    binary: Path
    python_backend: Path  # dir with libtriton_python.so and triton_python_backend_utils.py
    stub: Path
    libs: Path  # nvidia_pytriton.libs

    @classmethod
    def find(cls) -> BundledTriton:
        try:
            import pytriton
        except ImportError as e:
            raise TritonError(f"nvidia-pytriton is not installed: {install_hint('cloud')}") from e
        root = Path(pytriton.__file__).parent / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        found = cls(
            binary=root / "bin" / "tritonserver",
            python_backend=root / "backends" / "python",
            stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
            libs=Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs",
        )
        for path in (found.binary, found.python_backend, found.stub, found.libs):
            if not path.exists():
                raise TritonError(f"bundled Triton incomplete: {path} missing")
        return found

    def prepare_backends(self, work_dir: Path) -> Path:
        backend = work_dir / "backends" / "python"
        backend.mkdir(parents=True, exist_ok=True)
        for src in (
            self.python_backend / "libtriton_python.so",
            self.python_backend / "triton_python_backend_utils.py",
            self.stub,
        ):
            _install(src, backend / src.name)
        return backend.parent

    def environment(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (libdir, str(self.libs), env.get("LD_LIBRARY_PATH", "")) if p
        )
        env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
        env.update(extra or {})
        return env


def _install(src: Path, dst: Path) -> None:
    """Copies ``src`` to ``dst`` through a rename. On a restart the crashed server's stub may
    still be exiting from ``dst``, and writing over an executable that runs fails (ETXTBSY)."""
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def stop_process_group(proc: subprocess.Popen, grace_s: float, signal_group: bool) -> int:
    """SIGINT (to the leader, or to its whole group), SIGKILL after ``grace_s``, then SIGKILL
    anything left in the group: nothing started under ``proc`` outlives it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            if signal_group:
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.warning("pid %d ignored SIGINT for %.0fs; killing its group", proc.pid, grace_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    _wait_group_gone(proc.pid, timeout_s=10.0)
    return proc.returncode


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    """Waits (bounded) until no process of group ``pgid`` is left: SIGKILL is delivered
    asynchronously, and an orphan that is still exiting holds its files and memory."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _group_alive(pgid):
            return
        time.sleep(0.02)
    log.warning("process group %d still has members %.0fs after SIGKILL", pgid, timeout_s)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies, which hold nothing, do not
    count: where no init reaps orphans they would never go)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    if not Path("/proc/self/stat").exists():
        return True  # no /proc: trust killpg
    return any(True for _ in _live_members(pgid))


def _running_in(stat: Path, pgid: int) -> bool:
    """Whether the process of ``/proc/<pid>/stat`` runs (not a zombie) in group ``pgid``."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False  # gone meanwhile
    return int(fields[2]) == pgid and fields[0] not in ("Z", "X")


def _live_members(pgid: int):
    """The pids of group ``pgid`` that run, from /proc."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        if _running_in(stat, pgid):
            yield int(stat.parent.name)


def stub_pids(pgid: int) -> set[int]:
    """The Python backend stubs running in tritonserver's process group."""
    stubs = set()
    for pid in _live_members(pgid):
        with contextlib.suppress(OSError):
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
            if argv0.endswith(b"triton_python_backend_stub"):
                stubs.add(pid)
    return stubs


def pinned(cmd: list[str], cpus) -> list[str]:
    """``cmd`` run on ``cpus`` (all cores when None). A tiny exec wrapper, not Popen's
    preexec_fn: that runs Python in the forked child, which can deadlock when the parent has
    threads (a grpc server's, the supervisor's), and Popen then never returns."""
    if not cpus:
        return cmd
    setup = (
        f"import os, sys; os.sched_setaffinity(0, {sorted(cpus)}); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    return [sys.executable, "-c", setup, *cmd]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonServer:
    """A tritonserver process serving ``target`` from our model repository.

    Use as a context manager; ``stop()`` is idempotent and leaves no process or /dev/shm region
    behind.
    """

    def __init__(
        self,
        target_dir: str | Path,
        grpc_port: int = 0,
        threads: int | None = None,
        dtype: str = "auto",
        startup_timeout_s: float = 180.0,
        weights: str | None = None,
        model_repository: Path = MODEL_REPOSITORY,
        log_verbose: int = 0,
        cpus: set[int] | None = None,
        log_dir: str | Path | None = None,
        kv_per_client_share: float | None = None,  # None: as inherited, else the model's default
    ):
        self.target_dir = Path(target_dir).resolve()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = free_port()  # Triton's own metrics, on localhost only
        while self.metrics_port == self.grpc_port:  # two free ports in a row may coincide
            self.metrics_port = free_port()
        self.threads = threads
        self.dtype = dtype
        self.weights = weights
        self.kv_per_client_share = kv_per_client_share
        self.startup_timeout_s = startup_timeout_s
        self.model_repository = model_repository
        self.log_verbose = log_verbose
        self.cpus = cpus  # pin the server (and its stub) to these cores
        self.proc: subprocess.Popen | None = None
        self._work = Path(tempfile.mkdtemp(prefix="specsplit-triton-"))
        # Kept after stop() when log_dir is given (the work dir is removed).
        self.log_path = Path(log_dir or self._work) / f"tritonserver-{self.grpc_port}.log"
        self._shm_prefix = f"specsplit{os.getpid()}x{self.grpc_port}_"
        # stop() may run while another thread (re)starts the server: after it, nothing starts.
        self._lock = threading.Lock()
        self._closed = False
        self._stubs: set[int] = set()  # the model's Python backend stubs, found once ready

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> TritonServer:
        # One server starts at a time in a process: Python backend stubs starting side by side
        # here failed to import now and then (2 of 5 concurrent pairs: an ImportError, undefined
        # symbol _PyModule_Add in _ssl; 0 of 8 pairs started one after the other).
        with _STARTING:
            return self._start()

    def _start(self) -> TritonServer:
        if self._closed:
            raise TritonError("tritonserver was stopped")
        bundled = BundledTriton.find()
        backends = bundled.prepare_backends(self._work)
        extra = {
            "SPECSPLIT_TARGET_DIR": str(self.target_dir),
            "SPECSPLIT_TARGET_DTYPE": self.dtype,
        }
        if self.weights:  # else the model reads SPECSPLIT_TARGET_WEIGHTS as inherited, or auto
            extra["SPECSPLIT_TARGET_WEIGHTS"] = self.weights
        if self.threads:
            extra["SPECSPLIT_TARGET_THREADS"] = str(self.threads)
        if self.kv_per_client_share is not None:
            extra["SPECSPLIT_KV_PER_CLIENT_SHARE"] = repr(self.kv_per_client_share)
        cmd = [
            str(bundled.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backends}",
            "--model-control-mode=explicit",
            f"--load-model={MODEL_NAME}",
            "--allow-gpu-metrics=false",
            "--allow-http=false",
            # Triton's own Prometheus metrics (queue and compute times, per model) for a scraper
            # on this host; the gateway's port is the public one.
            "--allow-metrics=true",
            "--metrics-address=127.0.0.1",
            f"--metrics-port={self.metrics_port}",
            f"--grpc-port={self.grpc_port}",
            "--grpc-address=127.0.0.1",
            *TRITON_KEEPALIVE_FLAGS,
            f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}",
            f"--log-verbose={self.log_verbose}",
            # We stop Triton after the gateway: nothing in flight is worth waiting 30 s for
            # (sequences a killed gateway left open would otherwise hold the exit that long).
            "--exit-timeout-secs=5",
        ]
        log.info("starting tritonserver on %s", self.url)
        # Appended: a restarted server's log follows the crashed one's.
        cpus = self.cpus
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock, open(self.log_path, "ab") as out:
            if self._closed:
                raise TritonError("tritonserver was stopped")
            # New session: SIGINT from a terminal reaches us, and we stop Triton ourselves.
            self.proc = subprocess.Popen(
                pinned(cmd, cpus),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=bundled.environment(extra),
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_ready(self) -> None:
        import tritonclient.grpc as grpcclient

        deadline = time.monotonic() + self.startup_timeout_s
        # Polled every 0.2 s while the port is still closed: with grpc's default reconnect
        # backoff (growing to two minutes) a server that became ready during a slow start was
        # seen only minutes later; a poll must never hang either.
        client = grpcclient.InferenceServerClient(self.url, channel_args=_POLL_CHANNEL_ARGS)
        try:
            while time.monotonic() < deadline:
                proc = self.proc
                if proc is None:
                    raise TritonError("tritonserver was stopped during startup")
                if proc.poll() is not None:
                    raise TritonError(
                        f"tritonserver exited with {proc.returncode}:\n{self.log_tail()}"
                    )
                with contextlib.suppress(Exception):
                    if client.is_model_ready(MODEL_NAME, client_timeout=_POLL_TIMEOUT_S):
                        log.info("tritonserver ready on %s", self.url)
                        self._stubs = stub_pids(proc.pid)
                        return
                time.sleep(0.2)
        finally:
            client.close()
        raise TritonError(
            f"model {MODEL_NAME!r} not ready after {self.startup_timeout_s:.0f}s:\n"
            f"{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def exited(self) -> bool:
        """True when the server process ended without ``stop()``: it crashed or was killed."""
        proc = self.proc
        return proc is not None and proc.poll() is not None

    @property
    def stub_lost(self) -> bool:
        """True when a Python backend stub that served the model died while tritonserver runs
        on: Triton answers every request with "Stub process ... is not healthy" and still calls
        the model ready, and never starts the stub again. Only a restart mends it."""
        proc = self.proc
        return proc is not None and not all(
            _running_in(Path(f"/proc/{pid}/stat"), proc.pid) for pid in self._stubs
        )

    def kill(self, grace_s: float = 15.0) -> None:
        """Stops the server and everything in its group (a crashed server's Python backend stub
        lives on as an orphan there), and removes its shared-memory regions. Restartable."""
        with self._lock:
            proc, self.proc = self.proc, None
            self._stubs = set()
        if proc is not None:
            stop_process_group(proc, grace_s, signal_group=True)
        for f in glob.glob(f"/dev/shm/{self._shm_prefix}*"):
            with contextlib.suppress(OSError):
                os.unlink(f)

    def restart(self) -> TritonServer:
        """Cleans up what a crash left and starts again on the same port (clients keep their
        URL). Raises TritonError when the new server does not get ready."""
        self.kill(grace_s=5.0)
        return self.start()

    def stop(self, grace_s: float = 15.0) -> None:
        with self._lock:
            self._closed = True
        self.kill(grace_s)
        shutil.rmtree(self._work, ignore_errors=True)

    def __enter__(self) -> TritonServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
