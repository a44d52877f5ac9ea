"""One object that watches a deployed model: the drift alarm, the live rates, the label-free estimates.

:class:`Monitor` is fed, batch by batch in the order the inputs arrived, what every runner already
computes per input: the monitored score (the OOD score by default, higher = more unusual), and
where the export holds decisions the calibrated confidence, the calibrated mass of the prediction
set, its size, the OOD flag and the answer/abstain decision. It keeps

- a :class:`~hydra_deploy.monitor.drift.DriftTest` over the scores (the alarm and its guarantee);
- a :class:`~hydra_deploy.monitor.rates.RateWatch` per rate calibration gave an expectation for
  (``ood_flag``, ``abstained``, ``empty_set``);
- windowed means: the estimated accuracy (mean calibrated confidence), the estimated set coverage
  (mean calibrated set mass) and the mean set size.

Its state is a small JSON document (plus the stream's scores, one number per input: see
:mod:`~hydra_deploy.monitor.pvalues`), written atomically by :meth:`Monitor.save` and resumed
exactly by :meth:`Monitor.load`. :meth:`Monitor.observe` holds a lock: a server's threads may share
one monitor.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.atomic import atomic_write_json
from hydra_deploy.decisions import (
    binomial_upper_bound,
    calibrated_scores,
    check_classes,
    decided_from_scores,
)
from hydra_deploy.errors import DataError, ParameterError
from hydra_deploy.export_folder import DecisionRecord, reference_sha256
from hydra_deploy.monitor.drift import DriftTest
from hydra_deploy.monitor.rates import RateWatch, WindowMean
from hydra_deploy.uncertainty.metrics import ood_score

__all__ = ["EXPECTATION_LEVEL", "RATES", "Monitor", "expected_rates"]

#: the rates a monitor can watch: name -> the per-input outcome that counts as a hit
RATES = ("ood_flag", "abstained", "empty_set")
#: a rate measured on the quantile part is expected at most at its upper bound at this level
EXPECTATION_LEVEL = 0.05


def expected_rates(record: DecisionRecord, level: float = EXPECTATION_LEVEL) -> dict[str, float]:
    """What calibration expects of each rate the record's rules give: the OOD flag at most its
    alpha (its guarantee); abstentions and empty sets at most the exact upper bound, at ``level``,
    of their share in the quantile part (a measured rate, not a guaranteed one)."""
    if record.monitor is None:
        raise ParameterError(_NO_REFERENCE)
    expected = {}
    for name, (hits, count) in record.monitor.counts.items():
        if name == "ood_flag" and record.ood is not None:
            expected[name] = record.ood.alpha
        else:
            expected[name] = binomial_upper_bound(hits, count, level)
    return expected


_NO_REFERENCE = (
    "the decisions record holds no monitor reference (it was fitted before hydra-deploy stored "
    "one): fit the decisions again with hydra-calibrate"
)


def _column(values: Any, name: str, count: int) -> np.ndarray | None:
    if values is None:
        return None
    array = np.asarray(values).reshape(-1)
    if array.size != count:
        raise DataError(f"{name} has {array.size} values for {count} scores: one per input")
    return array


class Monitor:
    """Watch a stream of inputs against the export's calibration (see the module's docstring).

    ``reference``: the in-distribution values of the monitored score; ``expected``: the rate
    calibration expects for each of :data:`RATES` it gives (others are not watched);
    ``alpha``: the drift alarm's false-alarm level; ``window``: inputs per rate test and per
    estimate window; ``rate_level``: each window's false-alert level.
    """

    def __init__(
        self,
        reference: Any,
        *,
        expected: Mapping[str, float] | None = None,
        alpha: float = 0.05,
        rule: str = "jumper",
        window: int = 1000,
        rate_level: float = 0.01,
        seed: int = 0,
    ) -> None:
        unknown = sorted(set(expected or {}) - set(RATES))
        if unknown:
            raise ParameterError(
                f"no rate named {', '.join(unknown)}: a monitor watches {', '.join(RATES)}"
            )
        self.reference = np.sort(np.asarray(reference, dtype=np.float64).reshape(-1))
        self.drift = DriftTest(self.reference, alpha=alpha, rule=rule, seed=seed)
        self.rates = {
            name: RateWatch(name, float(rate), window=window, level=rate_level)
            for name, rate in (expected or {}).items()
        }
        self.window = int(window)
        self.rate_level = float(rate_level)
        self.estimates = {name: WindowMean(window) for name in ("accuracy", "coverage", "set_size")}
        self._lock = threading.Lock()
        self.record: DecisionRecord | None = None

    @classmethod
    def from_record(cls, record: DecisionRecord, **settings: Any) -> Monitor:
        """A monitor of the stream an export's decisions are applied to: its reference and
        expectations from ``record`` (``hydra-calibrate``'s), ``settings`` as the constructor's."""
        if record.monitor is None:
            raise ParameterError(_NO_REFERENCE)
        made = cls(record.monitor.values, expected=expected_rates(record), **settings)
        made.record = record
        return made

    def columns(self, member_logits: Any) -> dict[str, np.ndarray]:
        """What :meth:`observe` takes, from a batch of member logits [B, M, C] and the record
        (a monitor made by :meth:`from_record`): ``scores`` (the record's OOD score of the
        calibrated probabilities), ``confidence``, and ``set_mass``, ``set_size``, ``ood_flag``,
        ``accept`` for the rules the record holds."""
        record = self.record
        if record is None or record.monitor is None:
            raise ParameterError(
                "observe_logits needs a monitor made from a decisions record (Monitor.from_record)"
            )
        logits = np.asarray(member_logits)
        check_classes(logits, record)
        scores = calibrated_scores(logits, record.temperature)
        decided = decided_from_scores(scores, record)
        columns: dict[str, Any] = {
            "scores": ood_score(scores, record.monitor.score),
            "confidence": decided["confidence"],
        }
        if "prediction_set" in decided:
            members = decided["prediction_set"]
            columns["set_size"] = members.sum(axis=1)
            columns["set_mass"] = np.where(members, decided["calibrated_probs"], 0.0).sum(axis=1)
        if "ood_flag" in decided:
            columns["ood_flag"] = decided["ood_flag"]
        if "accept" in decided:
            columns["accept"] = decided["accept"]
        return columns

    def observe_logits(self, member_logits: Any) -> dict[str, np.ndarray]:
        """Apply the record to a batch of member logits [B, M, C] and observe the result: what a
        runner does per batch (a monitor made by :meth:`from_record`)."""
        return self.observe(**self.columns(member_logits))

    def observe(
        self,
        scores: Any,
        *,
        confidence: Any = None,
        set_mass: Any = None,
        set_size: Any = None,
        ood_flag: Any = None,
        accept: Any = None,
    ) -> dict[str, np.ndarray]:
        """Take a batch of inputs in arrival order; returns per input ``pvalue``, ``martingale``
        and ``alarm`` (True where the drift alarm went off)."""
        scores = np.asarray(scores, dtype=np.float64).reshape(-1)
        count = scores.size
        columns = {
            "accuracy": _column(confidence, "confidence", count),
            "coverage": _column(set_mass, "set_mass", count),
            "set_size": _column(set_size, "set_size", count),
        }
        sizes = columns["set_size"]
        hits = {
            "ood_flag": _column(ood_flag, "ood_flag", count),
            "abstained": None if accept is None else ~_column(accept, "accept", count).astype(bool),
            "empty_set": None if sizes is None else sizes == 0,
        }
        missing = [name for name in self.rates if hits[name] is None]
        if missing:
            raise DataError(
                f"the monitor watches {', '.join(missing)} but the batch does not give it"
            )
        with self._lock:
            out = self.drift.update_many(scores)
            for name, values in columns.items():
                if values is not None:
                    for value in values:
                        self.estimates[name].add(value)
            for name, watch in self.rates.items():
                for hit in hits[name]:
                    watch.add(hit)
        return out

    def summary(self) -> dict[str, Any]:
        """Where the stream stands: inputs, the martingale and its alarms, the rates, the estimates."""
        with self._lock:
            drift = self.drift
            return {
                "inputs": drift.index,
                "martingale": drift.value,
                "alpha": drift.alpha,
                "alarm_at": drift.threshold,
                "alarms": [vars(a) for a in drift.alarms],
                "rates": {name: watch.summary() for name, watch in self.rates.items()},
                "estimates": {name: mean.mean for name, mean in self.estimates.items()},
                "window": self.window,
            }

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {
                "reference": {"count": int(self.reference.size), "sha256": _digest(self.reference)},
                "onnx_sha256": None if self.record is None else self.record.onnx_sha256,
                "drift": self.drift.state(),
                "rates": {name: [w.expected, w.state()] for name, w in self.rates.items()},
                "estimates": {name: m.state() for name, m in self.estimates.items()},
                "window": self.window,
                "rate_level": self.rate_level,
            }

    @classmethod
    def from_state(cls, reference: Any, state: Mapping[str, Any]) -> Monitor:
        """Resume a saved state; ``reference``: the reference values, or the decisions record
        the state was kept for (its model file and reference are checked)."""
        record = reference if isinstance(reference, DecisionRecord) else None
        if record is not None:
            if record.monitor is None:
                raise ParameterError(_NO_REFERENCE)
            held = state.get("onnx_sha256")
            if held is not None and held != record.onnx_sha256:
                raise ParameterError(
                    f"this monitor state was kept for another model file (SHA-256 {held[:12]}); "
                    f"the export's is {record.onnx_sha256[:12]}: start a new state"
                )
            reference = record.monitor.values
        ref = np.sort(np.asarray(reference, dtype=np.float64).reshape(-1))
        held = state["reference"]
        if held["count"] != ref.size or held["sha256"] != _digest(ref):
            raise ParameterError(
                f"this monitor state was kept against another reference ({held['count']} scores, "
                f"SHA-256 {held['sha256'][:12]}); the export's has {ref.size} "
                f"({_digest(ref)[:12]}): the export was recalibrated, so start a new state"
            )
        drift = state["drift"]
        made = cls(
            ref,
            expected={name: entry[0] for name, entry in state["rates"].items()},
            alpha=drift["alpha"],
            rule=drift["bettor"]["rule"],
            window=state["window"],
            rate_level=state["rate_level"],
        )
        made.drift = DriftTest.from_state(ref, drift)
        for name, (_, watch_state) in state["rates"].items():
            made.rates[name].restore(watch_state)
        for name, values in state["estimates"].items():
            made.estimates[name].restore(values)
        made.record = record
        return made

    def save(self, path: str | Path) -> None:
        """Write the state as JSON, atomically (a crash leaves the previous file whole)."""
        atomic_write_json(path, self.state(), indent=None)

    @classmethod
    def load(cls, path: str | Path, reference: Any) -> Monitor:
        """:meth:`from_state` of the JSON at ``path``."""
        try:
            state = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ParameterError(f"no monitor state at {str(path)!r}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise DataError(
                f"{str(path)!r} is not a monitor state ({err}): delete it to start a new one"
            ) from None
        return cls.from_state(reference, state)


def _digest(reference: np.ndarray) -> str:
    return reference_sha256(reference.tolist())
