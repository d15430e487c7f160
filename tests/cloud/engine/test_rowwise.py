"""The float ops between the kernels (``cpu_rowwise.c``) at the real widths: a row's result is the
same batched as alone, bit for bit, at any thread count.

torch splits elementwise ops and reductions where the element and thread counts say (its vector
body and scalar tail use different exp/tanh), so at widths like 8960 a row's SiLU could change
with the batch; the tests of tests/cloud/engine/test_kernel_forward.py use widths far below torch's
grain size and could not see it. Widths here: the default target (Qwen2.5-1.5B: hidden 1536,
intermediate 8960, 12 heads x 128, 2 kv heads) and a Gemma-2-2B-sized model (hidden 2304,
intermediate 9216, 8 heads x 256, 4 kv heads, GELU-tanh, soft-caps 50 / 30). Thread counts
above the cores still exercise the chunking (OpenMP's and torch's).
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specsplit.cloud.engine import cpu_kernels as kernels
from specsplit.cloud.engine import decoder, kernel_library
from specsplit.cloud.engine.kernel_forward import KernelForward, PositionTables
from specsplit.cloud.engine.ragged import Segment
from specsplit.shared.tiny_families import FAMILIES, make_tiny
from tests.cloud.engine.conftest import BACKENDS, needs_kernels

pytestmark = needs_kernels

THREADS = (1, 3, 4, 8)
ROWS = range(1, 18)
QWEN = dict(hidden=1536, intermediate=8960, heads=12, kv_heads=2, head_dim=128, vocab=151936)
GEMMA = dict(hidden=2304, intermediate=9216, heads=8, kv_heads=4, head_dim=256, vocab=256000)
WIDTHS = {"qwen": QWEN, "gemma": GEMMA}


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def assert_rowwise(op, x: torch.Tensor) -> None:
    """op(rows) [R, ...] (a tensor or a tuple of them) equals op of each row alone, bit for bit,
    for the first R rows of x, R in ROWS, at every thread count; alone at 1 thread is the
    reference."""
    as_tuple = lambda y: y if isinstance(y, tuple) else (y,)  # noqa: E731
    with threads(1):
        alone = [as_tuple(op(x[i : i + 1])) for i in range(max(ROWS))]
    for n in THREADS:
        with threads(n):
            for r in ROWS:
                together = as_tuple(op(x[:r]))
                for i in range(r):
                    for part, ref in zip(together, alone[i], strict=True):
                        assert torch.equal(part[i : i + 1], ref), (n, r, i)
            again = as_tuple(op(x[max(ROWS) - 1 : max(ROWS)]))  # alone at n threads
            assert all(torch.equal(a, b) for a, b in zip(again, alone[-1], strict=True)), n


def rows(n: int, width: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    x = torch.randn(n, width, generator=torch.Generator().manual_seed(seed)) * scale
    x[:, 7] = 40.0  # far into SiLU's / GELU's linear and zero ends, and tanh's flat one
    x[:, 8] = -40.0
    return x


def norm(width: int, seed: int) -> tuple[torch.Tensor, float]:
    gen = torch.Generator().manual_seed(seed)
    return (0.5 + torch.rand(width, generator=gen)).contiguous(), 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("act", "width"), [("silu", 8960), ("gelu_tanh", 9216)])
def test_the_fused_activation_is_rowwise_and_quantises_its_own_float_product(act, width, backend):
    gate_up = rows(max(ROWS), 2 * width, seed=1)

    def fused(x):
        q = kernels.ActivatedRows(x, act, kernel=backend)
        return q.xq, q.xs, q.xsum

    assert_rowwise(fused, gate_up)
    assert_rowwise(lambda x: kernels.act_mul(x, act), gate_up)
    # the int8 values are exactly those of the float product quantised on its own
    q = kernels.ActivatedRows(gate_up, act, kernel=backend)
    ref = kernels.QuantizedRows(kernels.act_mul(gate_up, act), kernel=backend)
    for name in ("xq", "xs", "xsum"):
        assert torch.equal(getattr(q, name), getattr(ref, name)), name


@pytest.mark.parametrize(("act", "width"), [("silu", 8960), ("gelu_tanh", 9216)])
def test_the_fused_activation_is_the_exact_one_within_rounding(act, width):
    """Against act(gate) * up in float64: off by at most ~2 float32 roundings of |gate * up|
    (the size the next quantisation sees), and ~8 of the value itself where the gate does not
    take it near 0. torch's float32 GELU-tanh, for comparison, is off by up to 1.5e-5 of the
    value in its negative tail."""
    gate_up = torch.cat([rows(16, 2 * width, seed=2, scale=s) for s in (0.01, 1.0, 4.0, 30.0)])
    gate, up = gate_up.double().chunk(2, dim=-1)
    if act == "silu":
        exact = torch.nn.functional.silu(gate) * up
    else:
        exact = torch.nn.functional.gelu(gate, approximate="tanh") * up
    err = (kernels.act_mul(gate_up, act).double() - exact).abs()
    size = (gate * up).abs()
    assert (err <= 4e-7 * size).all(), (err / size).max()
    gated = exact.abs() > 1e-3 * size
    assert (err[gated] <= 1e-6 * exact.abs()[gated]).all(), (err / exact.abs())[gated].max()


@pytest.mark.parametrize("model", WIDTHS)
def test_rms_norm_of_heads_and_of_rows_is_rowwise(model):
    w = WIDTHS[model]
    hd, heads, kv = w["head_dim"], w["heads"], w["kv_heads"]
    qkv = rows(max(ROWS), (heads + 2 * kv) * hd, seed=3)
    q_norm, k_norm = norm(hd, 4), norm(hd, 5)

    def qk_norms(x):  # in place on the q and k heads of a fused q/k/v output, as the engine does
        x = x.clone()
        kernels.rms_norm(x[:, : heads * hd], q_norm, out=x[:, : heads * hd])
        kernels.rms_norm(
            x[:, heads * hd : (heads + kv) * hd], k_norm, out=x[:, heads * hd :][:, : kv * hd]
        )
        return x

    assert_rowwise(qk_norms, qkv)
    hidden = rows(max(ROWS), w["hidden"], seed=6)
    assert_rowwise(lambda x: kernels.rms_norm(x, norm(w["hidden"], 7)), hidden)

    got = qk_norms(qkv[:3]).view(3, heads + 2 * kv, hd)
    heads_of = qkv[:3].view(3, heads + 2 * kv, hd).double()
    expected = heads_of * torch.rsqrt(heads_of.pow(2).mean(-1, keepdim=True) + 1e-6)
    close = dict(rtol=1e-6, atol=1e-6)  # float32 roundings
    torch.testing.assert_close(
        got[:, :heads].double(), expected[:, :heads] * q_norm[0].double(), **close
    )
    torch.testing.assert_close(
        got[:, heads : heads + kv].double(),
        expected[:, heads : heads + kv] * k_norm[0].double(),
        **close,
    )
    assert torch.equal(got[:, heads + kv :], qkv[:3].view(3, heads + 2 * kv, hd)[:, heads + kv :])


@pytest.mark.parametrize("model", WIDTHS)
def test_residual_adds_are_rowwise(model):
    width = WIDTHS[model]["hidden"]
    both = torch.cat([rows(max(ROWS), width, seed=8), rows(max(ROWS), width, seed=9)], dim=1)
    post = norm(width, 10)
    plain = lambda xy: kernels.residual_add(xy[:, :width], xy[:, width:])  # noqa: E731
    normed = lambda xy: kernels.residual_add(xy[:, :width], xy[:, width:], post)  # noqa: E731
    assert_rowwise(plain, both)
    assert_rowwise(normed, both)
    x, y = both[:, :width], both[:, width:]
    assert torch.equal(plain(both), x + y)  # one IEEE add per element
    again = x.clone()
    assert kernels.residual_add(again, y, post, in_place=True) is again
    assert torch.equal(again, normed(both))
    yd = y.double()
    expected = x.double() + post[0].double() * yd * torch.rsqrt(
        yd.pow(2).mean(-1, keepdim=True) + 1e-6
    )
    torch.testing.assert_close(normed(both).double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("cap", "vocab"), [(30.0, 256000), (50.0, 151936), (30.0, 1003)])
def test_soft_caps_are_rowwise_and_tanh(cap, vocab):
    logits = rows(max(ROWS), vocab, seed=11, scale=20.0)
    logits[:, 9] = 1e-4  # tanh's small-argument end
    logits[:, 10] = float("inf")
    assert_rowwise(lambda x: kernels.soft_cap(x, cap), logits)
    got = kernels.soft_cap(logits, cap)
    expected = torch.tanh(logits.double() / cap) * cap
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    assert kernels.soft_cap(torch.tensor([float("nan")]), cap).isnan().all()


def test_a_positions_rotary_table_does_not_depend_on_the_pass():
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    config = Qwen2Config(hidden_size=1536, num_attention_heads=12, num_key_value_heads=2)
    inner = types.SimpleNamespace(rotary_emb=Qwen2RotaryEmbedding(config))
    rotary = decoder.Rotary(inner, config)
    positions = torch.arange(300)
    with threads(4):
        whole = PositionTables(rotary, 1536)(positions)[None]  # one pass asks for them all
    gen = torch.Generator().manual_seed(12)
    for n in THREADS:
        with threads(n):
            asked = PositionTables(rotary, 1536)  # passes of one row, positions out of order
            for p in torch.randperm(300, generator=gen)[:40]:
                cos, sin = asked(p[None])[None]
                assert torch.equal(cos[0], whole[0][p]) and torch.equal(sin[0], whole[1][p])
    cos, sin = rotary.tables(torch.zeros(1, 1536), [positions])[None]  # torch over the whole pass
    torch.testing.assert_close(whole[0], cos)
    torch.testing.assert_close(whole[1], sin)


def test_an_activation_the_kernels_do_not_compute_is_refused_by_name():
    from transformers import activations as hf

    assert kernels.activation_kind(hf.ACT2FN["silu"]) == "silu"
    assert kernels.activation_kind(torch.nn.SiLU()) == "silu"
    for name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        assert kernels.activation_kind(hf.ACT2FN[name]) == "gelu_tanh", name
    for name in ("gelu", "relu", "quick_gelu"):
        with pytest.raises(ValueError, match="MLP activations"):
            kernels.activation_kind(hf.ACT2FN[name])
    with pytest.raises(ValueError, match="not one of"):
        kernels.act_mul(torch.zeros(1, 128), "relu")
    from transformers import Gemma2Config, Qwen2Config

    assert kernels.fits(Qwen2Config(hidden_act="silu"))  # so a calibration offers int8 / int4
    assert kernels.fits(Gemma2Config(hidden_size=2304, intermediate_size=9216, head_dim=256))
    assert not kernels.fits(Qwen2Config(hidden_act="gelu"))  # float it is
    with pytest.raises(ValueError, match="multiple of 64"):
        kernels.act_mul(torch.zeros(1, 2 * 96), "silu")


def test_the_ctypes_table_matches_the_row_wise_prototypes():
    """ctypes passes what _SIGNATURES says, unchecked: each row-wise op's argument types there
    must be those cpu_kernels.h declares."""
    import ctypes
    import re

    header = kernel_library.HEADER.read_text()
    block = header[header.index("/* row-wise ops") :]
    c_types = {"int64_t": ctypes.c_int64, "float": ctypes.c_float, "int": ctypes.c_int}
    prototypes = re.findall(r"void (specsplit_\w+)\(([^)]*)\);", block)
    assert {name for name, _ in prototypes} == {
        "specsplit_act_mul",
        "specsplit_act_mul_quantize",
        "specsplit_rmsnorm",
        "specsplit_residual_add",
        "specsplit_soft_cap",
    }
    for name, params in prototypes:
        declared = [
            ctypes.c_void_p if "*" in p else c_types[p.split()[-2]]
            for p in (" ".join(p.split()) for p in params.split(","))
        ]
        assert kernel_library._SIGNATURES[name] == declared, name


REDUCTIONS = {"mean", "sum", "amax", "amin", "max", "min", "norm", "var", "softmax", "_softmax"}
MATMULS = {"mm", "bmm", "addmm", "matmul", "linear"}


class FloatOps(TorchDispatchMode):
    """Records the torch ops that compute on float tensors: elementwise, reductions, matmuls."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        floats = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        computes = torch.Tag.pointwise in func.tags or name in REDUCTIONS | MATMULS
        if floats and computes and not self._row_local_broadcast(name, args):
            self.seen.append(f"{func}{[tuple(a.shape) for a in floats]}")
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _row_local_broadcast(name: str, args) -> bool:
        """A projection's bias ([N] added to [R, N]) or the embedding's scale (a scalar):
        one IEEE operation per element, whatever torch's split (kernel_forward's docstring)."""
        other = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        return other is not None and (
            (name == "add" and other.dim() == 1) or (name == "mul" and other.dim() == 0)
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_no_torch_op_computes_between_two_kernels(family, tmp_path):
    """A pass of the quantised engine computes no float in torch (once the positions' rotary
    tables are known): every float op between two kernels is ``cpu_rowwise.c``'s."""
    from transformers import AutoModelForCausalLM

    path = make_tiny(family, tmp_path / "model", seed=16)
    forward = KernelForward(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), "int4")
    slots = [forward.slots.open(sid) for sid in range(2)]
    segments = [Segment(slots[0], [1, 2, 3, 4], True), Segment(slots[1], [5, 6], True)]
    forward(segments)  # the positions' tables, computed in torch one position at a time
    for slot in slots:
        slot.length = 0
    with FloatOps() as ops:
        forward(segments)
    assert ops.seen == []


# A whole pass of the engine at the real widths: one decoder layer, random weights, small vocab.


def one_layer_model(model: str):
    import transformers as tf

    w = WIDTHS[model]
    common = dict(
        hidden_size=w["hidden"],
        intermediate_size=w["intermediate"],
        num_attention_heads=w["heads"],
        num_key_value_heads=w["kv_heads"],
        head_dim=w["head_dim"],
        num_hidden_layers=1,
        vocab_size=512,
    )
    if model == "qwen":
        config = tf.Qwen2Config(**common, tie_word_embeddings=True)
        cls = tf.Qwen2ForCausalLM
    else:
        config = tf.Gemma2Config(
            **common,
            hidden_activation="gelu_pytorch_tanh",
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=256,
        )
        cls = tf.Gemma2ForCausalLM
    torch.manual_seed(13)
    net = cls(config).float().eval()
    gen = torch.Generator().manual_seed(14)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "norm" in name:  # norms start at ones (Gemma: zeros): make them matter
                p.copy_(
                    torch.rand(p.shape, generator=gen) * 0.5 + (0.0 if model == "gemma" else 0.75)
                )
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return net


SESSIONS = 5


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("model", WIDTHS)
def test_a_real_width_layer_gives_every_row_batched_what_it_gives_alone(model, weights):
    """Sessions with some context each; a pass of R rows (one session's block of R, or R spread
    over five sessions) gives each row's logits bit for bit those of its session stepped alone,
    one row per pass, for R in 1..17 at 1, 3, 4 and 8 threads."""
    forward = KernelForward(one_layer_model(model), weights)
    gen = torch.Generator().manual_seed(15)
    contexts = [
        torch.randint(0, 512, (3 + 2 * s,), generator=gen).tolist() for s in range(SESSIONS)
    ]
    tokens = [torch.randint(0, 512, (max(ROWS),), generator=gen).tolist() for _ in range(SESSIONS)]
    slots = [forward.slots.open(sid) for sid in range(SESSIONS)]
    forward([Segment(slot, ctx, False) for slot, ctx in zip(slots, contexts, strict=True)])

    def run(blocks: list[list[int]]) -> list[torch.Tensor]:
        """One pass of each session's block after its context; the slots roll back after."""
        segments = [Segment(slot, b, True) for slot, b in zip(slots, blocks, strict=True) if b]
        out = forward(segments)
        for slot, ctx in zip(slots, contexts, strict=True):
            slot.length = len(ctx)
        return out

    def stepped(sid: int, n: int) -> torch.Tensor:
        out = []
        for j in range(n):
            out.append(forward([Segment(slots[sid], [tokens[sid][j]], True)])[0])
        slots[sid].length = len(contexts[sid])
        return torch.cat(out)

    spread_len = -(-max(ROWS) // SESSIONS)
    with threads(1):
        alone = [stepped(sid, max(ROWS) if sid == 0 else spread_len) for sid in range(SESSIONS)]
    for n in THREADS:
        with threads(n):
            assert torch.equal(stepped(0, max(ROWS)), alone[0]), n
            for r in ROWS:
                [got] = run([tokens[0][:r]] + [[] for _ in range(SESSIONS - 1)])
                assert torch.equal(got, alone[0][:r]), (n, r, "one session")
                counts = [r // SESSIONS + (s < r % SESSIONS) for s in range(SESSIONS)]
                got = run([tokens[s][: counts[s]] for s in range(SESSIONS)])
                owners = [s for s in range(SESSIONS) if counts[s]]
                for sid, logits in zip(owners, got, strict=True):
                    assert torch.equal(logits, alone[sid][: counts[sid]]), (n, r, sid)
