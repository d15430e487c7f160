"""The edge's draft model: ONNX Runtime over an ``edge.export.exporter`` directory, plus its KV
cache.

Contract: ``OnnxDrafter`` knows token ids, logits and the cache; nothing about tokenization,
sampling or the protocol. ``cached`` is the token prefix whose keys/values are in the cache.
``forward(tokens)`` runs one pass over ``tokens`` appended after ``cached`` and returns the logits
after the last of them, [1, vocab] (the graph's LM head runs on that position only: a prompt's
other positions would cost [len, vocab] floats, 1.2 GB at 2,048 tokens); with ``all_logits``
every token's, [len(tokens), vocab] (teacher-forced scoring). ``truncate(n)`` rolls the
cache back to ``cached[:n]`` without recomputing or copying anything (only the cache's length
moves), and is exact: ``truncate(n)`` then ``forward(x)`` gives the logits of a fresh run over
``cached[:n] + x``.

The cache lives in place (``edge.export.onnx_graph``'s contract): one buffer per layer and kind,
bound with IO binding as both the graph's past and present, on the device the graph runs on; a step
writes only its new positions. A sequence that outgrows the buffers moves them to twice the size,
copying once, so a short chat never holds a max_positions-sized cache.

Edge runtime only: onnxruntime + numpy. Never import torch or transformers here.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specsplit.edge.drafting import Interrupted
from specsplit.edge.models import GRAPH_FORMAT

log = logging.getLogger(__name__)

METADATA_FILE = (
    "specsplit_draft.json"  # same name as edge.export.exporter writes (not imported: no torch)
)
SUPPORTED_FORMAT = 1
# graph formats whose I/O this drafter runs (4 changed the layout; 5 the split head's I/O, which
# only an export with lm_head_ids has)
SAME_IO = (3, 4, GRAPH_FORMAT)
REST_NONE = 2**62  # rest_from that asks for no position's rest of a split head
# A split head computes its rest while an id outside its frequent rows lies among the sequence's
# last this many tokens: rare ids come together (another language, an unusual name), and one
# far back (the default system prompt's " Cloud") says little about what comes next.
RARE_WINDOW = 32
INITIAL_CAPACITY = 256  # KV positions first allocated ...
# ... and grown by this factor (at least to what is needed) whenever a sequence outgrows them.
# Attention reads every position of the buffers, the empty ones too, so room beyond the sequence
# costs every pass: doubling let a prefill chunk read up to twice the positions it needed. On one
# AMD EPYC core (Qwen2.5-Coder-0.5B int4, bench.draft_prefill, the two taking turns) a 2,048-token
# prompt prefilled at 345-356 tok/s against 319-328 doubling, and a step after it took 17.5 ms
# against 19.5; 8,192 tokens 214 against 185 tok/s (1.25: 349-351 at 2,048). Each growth copies
# the valid part once: ~50 MB at 2,048 positions, a few ms.
GROWTH = 1.0625
PREFILL_CHUNK = 512  # tokens per forward pass of a long prompt, at most ...
# ... and fewer where the cache is long: one pass holds attention scores of [heads, chunk,
# capacity] float32 (a few such tensors at once), kept to about this many bytes each, so a
# prompt of any length prefills in bounded memory.
SCORES_BYTES = 16 << 20
MIN_PREFILL_CHUNK = 32


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The CPUs this process may use where they are fewer than the machine's: its affinity mask
    (``taskset``, a container's cpuset) or its cgroup's CPU quota (a container's ``--cpus``),
    whichever is smaller; None where neither narrows it.

    ONNX Runtime sizes its default thread pool from the machine's physical cores and ignores
    both, so a drafter pinned to one core of two ran two spinning
    threads on it: its steps took 20-115 ms, erratic, against a steady ~27 ms with one thread
    (2-core AMD EPYC, int4 draft). The drafter's default is this count where it is set."""
    machine = os.cpu_count() or 1
    allowed = machine
    if hasattr(os, "sched_getaffinity"):
        allowed = len(os.sched_getaffinity(0)) or machine
    quota = _cgroup_quota(cgroup_root)
    if quota is not None:
        allowed = min(allowed, quota)
    return allowed if allowed < machine else None


def _cgroup_quota(root: Path) -> int | None:
    """CPUs the process's cgroup may use, rounded up (cgroup v2 ``cpu.max``, else v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); None: no quota, or none readable."""
    try:
        v2 = ""
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                v2 = line[3:].strip("/")
        for where in ([root / v2] if v2 else []) + [root]:
            if (f := where / "cpu.max").is_file():
                quota, period = f.read_text().split()[:2]
                return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def prefill_chunk(num_heads: int, capacity: int) -> int:
    """Tokens per pass of a prompt into a cache of ``capacity`` positions."""
    fits = SCORES_BYTES // (4 * num_heads * capacity)
    return min(PREFILL_CHUNK, max(MIN_PREFILL_CHUNK, fits))


def chunk_after(num_heads: int, done: int) -> int:
    """Tokens of the next pass of a prompt after ``done`` cached positions: the most (within
    ``prefill_chunk``'s bounds) whose scores fit SCORES_BYTES over a cache that ends with them,
    the room a pass needs at least (``OnnxDrafter.forward`` then sizes it to the room it got)."""
    rows = SCORES_BYTES // (4 * num_heads)  # chunk x positions
    # the largest c with c * (done + c) <= rows
    c = int((math.isqrt(done * done + 4 * rows) - done) // 2)
    return min(PREFILL_CHUNK, max(MIN_PREFILL_CHUNK, c))


# --provider names -> ONNX Runtime's, in the order ``auto`` prefers them: the device's
# accelerator (an NVIDIA GPU, Apple's Neural Engine and GPU, any DirectX 12 GPU on Windows, any
# GPU through WebGPU), else the CPU.
PROVIDERS = {
    "cuda": "CUDAExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "directml": "DmlExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
    "cpu": "CPUExecutionProvider",
}
AUTO = "auto"
# Where each comes from, for the error that names a provider this runtime does not offer.
INSTALL = {
    "cuda": "onnxruntime-gpu and an NVIDIA driver (the edge extra on Linux and Windows x86_64, "
    "edge-cuda on Linux aarch64)",
    "coreml": "the plain onnxruntime on macOS (the edge extra there)",
    "directml": "onnxruntime-directml on Windows, installed instead of onnxruntime",
    "webgpu": "the WebGPU plugin, pip install onnxruntime-ep-webgpu (the webgpu extra; on Linux "
    "also a Vulkan loader, libvulkan.so.1)",
    "cpu": "every onnxruntime",
}
# CoreML runs no com.microsoft operator: a quantised graph's MatMulNBits (edge.export.onnx_quant)
# would run on the CPU anyway, the graph cut into pieces around them. ``auto`` skips it then.
QUANTISED = ("int8", "int4", "int4-fp16")
_webgpu: list = []  # the plugin's EP device, once found (a registered library stays registered)


def webgpu_device():
    """The WebGPU plugin's EP device (``onnxruntime-ep-webgpu``, registered with ONNX Runtime on
    first use); None where the plugin is not installed, does not load, or finds no GPU."""
    if _webgpu:
        return _webgpu[0]
    try:
        import onnxruntime_ep_webgpu as plugin
    except ImportError:
        return None
    try:
        ort.register_execution_provider_library("webgpu", plugin.get_library_path())
        device = next(d for d in ort.get_ep_devices() if d.ep_name == plugin.get_ep_name())
    except (AttributeError, StopIteration, RuntimeError, OSError) as e:  # old ORT, no Vulkan
        log.info("the WebGPU plugin is installed but unusable here: %s", e)
        return None
    _webgpu.append(device)
    return device


def available_providers() -> list[str]:
    """The --provider names this ONNX Runtime offers here, in ``auto``'s order (CPU last)."""
    offered = set(ort.get_available_providers())
    return [
        name
        for name, ep in PROVIDERS.items()
        if ep in offered or (name == "webgpu" and webgpu_device() is not None)
    ]


def choose_provider(requested: str = AUTO, precision: str = "fp32") -> str:
    """``requested`` when this runtime offers it (else a ValueError that says where it comes
    from); for ``auto``, the first offered that runs a graph of ``precision`` whole."""
    if requested != AUTO and requested not in PROVIDERS:
        choices = ", ".join([AUTO, *PROVIDERS])
        raise ValueError(f"provider must be one of {choices}; got {requested!r}")
    offered = available_providers()
    if requested == AUTO:
        return next(p for p in offered if not (p == "coreml" and precision in QUANTISED))
    if requested not in offered:
        raise ValueError(
            f"provider {requested!r} is not offered by this ONNX Runtime {ort.__version__} "
            f"(it offers {', '.join(offered)}); it comes with {INSTALL[requested]}"
        )
    return requested


def session_providers(provider: str, options) -> list[str]:
    """The providers list an InferenceSession takes for ``provider`` (a --provider name), CPU
    after it for the operators it lacks; WebGPU, a plugin, is added to ``options`` instead."""
    if provider == "webgpu":
        options.add_provider_for_devices([webgpu_device()], {})
        return []
    if provider == "directml":  # DirectML takes neither (ONNX Runtime's DirectML EP docs)
        options.enable_mem_pattern = False
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    ep = PROVIDERS[provider]
    return [ep] if provider == "cpu" else [ep, "CPUExecutionProvider"]


def _create_session(path: str, options, providers: list[str]) -> ort.InferenceSession:
    # onnxruntime-gpu lists CUDA even where its libraries are missing, and then logs an ERROR
    # before falling back to CPU. A fallback is expected on CPU-only machines: keep it quiet and
    # report the provider actually in use instead.
    quiet = bool(providers) and providers[0] == "CUDAExecutionProvider"
    if quiet:
        ort.set_default_logger_severity(4)
    try:
        session = ort.InferenceSession(path, sess_options=options, providers=providers)
    except Exception as e:  # an older runtime fails on the opset-24 graph with a cryptic error
        raise RuntimeError(
            f"ONNX Runtime {ort.__version__} could not load {path}: {e}. Graph format "
            f"{GRAPH_FORMAT} needs ONNX opset 24 (TensorScatter): onnxruntime-gpu >= 1.31"
        ) from e
    finally:
        if quiet:
            ort.set_default_logger_severity(2)
    if not quiet:
        return session
    if session.get_providers()[0] != "CUDAExecutionProvider":
        log.info("CUDA execution provider unavailable here; the draft runs on CPU")
    return session


class _KVCache:
    """One [1, kv_heads, capacity, head_dim] float32 buffer per layer and kind (the drafter
    knows how many positions are valid). ``reserve`` grows them (by GROWTH, one copy of the
    valid part) and shrinks them once a sequence needs far fewer."""

    def __init__(
        self, names: list[str], kv_heads: int, head_dim: int, limit: int, device: str
    ) -> None:
        self.names = names  # key.0, value.0, key.1, ...
        self._shape, self._limit, self._device = (kv_heads, head_dim), limit, device
        self.capacity = 0
        self.values: list[ort.OrtValue] = []

    def reserve(self, total: int, valid: int, shrink: bool, bind) -> bool:
        """Room for ``total`` positions, the first ``valid`` kept; True when the buffers moved.
        ``bind(name, value)`` is called with each new buffer as soon as it holds its valid part,
        before the next one is made, so that the old one is freed then (the binding held it
        too): growth needs one buffer's bytes more, not twice the cache's (at 8,192 positions of
        Qwen2.5-0.5B the cache is 200 MB). With ``shrink`` (a forward's first chunk) they also
        shrink where ``total`` is under a quarter of them (a long sequence ended, a short one
        began): attention reads every position of the buffers: a drafter kept since a
        4,096-token prompt stepped at 42.4 ms in a new 16-token sequence, as at 4,096
        positions, against 17.0 ms once they shrank, and its RSS went from 795 to 593 MB
        (bench.draft_prefill, one AMD EPYC core)."""
        shrinks = shrink and self.capacity > INITIAL_CAPACITY and 4 * total <= self.capacity
        if total <= self.capacity and not shrinks:
            return False
        if shrinks:  # twice what is needed: a sequence that grows back costs fewer copies
            capacity = max(INITIAL_CAPACITY, 2 * total)
        else:
            grown = math.ceil(GROWTH * self.capacity)
            capacity = min(self._limit, max(INITIAL_CAPACITY, grown, total))
        kv_heads, head_dim = self._shape
        if not self.values:
            self.values = [None] * len(self.names)
        try:
            for i, name in enumerate(self.names):
                new = np.zeros((1, kv_heads, capacity, head_dim), np.float32)
                if (old := self.values[i]) is not None:
                    new[:, :, :valid] = old.numpy()[:, :, :valid]
                # On CPU the OrtValue aliases ``new`` (and keeps it alive); on CUDA a copy.
                self.values[i] = ort.OrtValue.ortvalue_from_numpy(new, self._device, 0)
                del old, new
                bind(name, self.values[i])
        except BaseException:  # out of memory: the old buffers replaced so far are gone
            self.values, self.capacity = [], 0  # the next reserve makes and binds all anew
            raise
        self.capacity = capacity
        log.debug("draft KV cache: room for %d positions", capacity)
        return True


class OnnxDrafter:
    """Incremental forward passes of the exported draft model with a rollback-able KV cache."""

    def __init__(
        self,
        model_dir: Path,
        providers: list[str] | None = None,
        threads: int | None = None,
        provider: str = AUTO,
        profile: bool = False,
        background: bool = False,
    ) -> None:
        """``provider``: a --provider name (``choose_provider``); ``providers``, ONNX Runtime's
        own list, overrides it. ``profile``: ONNX Runtime's profiler records every pass until
        ``end_profiling`` (bench.draft_prefill). ``background``: the ONNX Runtime session is
        created on a thread of its own, so the caller goes on at once (a CLI process loads its
        tokenizer and sends its request meanwhile: creating the int4 draft's session takes
        ~0.6 s of one AMD EPYC core, mostly repacking weights); what needs the model waits for
        it (``forward``, ``another``, ``provider``), and a failed load raises there. The export's
        metadata (vocabulary, limits, tokenizer) is read before this returns either way."""
        model_dir = Path(model_dir)
        meta = json.loads((model_dir / METADATA_FILE).read_text())
        if meta.get("format") != SUPPORTED_FORMAT:
            raise ValueError(f"{model_dir}: draft format {meta.get('format')}, need 1")
        if meta.get("graph_format") not in SAME_IO:
            raise ValueError(
                f"{model_dir} was exported with graph format {meta.get('graph_format')}; this "
                f"version runs format {GRAPH_FORMAT} (the prefill's logits of the last position "
                f"only, KV cache in place). Export it again: "
                f"specsplit-edge export --draft <its Hugging Face directory> --out {model_dir}"
            )
        self.vocab_size: int = int(meta["vocab_size"])
        self.eos_token_ids: tuple[int, ...] = tuple(meta["eos_token_ids"])
        self.precision: str = meta["precision"]
        self.max_positions: int = int(meta["max_positions"])  # the longest context it runs
        self._num_heads = int(meta["num_heads"])
        # shared.tokenizer_fingerprint of the draft's tokenizer (None: exported without one);
        # the target's must be the same for the pair to make sense
        self.tokenizer_fingerprint: str | None = meta.get("tokenizer_fingerprint")
        # Ids past the tokenizer's are padding rows no text maps to: never proposed.
        self.token_count: int = min(
            int(meta.get("token_count") or self.vocab_size), self.vocab_size
        )

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.inter_op_num_threads = 1
        options.enable_profiling = profile
        threads = threads if threads is not None else usable_cpus()
        if threads is not None:
            options.intra_op_num_threads = threads
        # None: ONNX Runtime's default (one per physical core); else given, or the CPUs this
        # process may use where fewer (usable_cpus)
        self.threads = threads
        self.chosen: str | None = None  # the --provider name chosen (None: given ``providers``)
        if providers is None:
            self.chosen = choose_provider(provider, self.precision)
            providers = session_providers(self.chosen, options)
        # An LM head split by frequency (edge.export.exporter.head_rows): the frequent ids'
        # logits every pass, the others' (logits_rest) only where the sequence's last tokens
        # hold one of them (``_needs_rest``); else they are -inf, so the draft does not propose
        # them (its q is 0 there, which keeps it exact). A format 3-4 export's partial head has
        # no rest.
        ids = meta.get("lm_head_ids")
        self._head_ids = None if ids is None else np.load(model_dir / ids)
        self._rest_ids = self._frequent = None
        self._meta = meta
        path = str(model_dir / meta["onnx_file"])
        # Set while the session loads on its thread (``background``); None once it is open.
        self._loading: Future | None = None
        self._lock = threading.Lock()  # opens the loaded session once, whichever thread asks
        self._tokens: list[int] = []  # nothing is cached before the session opens
        self._rare: list[int] = []
        if not background:
            self._open(_create_session(path, options, providers))
            return
        self._loading = Future()

        def load() -> None:  # not a daemon: a process never exits inside ONNX Runtime's load
            try:
                self._loading.set_result(_create_session(path, options, providers))
            except BaseException as e:
                self._loading.set_exception(e)

        threading.Thread(target=load, name="draft-load").start()

    def _open(self, session: ort.InferenceSession) -> None:
        """What needs the session: the provider it runs on, the cache's device, the split
        head's rest, this drafter's own sequence."""
        meta = self._meta
        self._session = session
        # The provider it runs on (CUDA falls back to CPU where its libraries cannot start).
        self._provider: str = session.get_providers()[0]
        layers = [
            f"{kind}.{i}" for i in range(int(meta["num_layers"])) for kind in ("key", "value")
        ]
        device = "cuda" if self._provider == "CUDAExecutionProvider" else "cpu"
        self._kv_layout = (layers, int(meta["num_kv_heads"]), int(meta["head_dim"]), device)
        inputs = {i.name for i in session.get_inputs()}
        if self._head_ids is not None and "rest_from" in inputs:
            self._rest_ids = np.setdiff1d(np.arange(self.vocab_size), self._head_ids)
            self._frequent = np.zeros(self.vocab_size, dtype=bool)
            self._frequent[self._head_ids] = True
        self._open_sequence()
        log.info("draft %s (%s) on %s", meta["source"]["name"], self.precision, self._provider)

    def _ready(self) -> None:
        """Waits for a session loading in the background and opens it (its error, if it
        failed to load, is raised here, to every caller)."""
        if self._loading is None:
            return
        session = self._loading.result()
        with self._lock:
            if self._loading is not None:
                self._open(session)
                self._loading = None

    @property
    def provider(self) -> str:
        """The ONNX Runtime provider the draft runs on (waits for a background load)."""
        self._ready()
        return self._provider

    def _open_sequence(self) -> None:
        """This drafter's own sequence: an empty KV cache and the IO binding that feeds it."""
        layers, kv_heads, head_dim, device = self._kv_layout
        self._kv = _KVCache(layers, kv_heads, head_dim, self.max_positions, device)
        self._binding = self._session.io_binding()
        # interrupt() sets its terminate flag from another thread; each forward clears it first
        self._run = ort.RunOptions()
        self._binding.bind_output("logits", "cpu")  # first: get_outputs()[0], in binding order
        if self._rest_ids is not None:
            self._binding.bind_output("logits_rest", "cpu")  # second
        self._tokens: list[int] = []
        self._rare: list[int] = []  # positions in _tokens of ids outside a split head's rows

    def another(self) -> OnnxDrafter:
        """A drafter for another sequence on this one's ONNX Runtime session: the weights and
        the thread pool are shared, the KV cache and the IO binding are its own. Drafters made so
        may run at once from different threads (a session's Run is thread-safe). Each new
        session would hold the weights again: each added ~360 MB of RSS with the int4 draft, so the
        OpenAI endpoint's 4 slots held 1.5 GB, and 4 intra-op pools, each sized to every CPU,
        spun against each other on them."""
        self._ready()
        other = copy.copy(self)  # the session and the model's metadata, shared
        other._open_sequence()
        return other

    @property
    def cached(self) -> list[int]:
        """Tokens whose keys/values are in the cache (a copy; mutate via forward/truncate)."""
        return list(self._tokens)

    def forward(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Appends ``tokens`` after ``cached``; returns the logits after the last of them,
        [1, vocab], or with ``all_logits`` those after each, [len(tokens), vocab]."""
        self._ready()
        past = len(self._tokens)
        seq = len(tokens)
        if seq == 0:
            raise ValueError("forward needs at least one token")
        if past + seq > self.max_positions:
            raise ValueError(
                f"context of {past + seq} tokens exceeds the draft's limit of "
                f"{self.max_positions} positions (max_positions of its export)"
            )
        # A long prompt goes in chunks: attention scores are [heads, chunk, capacity] floats.
        # The cache grows as they go (by GROWTH): attention reads the whole buffer, so one sized
        # for the whole prompt up front would make every early chunk read empty positions.
        rare = self._rare_at(tokens)  # a split head's: where the rest is needed
        rest = self._needs_rest(past + seq, rare)
        self._run.terminate = False  # an interrupt() from before this pass is not for it
        chunks, i = [], 0
        try:
            while i < seq:
                done = len(self._tokens)
                # room for a chunk sized to end where the room ends, then the chunk sized to the
                # room it got (grown past it, or kept from a longer sequence); only a forward's
                # first chunk may shrink the room: the later ones grow it
                size = min(seq - i, chunk_after(self._num_heads, done))
                self._reserve(done + size, done, shrink=not chunks)
                size = min(size, prefill_chunk(self._num_heads, self._kv.capacity))
                chunks.append(self._step(tokens[i : i + size], all_logits, rest))
                i += size
        finally:  # the chunks that ran are cached: their rare ids too
            self._rare.extend(past + int(r) for r in rare if past + r < len(self._tokens))
        if all_logits and len(chunks) > 1:  # [seq, head rows]
            parts = [np.concatenate(part) for part in zip(*chunks, strict=True)]
        elif all_logits:
            parts = chunks[0]
        else:  # [1, head rows]: the last position's
            parts = [part[-1:] for part in chunks[-1]]
        logits = parts[0]
        if self._head_ids is not None:
            full = np.full((len(logits), self.vocab_size), -np.inf, dtype=np.float32)
            full[:, self._head_ids] = logits
            if rest:
                full[:, self._rest_ids] = parts[1]
            logits = full
        if self.token_count < self.vocab_size:
            logits[:, self.token_count :] = -np.inf
        return logits  # [seq or 1, vocab]

    def _needs_rest(self, end: int, rare: np.ndarray) -> bool:
        """Whether a split head's rest is computed for a pass that ends the sequence at ``end``
        (``rare``: ``_rare_at`` of its tokens): the sequence's last RARE_WINDOW tokens hold an id
        outside the frequent rows (text they do not cover: another language, a rare name),
        which makes the next ids likelier to be outside too."""
        since = end - RARE_WINDOW
        if rare.size:
            return len(self._tokens) + int(rare[-1]) >= since
        return bool(self._rare) and self._rare[-1] >= since

    def _rare_at(self, tokens: Sequence[int]) -> np.ndarray:
        """Indices into ``tokens`` of the ids outside a split head's frequent rows (none where
        the head is not split)."""
        if self._frequent is None:
            return np.empty(0, dtype=np.int64)
        ids = np.asarray(tokens, dtype=np.int64)
        inside = (ids >= 0) & (ids < self.vocab_size)
        return np.flatnonzero(~inside | ~self._frequent[np.where(inside, ids, 0)])

    def _step(self, tokens: Sequence[int], all_logits: bool, rest: bool = False) -> list:
        """One pass: the logits of every token, or of the last one only ([1, head rows]), and
        with ``rest`` a split head's rest for the same positions ([n, other ids])."""
        past, seq = len(self._tokens), len(tokens)
        self._reserve(past + seq, past)
        binding = self._binding
        binding.bind_cpu_input("input_ids", np.asarray(tokens, dtype=np.int64).reshape(1, seq))
        binding.bind_cpu_input("past_len", np.array([past], dtype=np.int64))
        logits_from = 0 if all_logits else seq - 1
        binding.bind_cpu_input("logits_from", np.array([logits_from], dtype=np.int64))
        binding.bind_output("logits", "cpu")  # a fresh [1, seq - logits_from, vocab] each call
        if self._rest_ids is not None:
            rest_from = np.array([0 if rest else REST_NONE], dtype=np.int64)
            binding.bind_cpu_input("rest_from", rest_from)
            binding.bind_output("logits_rest", "cpu")
        try:
            self._session.run_with_iobinding(binding, self._run)
        except RuntimeError as e:
            if self._run.terminate:
                raise Interrupted("the draft's forward pass was interrupted") from e
            raise
        # [1, seq - logits_from, vocab or head rows], then the rest (bound second)
        outputs = binding.get_outputs()[: 2 if rest else 1]
        self._tokens.extend(int(t) for t in tokens)
        return [out.numpy()[0] for out in outputs]

    def _reserve(self, total: int, valid: int, shrink: bool = False) -> None:
        # where the buffers moved, past and present are bound to the new ones
        try:
            self._kv.reserve(total, valid, shrink, self._bind)
        except BaseException:  # a growth failed halfway: the cache is gone, and with it what
            self._tokens.clear()  # it held (a next pass feeds the sequence again)
            self._rare.clear()
            raise

    def _bind(self, name: str, value: ort.OrtValue) -> None:
        self._binding.bind_ortvalue_input(f"past_{name}", value)
        self._binding.bind_ortvalue_output(f"present_{name}", value)

    def truncate(self, n: int) -> None:
        """Rolls the cache back to ``cached[:n]``: only its length moves (the next forward
        overwrites the positions after it in place)."""
        if not 0 <= n <= len(self._tokens):
            raise ValueError(f"truncate({n}) outside 0..{len(self._tokens)}")
        del self._tokens[n:]
        while self._rare and self._rare[-1] >= n:
            self._rare.pop()

    def reset(self) -> None:
        self.truncate(0)

    def interrupt(self) -> None:
        """Stops the forward pass running in another thread within about one operator (ONNX
        Runtime's RunOptions.terminate): it raises ``Interrupted`` and caches nothing of the chunk
        it was on. A drafter's token that the cloud has rejected meanwhile need not be finished
        (edge.cloud_led). Between passes it does nothing: the next pass clears it (so too while
        the session loads: no pass runs yet)."""
        if self._loading is None:
            self._run.terminate = True

    def end_profiling(self) -> str:
        """Stops the profiler (``profile=True``); returns the path of its JSON trace."""
        self._ready()
        return self._session.end_profiling()


def runtime_distribution() -> str:
    """Which ONNX Runtime distribution is installed (they share the module ``onnxruntime``)."""
    from importlib import metadata

    for name in ("onnxruntime-gpu", "onnxruntime-directml", "onnxruntime"):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return f"onnxruntime {ort.__version__}"


def ms_per_token(drafter: OnnxDrafter, steps: int = 32, prompt_len: int = 16) -> float:
    """The draft's median milliseconds per single-token step (the lock-step drafting cost),
    greedy, after a ``prompt_len``-token prompt; the drafter's cache is reset after."""
    if steps < 1 or prompt_len < 1:
        raise ValueError("steps and prompt_len must be >= 1")
    drafter.reset()
    token = int(
        np.argmax(drafter.forward([i % drafter.token_count for i in range(prompt_len)])[-1])
    )
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        token = int(np.argmax(drafter.forward([token])[-1]))
        times.append((time.perf_counter() - t0) * 1e3)
    drafter.reset()
    return float(np.median(times))
