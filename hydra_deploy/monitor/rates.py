"""Live rates against what calibration expects, and label-free estimates over a window.

:class:`RateWatch` counts one yes/no outcome per input (flagged as OOD, abstained, an empty set)
and compares its rate with the rate calibration expects. The stream is cut into consecutive windows
of ``window`` inputs; each complete window is one exact binomial test at level ``level`` of "the
rate is above (or below) what was expected", and an alert is raised where it rejects. So on inputs
like the calibration data, each window alerts falsely with probability at most ``level`` (a rate
guaranteed to be *at most* its expectation, as the OOD flag's, is tested at the guaranteed value,
which makes the test conservative). The interval shown beside the rate is the exact
(Clopper-Pearson) two-sided interval of the current window at the same level.

:class:`WindowMean` keeps the mean of a number over the last ``window`` inputs: the estimated
accuracy (the mean calibrated confidence) and the estimated coverage of the prediction sets (the
mean calibrated probability mass inside them). They are *estimates*: right when the calibrated
probabilities stay calibrated, which a covariate shift erodes and a concept shift (the same inputs,
other labels) breaks without a sign.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hydra_deploy.decisions import binomial_cdf, binomial_upper_bound
from hydra_deploy.errors import ParameterError

__all__ = ["RateAlert", "RateWatch", "WindowMean", "binomial_interval"]

SIDES = ("above", "below", "both")


def binomial_interval(k: int, n: int, level: float) -> tuple[float, float]:
    """The exact two-sided (Clopper-Pearson) interval of a rate with ``k`` of ``n``, at ``level``
    (``level / 2`` in each tail); (0, 1) for n = 0."""
    if n == 0:
        return 0.0, 1.0
    upper = binomial_upper_bound(k, n, level / 2)
    lower = 1.0 - binomial_upper_bound(n - k, n, level / 2)
    return max(0.0, lower), min(1.0, upper)


@dataclass(frozen=True)
class RateAlert:
    """A window whose rate the binomial test rejected: inputs ``start`` to ``start + count - 1``."""

    name: str
    start: int
    count: int
    hits: int
    expected: float
    pvalue: float


@dataclass
class RateWatch:
    """One rate (``name``) against ``expected``, tested per window of ``window`` inputs.

    ``side``: ``above`` (alert when the rate is higher: flags, abstentions, empty sets), ``below``
    or ``both``.
    """

    name: str
    expected: float
    side: str = "above"
    window: int = 1000
    level: float = 0.01
    total: int = 0
    total_hits: int = 0
    current: int = 0
    current_hits: int = 0
    alerts: list[RateAlert] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0.0 <= self.expected <= 1.0:
            raise ParameterError(
                f"the expected rate of {self.name} {self.expected} is not in [0, 1]"
            )
        if self.side not in SIDES:
            raise ParameterError(f"`side` {self.side!r}: choose one of {', '.join(SIDES)}")
        if int(self.window) < 1:
            raise ParameterError(f"`window` {self.window} must be at least 1 input")
        if not 0.0 < self.level < 1.0:
            raise ParameterError(f"`level` {self.level} must be in (0, 1)")

    def pvalue(self, hits: int, count: int) -> float:
        """The exact binomial p-value of ``hits`` in ``count`` against the expected rate."""
        above = 1.0 - binomial_cdf(hits - 1, count, self.expected)  # P(X >= hits)
        below = binomial_cdf(hits, count, self.expected)  # P(X <= hits)
        if self.side == "above":
            return above
        if self.side == "below":
            return below
        return min(1.0, 2.0 * min(above, below))

    def add(self, hit: bool) -> RateAlert | None:
        """Count one input; returns the alert when it completes a window that fails the test."""
        hit = bool(hit)
        self.total += 1
        self.total_hits += hit
        self.current += 1
        self.current_hits += hit
        if self.current < self.window:
            return None
        start, count, hits = self.total - self.current, self.current, self.current_hits
        self.current = self.current_hits = 0
        pvalue = self.pvalue(hits, count)
        if pvalue > self.level:
            return None
        alert = RateAlert(self.name, start, count, hits, self.expected, pvalue)
        self.alerts.append(alert)
        return alert

    @property
    def rate(self) -> float | None:
        """The rate over the whole stream so far (None before the first input)."""
        return self.total_hits / self.total if self.total else None

    def summary(self) -> dict[str, Any]:
        low, high = binomial_interval(self.current_hits, self.current, self.level)
        return {
            "name": self.name,
            "expected": self.expected,
            "rate": self.rate,
            "count": self.total,
            "window_rate": self.current_hits / self.current if self.current else None,
            "window_interval": [low, high],
            "alerts": len(self.alerts),
        }

    def state(self) -> dict[str, Any]:
        keys = ("total", "total_hits", "current", "current_hits")
        return {
            **{k: getattr(self, k) for k in keys},
            "alerts": [vars(a) for a in self.alerts],
        }

    def restore(self, state: dict[str, Any]) -> None:
        for key in ("total", "total_hits", "current", "current_hits"):
            setattr(self, key, int(state[key]))
        self.alerts = [RateAlert(**a) for a in state["alerts"]]


class WindowMean:
    """The mean of a number over the last ``window`` inputs (NaN inputs are skipped)."""

    def __init__(self, window: int = 1000) -> None:
        if int(window) < 1:
            raise ParameterError(f"`window` {window} must be at least 1 input")
        self.window = int(window)
        self.values: deque[float] = deque(maxlen=self.window)

    def add(self, value: float) -> None:
        value = float(value)
        if value == value:
            self.values.append(value)

    @property
    def mean(self) -> float | None:
        return sum(self.values) / len(self.values) if self.values else None

    def state(self) -> list[float]:
        return list(self.values)

    def restore(self, values: list[float]) -> None:
        self.values = deque((float(v) for v in values), maxlen=self.window)
