"""Replaying a stored stream through a monitor, and the monitor's summary in words.

``hydra-run --monitor`` feeds a :class:`~hydra_deploy.monitor.Monitor` batch by batch while it
runs; ``hydra-monitor`` feeds one the rows a run stored (hydra-run's JSON results,
hydra-score-dataset's Parquet rows, as dicts): :func:`stream_columns` turns the rows into what
:meth:`Monitor.observe <hydra_deploy.monitor.Monitor.observe>` takes, :func:`replay` observes them
in order and adds the running series a plot shows, :func:`summary_lines` says where the stream
stands. numpy only (edge code).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hydra_deploy.errors import DataError, ParameterError, counted
from hydra_deploy.monitor.monitor import Monitor

log = logging.getLogger("hydra_deploy")

__all__ = ["no_reference", "replay", "rolling_mean", "stream_columns", "summary_lines"]

_ESTIMATES = {  # estimate -> what it is the mean of
    "accuracy": "estimated accuracy (mean calibrated confidence)",
    "coverage": "estimated set coverage (mean calibrated set mass)",
    "set_size": "mean set size",
}


def no_reference(model: Any) -> ParameterError:
    """The error for an export whose decisions hold no monitor reference, with the fix."""
    return ParameterError(
        f"{model} holds no monitor reference: fit the decisions again with "
        f"hydra-calibrate {model} --data LABELLED --overwrite"
    )


def _rerun(what: str) -> DataError:
    return DataError(
        f"the stored rows hold no {what}: run hydra-run again with --monitor (or "
        "hydra-score-dataset with --member-logits) on an export that hydra-calibrate fitted, "
        "without --raw"
    )


def _scores(rows: Sequence[Mapping[str, Any]], monitor: Monitor) -> np.ndarray:
    """The monitored score per row: hydra-run --monitor's ``monitor_score``; else, for the
    record's ``msp`` score, the calibrated confidence negated (the same number)."""
    if all(row.get("monitor_score") is not None for row in rows):
        return np.array([row["monitor_score"] for row in rows], dtype=np.float64)
    record = monitor.record
    score = None if record is None or record.monitor is None else record.monitor.score
    if score == "msp" and all(row.get("confidence") is not None for row in rows):
        log.warning(
            "the stored rows hold no monitor_score: the msp score is taken from the calibrated "
            "confidence, rounded to float32, so p-values can differ from a live run's where "
            "scores are that close (rerun hydra-run with --monitor for the exact score)"
        )
        return -np.array([row["confidence"] for row in rows], dtype=np.float64)
    raise _rerun(f"monitored score ({score or 'the OOD score'})")


def stream_columns(rows: Sequence[Mapping[str, Any]], monitor: Monitor) -> dict[str, np.ndarray]:
    """What :meth:`Monitor.observe` takes for the stored ``rows``, in their order: from the
    member logits where the rows hold them (hydra-score-dataset ``--member-logits``: exactly
    what the live run computed), else from hydra-run's fields (``monitor_score`` and
    ``monitor_set_mass`` of ``--monitor``, ``confidence``, ``prediction_set``, ``accept``,
    ``ood_flag``). A :class:`DataError` names the flag to rerun with when they are missing."""
    if not rows:
        raise DataError("the stored stream holds no rows: nothing to replay")
    if all(row.get("member_logits") is not None for row in rows):
        logits = np.asarray([row["member_logits"] for row in rows], dtype=np.float32)
        return monitor.columns(logits)
    if any(row.get("confidence") is None for row in rows):
        raise _rerun("calibrated confidence")
    scores = _scores(rows, monitor)
    columns: dict[str, Any] = {
        "scores": scores,
        "confidence": np.array([row["confidence"] for row in rows], dtype=np.float64),
    }
    first = rows[0]
    if "prediction_set" in first:
        columns["set_size"] = np.array([len(row["prediction_set"]) for row in rows])
        if all(row.get("monitor_set_mass") is not None for row in rows):
            columns["set_mass"] = np.array([row["monitor_set_mass"] for row in rows])
    for name in ("ood_flag", "accept"):
        if name in first:
            columns[name] = np.array([bool(row[name]) for row in rows])
    return columns


def rolling_mean(values: Any, window: int) -> np.ndarray:
    """The mean of the last ``window`` values (fewer at the start) at each step."""
    values = np.asarray(values, dtype=np.float64)
    sums = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, values.size + 1)
    starts = np.maximum(ends - int(window), 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def replay(monitor: Monitor, columns: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Observe ``columns`` (:func:`stream_columns`) in order; the per-input ``pvalue``,
    ``martingale`` and ``alarm``, and the running series a plot shows: ``accuracy`` (the
    estimated accuracy over the last window) and ``rate_<name>`` for each watched rate."""
    given = dict(columns)
    out = monitor.observe(**given)
    window = monitor.window
    if "confidence" in given:
        out["accuracy"] = rolling_mean(given["confidence"], window)
    hits = {
        "ood_flag": given.get("ood_flag"),
        "abstained": None if "accept" not in given else ~np.asarray(given["accept"], dtype=bool),
        "empty_set": None if "set_size" not in given else np.asarray(given["set_size"]) == 0,
    }
    for name in monitor.rates:
        out[f"rate_{name}"] = rolling_mean(hits[name], window)
    return out


def _alarm_lines(summary: Mapping[str, Any]) -> list[str]:
    alarms = summary["alarms"]
    threshold = f"{summary['alarm_at']:g}"
    if not alarms:
        return [
            f"drift alarm: none over {summary['inputs']} inputs (martingale "
            f"{summary['martingale']:.3g}, alarm at {threshold} = 1/{summary['alpha']:g})"
        ]
    lines = [f"drift alarm: {len(alarms)} over {summary['inputs']} inputs (alarm at {threshold})"]
    lines += [
        f"  at input {a['index']} (martingale {a['value']:.3g}"
        + (
            ", the first: P(a false alarm ever) <= alpha)"
            if a["run"] == 0
            else ", after a restart)"
        )
        for a in alarms
    ]
    return lines


def summary_lines(summary: Mapping[str, Any]) -> list[str]:
    """:meth:`Monitor.summary` in words: the alarms, each rate against calibration's
    expectation, the label-free estimates."""
    lines = _alarm_lines(summary)
    for name, rate in summary["rates"].items():
        if rate["rate"] is None:
            continue
        low, high = rate["window_interval"]
        window = (
            f"; last window {rate['window_rate']:.4f} [{low:.4f}, {high:.4f}]"
            if rate["window_rate"] is not None
            else ""
        )
        lines.append(
            f"{name}: {rate['rate']:.4f} of {rate['count']} (expected <= {rate['expected']:.4f}"
            f"{window}; {counted(rate['alerts'], 'alert')})"
        )
    for name, value in summary["estimates"].items():
        if value is not None:
            lines.append(
                f"{_ESTIMATES[name]}: {value:.4f} over the last {summary['window']} inputs "
                "(an estimate: it fails under concept shift)"
            )
    return lines
