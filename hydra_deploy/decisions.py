"""From member logits to decisions: temperature scaling, conformal prediction sets, answer-or-abstain
with a risk guarantee and an OOD flag (numpy only: edge code).

Everything works on the temperature-scaled probabilities ``p = mean_m softmax(logits_m / T)`` of
member logits ``[batch, members, classes]``:

- **Temperature** (:func:`fit_temperature`): one T shared by the members, the argmin of the NLL of
  p on labelled data, searched over log T in [0.05, 20].
- **Prediction sets** (split conformal, :func:`class_scores`, :func:`prediction_sets`): one
  registered score each (:mod:`hydra_deploy.set_scores`, re-exported here): LAC, the default,
  ``{y : p_y >= 1 - qhat}`` (may be empty: nothing is plausible); APS, deterministic,
  ``s(x, y)`` = the sum of p_j over the classes ranked at or above y (p descending, ties by lower
  index), the set ``{y : s(x, y) <= qhat}`` plus the top class; RAPS adds
  ``lambda * max(0, rank - k_reg)``. ``qhat`` is the ceil((n + 1)(1 - alpha))-th smallest
  calibration score (:func:`conformal_quantile`); over exchangeable data the set holds the true
  class with probability at least 1 - alpha (marginally). Membership is decided as
  :func:`class_room` >= :func:`set_floor` (the probability, or the mass ranked below the class,
  against ``1 - qhat`` with a tolerance relative to it): the one rule every runner, the graph and
  the benchmarks use (:func:`prediction_sets`, :func:`set_members`).
- **Answer or abstain** (:func:`fit_selective`): answer when the calibrated score passes tau; tau
  is the lowest threshold of a grid fixed before the labels are seen that a family-wise test of
  the exact binomial p-values of "selective error rate > target" certifies (Learn then Test; by
  default a graph test, :func:`_graph_rejections`: a fixed sequence from a start chosen on the
  temperature part with a Bonferroni fallback), so P(selective error rate > target) <= delta.
- **OOD flag** (:func:`fit_ood`): flag when the OOD score (msp negated, or an entropy) exceeds the
  conformal quantile of its in-distribution calibration values: at most alpha_ood of
  in-distribution inputs are flagged.

Accept and flag compare with a margin (:func:`accept_mask`, :func:`ood_mask`), the same in the
graph, so a score at its threshold gets the same answer on both paths.

:func:`fit_decisions` fits T (and the set score's parameters and the threshold grid) on one part of
the data and every quantile on the other (``holdout``), so each guarantee holds as stated, and returns
the :class:`~hydra_deploy.export_folder.DecisionRecord` that ``hydra-calibrate`` stores in
hydra.json; :func:`apply_decisions` applies a record to new logits (what every runner does);
:func:`decision_metrics` measures a record on labelled data (coverage, set size, selective risk,
flag rate, ECE before and after T).

The guarantees are marginal, over data exchangeable with the calibration data; none holds under
distribution shift.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hydra_deploy.errors import DataError, ParameterError, counted, said
from hydra_deploy.export_folder import (
    DECISION_SCORES,
    SELECTIVE_PROCEDURES,
    SET_METHODS,
    DecisionRecord,
    MonitorReference,
    OodRule,
    SelectiveRule,
    SetRule,
)
from hydra_deploy.set_scores import (
    RAPS_LAMBDAS,
    SET_FLOOR,
    SET_TOLERANCE,
    TooFewExamples,
    _level,
    class_room,
    class_scores,
    conformal_quantile,
    fit_raps,
    min_calibration_size,
    prediction_sets,
    set_floor,
    set_members,
    set_score,
)
from hydra_deploy.uncertainty.metrics import ece, nll, ood_score
from hydra_deploy.uncertainty.scores import ensemble_scores

__all__ = [
    "DECISION_MARGIN",
    "DECISION_SCORES",
    "GRID_SIZE",
    "RAPS_LAMBDAS",
    "SELECTIVE_PROCEDURES",
    "SET_FLOOR",
    "SET_METHODS",
    "SET_TOLERANCE",
    "TEMPERATURE_BOUNDS",
    "TooFewExamples",
    "accept_mask",
    "apply_decisions",
    "binomial_cdf",
    "binomial_upper_bound",
    "calibrated_scores",
    "class_room",
    "class_scores",
    "conformal_quantile",
    "decision_margin",
    "decision_metrics",
    "describe_split",
    "fit_decisions",
    "fit_ood",
    "fit_raps",
    "fit_selective",
    "fit_temperature",
    "min_calibration_size",
    "ood_mask",
    "prediction_sets",
    "selective_grid",
    "selective_levels",
    "selective_pvalues",
    "selective_start",
    "set_floor",
    "set_members",
    "split_rows",
    "temperature_at_bound",
    "temperature_nll",
    "temperature_warning",
]

_log = logging.getLogger(__name__)

TEMPERATURE_BOUNDS = (0.05, 20.0)
#: The most thresholds a selective grid holds (Bonferroni divides delta by its size).
GRID_SIZE = 50
#: An accept or OOD-flag threshold is passed only by a margin of this (relative above 1 in
#: magnitude): a score within float32's rounding of the threshold abstains and is not flagged, on
#: the numpy path and in the graph alike. Fitting uses the same comparison (the answered examples
#: tested are the ones deployed), and a flag needs more than the conformal quantile, so both
#: guarantees hold as stated.
DECISION_MARGIN = 1e-5


# --- checks ---------------------------------------------------------------------------------------
def _is_temperature(value: Any) -> bool:
    low, high = TEMPERATURE_BOUNDS
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float, np.number))
        and (low <= value <= high)
    )


def _choice(value: Any, name: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ParameterError(f"`{name}` must be one of {', '.join(choices)}, got {value!r}")
    return value


def _logits(member_logits: Any) -> np.ndarray:
    logits = np.asarray(member_logits)
    if logits.ndim != 3 or 0 in logits.shape:
        raise DataError(
            f"member_logits must be [examples, members, classes] with no empty axis, got "
            f"{logits.shape}"
        )
    if not np.issubdtype(logits.dtype, np.number) or np.issubdtype(
        logits.dtype, np.complexfloating
    ):
        raise DataError(f"member_logits must be a float array, got dtype {logits.dtype}")
    logits = logits.astype(np.float64)
    bad = ~np.isfinite(logits).all(axis=(1, 2))
    if bad.any():
        raise DataError(
            f"member_logits holds NaN or infinite values in {int(bad.sum())} of "
            f"{counted(len(logits), 'example')} (first: example {int(np.argmax(bad))}); decisions "
            "are fitted on finite logits: check the model with hydra-compare, or leave those "
            "examples out"
        )
    return logits


def _labels(labels: Any, count: int, num_classes: int) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1 or len(y) != count:
        raise DataError(
            f"labels must be one class index per example ({count}), got shape {y.shape}"
        )
    whole = np.issubdtype(y.dtype, np.integer) or (
        np.issubdtype(y.dtype, np.floating) and np.all(np.isfinite(y)) and np.all(y == np.round(y))
    )
    if not whole:
        raise DataError(f"labels must be class indices (integers), got dtype {y.dtype}")
    y = y.astype(np.int64)
    outside = (y < 0) | (y >= num_classes)
    if outside.any():
        raise DataError(
            f"labels hold {counted(int(outside.sum()), 'value')} outside the model's classes "
            f"0..{num_classes - 1} (first: {int(y[np.argmax(outside)])} at example "
            f"{int(np.argmax(outside))}); "
            "map the labels to the model's classes"
        )
    return y


# --- temperature ----------------------------------------------------------------------------------
def _log_probs(logits: np.ndarray, temperature: float) -> np.ndarray:
    """log p [N, C] of member logits [N, M, C] at ``temperature`` (float64, log-sum-exp safe)."""
    z = logits / temperature
    z = z - z.max(axis=-1, keepdims=True)
    log_member = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))  # [N, M, C]
    top = log_member.max(axis=1, keepdims=True)
    return (top + np.log(np.exp(log_member - top).mean(axis=1, keepdims=True)))[:, 0]


def temperature_nll(member_logits: Any, labels: Any, temperature: float) -> float:
    """Mean NLL of ``mean_m softmax(member_logits_m / temperature)`` at the labels."""
    logits = _logits(member_logits)
    y = _labels(labels, len(logits), logits.shape[2])
    return float(-_log_probs(logits, temperature)[np.arange(len(y)), y].mean())


def fit_temperature(
    member_logits: Any, labels: Any, *, bounds: tuple[float, float] = TEMPERATURE_BOUNDS
) -> float:
    """The temperature T in ``bounds`` that minimises the NLL of the calibrated probabilities.

    A 61-point grid over log T, then a golden-section search between the best point's
    neighbours (the NLL of an ensemble's mean is not always convex in T; the grid keeps the search
    from a local minimum)."""
    logits = _logits(member_logits)
    y = _labels(labels, len(logits), logits.shape[2])
    rows = np.arange(len(y))
    low, high = (math.log(b) for b in bounds)

    def loss(log_t: float) -> float:
        return float(-_log_probs(logits, math.exp(log_t))[rows, y].mean())

    grid = np.linspace(low, high, 61)
    values = [loss(g) for g in grid]
    best = int(np.argmin(values))
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = loss(c), loss(d)
    for _ in range(40):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = loss(d)
    candidates = [(values[best], grid[best]), (fc, c), (fd, d)]
    return float(math.exp(min(candidates)[1]))


def temperature_at_bound(temperature: float) -> bool:
    """Whether ``temperature`` is at (within 1% of) a bound of :data:`TEMPERATURE_BOUNDS`."""
    low, high = TEMPERATURE_BOUNDS
    return not low * 1.01 < temperature < high / 1.01


def temperature_warning(
    temperature: float, member_logits: Any, labels: Any, *, of: int | None = None
) -> str | None:
    """A warning when ``temperature`` is at a bound of :data:`TEMPERATURE_BOUNDS`: the NLL of
    the data it was fitted on still falls there, so no T in the range fits them (at the lower
    bound, typically a temperature part without a single error: every p sharpened to 1 costs
    nothing on it, and a confident mistake on new data costs a lot). None otherwise. ``of``: how
    many calibration examples were given in all (the message names both counts)."""
    if not temperature_at_bound(temperature):
        return None
    low, high = TEMPERATURE_BOUNDS
    logits = _logits(member_logits)
    y = _labels(labels, len(logits), logits.shape[2])
    wrong = int((ensemble_scores(logits, dtype=np.float64)["prediction"] != y).sum())
    side = "lower" if temperature <= low * 1.01 else "upper"
    given = counted(len(y), "example") if of is None else f"{len(y)} of the {of} given"
    return (
        f"T = {temperature:.3g} is at the {side} bound of its search ({low:g} to {high:g}): the "
        f"NLL of the temperature part ({given}; the model errs on {wrong} of "
        "them) still falls there, so these probabilities are "
        + ("over-sharpened" if side == "lower" else "flattened")
        + " and can be badly calibrated on new data; give more labelled data (with some of the "
        "model's errors among it), or use the probabilities at T = 1 (hydra-run without decisions)"
    )


def calibrated_scores(
    member_logits: Any, temperature: float, *, allow_nonfinite: bool = False
) -> dict[str, np.ndarray]:
    """:func:`~hydra_deploy.uncertainty.ensemble_scores` of ``member_logits / temperature`` in
    float64: ``probs`` (the calibrated p), ``msp`` (the calibrated confidence), the entropies,
    mutual information and ``prediction``."""
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = np.asarray(member_logits, dtype=np.float64) / float(temperature)
    return ensemble_scores(scaled, allow_nonfinite=allow_nonfinite, dtype=np.float64)


# --- prediction sets (the rule and the scores: hydra_deploy.set_scores) ------------------------
def decision_margin(threshold: float | np.ndarray) -> float | np.ndarray:
    """How far a score must pass an accept or OOD threshold (:data:`DECISION_MARGIN`, relative
    above 1 in magnitude)."""
    return DECISION_MARGIN * np.maximum(1.0, np.abs(threshold))


def accept_mask(values: Any, score: str, tau: float) -> np.ndarray:
    """Answer-or-abstain on calibrated ``score`` values [B]: msp ``>= tau``, an entropy
    ``<= tau``, each by :func:`decision_margin` (NaN: False)."""
    v = np.asarray(values, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        if score == "msp":
            return v >= tau + decision_margin(tau)
        return v <= tau - decision_margin(tau)


def ood_mask(values: Any, threshold: float) -> np.ndarray:
    """The OOD flag on OOD scores [B] (higher = more unusual): ``> threshold`` by
    :func:`decision_margin` (NaN: False; the caller flags non-finite inputs)."""
    v = np.asarray(values, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return v > threshold + decision_margin(threshold)


def _true_scores(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    return scores[np.arange(len(labels)), labels]


def _set_qhat(
    scores: np.ndarray,
    labels: np.ndarray,
    alpha: float,
    class_conditional: bool,
    class_names: Sequence[str] | None,
) -> tuple[float, ...]:
    true = _true_scores(scores, labels)
    if not class_conditional:
        return (conformal_quantile(true, alpha),)
    qhat = []
    for c in range(scores.shape[1]):
        name = f"class {c}" + (f" ({class_names[c]})" if class_names else "")
        qhat.append(
            conformal_quantile(
                true[labels == c],
                alpha,
                what=f"calibration examples of {name} (class-conditional sets)",
            )
        )
    return tuple(qhat)


# --- answer or abstain ----------------------------------------------------------------------------
def _log_binomial_terms(k: int, n: int, p: float) -> np.ndarray:
    i = np.arange(k + 1, dtype=np.float64)
    log_comb = np.concatenate([[0.0], np.cumsum(np.log(n - i[1:] + 1.0) - np.log(i[1:]))])
    with np.errstate(divide="ignore"):
        return log_comb + i * np.log(p) + (n - i) * np.log1p(-p)


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) <= k), exactly (a sum of log-space terms; numpy only)."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    terms = _log_binomial_terms(int(k), int(n), float(p))
    top = terms.max()
    return float(min(1.0, math.exp(top) * np.exp(terms - top).sum()))


def binomial_upper_bound(k: int, n: int, level: float) -> float:
    """The one-sided Clopper-Pearson upper bound: the smallest p with P(Bin(n, p) <= k) <= level
    (1.0 for n = 0): with ``k`` errors in ``n`` answers, the risk is below it at confidence
    1 - ``level``."""
    if n == 0 or k >= n:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if binomial_cdf(k, n, middle) <= level:
            high = middle
        else:
            low = middle
    return high


def _confidence(scores: dict[str, np.ndarray], name: str) -> np.ndarray:
    """The score oriented higher = more confident (msp as it is, an entropy negated)."""
    return -ood_score(scores, name)


def selective_grid(confidence: Any, size: int = GRID_SIZE) -> np.ndarray:
    """At most ``size`` thresholds, ascending: quantiles 0 to 0.98 of ``confidence`` (the
    temperature part's calibrated confidences: fixed before the quantile part's labels are seen)."""
    values = np.asarray(confidence, dtype=np.float64)
    return np.unique(np.quantile(values, np.linspace(0.0, 0.98, size)))


def _answered(confidence: np.ndarray, tau: float) -> np.ndarray:
    """The examples answered at ``tau`` (confidence oriented higher = more confident): the
    comparison :func:`accept_mask` deploys, margin included."""
    return accept_mask(confidence, "msp", tau)


def _risk_counts(confidence: Any, correct: Any, grid: Any) -> np.ndarray:
    """(answered, errors) [G, 2] at each threshold of ``grid``."""
    conf = np.asarray(confidence, dtype=np.float64)
    errors = ~np.asarray(correct, dtype=bool)
    counts = []
    for tau in np.asarray(grid, dtype=np.float64):
        answered = _answered(conf, float(tau))
        counts.append((int(answered.sum()), int(errors[answered].sum())))
    return np.asarray(counts, dtype=np.int64).reshape(-1, 2)


def selective_pvalues(confidence: Any, correct: Any, grid: Any, target_risk: float) -> np.ndarray:
    """The exact binomial p-value of "selective error rate > ``target_risk``" at each threshold
    of ``grid`` [G] (1 where nothing is answered)."""
    return np.asarray(
        [
            binomial_cdf(int(k), int(n), target_risk) if n else 1.0
            for n, k in _risk_counts(confidence, correct, grid)
        ]
    )


def selective_start(
    confidence: Any, correct: Any, grid: Any, target_risk: float, quantile_count: int
) -> int:
    """Where the fixed sequence of :func:`fit_selective` starts: the index of ``grid`` whose
    p-value the temperature part (``confidence``, ``correct``) predicts smallest for a quantile
    part of ``quantile_count`` examples (its answered share and error rate at the quantile
    part's size). Fixed before the quantile part's labels are seen."""
    counts = _risk_counts(confidence, correct, grid)
    total = max(len(np.asarray(confidence)), 1)
    predicted = []
    for n, k in counts:
        n_q = round(n / total * quantile_count)
        k_q = round(k / n * n_q) if n else 0
        predicted.append(binomial_cdf(k_q, n_q, target_risk) if n_q else 1.0)
    values = np.asarray(predicted)
    return int(np.flatnonzero(values == values.min())[-1])  # ties: the higher (safer) threshold


def _graph_rejections(pvalues: np.ndarray, start: int, delta: float) -> list[int]:
    """The thresholds a sequentially rejective graph test (Bretz et al. 2009) rejects "risk >
    target" at, FWER <= delta: half of delta on ``start``, half spread evenly over the grid
    (Bonferroni), and each rejected threshold's level passed on to the next lower threshold not
    yet rejected (a fixed sequence down from ``start``, with a Bonferroni fallback). The set
    rejected does not depend on the order the rejections are made in."""
    count = len(pvalues)
    # weights in whole units of 1 / (2 count), so that passing them on adds exactly
    weights = np.ones(count, dtype=np.int64)
    weights[start] += count  # the level of a threshold: weights * delta / (2 count)
    active = np.ones(count, dtype=bool)
    rejected: list[int] = []
    while True:
        hits = np.flatnonzero(active & (pvalues <= weights * (delta / (2 * count))))
        if not len(hits):
            return rejected
        j = int(hits[0])
        active[j] = False
        rejected.append(j)
        lower = np.flatnonzero(active[:j])
        if len(lower):
            weights[lower[-1]] += weights[j]
        weights[j] = 0


def selective_levels(
    size: int, delta: float, procedure: str = "graph", start: int = 0
) -> np.ndarray:
    """The level [size] each threshold of a grid is first tested at by :func:`fit_selective`,
    before any rejection passes its level on: ``delta / size`` each (``bonferroni``); half of
    that each, and half of delta more on ``start`` (``graph``)."""
    if procedure == "bonferroni":
        return np.full(size, delta / size)
    levels = np.full(size, 0.5 * delta / size)
    levels[start] += 0.5 * delta
    return levels


def fit_selective(
    confidence: Any,
    correct: Any,
    grid: Any,
    target_risk: float,
    delta: float,
    *,
    procedure: str = "graph",
    start: int | None = None,
    what: str | None = None,
) -> tuple[float, dict[str, Any]]:
    """The lowest threshold of ``grid`` (largest coverage) certified for ``target_risk``, so that
    P(selective error rate > target_risk) <= delta (Learn then Test: every threshold's exact
    binomial p-value of "selective error rate > target_risk", tested with family-wise error
    at most delta).

    ``procedure``: ``"graph"`` (the default) tests them with :func:`_graph_rejections`' graph,
    half of delta on a fixed sequence down from ``start`` (an index of ``grid``, chosen on other
    data: :func:`selective_start`), half as Bonferroni; ``"bonferroni"`` tests each at
    delta / len(grid) (the only test before: every record without a procedure). Returns (tau, details:
    coverage, risk and answered count at tau on these data, the procedure). Refused, naming the
    best risk the data can certify at this delta, when no threshold reaches the target (``what``
    says which data, in the message: by default "N calibration examples")."""
    target_risk = _level(target_risk, "risk")
    delta = _level(delta, "delta")
    procedure = _choice(procedure, "procedure", SELECTIVE_PROCEDURES)
    conf = np.asarray(confidence, dtype=np.float64)
    errors = ~np.asarray(correct, dtype=bool)
    thresholds = np.asarray(grid, dtype=np.float64)
    pvalues = selective_pvalues(conf, ~errors, thresholds, target_risk)
    if procedure == "bonferroni":
        passed = np.flatnonzero(pvalues <= delta / len(thresholds))
        levels = selective_levels(len(thresholds), delta, procedure)
    else:
        if start is None or not 0 <= start < len(thresholds):
            raise ParameterError(
                f"`start` must be an index of the grid (0..{len(thresholds) - 1}), got {start!r}: "
                "choose it on the temperature part with selective_start"
            )
        passed = np.asarray(_graph_rejections(pvalues, start, delta), dtype=np.int64)
        levels = selective_levels(len(thresholds), delta, procedure, start)
    if not len(passed):
        counts = _risk_counts(conf, ~errors, thresholds)
        best_bound = min(
            binomial_upper_bound(int(k), int(n), float(level))
            for (n, k), level in zip(counts, levels, strict=True)
        )
        raise DataError(
            f"no threshold reaches a selective risk of {target_risk:g} at delta {delta:g} on "
            f"{what or counted(len(conf), 'calibration example')}: the best these data can "
            f"guarantee is {best_bound:.4g}; "
            + said("ask for a larger `risk`, a larger `delta`, or give more labelled data")
        )
    certified = float(thresholds[int(passed.min())])
    answered = _answered(conf, certified)
    details = {
        "coverage": float(answered.mean()),
        "risk": float(errors[answered].mean()),
        "answered": int(answered.sum()),
        "grid_size": len(thresholds),
        "procedure": procedure,
    }
    return certified, details


def fit_ood(ood_scores: Any, alpha: float) -> float:
    """The OOD threshold: the conformal quantile of in-distribution OOD scores (higher = more
    unusual) at level 1 - alpha; flagging scores above it flags at most alpha of ID inputs."""
    return conformal_quantile(
        ood_scores, alpha, what="in-distribution calibration examples (OOD flag)"
    )


# --- the whole fit ------------------------------------------------------------------------------
def split_rows(count: int, holdout: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(temperature rows, quantile rows): a random split of ``count`` examples with a share
    ``holdout`` for the quantiles; both parts non-empty."""
    holdout = _level(holdout, "holdout")
    quantile_count = round(count * holdout)
    if quantile_count < 1 or quantile_count > count - 1:
        raise DataError(
            f"{counted(count, 'calibration example')} cannot be split {1 - holdout:g} / "
            f"{holdout:g} into a part for the temperature and a part for the thresholds with an "
            "example in each; give more labelled data"
        )
    order = np.random.default_rng(seed).permutation(count)
    return np.sort(order[quantile_count:]), np.sort(order[:quantile_count])


@dataclass(frozen=True)
class _Parts:
    """The calibration data split in two: T fitted on the temperature part (``tune``: its
    calibrated scores and labels), every quantile on the quantile part (``held``)."""

    count: int
    holdout: float
    temperature: float
    tune: dict[str, np.ndarray]
    y_tune: np.ndarray
    held: dict[str, np.ndarray]
    y_held: np.ndarray

    @classmethod
    def split(
        cls,
        logits: np.ndarray,
        y: np.ndarray,
        holdout: float,
        seed: int,
        temperature: float | None = None,
    ) -> _Parts:
        """Split the rows; T fitted on the temperature part, or the given ``temperature``."""
        t_rows, q_rows = split_rows(len(y), holdout, seed)
        if temperature is None:
            temperature = fit_temperature(logits[t_rows], y[t_rows])
            warning = temperature_warning(temperature, logits[t_rows], y[t_rows], of=len(y))
            if warning:
                _log.warning(warning)
        elif _is_temperature(temperature):
            temperature = float(temperature)
        else:
            low, high = TEMPERATURE_BOUNDS
            raise ParameterError(
                f"`temperature` must be a number in [{low:g}, {high:g}], got {temperature!r}"
            )
        return cls(
            count=len(y),
            holdout=float(holdout),
            temperature=temperature,
            tune=calibrated_scores(logits[t_rows], temperature),
            y_tune=y[t_rows],
            held=calibrated_scores(logits[q_rows], temperature),
            y_held=y[q_rows],
        )

    @property
    def named(self) -> str:
        """The data as given and as split, for messages (:func:`describe_split`)."""
        return describe_split(len(self.y_tune), len(self.y_held))

    def total_for(self, part: str, needed: int) -> int:
        """The fewest examples in all whose split gives ``part`` at least ``needed``."""
        total = needed
        while True:
            in_part = round(total * self.holdout)
            if part == "temperature":
                in_part = total - in_part
            if in_part >= needed:
                return total
            total += 1

    def too_few(self, needed: int, part: str, purpose: str, level: str) -> DataError:
        """The data are too few for ``purpose`` (fitted on ``part``) at ``level`` (``"`alpha`
        0.1"``), in counts of the data as given: what each part holds, what ``part`` needs and
        how many that makes in all."""
        where = "the thresholds" if part == "quantile" else "the temperature"
        name = level.split()[0]
        return DataError(
            f"{self.named} are too few for {purpose}: "
            + said(
                f"{level} needs at least {needed} for {where}, so at least "
                f"{self.total_for(part, needed)} in all; give more labelled data, or a larger "
                f"{name}"
            )
        )

    def too_few_of_class(self, needed: int, alpha: float, name: str, held: int) -> DataError:
        """Class-conditional sets: class ``name`` holds ``held`` of the examples for the
        thresholds where ``needed`` are the fewest."""
        return DataError(
            f"{self.named} are too few for class-conditional sets: {name} has {held} of the "
            f"{len(self.y_held)} for the thresholds; "
            + said(
                f"`alpha` {alpha:g} needs at least {needed} of each class there, so about "
                f"{self.total_for('quantile', needed)} of each in all; give more labelled data "
                "(of that class), a larger `alpha`, or leave out `class_conditional`"
            )
        )


def describe_split(n_temperature: int, n_quantile: int) -> str:
    """The calibration data as given (every example goes to one part) and as the fit split them,
    as every message says it: "400 calibration examples (200 for the temperature, 200 for the
    thresholds)"."""
    return (
        f"{counted(n_temperature + n_quantile, 'calibration example')} ({n_temperature} for "
        f"the temperature, {n_quantile} for the thresholds)"
    )


def _check_class_counts(parts: _Parts, alpha: float, class_names: Sequence[str] | None) -> None:
    """Class-conditional sets: refuse (naming the class and the counts as given) a class with
    fewer examples for the thresholds than ``alpha`` needs."""
    needed = min_calibration_size(alpha)
    held = np.bincount(parts.y_held, minlength=parts.tune["probs"].shape[1])
    short = np.flatnonzero(held < needed)
    if len(short):
        c = int(short[0])
        name = f"class {c}" + (f" ({class_names[c]})" if class_names else "")
        if len(short) > 1:
            name += f" (and {counted(len(short) - 1, 'other class', 'other classes')})"
        raise parts.too_few_of_class(needed, alpha, name, int(held[c]))


def _fit_sets(
    parts: _Parts,
    method: str,
    alpha: float,
    class_conditional: bool,
    class_names: Sequence[str] | None,
) -> SetRule:
    """The set score's parameters on the temperature part, qhat on the quantile part."""
    score = set_score(method)
    try:
        params = score.fit(parts.tune["probs"], parts.y_tune, alpha)
    except TooFewExamples as err:
        level = f"`alpha` {alpha:g}"
        raise parts.too_few(
            err.needed, "temperature", f"{method.upper()}'s parameters", level
        ) from None
    scores = 1.0 - score.room(parts.held["probs"], params)
    if class_conditional:
        _check_class_counts(parts, alpha, class_names)
    try:
        qhat = _set_qhat(scores, parts.y_held, alpha, class_conditional, class_names)
    except TooFewExamples as err:
        raise parts.too_few(
            err.needed, "quantile", "prediction sets", f"`alpha` {alpha:g}"
        ) from None
    return SetRule(method, alpha, qhat, class_conditional, params)


def _fit_answer(parts: _Parts, score: str, risk: float, delta: float) -> SelectiveRule:
    """The threshold grid and the fixed sequence's start on the temperature part, tau certified
    on the quantile part."""
    tune_confidence = _confidence(parts.tune, score)
    grid = selective_grid(tune_confidence)
    quantile_count = len(parts.y_held)
    start = selective_start(
        tune_confidence, parts.tune["prediction"] == parts.y_tune, grid, risk, quantile_count
    )
    tau, details = fit_selective(
        _confidence(parts.held, score),
        parts.held["prediction"] == parts.y_held,
        grid,
        risk,
        delta,
        start=start,
        what=parts.named + ", tested on the ones for the thresholds",
    )
    return SelectiveRule(
        score=score,
        target_risk=risk,
        delta=delta,
        tau=tau if score == "msp" else -tau,  # in the score's own units
        grid_size=details["grid_size"],
        coverage=details["coverage"],
        procedure=details["procedure"],
    )


def _fit_flag(parts: _Parts, score: str, alpha: float) -> OodRule:
    """The OOD threshold on the quantile part."""
    try:
        threshold = fit_ood(-_confidence(parts.held, score), alpha)
    except TooFewExamples as err:
        level = f"`ood_alpha` {alpha:g}"
        raise parts.too_few(err.needed, "quantile", "the OOD flag", level) from None
    return OodRule(score, alpha, threshold)


def fit_decisions(
    member_logits: Any,
    labels: Any,
    *,
    onnx_sha256: str,
    data_sha256: str,
    alpha: float | None = 0.1,
    sets: str = "lac",
    class_conditional: bool = False,
    risk: float | None = None,
    delta: float = 0.1,
    accept_score: str = "msp",
    ood_alpha: float | None = 0.05,
    ood_score: str = "msp",
    holdout: float = 0.5,
    seed: int = 0,
    class_names: Sequence[str] | None = None,
    temperature: float | None = None,
) -> DecisionRecord:
    """Fit every decision on labelled in-distribution data and return the record.

    T (and the set score's parameters, :data:`SET_METHODS`, and the selective grid) are fitted on
    a ``1 - holdout`` share of the examples, every quantile (qhat, tau, the OOD threshold) on the
    other ``holdout`` share. ``alpha`` None: no prediction sets; ``risk`` None: no
    answer-or-abstain rule; ``ood_alpha`` None: no OOD flag. ``onnx_sha256`` / ``data_sha256``
    name the model file and the data.
    ``temperature``: use this T (within :data:`TEMPERATURE_BOUNDS`) instead of fitting one."""
    logits = _logits(member_logits)
    count, _, num_classes = logits.shape
    y = _labels(labels, count, num_classes)
    if alpha is not None:
        alpha, sets = _level(alpha, "alpha"), set_score(sets).name
    if risk is not None:
        risk, delta = _level(risk, "risk"), _level(delta, "delta")
        accept_score = _choice(accept_score, "accept_score", DECISION_SCORES)
    if ood_alpha is not None:
        ood_alpha = _level(ood_alpha, "ood_alpha")
        ood_score = _choice(ood_score, "ood_score", DECISION_SCORES)
    if class_names is not None and len(class_names) != num_classes:
        raise ParameterError(
            f"`class_names` holds {len(class_names)} names for a model of {num_classes} classes"
        )
    parts = _Parts.split(logits, y, holdout, seed, temperature)
    set_rule = selective_rule = ood_rule = None
    if alpha is not None:
        set_rule = _fit_sets(parts, sets, alpha, class_conditional, class_names)
    if risk is not None:
        selective_rule = _fit_answer(parts, accept_score, risk, delta)
    if ood_alpha is not None:
        ood_rule = _fit_flag(parts, ood_score, ood_alpha)
    monitored = ood_rule.score if ood_rule is not None else "msp"
    return DecisionRecord(
        temperature=parts.temperature,
        num_classes=num_classes,
        onnx_sha256=onnx_sha256,
        data_sha256=data_sha256,
        n_temperature=len(parts.y_tune),
        n_quantile=len(parts.y_held),
        holdout=parts.holdout,
        seed=int(seed),
        sets=set_rule,
        selective=selective_rule,
        ood=ood_rule,
        monitor=monitor_reference(parts.held, monitored, set_rule, selective_rule, ood_rule),
    )


def monitor_reference(
    parts_held: dict[str, np.ndarray],
    score: str,
    sets: SetRule | None,
    selective: SelectiveRule | None,
    ood: OodRule | None,
) -> MonitorReference:
    """The drift monitor's reference: the OOD score ``score`` on the quantile part (its calibrated
    scores ``parts_held``), and how many of its examples each fitted rule flagged, left
    unanswered, or gave an empty set."""
    count = len(parts_held["prediction"])
    counts: dict[str, tuple[int, int]] = {}
    if ood is not None:
        flagged = ood_mask(ood_score(parts_held, ood.score), ood.threshold)
        counts["ood_flag"] = (int(flagged.sum()), count)
    if selective is not None:
        answered = accept_mask(parts_held[selective.score], selective.score, selective.tau)
        counts["abstained"] = (int((~answered).sum()), count)
    if sets is not None:
        qhat = np.asarray(sets.qhat) if sets.class_conditional else sets.qhat[0]
        sizes = prediction_sets(parts_held["probs"], qhat, sets.method, sets.params).sum(axis=1)
        counts["empty_set"] = (int((sizes == 0).sum()), count)
    return MonitorReference.new(score, ood_score(parts_held, score).tolist(), counts)


# --- applying a record ----------------------------------------------------------------------------
def apply_decisions(
    member_logits: Any, record: DecisionRecord, *, allow_nonfinite: bool = False
) -> dict[str, np.ndarray]:
    """The decisions of ``record`` on member logits [B, M, C].

    Returns ``calibrated_probs`` [B, C] (float32), ``confidence`` [B] (the calibrated max
    probability, float32), ``prediction`` [B] (int64), and, for each rule the record holds,
    ``prediction_set`` [B, C], ``accept`` [B] and ``ood_flag`` [B] (bool). With
    ``allow_nonfinite``, an example with non-finite logits gets NaN probabilities, an empty set,
    accept False and ood_flag True."""
    logits = np.asarray(member_logits)
    check_classes(logits, record)
    scores = calibrated_scores(logits, record.temperature, allow_nonfinite=allow_nonfinite)
    return decided_from_scores(scores, record)


def check_classes(logits: np.ndarray, record: DecisionRecord) -> None:
    """Refuse member logits that are not [B, M, C] of the record's C classes."""
    if logits.ndim != 3 or logits.shape[2] != record.num_classes:
        raise DataError(
            f"the decisions were fitted for {record.num_classes} classes; member_logits has shape "
            f"{logits.shape}"
        )


def decided_from_scores(
    scores: dict[str, np.ndarray], record: DecisionRecord
) -> dict[str, np.ndarray]:
    """:func:`apply_decisions` from the :func:`calibrated_scores` of the logits at the record's
    temperature (for a caller that needs those scores too: one pass, not two)."""
    finite = scores["prediction"] >= 0
    out: dict[str, np.ndarray] = {
        "calibrated_probs": scores["probs"].astype(np.float32),
        "confidence": scores["msp"].astype(np.float32),
        "prediction": scores["prediction"],
    }
    if record.sets is not None:
        rule = record.sets
        qhat = np.asarray(rule.qhat) if rule.class_conditional else rule.qhat[0]
        probs = np.where(finite[:, None], scores["probs"], 0.0)
        out["prediction_set"] = (
            prediction_sets(probs, qhat, rule.method, rule.params) & finite[:, None]
        )
    if record.selective is not None:
        rule = record.selective
        out["accept"] = accept_mask(scores[rule.score], rule.score, rule.tau) & finite
    if record.ood is not None:
        out["ood_flag"] = (
            ood_mask(ood_score(scores, record.ood.score), record.ood.threshold) | ~finite
        )
    return out


def decision_metrics(
    member_logits: Any, labels: Any | None, record: DecisionRecord, *, bins: int = 15
) -> dict[str, Any]:
    """What ``record`` does on data: with labels (in-distribution), accuracy, ECE and NLL before
    and after T, set coverage and mean size (and the share of empty sets), selective coverage and
    risk at tau, and the OOD flag rate; without labels (an OOD set), the flag rate, the share
    answered and the mean set size."""
    logits = _logits(member_logits)
    decided = apply_decisions(logits, record)
    out: dict[str, Any] = {"count": len(logits)}
    if "prediction_set" in decided:
        sizes = decided["prediction_set"].sum(axis=1)
        out["mean_set_size"] = float(sizes.mean())
        out["empty_sets"] = float((sizes == 0).mean())
    if "accept" in decided:
        out["answered"] = float(decided["accept"].mean())
    if "ood_flag" in decided:
        out["flag_rate"] = float(decided["ood_flag"].mean())
    if labels is None:
        return out
    y = _labels(labels, len(logits), logits.shape[2])
    raw = ensemble_scores(logits, dtype=np.float64)
    correct = decided["prediction"] == y
    out["accuracy"] = float(correct.mean())
    out["ece_raw"] = ece(raw["probs"], y, bins)
    out["ece"] = ece(decided["calibrated_probs"].astype(np.float64), y, bins)
    out["nll_raw"] = nll(raw["probs"], y)
    out["nll"] = nll(decided["calibrated_probs"].astype(np.float64), y)
    if "prediction_set" in decided:
        out["coverage"] = float(decided["prediction_set"][np.arange(len(y)), y].mean())
    if "accept" in decided:
        answered = decided["accept"]
        out["selective_risk"] = float((~correct[answered]).mean()) if answered.any() else None
    return out
