"""Live rates and windows: exact binomial tests equal SciPy's; false alerts per window stay at level."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_deploy.errors import ParameterError
from hydra_deploy.monitor.rates import RateWatch, WindowMean, binomial_interval

scipy_stats = pytest.importorskip(
    "scipy.stats", reason="SciPy is the reference of the binomial test"
)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 400),
    share=st.floats(0.0, 1.0),
    expected=st.floats(0.001, 0.999),
    side=st.sampled_from(["above", "below"]),
)
def test_pvalue_and_interval_equal_scipys(n, share, expected, side):
    k = round(share * n)
    watch = RateWatch("flags", expected=expected, side=side)
    alternative = "greater" if side == "above" else "less"
    reference = scipy_stats.binomtest(k, n, expected, alternative=alternative).pvalue
    assert watch.pvalue(k, n) == pytest.approx(reference, rel=1e-6, abs=1e-12)
    low, high = binomial_interval(k, n, 0.05)
    ci = scipy_stats.binomtest(k, n, 0.5).proportion_ci(0.95, method="exact")
    assert low == pytest.approx(ci.low, abs=1e-7) and high == pytest.approx(ci.high, abs=1e-7)


def test_false_alerts_per_window_stay_at_the_level():
    rng = np.random.default_rng(0)
    watch = RateWatch("flags", expected=0.05, window=200, level=0.05)
    windows = 2000
    for hit in rng.random(200 * windows) < 0.05:
        watch.add(hit)
    share = len(watch.alerts) / windows
    assert share <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / windows), share
    assert watch.total == 200 * windows and watch.current == 0


def test_a_raised_rate_alerts_with_its_window():
    rng = np.random.default_rng(1)
    watch = RateWatch("abstained", expected=0.1, window=100, level=0.01)
    for hit in rng.random(300) < 0.1:
        watch.add(hit)
    before = len(watch.alerts)
    for hit in rng.random(100) < 0.4:  # a window of 400..499 at four times the rate
        watch.add(hit)
    alert = watch.alerts[-1]
    assert len(watch.alerts) == before + 1 and alert.start == 300 and alert.count == 100
    assert alert.hits > 25 and alert.pvalue <= 0.01
    summary = watch.summary()
    assert summary["count"] == 400 and summary["alerts"] == len(watch.alerts)


def test_state_round_trips_and_windows_mean():
    watch = RateWatch("empty sets", expected=0.02, window=7)
    for i in range(10):
        watch.add(i % 3 == 0)
    again = RateWatch("empty sets", expected=0.02, window=7)
    again.restore(json.loads(json.dumps(watch.state())))
    assert again.summary() == watch.summary()
    mean = WindowMean(window=3)
    for value in (1.0, float("nan"), 2.0, 3.0, 4.0):
        mean.add(value)
    assert mean.mean == pytest.approx(3.0)
    copy = WindowMean(window=3)
    copy.restore(mean.state())
    assert copy.mean == mean.mean


def test_bad_settings_say_what_is_wrong():
    with pytest.raises(ParameterError, match="not in"):
        RateWatch("flags", expected=1.5)
    with pytest.raises(ParameterError, match="above, below, both"):
        RateWatch("flags", expected=0.1, side="up")
    with pytest.raises(ParameterError, match="window"):
        WindowMean(0)
