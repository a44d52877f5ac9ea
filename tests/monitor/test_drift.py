"""The drift alarm's guarantees, checked by simulation with fixed seeds (not timing-dependent).

- the randomised conformal p-values against a reference that grows with the stream are uniform and
  independent when the stream is exchangeable with the reference, ties included;
- the betting martingales are test martingales: under the null the share of streams whose
  martingale ever reaches 1 / alpha stays at or below alpha (Monte-Carlo margin of 3 sigma);
- a shift is found; a state saved as JSON resumes the same stream exactly.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hydra_deploy.errors import ParameterError
from hydra_deploy.monitor import ConformalPValues, DriftTest, PowerMixture, SimpleJumper


def _margin(rate: float, n: int) -> float:
    return 3.0 * math.sqrt(rate * (1.0 - rate) / n)


@pytest.mark.parametrize("ties", [False, True])
def test_pvalues_are_uniform_and_independent_under_exchangeability(ties):
    rng = np.random.default_rng(0)
    streams, reference_size, steps = 300, 50, 40
    pvalues = np.empty((streams, steps))
    for i in range(streams):
        data = rng.normal(size=reference_size + steps)
        if ties:
            data = np.round(data)  # a handful of values: many ties
        test = ConformalPValues(data[:reference_size], seed=i)
        pvalues[i] = test.pvalues(data[reference_size:])
    flat = pvalues.reshape(-1)
    assert flat.min() > 0.0 and flat.max() <= 1.0
    # uniform: each decile holds a tenth (12,000 p-values; 4 sigma of a binomial share)
    counts = np.histogram(flat, bins=10, range=(0.0, 1.0))[0] / flat.size
    assert np.all(np.abs(counts - 0.1) < 4 * math.sqrt(0.09 / flat.size))
    # independent: consecutive p-values of a stream are uncorrelated (a shared reference would not be)
    lag = np.corrcoef(pvalues[:, :-1].reshape(-1), pvalues[:, 1:].reshape(-1))[0, 1]
    assert abs(lag) < 4 / math.sqrt(flat.size)
    # the first p-value of each stream, across streams, too (the reference's own draw)
    assert abs(pvalues[:, 0].mean() - 0.5) < 4 * math.sqrt(1 / 12 / streams)


@pytest.mark.parametrize("rule", [SimpleJumper, PowerMixture])
def test_false_alarms_stay_below_alpha_on_a_null_of_20000_steps(rule):
    rng = np.random.default_rng(1)
    streams, steps, alpha = 2000, 20_000, 0.05
    bettor = rule(streams=(streams,))
    crossed = np.zeros(streams, dtype=bool)
    for _ in range(steps):
        bettor.bet(1.0 - rng.random(streams))  # exact p-values are uniform on (0, 1] (see above)
        crossed |= bettor.log_wealth >= -math.log(alpha)
    rate = crossed.mean()
    assert rate <= alpha + _margin(alpha, streams), rate


def _expected_factor(bettor, log_p: np.ndarray) -> float:
    """E[f(p)] for a uniform p by the trapezoid rule in x = log p (dp = e^x dx: smooth integrand)."""
    before = np.asarray(bettor.log_wealth)
    bettor.bet(np.exp(log_p))
    integrand = np.exp(np.asarray(bettor.log_wealth) - before + log_p)
    return float(np.sum((integrand[1:] + integrand[:-1]) / 2 * np.diff(log_p)))


def test_the_jumper_and_the_mixture_bet_fairly():
    """E[f(p)] = 1 for a uniform p, at every step: the martingale property."""
    log_p = np.linspace(-700.0, 0.0, 400_001)  # p from e^-700 (mass below: < 1e-7) to 1
    for rule in (
        lambda: SimpleJumper(jump=0.3, streams=log_p.shape),
        lambda: PowerMixture(streams=log_p.shape),
    ):
        bettor = rule()
        assert _expected_factor(bettor, log_p) == pytest.approx(1.0, abs=1e-4)
        bettor.reset()
        for p in (0.3, 0.01, 0.9):  # after other bets the bettors' weights differ
            bettor.bet(np.full(log_p.shape, p))
        assert _expected_factor(bettor, log_p) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("rule", ["jumper", "mixture"])
def test_a_shift_raises_an_alarm_and_a_quiet_stream_does_not(rule):
    rng = np.random.default_rng(2)
    test = DriftTest(rng.normal(size=1000), alpha=0.05, rule=rule, seed=3)
    test.update_many(rng.normal(size=500))
    assert not test.alarms
    test.update_many(rng.normal(loc=2.0, size=300))  # the OOD score jumps: inputs look unusual
    assert test.alarms and 500 <= test.alarms[0].index < 600
    assert test.alarms[0].value >= 20.0 and test.alarms[0].run == 0


def test_restart_and_standing_alarm():
    rng = np.random.default_rng(4)
    reference, shifted = rng.normal(size=500), rng.normal(loc=3.0, size=200)
    restarting = DriftTest(reference, restart=True)
    restarting.update_many(shifted)
    assert len(restarting.alarms) > 1
    assert [a.run for a in restarting.alarms] == list(range(len(restarting.alarms)))
    standing = DriftTest(reference, restart=False)
    out = standing.update_many(shifted)
    assert len(standing.alarms) == 1 and standing.raised and out["alarm"].sum() == 1


def test_state_resumes_the_stream_exactly():
    rng = np.random.default_rng(5)
    reference, stream = rng.normal(size=300), rng.normal(loc=0.5, size=400)
    whole = DriftTest(reference, rule="mixture", seed=9)
    expected = whole.update_many(stream)
    first = DriftTest(reference, rule="mixture", seed=9)
    head = first.update_many(stream[:150])
    resumed = DriftTest.from_state(reference, json.loads(json.dumps(first.state())))
    tail = resumed.update_many(stream[150:])
    for key in ("pvalue", "martingale", "alarm"):
        np.testing.assert_array_equal(np.concatenate([head[key], tail[key]]), expected[key])
    assert resumed.alarms == whole.alarms


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ParameterError, match="alpha"):
        DriftTest([0.0, 1.0], alpha=1.5)
    with pytest.raises(ParameterError, match="empty"):
        DriftTest([])
    with pytest.raises(ParameterError, match="choose one of jumper, mixture"):
        DriftTest([0.0], rule="kelly")
    with pytest.raises(ParameterError, match="NaN"):
        DriftTest([0.0]).update(float("nan"))
    with pytest.raises(ParameterError, match="version"):
        DriftTest.from_state([0.0], {"version": 99})


@pytest.mark.parametrize("ties", [False, True])
def test_stream_pvalues_equal_the_one_stream_path_bit_for_bit(ties):
    from hydra_deploy.monitor.pvalues import stream_pvalues

    rng = np.random.default_rng(7)
    reference, streams = rng.normal(size=60), rng.normal(size=(5, 90))
    if ties:
        reference, streams = np.round(reference), np.round(streams)
    u = np.empty_like(streams)
    expected = np.empty_like(streams)
    for row in range(streams.shape[0]):
        one = ConformalPValues(reference, seed=row)
        u[row] = 1.0 - np.random.default_rng(row).random(streams.shape[1])
        expected[row] = one.pvalues(streams[row])
    np.testing.assert_array_equal(stream_pvalues(reference, streams, u), expected)
