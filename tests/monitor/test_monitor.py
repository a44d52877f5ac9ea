"""The Monitor: every part fed from one batch call, a state that resumes exactly, shared by threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hydra_deploy.errors import DataError, ParameterError
from hydra_deploy.monitor import Monitor


def _batch(rng: np.random.Generator, count: int, shift: float = 0.0) -> dict[str, np.ndarray]:
    sizes = rng.integers(0, 4, size=count)
    return {
        "scores": rng.normal(loc=shift, size=count),
        "confidence": rng.uniform(0.5, 1.0, size=count),
        "set_mass": rng.uniform(0.8, 1.0, size=count),
        "set_size": sizes,
        "ood_flag": rng.random(count) < 0.05 + shift / 4,
        "accept": rng.random(count) > 0.1,
    }


def _monitor(reference: np.ndarray, **settings) -> Monitor:
    expected = {"ood_flag": 0.05, "abstained": 0.1, "empty_set": 0.25}
    return Monitor(reference, expected=expected, window=50, **settings)


def test_observe_feeds_the_alarm_the_rates_and_the_estimates():
    rng = np.random.default_rng(0)
    monitor = _monitor(rng.normal(size=400))
    batch = _batch(rng, 120)
    scores = batch.pop("scores")
    out = monitor.observe(scores, **batch)
    assert set(out) == {"pvalue", "martingale", "alarm"} and out["pvalue"].shape == (120,)
    summary = monitor.summary()
    assert summary["inputs"] == 120 and not summary["alarms"]
    flags = summary["rates"]["ood_flag"]
    assert flags["count"] == 120 and flags["rate"] == pytest.approx(batch["ood_flag"].mean())
    assert summary["rates"]["empty_set"]["rate"] == pytest.approx((batch["set_size"] == 0).mean())
    assert summary["estimates"]["accuracy"] == pytest.approx(batch["confidence"][-50:].mean())
    assert summary["estimates"]["coverage"] == pytest.approx(batch["set_mass"][-50:].mean())


def test_a_shift_alarms_and_alerts():
    rng = np.random.default_rng(1)
    monitor = _monitor(rng.normal(size=400))
    quiet = _batch(rng, 200)
    monitor.observe(quiet.pop("scores"), **quiet)
    shifted = _batch(rng, 200, shift=2.0)
    out = monitor.observe(shifted.pop("scores"), **shifted)
    assert out["alarm"].any()
    assert monitor.summary()["rates"]["ood_flag"]["alerts"] >= 1


def test_saved_state_resumes_exactly(tmp_path):
    rng = np.random.default_rng(2)
    reference = rng.normal(size=300)
    batches = [_batch(rng, 80, shift=s) for s in (0.0, 0.0, 1.0)]
    whole = _monitor(reference, rule="mixture", seed=4)
    expected = [
        whole.observe(b["scores"], **{k: v for k, v in b.items() if k != "scores"}) for b in batches
    ]
    first = _monitor(reference, rule="mixture", seed=4)
    first.observe(batches[0]["scores"], **{k: v for k, v in batches[0].items() if k != "scores"})
    first.save(tmp_path / "monitor.json")
    resumed = Monitor.load(tmp_path / "monitor.json", reference)
    for batch, want in zip(batches[1:], expected[1:], strict=True):
        got = resumed.observe(batch["scores"], **{k: v for k, v in batch.items() if k != "scores"})
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    assert resumed.summary() == whole.summary()


def test_a_state_of_another_reference_or_a_broken_file_is_refused(tmp_path):
    rng = np.random.default_rng(3)
    monitor = _monitor(rng.normal(size=100))
    monitor.save(tmp_path / "m.json")
    with pytest.raises(ParameterError, match="recalibrated, so start a new state"):
        Monitor.load(tmp_path / "m.json", rng.normal(size=100))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="delete it to start a new one"):
        Monitor.load(tmp_path / "bad.json", monitor.reference)
    with pytest.raises(ParameterError, match="no monitor state"):
        Monitor.load(tmp_path / "none.json", monitor.reference)


def test_missing_columns_and_unknown_rates_are_named():
    monitor = _monitor(np.arange(10.0))
    with pytest.raises(DataError, match="ood_flag, abstained, empty_set"):
        monitor.observe([0.5])
    with pytest.raises(DataError, match="one per input"):
        monitor.observe([0.5, 0.2], confidence=[0.9])
    with pytest.raises(ParameterError, match="no rate named coverage"):
        Monitor([0.0], expected={"coverage": 0.9})


def test_threads_share_one_monitor():
    rng = np.random.default_rng(5)
    monitor = Monitor(rng.normal(size=200), expected={"ood_flag": 0.05})
    batches = [rng.normal(size=25) for _ in range(40)]

    def feed(part):
        for scores in part:
            monitor.observe(scores, ood_flag=np.zeros(scores.size, dtype=bool))

    threads = [threading.Thread(target=feed, args=(batches[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    summary = monitor.summary()
    assert summary["inputs"] == 1000 and summary["rates"]["ood_flag"]["count"] == 1000
    assert len(monitor.drift.pvalues.stream) == 1000
