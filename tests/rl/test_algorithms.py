"""The RL maths against numbers computed by hand (see each comment)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from codeplane.rl.algorithms import (
    group_advantages,
    informative,
    mismatch_stats,
    policy_loss,
    token_weights,
)


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def test_grpo_divides_by_the_sample_std():
    # mean 0.5; centred ±0.5; Bessel std sqrt((4 * 0.25) / 3) = 0.57735 -> ±0.866025
    adv = group_advantages(t(1, 0, 0, 1), "grpo", eps=0.0)
    assert adv.tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-6)


def test_dr_grpo_only_centres():
    assert group_advantages(t(1, 0, 0, 1), "dr_grpo").tolist() == [0.5, -0.5, -0.5, 0.5]
    # a near-solved group keeps its small advantages (GRPO's /std would blow them up)
    assert group_advantages(t(1, 1, 1, 0.9), "dr_grpo").tolist() == pytest.approx(
        [0.025, 0.025, 0.025, -0.075])


def test_rloo_uses_the_mean_of_the_others():
    # r0 - mean(0, 0) = 1; r1 - mean(1, 0) = -0.5
    assert group_advantages(t(1, 0, 0), "rloo").tolist() == pytest.approx([1.0, -0.5, -0.5])
    # r0 = 3 - mean(1, 2) = 1.5; r1 = 1 - mean(3, 2) = -1.5; r2 = 2 - mean(3, 1) = 0
    assert group_advantages(t(3, 1, 2), "rloo").tolist() == pytest.approx([1.5, -1.5, 0.0])


def test_a_group_of_one_has_no_advantage():
    for method in ("grpo", "dr_grpo", "rloo"):
        assert group_advantages(t(1), method).tolist() == [0.0]


def test_zero_variance_groups_are_not_informative():
    assert not informative([1.0, 1.0, 1.0])
    assert not informative([0.0])
    assert informative([1.0, 0.0, 1.0])


def test_token_weights_per_aggregation():
    # rollouts of 2 and 1 completion tokens
    assert token_weights([2, 1], "token", 4).tolist() == pytest.approx([1 / 3] * 3)
    assert token_weights([2, 1], "sequence", 4).tolist() == pytest.approx([0.25, 0.25, 0.5])
    assert token_weights([2, 1], "constant", 4).tolist() == pytest.approx([1 / 8] * 3)


def _loss(logp, old, sampler, adv, w, **kw):
    kw = {"eps_low": 0.2, "eps_high": 0.28, "tis_cap": None, **kw}
    return policy_loss(logp, old, sampler, adv, w, **kw)


def test_clip_higher_lets_positive_tokens_rise_further():
    # token 1: ratio 1.5, A=+1 -> min(1.5, 1.28) = 1.28; token 2: ratio 0.5, A=-1 ->
    # min(-0.5, -0.8) = -0.8. loss = -(0.5 * 1.28 + 0.5 * -0.8) = -0.24
    logp = t(math.log(0.75), math.log(0.25))
    old = t(math.log(0.5), math.log(0.5))
    parts = _loss(logp, old, old, t(1, -1), t(0.5, 0.5))
    assert float(parts.loss) == pytest.approx(-0.24)
    assert parts.clip_fraction == pytest.approx(1.0)
    symmetric = _loss(logp, old, old, t(1, -1), t(0.5, 0.5), eps_high=0.2)
    assert float(symmetric.loss) == pytest.approx(-(0.5 * 1.2 - 0.5 * 0.8))


def test_clipped_tokens_carry_no_gradient():
    logp = t(math.log(0.75), math.log(0.5)).requires_grad_()
    old = t(math.log(0.5), math.log(0.5))
    _loss(logp, old, old, t(1, 1), t(1, 1)).loss.backward()
    # token 1 is clipped (ratio 1.5 > 1.28); token 2 is on-policy: d(-exp(x - old))/dx = -1
    assert logp.grad.tolist() == pytest.approx([0.0, -1.0])


def test_tis_weights_by_the_capped_sampler_ratio():
    # trainer p = 0.5, sampler p = 0.1: weight 5, capped at 2; on-policy ratio 1, A = 1
    logp = t(math.log(0.5))
    sampler = t(math.log(0.1))
    assert float(_loss(logp, logp, sampler, t(1), t(1)).loss) == pytest.approx(-1.0)
    capped = _loss(logp, logp, sampler, t(1), t(1), tis_cap=2.0)
    assert float(capped.loss) == pytest.approx(-2.0)
    assert capped.tis_truncated == 1.0
    assert float(_loss(logp, logp, sampler, t(1), t(1), tis_cap=10.0).loss) == pytest.approx(-5)


def test_kl_to_the_reference_is_the_k3_estimator():
    # p = 0.5, ref = 0.25: d = log 0.5; k3 = 0.5 - log 0.5 - 1 = 0.193147; beta 0.1, A = 0
    logp = t(math.log(0.5))
    parts = _loss(logp, logp, logp, t(0), t(1), kl_beta=0.1, logp_ref=t(math.log(0.25)))
    assert parts.kl == pytest.approx(0.193147, abs=1e-6)
    assert float(parts.loss) == pytest.approx(0.0193147, abs=1e-7)


def test_mismatch_stats():
    trainer = t(math.log(0.5), math.log(0.5), math.log(0.5))
    sampler = t(math.log(0.5), math.log(0.25), math.log(1.0))
    stats = mismatch_stats(trainer, sampler)
    # |deltas| = 0, log 2, log 2
    assert stats["mismatch_abs_mean"] == pytest.approx(2 * math.log(2) / 3)
    assert stats["mismatch_abs_p50"] == pytest.approx(math.log(2))
    assert stats["is_ratio_min"] == pytest.approx(0.5)
    assert stats["is_ratio_max"] == pytest.approx(2.0)
