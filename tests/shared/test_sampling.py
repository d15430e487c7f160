import numpy as np
import pytest

from specsplit.shared.sampling import SamplingConfig, logits_to_probs, sample, truncate


def test_greedy_is_one_hot_argmax():
    p = logits_to_probs(np.array([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]]), SamplingConfig())
    np.testing.assert_array_equal(p, [[0, 1, 0], [1, 0, 0]])


def test_temperature_scales_logits():
    logits = np.log(np.array([0.2, 0.3, 0.5]))
    np.testing.assert_allclose(
        logits_to_probs(logits, SamplingConfig(temperature=1.0)), [0.2, 0.3, 0.5]
    )
    p2 = logits_to_probs(logits, SamplingConfig(temperature=0.5))
    np.testing.assert_allclose(p2, np.array([0.04, 0.09, 0.25]) / 0.38)


def test_top_k_keeps_k_most_likely():
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    p = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [0, 4 / 7, 0, 3 / 7])


def test_top_p_keeps_smallest_prefix_reaching_mass():
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    # 0.4 < 0.6, 0.4 + 0.3 >= 0.6: keep {1, 3}
    p = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.6))
    np.testing.assert_allclose(p, [0, 4 / 7, 0, 3 / 7])
    # the most likely token always survives
    p = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.01))
    np.testing.assert_allclose(p, [0, 1, 0, 0])


def test_top_k_then_top_p_order():
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    # top_k=3 -> [0, .4, .2, .3]/.9; top_p=0.5: .444 < .5, then .777 -> keep {1, 3}
    p = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=3, top_p=0.5))
    np.testing.assert_allclose(p, [0, 4 / 7, 0, 3 / 7])


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)]
)
def test_bad_config_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)


def test_sample_never_draws_zero_probability():
    p = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    rng = np.random.default_rng(0)
    draws = {sample(p, rng) for _ in range(2000)}
    assert draws == {1, 3}


def test_truncate_keeps_top_entries_and_renormalises():
    q = truncate(np.array([0.1, 0.4, 0.2, 0.3]), 2)
    assert sorted(q.ids.tolist()) == [1, 3]
    assert q.probs.sum() == pytest.approx(1.0)
    assert q.prob_of(1) == pytest.approx(4 / 7)
    assert q.prob_of(0) == 0.0
    np.testing.assert_allclose(q.dense(4), [0, 4 / 7, 0, 3 / 7])
