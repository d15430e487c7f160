"""Every decoder family the target serves, on tiny random checkpoints, against transformers.

The ragged engine (``cloud.engine.ragged``) runs sessions of different lengths together in blocks of
1..5 rows; fed the tokens transformers' own greedy generation produced, every row's argmax must
be transformers' next token and its logits close to those transformers computes generating one
token at a time (float32: only summation order differs). Sliding windows are shorter than the
sequences, and Phi-3's LongRoPE switches to its long factors inside them, so both matter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specsplit.cloud.engine.ragged import RaggedForward, Segment
from specsplit.shared.tiny import reference_greedy
from specsplit.shared.tiny_families import FAMILIES, make_tiny, stepwise_greedy, stepwise_logits
from tests.cloud.engine.passes import ragged_passes, stepped_alone

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 100], [42, 17, 250, 8, 8, 8, 31, 64, 99, 12, 5]]
N_NEW = 20


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path = make_tiny(request.param, tmp_path_factory.mktemp(request.param) / "model", seed=11)
    return request.param, path


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_stepwise_greedy_is_generate(family):
    name, path = family
    if name == "phi3":
        pytest.skip("generate() and one-token calls pick different LongRoPE factors past 16")
    assert stepwise_greedy(hf_model(path), PROMPTS[1], 12)[3:] == reference_greedy(
        path, PROMPTS[1], 12
    )


def test_ragged_passes_follow_transformers(family):
    name, path = family
    model = hf_model(path)
    sequences = [stepwise_greedy(model, p, N_NEW) for p in PROMPTS]
    reference = [stepwise_logits(model, s) for s in sequences]
    got = ragged_passes(RaggedForward(hf_model(path)), sequences, np.random.default_rng(5), 5)
    for sid, (seq, logits) in enumerate(zip(sequences, got, strict=True)):
        # positions 1..len-1: row j predicts the token at j + 2
        ref = reference[sid][1:]
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        n = len(PROMPTS[sid])
        assert logits[n - 2 : -1].argmax(-1).tolist() == seq[n:], (name, sid)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_quantised_engine_is_batch_invariant_and_near_the_float_model(family, weights):
    """The same family traits on our CPU kernels: every row's logits are bit for bit those of
    one-row steps whatever shares the pass (what lossless greedy needs), and int8 stays near the
    float model's (a missing norm, window or soft-cap would not)."""
    from specsplit.cloud.engine import kernel_library
    from specsplit.cloud.engine.kernel_forward import KernelForward

    if not kernel_library.available():
        pytest.skip("needs the CPU kernels")
    name, path = family
    forward = KernelForward(hf_model(path), weights)
    sequences = [p + list(range(40, 52)) for p in PROMPTS]

    alone = [stepped_alone(forward, s) for s in sequences]
    got = ragged_passes(forward, sequences, np.random.default_rng(8), 5)
    for sid, logits in enumerate(got):
        assert torch.equal(logits, alone[sid]), (name, sid)
    if weights == "int8":
        reference = RaggedForward(hf_model(path))
        slot = reference.slots.open(1)
        ref = reference([Segment(slot, sequences[0], True)])[0][1:]
        err = (alone[0] - ref).norm(dim=-1) / ref.norm(dim=-1)
        assert err.mean() < 0.1 and err.max() < 0.25, (name, err)
