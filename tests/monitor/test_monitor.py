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


# --- from an export's decisions record ------------------------------------------------------------
def _logits(rng: np.random.Generator, count: int, signal: float) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.integers(0, 5, size=count)
    logits = rng.normal(size=(count, 3, 5))
    logits[np.arange(count), :, labels] += signal
    return logits, labels


def _record(seed: int = 0, onnx: str = "a"):
    from hydra_deploy.decisions import fit_decisions

    logits, labels = _logits(np.random.default_rng(seed), 600, 3.0)
    return fit_decisions(logits, labels, onnx_sha256=onnx * 64, data_sha256="b" * 64, risk=0.2)


def test_the_record_carries_the_reference_and_the_expected_rates():
    import json

    from hydra_deploy.decisions import calibrated_scores, split_rows
    from hydra_deploy.export_folder import DecisionRecord
    from hydra_deploy.monitor.monitor import expected_rates
    from hydra_deploy.uncertainty.metrics import ood_score

    record = _record()
    reference = record.monitor
    assert reference.score == "msp" and len(reference.values) == record.n_quantile
    assert list(reference.values) == sorted(reference.values)
    logits, _ = _logits(np.random.default_rng(0), 600, 3.0)
    _, held = split_rows(600, record.holdout, record.seed)
    expected = np.sort(ood_score(calibrated_scores(logits[held], record.temperature), "msp"))
    np.testing.assert_array_equal(np.asarray(reference.values), expected)
    assert set(reference.counts) == {"ood_flag", "abstained", "empty_set"}
    again = DecisionRecord.from_dict(json.loads(json.dumps(record.to_dict())))
    assert again == record
    rates = expected_rates(record)
    assert rates["ood_flag"] == record.ood.alpha
    hits, count = reference.counts["abstained"]
    assert hits / count <= rates["abstained"] <= 1.0


def test_a_damaged_reference_is_refused():
    import json

    from hydra_deploy.export_folder import DecisionRecord, ExportFolderError

    entry = json.loads(json.dumps(_record().to_dict()))
    entry["monitor"]["values"][0] -= 1.0
    with pytest.raises(ExportFolderError, match="do not match their SHA-256"):
        DecisionRecord.from_dict(entry)
    entry = json.loads(json.dumps(_record().to_dict()))
    del entry["monitor"]  # a record from before the reference: still read
    assert DecisionRecord.from_dict(entry).monitor is None


def test_observe_logits_watches_what_a_runner_computes(tmp_path):
    record = _record()
    rng = np.random.default_rng(7)
    monitor = Monitor.from_record(record, window=100, rule="mixture")
    quiet, _ = _logits(rng, 300, 3.0)
    out = monitor.observe_logits(quiet)
    assert out["pvalue"].shape == (300,) and not monitor.summary()["alarms"]
    estimates = monitor.summary()["estimates"]
    assert 0.5 < estimates["accuracy"] <= 1.0 and 0.5 < estimates["coverage"] <= 1.0
    monitor.save(tmp_path / "state.json")
    resumed = Monitor.load(tmp_path / "state.json", record)
    noisy, _ = _logits(rng, 300, 0.5)  # the model is unsure: inputs unlike the calibration's
    assert resumed.observe_logits(noisy)["alarm"].any()
    assert resumed.summary()["rates"]["ood_flag"]["alerts"] >= 1
    with pytest.raises(ParameterError, match="another model file"):
        Monitor.load(tmp_path / "state.json", _record(onnx="c"))


def test_a_record_without_a_reference_says_to_refit():
    import dataclasses

    old = dataclasses.replace(_record(), monitor=None)
    with pytest.raises(ParameterError, match="fit the decisions again with hydra-calibrate"):
        Monitor.from_record(old)
