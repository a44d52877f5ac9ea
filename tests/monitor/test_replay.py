"""The replay helpers: running means, the columns of stored rows, the summary in words."""

from __future__ import annotations

import numpy as np
import pytest

from hydra_deploy.errors import DataError
from hydra_deploy.monitor import Monitor, replay, rolling_mean, stream_columns, summary_lines


def test_rolling_mean_is_the_mean_of_the_last_window():
    values = np.arange(10.0)
    got = rolling_mean(values, 3)
    want = [values[max(0, i - 2) : i + 1].mean() for i in range(10)]
    np.testing.assert_allclose(got, want)


def test_rows_replay_like_observe_and_the_summary_reads():
    rng = np.random.default_rng(0)
    reference = rng.normal(size=200)
    rows = [
        {
            "monitor_score": float(s),
            "confidence": float(c),
            "prediction_set": [0] * int(k),
            "monitor_set_mass": 0.9,
            "ood_flag": bool(s > 1.6),
            "accept": bool(c > 0.6),
        }
        for s, c, k in zip(
            rng.normal(loc=1.0, size=120),
            rng.uniform(0.5, 1, 120),
            rng.integers(0, 3, 120),
            strict=True,
        )
    ]
    expected = {"ood_flag": 0.05, "abstained": 0.2, "empty_set": 0.3}
    live = Monitor(reference, expected=expected, window=30)
    want = live.observe(
        [r["monitor_score"] for r in rows],
        confidence=[r["confidence"] for r in rows],
        set_mass=[0.9] * 120,
        set_size=[len(r["prediction_set"]) for r in rows],
        ood_flag=[r["ood_flag"] for r in rows],
        accept=[r["accept"] for r in rows],
    )
    replayed = Monitor(reference, expected=expected, window=30)
    out = replay(replayed, stream_columns(rows, replayed))
    for key in ("pvalue", "martingale", "alarm"):
        np.testing.assert_array_equal(out[key], want[key])
    assert out["rate_ood_flag"][-1] == pytest.approx(np.mean([r["ood_flag"] for r in rows[-30:]]))
    assert replayed.summary() == live.summary()
    text = "\n".join(summary_lines(replayed.summary()))
    assert "drift alarm" in text and "at input" in text and "expected <= 0.0500" in text
    assert "estimated accuracy" in text


def test_rows_without_what_the_monitor_needs_are_refused():
    monitor = Monitor(np.zeros(10))
    with pytest.raises(DataError, match="no rows"):
        stream_columns([], monitor)
    with pytest.raises(DataError, match=r"calibrated confidence.*--monitor"):
        stream_columns([{"msp": 0.5}], monitor)
    with pytest.raises(DataError, match="monitored score"):
        stream_columns([{"confidence": 0.5}], monitor)  # no record: the score is unknown
