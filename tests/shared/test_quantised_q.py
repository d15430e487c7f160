"""Quantised q: the edge samples from it and the cloud rebuilds it bit for bit from one byte per
entry, so speculative sampling stays exact (the chi-square check is in test_distribution)."""

import numpy as np
import pytest

from specsplit.shared.protocol import pb, sparse_from_pb, sparse_to_pb
from specsplit.shared.sampling import SparseDist, from_counts, quantise


def _q(probs) -> SparseDist:
    probs = np.asarray(probs, dtype=np.float64)
    return SparseDist(ids=np.arange(10, 10 + probs.size, dtype=np.int64), probs=probs / probs.sum())


def test_wire_round_trip_is_bit_exact():
    rng = np.random.default_rng(0)
    for _ in range(200):
        q = quantise(_q(rng.dirichlet(np.full(12, 0.3))))
        back = sparse_from_pb(
            pb.SparseDistribution.FromString(sparse_to_pb(q).SerializeToString()), 100
        )
        np.testing.assert_array_equal(back.ids, q.ids)
        assert back.probs.tobytes() == q.probs.tobytes()  # the very floats the edge sampled from


def test_one_byte_per_entry_on_the_wire():
    q = quantise(_q([0.5, 0.3, 0.2]))
    msg = sparse_to_pb(q)
    assert len(msg.counts) == 3 and not msg.probs
    assert sparse_to_pb(q, counts_ok=False).probs  # an older server gets floats


def test_entries_below_half_a_step_are_dropped():
    q = quantise(_q([0.99, 0.007, 0.003]), levels=127)  # 0.003 * 127 < 0.5
    assert q.ids.tolist() == [10, 11]
    assert abs(q.probs.sum() - 1.0) < 1e-12


def test_a_flat_q_never_becomes_empty():
    q = quantise(_q(np.ones(300)), levels=127)  # every entry below half a step
    assert q.ids.size == 1 and q.probs[0] == 1.0


@pytest.mark.parametrize(
    "msg, reason",
    [
        (pb.SparseDistribution(token_ids=[1, 2], counts=b"\x00\x00"), "all be 0"),
        (pb.SparseDistribution(token_ids=[1, 2], counts=b"\x01", probs=[1.0]), "both"),
        (pb.SparseDistribution(token_ids=[1, 2], counts=b"\x01"), "as many"),
    ],
)
def test_bad_counts_are_refused(msg, reason):
    with pytest.raises(ValueError, match=reason):
        sparse_from_pb(msg, 100)


def test_from_counts_matches_the_edge_division():
    q = from_counts(np.array([3, 4]), np.array([1, 2], dtype=np.uint8))
    assert q.probs.tolist() == [1 / 3, 2 / 3]
