"""The adaptive rule of speculative decoding (torch_topg.engine.speculative.adaptive): the
measured cost curve (its fit, bounded work, the profile prior, the cached fit against a full
refit) and the per-sequence plan (pricing, the closed-batch margin, the draft's time,
probes and shadow proposals, pooled acceptance)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torch_topg.engine.speculative import AdaptiveController, CostModel


def test_cost_model_monotone_fit_ignores_bursts():
    c = CostModel(window=8)
    assert c(5) == 1.0  # unmeasured: flat
    c.observe(1, 0.010)
    assert c(1) == c(9) == 0.010  # one count: flat
    c.observe(3, 0.014)
    assert c(2) == pytest.approx(0.012) and c(5) == pytest.approx(0.018)
    c.observe(3, 0.014)
    c.observe(3, 0.014)
    for _ in range(2):
        c.observe(3, 0.050)  # a neighbour's burst: the median stays
    assert c(3) == pytest.approx(0.014)
    for _ in range(8):
        c.observe(3, 0.024)  # a lasting change moves it within a window
    assert c(3) == pytest.approx(0.024)
    d = CostModel()
    for _ in range(9):
        d.observe(1, 0.020)
    d.observe(2, 0.010)  # a noisy cheap point: pooled with its neighbour, never cheaper
    d.observe(4, 0.030)
    assert d(1) == d(2) == pytest.approx(0.019)
    assert d(4) == 0.030 and d(3) == pytest.approx(0.0245)
    assert list(d.points()) == [1, 2, 4]


def test_cost_model_work_is_bounded():
    """Every prefill size is a count: a long-running server must not refit over all of
    them every step (600 counts took 0.53 ms a refit before the bound)."""
    c = CostModel(max_counts=64)
    for T in range(1, 10):
        c.seed(T, 0.01 + 0.001 * T)
    for T in range(1, 600):
        c.observe(T, 0.01 + 0.0001 * T)
    assert len(c._obs) == 64 and min(c._obs) == 600 - 64  # the latest 64 kept
    for _ in range(200):  # the horizon passes: the old counts only restate the prior
        c.observe(8, 0.011)
    assert set(c.points()) == set(range(1, 10))
    assert c(9) >= c(8) == pytest.approx(0.011, rel=0.05)


def test_cost_model_rare_count_is_not_cheaper_than_the_common_one():
    # The batch-8 case: the plain count seen every step, one more token seen twice, both
    # with the same spread. The fitted curve must keep the extra token's cost (a lower
    # quartile made the rare count's minimum look cheaper than the common count's
    # quartile, and the fit then pooled them into a flat segment).
    c = CostModel()
    spread = [0.0150, 0.0145, 0.0170, 0.0140, 0.0160, 0.0155, 0.0148, 0.0165] * 2
    for t in spread:
        c.observe(8, t)
    c.observe(9, 0.0142 + 0.0007)
    c.observe(9, 0.0165 + 0.0007)
    assert c(9) - c(8) > 0.0005


def test_cost_model_prices_rare_counts_by_the_profile_shape_at_todays_level():
    c = CostModel(horizon=32)
    for T, t in ((8, 0.010), (9, 0.011), (12, 0.014)):  # start-up profile, short context
        c.seed(T, t)
    assert c(9) == pytest.approx(0.011)
    c.observe(9, 0.0105)  # seen once early, at a short context
    for _ in range(40):  # later steps at a longer context: the plain count costs more
        c.observe(8, 0.015)
    # the early 9 is older than the horizon: t(9) follows the profile from today's t(8)
    assert c(8) == pytest.approx(0.015)
    assert c(9) == pytest.approx(0.015 * 1.1) and c(12) == pytest.approx(0.015 * 1.4)
    assert c(10) == pytest.approx(0.015 * 1.2)  # between profile points: interpolated
    c.observe(9, 0.0140)  # measured now, once: pulled towards the prior (4 to 1)
    assert c(9) == pytest.approx((0.0140 + 4 * 0.0165) / 5)
    for _ in range(12):
        c.observe(9, 0.0180)  # measured often: its own median dominates
    assert c(9) == pytest.approx((13 * 0.018 + 4 * 0.0165) / 17)
    # without a profile, a count keeps its measurements however old
    d = CostModel(horizon=4)
    d.observe(2, 0.02)
    for _ in range(10):
        d.observe(1, 0.01)
    assert d(2) == pytest.approx(0.02)


_cost_ops = st.lists(
    st.tuples(
        st.sampled_from(["observe", "observe", "observe", "seed"]),
        st.integers(1, 12),
        st.sampled_from([0.0, -1.0, 0.010, 0.011, 0.012, 0.015, 0.020, 0.050]),
    ),
    max_size=80,
)


@given(ops=_cost_ops, horizon=st.integers(1, 12), window=st.integers(1, 6),
       max_counts=st.integers(1, 8))  # fmt: skip
def test_cost_model_cached_fit_equals_the_refit(ops, horizon, window, max_counts):
    """The fit from cached per-count medians equals the fit from every measurement after
    any history: counts leaving the horizon, the window and the bound on counts, seeds
    after observations, rejected measurements."""
    c = CostModel(window=window, horizon=horizon, max_counts=max_counts)
    for op, T, s in ops:
        getattr(c, op)(T, s)
        assert c._fit() == c._fit_reference()
        assert c.at(range(1, 14)) == [c(T) for T in range(1, 14)]


def _flat(t1=0.02, slope=0.0):
    c = CostModel()
    for T in (1, 2, 4, 8, 16, 64, 128):
        c.observe(T, t1 + slope * (T - 1))
    return c


def test_plan_speculates_when_it_pays_and_not_otherwise():
    ctl = AdaptiveController(k_max=4, cost=_flat(), probe_every=0)
    for _ in range(20):
        ctl.observe("good", 4, 4)
        ctl.observe("bad", 4, 0)
    assert ctl.acceptance("good") > 0.9 and ctl.acceptance("bad") < 0.2
    # a memory-bound step (flat cost): the good sequence proposes all 4
    ks = ctl.plan([("good", 4), ("bad", 4), ("new", 2)], base_tokens=3)
    assert ks[0] == 4 and ks[2] <= 2
    # a step whose cost grows with every token (compute-bound): the poor proposals go
    steep = AdaptiveController(k_max=4, cost=_flat(0.02, 0.01), probe_every=0)
    for _ in range(20):
        steep.observe("bad", 4, 0)
    assert steep.plan([("bad", 4)], base_tokens=1) == [0]
    # a large batch whose step time is proportional to its tokens: nothing pays
    big = AdaptiveController(k_max=4, cost=_flat(0.001, 0.001), probe_every=0)
    for _ in range(20):
        big.observe("x", 4, 2)
    assert big.plan([("x", 4)] * 32, base_tokens=32) == [0] * 32
    # caps are respected; not adaptive: the caps
    assert AdaptiveController(k_max=3, adaptive=False).plan([("a", 5), ("b", 1)], 2) == [3, 1]
    assert AdaptiveController(k_max=3, disable_by_batch_size=2).plan([("a", 3), ("b", 3)], 2) == [
        0,
        0,
    ]


def test_a_closed_batch_needs_the_larger_margin():
    """A batch no request waits to join speculates only for a predicted gain above
    ``closed_min_gain``: its length is set by its slowest sequence."""
    ctl = AdaptiveController(k_max=4, cost=_flat(0.0065, 0.0005), probe_every=0)
    for _ in range(40):  # ~0.8: the best plan gains ~8% (5% more time per token)
        ctl.observe("a", 5, 4)
        ctl.observe("b", 4, 4)
    assert 0.75 < ctl.acceptance("a") < 0.85 and ctl.acceptance("b") > 0.95
    others = [(f"o{i}", 0) for i in range(7)]
    assert ctl.plan([("a", 4), *others], base_tokens=8)[0] > 0
    assert ctl.plan([("a", 4), *others], base_tokens=8, closed=True)[0] == 0
    assert ctl.plan([("b", 4), *others], base_tokens=8, closed=True)[0] == 4
    ctl.closed_min_gain = ctl.min_gain
    assert ctl.plan([("a", 4), *others], base_tokens=8, closed=True)[0] > 0


def test_plan_counts_the_draft_models_time():
    ctl = AdaptiveController(k_max=4, cost=_flat(), probe_every=0)
    for _ in range(20):
        ctl.observe("s", 4, 2)
    assert ctl.plan([("s", 4)], 1)[0] > 0
    slow = CostModel()
    slow.observe(1, 0.05)  # a draft step costs more than the target's
    ctl.draft_cost = slow
    assert ctl.plan([("s", 4)], 1) == [0]


def test_probe_and_shadow_update_a_switched_off_sequence():
    ctl = AdaptiveController(k_max=4, cost=_flat(0.02, 0.01), probe_every=3)
    for _ in range(30):
        ctl.observe("s", 4, 0)
    assert ctl.plan([("s", 4)], 1) == [0]  # no step time observed yet: no budget
    for _ in range(1000):  # 20 s of one-token steps: a budget of 0.4 s of probes
        ctl.observe_step(1, 0.02)
    plans = [ctl.plan([("s", 4)], 1)[0] for _ in range(6)]
    assert plans == [0, 1, 0, 0, 1, 0]
    ctl.probe_k = 0  # prompt lookup: the whole match
    assert [ctl.plan([("s", 3)], 1)[0] for _ in range(3)] == [0, 3, 0]
    before = ctl.acceptance("s")
    tokens = [5, 6, 7, 8, 9]
    ctl.set_shadow("s", [7, 8, 9], start=2)
    assert ctl.check_shadow("s", tokens[:3])  # not decided yet: one of three seen, equal
    assert ctl.acceptance("s") == before
    assert not ctl.check_shadow("s", tokens)
    assert ctl.acceptance("s") > before
    ctl.forget("s")
    assert ctl.acceptance("s") == ctl.global_acceptance


def test_acceptance_prior_is_pooled_per_group():
    """Keys (owner, group): a new key starts from its group's pooled rate (prompt lookup:
    the match length), other keys from the rate of all; the pooled rate of all moves
    with every key."""
    ctl = AdaptiveController(k_max=4, cost=_flat(0.02, 0.005), probe_every=0)
    for _ in range(40):
        ctl.observe(("a", 1), 4, 0)  # one-token matches: every proposal rejected
        ctl.observe(("a", 3), 4, 4)  # three-token matches: all accepted
    low, high = ctl.group_acceptance(1), ctl.group_acceptance(3)
    assert low < 0.1 and high > 0.9
    assert low < ctl.global_acceptance < high
    # a new sequence: its estimate per match length is its group's
    assert ctl.acceptance(("b", 1)) == pytest.approx(low)
    assert ctl.acceptance(("b", 3)) == pytest.approx(high)
    assert ctl.acceptance("b") == ctl.global_acceptance
    assert ctl.group_acceptance(2) == ctl.global_acceptance  # nothing seen in group 2
    # priced apart: the same sequence proposes after a long match, not after a short one
    assert ctl.plan([(("b", 3), 4)], 1)[0] > 0
    assert ctl.plan([(("b", 1), 4)], 1) == [0]
    ctl.forget(("a", 1))
    assert ctl.group_acceptance(1) == pytest.approx(low)  # the pool outlives its keys


def test_probes_are_rationed_by_the_budget():
    """At most one probe per step, and the cost curve's extra time of all probes stays
    within probe_budget of the observed step time."""
    cost = _flat(0.02, 0.01)  # every proposal adds half a one-token step: none pays
    ctl = AdaptiveController(k_max=4, cost=cost, probe_every=2, probe_k=0)
    seqs = [(f"s{i}", 3) for i in range(8)]
    for key, _ in seqs:
        for _ in range(30):
            ctl.observe(key, 4, 0)
    probes = spent = elapsed = 0.0
    for _ in range(400):
        ks = ctl.plan(seqs, base_tokens=8)
        assert sum(1 for k in ks if k) <= 1  # one probing sequence per step
        probes += sum(ks) > 0
        spent += cost(8 + sum(ks)) - cost(8)
        step = cost(8 + sum(ks))
        ctl.observe_step(8 + sum(ks), step)
        elapsed += step
        assert spent <= ctl.probe_budget * elapsed + 1e-12
    assert probes > 0  # probing did not stop for good
    assert spent / elapsed == pytest.approx(ctl.probe_budget, rel=0.25)


def test_nothing_to_propose_skips_pricing_but_counts_idle_steps():
    """Candidates that found nothing (caps 0) get k = 0 without the cost curve being
    consulted, and their idle steps still count towards a probe once they can propose."""

    class Counting(CostModel):
        calls = 0

        def __call__(self, tokens: int) -> float:
            Counting.calls += 1
            return super().__call__(tokens)

    cost = Counting()
    cost.seed(1, 0.01)
    cost.seed(2, 0.02)  # a proposal costs a whole step: only a probe proposes
    ctl = AdaptiveController(k_max=4, cost=cost, probe_every=5)
    for _ in range(60):  # steps enough that one probe fits the budget
        ctl.observe_step(1, 0.01)
    for _ in range(5):
        assert ctl.plan([("s", 0)], base_tokens=1) == [0]
    assert Counting.calls == 0
    assert ctl.plan([("s", 2)], base_tokens=1) == [1]  # due: five idle steps, a probe
    assert Counting.calls > 0
