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

import hashlib
import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.atomic import atomic_write_json
from hydra_deploy.errors import DataError, ParameterError
from hydra_deploy.monitor.drift import DriftTest
from hydra_deploy.monitor.rates import RateWatch, WindowMean

__all__ = ["RATES", "Monitor"]

#: the rates a monitor can watch: name -> the per-input outcome that counts as a hit
RATES = ("ood_flag", "abstained", "empty_set")


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
                "drift": self.drift.state(),
                "rates": {name: [w.expected, w.state()] for name, w in self.rates.items()},
                "estimates": {name: m.state() for name, m in self.estimates.items()},
                "window": self.window,
                "rate_level": self.rate_level,
            }

    @classmethod
    def from_state(cls, reference: Any, state: Mapping[str, Any]) -> Monitor:
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
        return made

    def save(self, path: str | Path) -> None:
        """Write the state as JSON, atomically (a crash leaves the previous file whole)."""
        atomic_write_json(path, self.state(), indent=None)

    @classmethod
    def load(cls, path: str | Path, reference: Any) -> Monitor:
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
    return hashlib.sha256(np.ascontiguousarray(reference, dtype="<f8").tobytes()).hexdigest()
