"""Evaluation metrics (numpy only: safe to import on an edge device).

Conventions (every one is also an argument or stated in the function's docstring):

- ``probs`` [N, C] are probabilities (rows sum to 1 within ``PROB_SUM_ATOL`` = 1e-3), ``labels``
  [N] integer class indices; the prediction is ``argmax probs`` (ties to the lowest index);
  logarithms are natural.
- OOD detection (:func:`auroc`, :func:`aupr`, :func:`fpr_at_tpr`, :func:`ood_metrics`) treats OOD
  as the positive class by default (``positive="ood"``) and reads scores as "higher = more
  positive": pass predictive entropy, expected entropy, mutual information or disagreement as
  they are and ``-msp`` for MSP (:func:`ood_score` does the sign). An empty side is refused.
- FPR95 is the FPR at the first threshold (from the highest score down) where TPR >= 0.95.
- ECE uses ``bins`` equal-width bins (15 by default) on the max-probability confidence.
- AURC is raw (:func:`aurc`); E-AURC (:func:`excess_aurc`) is AURC minus the perfect ranking's.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hydra_deploy.errors import HydraError, counted


def _as_array(values: object, name: str, dtype: type | None = None) -> np.ndarray:
    """``np.asarray(values, dtype)``; HydraError for ragged lists or values that are not numbers."""
    try:
        array = np.asarray(values)
        if dtype is not None and array.dtype.kind not in "biuf":  # not None -> NaN, not complex
            raise TypeError(f"dtype {array.dtype} does not hold real numbers")
        return array if dtype is None else array.astype(dtype)
    except (ValueError, TypeError) as err:
        raise HydraError(
            f"{name} is not a numeric array ({err}); pass a numpy array of numbers"
        ) from None


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks with ties given their average rank (as scipy.stats.rankdata)."""
    order = np.argsort(values, kind="mergesort")
    sorted_values = values[order]
    # boundaries of runs of equal values
    starts = np.flatnonzero(np.r_[True, sorted_values[1:] != sorted_values[:-1]])
    ends = np.r_[starts[1:], len(values)]
    run_ranks = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.repeat(run_ranks, ends - starts)
    return ranks


def auroc(scores_negative: np.ndarray, scores_positive: np.ndarray) -> float:
    """Area under the ROC curve: the probability that a positive scores above a negative.

    Higher scores mean "more positive" (for OOD detection: more likely OOD). Ties count one half
    (the Mann-Whitney U statistic). Refuses an empty side. For OOD detection with OOD positive
    call ``auroc(scores_id, scores_ood)`` with OOD scores (or use :func:`ood_metrics`).
    """
    neg = _as_array(scores_negative, "scores_negative", np.float64).ravel()
    pos = _as_array(scores_positive, "scores_positive", np.float64).ravel()
    if neg.size == 0 or pos.size == 0:
        raise HydraError(
            f"AUROC needs both sides: got {neg.size} negatives and {pos.size} positives"
        )
    if not (np.isfinite(neg).all() and np.isfinite(pos).all()):
        raise HydraError("AUROC scores must be finite")
    ranks = _average_ranks(np.concatenate([neg, pos]))
    rank_sum_pos = ranks[neg.size :].sum()
    return float((rank_sum_pos - pos.size * (pos.size + 1) / 2.0) / (pos.size * neg.size))


# ---------------------------------------------------------------------------------------------
# Conventions shared by everything below
# ---------------------------------------------------------------------------------------------

PROB_SUM_ATOL = 1e-3
"""How far a row of ``probs`` may sum from 1 (absolute) before it is refused."""

ECE_BINS = 15
"""Default number of equal-width confidence bins for :func:`ece` and :func:`reliability_bins`."""

MAX_BINS = 10_000
"""The most confidence bins :func:`ece` and :func:`reliability_bins` take (more is all empty bins)."""

POSITIVE_CHOICES = ("ood", "id")

_OOD_SIGN = {
    "msp": -1.0,
    "predictive_entropy": 1.0,
    "expected_entropy": 1.0,
    "mutual_information": 1.0,
    "disagreement": 1.0,
}


def _finite_1d(values: np.ndarray, name: str, *, allow_empty: bool = False) -> np.ndarray:
    array = _as_array(values, name)
    if array.ndim != 1:
        raise HydraError(f"{name} must be a 1-D array, got shape {array.shape}")
    if not (
        np.issubdtype(array.dtype, np.floating)
        or np.issubdtype(array.dtype, np.integer)
        or array.dtype == np.bool_
    ):
        raise HydraError(f"{name} must hold numbers, got dtype {array.dtype}")
    array = array.astype(np.float64)
    if array.size == 0 and not allow_empty:
        raise HydraError(f"{name} is empty")
    bad = ~np.isfinite(array)
    if bad.any():
        raise HydraError(
            f"{name} holds {counted(int(bad.sum()), 'NaN or infinite value')} (first at index "
            f"{int(np.argmax(bad))})"
        )
    return array


def _check_probs_labels(probs: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validated ``probs`` [N, C] (float64) and ``labels`` [N] (int64)."""
    p = _as_array(probs, "probs")
    if p.ndim != 2 or 0 in p.shape:
        raise HydraError(
            f"probs must be [examples, classes] with no empty axis, got shape {p.shape}"
        )
    if not (np.issubdtype(p.dtype, np.floating) or np.issubdtype(p.dtype, np.integer)):
        raise HydraError(f"probs must be a float array, got dtype {p.dtype}")
    p = p.astype(np.float64)
    bad = ~np.isfinite(p)
    if bad.any():
        row = int(np.argmax(bad.any(axis=1)))
        raise HydraError(
            f"probs holds NaN or infinite values in {counted(int(bad.any(axis=1).sum()), 'row')} "
            "(first: "
            f"row {row})"
        )
    if (p < 0).any() or (p > 1 + PROB_SUM_ATOL).any():
        raise HydraError(
            "probs must lie in [0, 1]; got values from "
            f"{p.min():.6g} to {p.max():.6g} (pass probabilities, not logits)"
        )
    sums = p.sum(axis=1)
    off = np.abs(sums - 1.0) > PROB_SUM_ATOL
    if off.any():
        row = int(np.argmax(off))
        raise HydraError(
            f"probs rows must sum to 1 within {PROB_SUM_ATOL}: {counted(int(off.sum()), 'row')} "
            f"{'does' if int(off.sum()) == 1 else 'do'} not "
            f"(first: row {row} sums to {sums[row]:.6g}); pass probabilities, not logits"
        )
    y = _as_array(labels, "labels")
    if y.ndim != 1 or y.shape[0] != p.shape[0]:
        raise HydraError(
            f"labels must be 1-D with one label per row of probs ({p.shape[0]}), got shape "
            f"{y.shape}"
        )
    if not np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_:
        raise HydraError(f"labels must be integer class indices, got dtype {y.dtype}")
    out = (y < 0) | (y >= p.shape[1])  # before the cast: uint64 labels above 2**63 stay themselves
    if out.any():
        raise HydraError(
            f"labels must lie in [0, {p.shape[1] - 1}] (probs has {p.shape[1]} classes); "
            f"{int(out.sum())} do not (first: label {y[int(np.argmax(out))]} at index "
            f"{int(np.argmax(out))})"
        )
    return p, y.astype(np.int64)


def _is_real(value: object) -> bool:
    """A real number (not a bool): what a tolerance or rate may be."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def _check_bins(bins: int) -> int:
    if isinstance(bins, bool) or not isinstance(bins, (int, np.integer)) or bins < 1:
        raise HydraError(f"bins must be a positive integer, got {bins!r}")
    if bins > MAX_BINS:
        raise HydraError(
            f"bins must be in 1..{MAX_BINS} (equal-width confidence bins, {ECE_BINS} by "
            f"default), got {bins!r}"
        )
    return int(bins)


# ---------------------------------------------------------------------------------------------
# Classification: accuracy, NLL, Brier, ECE
# ---------------------------------------------------------------------------------------------


def accuracy(probs: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of examples whose prediction ``argmax_c probs`` equals the label.

    ``probs`` is [N, C] (rows are probabilities summing to 1 within ``PROB_SUM_ATOL``), ``labels``
    [N] integer class indices. A tie in ``argmax`` goes to the lowest class index (numpy's rule).
    """
    p, y = _check_probs_labels(probs, labels)
    return float((p.argmax(axis=1) == y).mean())


def nll(probs: np.ndarray, labels: np.ndarray, eps: float = 1e-12) -> float:
    """Mean negative log-likelihood of the labels, natural log: ``-mean_n log p[n, y_n]``.

    The probability of the label is clipped below at ``eps`` (so a zero gives ``-log(eps)``, about
    27.6 nats for the default, instead of infinity); rows are not renormalized.
    """
    if not _is_real(eps) or not 0 < eps < 1:
        raise HydraError(f"eps must be positive (and below 1), got {eps!r}")
    p, y = _check_probs_labels(probs, labels)
    picked = p[np.arange(len(y)), y]
    return float(-np.log(np.maximum(picked, eps)).mean())


def brier(probs: np.ndarray, labels: np.ndarray) -> float:
    """Multiclass Brier score: mean over examples of the sum over classes of the squared error.

    ``mean_n sum_c (probs[n, c] - onehot(y_n)[c])**2``, in [0, 2] (the original Brier 1950
    definition; scikit-learn's binary ``brier_score_loss`` is half of this for two classes).
    """
    p, y = _check_probs_labels(probs, labels)
    onehot = np.zeros_like(p)
    onehot[np.arange(len(y)), y] = 1.0
    return float(((p - onehot) ** 2).sum(axis=1).mean())


def reliability_bins(
    probs: np.ndarray, labels: np.ndarray, bins: int = ECE_BINS
) -> dict[str, np.ndarray]:
    """Per-bin table of a reliability diagram on the max-probability confidence.

    Confidence is ``max_c probs``, the prediction ``argmax_c probs`` (ties to the lowest index).
    The bins are ``bins`` equal-width intervals of [0, 1] with ``edges = np.linspace(0, 1, bins+1)``,
    closed on the right: bin ``b`` holds ``edges[b] < confidence <= edges[b+1]`` (a confidence of
    exactly 0 goes to the first bin).

    Returns ``edges`` [bins+1] and, per bin [bins], ``count`` (int64), ``accuracy`` and
    ``confidence`` (mean accuracy and mean confidence in the bin; NaN for an empty bin).
    """
    bins = _check_bins(bins)
    p, y = _check_probs_labels(probs, labels)
    confidence = p.max(axis=1)
    correct = (p.argmax(axis=1) == y).astype(np.float64)
    edges = np.linspace(0.0, 1.0, bins + 1)
    index = np.clip(np.searchsorted(edges, confidence, side="left") - 1, 0, bins - 1)
    count = np.bincount(index, minlength=bins).astype(np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = np.bincount(index, weights=correct, minlength=bins) / count
        conf = np.bincount(index, weights=confidence, minlength=bins) / count
    return {"edges": edges, "count": count, "accuracy": acc, "confidence": conf}


def ece(probs: np.ndarray, labels: np.ndarray, bins: int = ECE_BINS) -> float:
    """Expected calibration error with ``bins`` equal-width bins (15 by default).

    ``sum_b (n_b / N) * |accuracy_b - confidence_b|`` over the non-empty bins of
    :func:`reliability_bins` (max-probability confidence, right-closed bins ``(lo, hi]``).
    """
    table = reliability_bins(probs, labels, bins)
    count = table["count"]
    filled = count > 0
    gap = np.abs(table["accuracy"][filled] - table["confidence"][filled])
    return float((count[filled] * gap).sum() / count.sum())


# ---------------------------------------------------------------------------------------------
# OOD detection: AUPR, FPR at TPR (AUROC above)
# ---------------------------------------------------------------------------------------------


def ood_score(scores: np.ndarray | Mapping[str, np.ndarray], name: str) -> np.ndarray:
    """An ensemble score turned into an OOD score (higher = more likely OOD).

    ``msp`` is negated (a high max-probability means in-distribution); ``predictive_entropy``,
    ``expected_entropy``, ``mutual_information`` and ``disagreement`` are returned as they are.
    ``scores`` is the score's array, or the dict of :func:`ensemble_scores` (``scores[name]`` is
    taken). Returns float64.
    """
    if not isinstance(name, str) or name not in _OOD_SIGN:
        raise HydraError(f"unknown score {name!r}; expected one of {sorted(_OOD_SIGN)}")
    if isinstance(scores, Mapping) and name not in scores:
        raise HydraError(
            f"the scores hold no {name!r} (they hold {sorted(map(str, scores))}); pass the dict "
            "ensemble_scores returns, or the score's array itself"
        )
    values = scores[name] if isinstance(scores, Mapping) else scores
    return _OOD_SIGN[name] * _as_array(values, name, np.float64)


def _ood_sides(
    scores_id: np.ndarray, scores_ood: np.ndarray, positive: str, metric: str
) -> tuple[np.ndarray, np.ndarray]:
    """(negatives, positives) after validation; refuses an empty side."""
    if positive not in POSITIVE_CHOICES:
        raise HydraError(f"positive must be 'ood' or 'id', got {positive!r}")
    ind = _finite_1d(scores_id, "scores_id", allow_empty=True)
    ood = _finite_1d(scores_ood, "scores_ood", allow_empty=True)
    if ind.size == 0 or ood.size == 0:
        raise HydraError(
            f"{metric} needs both sides: got {ind.size} in-distribution and {ood.size} OOD "
            "score(s); an OOD evaluation with an empty side is meaningless"
        )
    return (ind, ood) if positive == "ood" else (ood, ind)


def _positive_counts(negatives: np.ndarray, positives: np.ndarray) -> tuple[np.ndarray, ...]:
    """Cumulative (true, false) positive counts at each distinct score, highest first.

    The threshold rule is "positive when score >= t"; t runs over the distinct scores in descending
    order, so tied scores are always admitted together.
    """
    scores = np.concatenate([positives, negatives])
    is_pos = np.r_[np.ones(positives.size), np.zeros(negatives.size)]
    order = np.argsort(-scores, kind="mergesort")
    scores, is_pos = scores[order], is_pos[order]
    last_of_run = np.r_[np.flatnonzero(scores[1:] != scores[:-1]), scores.size - 1]
    tps = np.cumsum(is_pos)[last_of_run]
    fps = (last_of_run + 1) - tps
    return tps, fps


def aupr(scores_id: np.ndarray, scores_ood: np.ndarray, positive: str = "ood") -> float:
    """Area under the precision-recall curve as average precision (``sklearn``'s definition).

    ``AP = sum_k (R_k - R_{k-1}) P_k`` over the distinct score thresholds, highest first
    (step-wise, no interpolation), equal to ``sklearn.metrics.average_precision_score``.

    Scores: higher = more positive. With ``positive="ood"`` (default; AUPR-Out) OOD is the positive
    class and the scores must be OOD scores, e.g. predictive entropy or mutual information as they
    are and ``-msp`` for MSP (see :func:`ood_score`). ``positive="id"`` (AUPR-In) swaps the roles:
    the ID examples are the positives and a higher score must mean "more in-distribution" (e.g.
    ``msp``); it equals calling with the two sides swapped. Refuses an empty side or NaN.
    """
    negatives, positives = _ood_sides(scores_id, scores_ood, positive, "AUPR")
    tps, fps = _positive_counts(negatives, positives)
    precision = tps / (tps + fps)
    recall = tps / positives.size
    return float((np.diff(recall, prepend=0.0) * precision).sum())


def fpr_at_tpr(
    scores_id: np.ndarray, scores_ood: np.ndarray, tpr: float = 0.95, positive: str = "ood"
) -> float:
    """False-positive rate at the first threshold where the true-positive rate reaches ``tpr``.

    Thresholds are the distinct scores taken from the highest down, "positive when score >= t";
    the result is FPR at the first (highest) threshold with ``TPR >= tpr``. This is
    ``fpr[argmax(tpr_curve >= tpr)]`` of ``sklearn.metrics.roc_curve(..., drop_intermediate=False)``
    (with the default ``drop_intermediate=True`` scikit-learn may skip that point when scores tie).
    With ``tpr=0.95`` this is FPR95.

    ``positive`` and the sign of the scores as in :func:`aupr`: higher = more positive; OOD is
    positive by default, so pass OOD scores (entropy, MI as they are; ``-msp`` for MSP).
    """
    if not _is_real(tpr) or not 0.0 < tpr <= 1.0:
        raise HydraError(f"tpr must lie in (0, 1], got {tpr!r}")
    negatives, positives = _ood_sides(scores_id, scores_ood, positive, "FPR@TPR")
    tps, fps = _positive_counts(negatives, positives)
    reached = tps / positives.size >= tpr
    return float(fps[int(np.argmax(reached))] / negatives.size)


def ood_metrics(
    scores_id: np.ndarray, scores_ood: np.ndarray, positive: str = "ood"
) -> dict[str, float]:
    """``auroc``, ``aupr`` and ``fpr95`` (FPR at TPR >= 0.95) of an OOD evaluation.

    Scores: higher = more positive; OOD is the positive class by default (pass entropy or MI as
    they are, ``-msp`` for MSP; see :func:`ood_score`). ``positive="id"`` swaps the roles (ID
    positive, higher score = more in-distribution). Refuses an empty side with :class:`HydraError`.
    """
    negatives, positives = _ood_sides(scores_id, scores_ood, positive, "the OOD evaluation")
    return {
        "auroc": auroc(negatives, positives),
        "aupr": aupr(scores_id, scores_ood, positive=positive),
        "fpr95": fpr_at_tpr(scores_id, scores_ood, tpr=0.95, positive=positive),
    }


# ---------------------------------------------------------------------------------------------
# Misclassification detection: AURC, E-AURC
# ---------------------------------------------------------------------------------------------


def _check_selective(confidence: np.ndarray, correct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    conf = _finite_1d(confidence, "confidence")
    ok = _as_array(correct, "correct")
    if ok.ndim != 1 or ok.shape[0] != conf.shape[0]:
        raise HydraError(
            f"correct must be 1-D with one entry per confidence ({conf.shape[0]}), got shape "
            f"{ok.shape}"
        )
    if ok.dtype != np.bool_:
        if not np.issubdtype(ok.dtype, np.number) or not np.isin(ok, (0, 1)).all():
            raise HydraError("correct must be booleans or 0/1 (1 = the prediction was right)")
        ok = ok.astype(bool)
    return conf, ok


def _risk_area(errors_sorted_by_group: np.ndarray, group_sizes: np.ndarray) -> float:
    """Mean over coverages k = 1..N of E[errors among the top k] / k, ties spread evenly."""
    n = int(group_sizes.sum())
    starts = np.r_[0, np.cumsum(group_sizes)[:-1]]
    before = np.r_[0.0, np.cumsum(errors_sorted_by_group)[:-1]]
    rate = errors_sorted_by_group / group_sizes
    group = np.repeat(np.arange(group_sizes.size), group_sizes)
    k = np.arange(1, n + 1, dtype=np.float64)
    errors_at_k = before[group] + (k - starts[group]) * rate[group]
    return float((errors_at_k / k).mean())


def aurc(confidence: np.ndarray, correct: np.ndarray) -> float:
    """Area under the risk-coverage curve (raw AURC, lower is better), in [0, 1].

    Examples are accepted in decreasing ``confidence`` (higher = more likely correct; e.g. ``msp``,
    or ``-predictive_entropy``); at coverage k/N the risk is the error rate among the k accepted,
    and AURC is the mean of the N risks (k = 1..N). Ties are handled deterministically: a group
    of tied confidences is entered in an order-free way, as the expectation over uniformly random
    orders within the group (the group's errors are spread evenly over its positions), so the
    result does not depend on the input order.
    """
    conf, ok = _check_selective(confidence, correct)
    order = np.argsort(-conf, kind="mergesort")
    conf, errors = conf[order], (~ok[order]).astype(np.float64)
    starts = np.flatnonzero(np.r_[True, conf[1:] != conf[:-1]])
    sizes = np.diff(np.r_[starts, conf.size])
    return _risk_area(np.add.reduceat(errors, starts), sizes)


def _optimal_aurc(n: int, n_errors: int) -> float:
    """AURC of the perfect ranking (all correct first), exact discrete form, no ln approximation."""
    if n_errors == 0:
        return 0.0
    k = np.arange(n - n_errors + 1, n + 1, dtype=np.float64)
    return float(((k - (n - n_errors)) / k).sum() / n)


def excess_aurc(confidence: np.ndarray, correct: np.ndarray) -> float:
    """Excess AURC (E-AURC): :func:`aurc` minus the AURC of the perfect ranking of the same data.

    The optimal AURC puts every correct example first: ``(1/N) sum_{k=N-E+1}^{N} (k-(N-E))/k`` for
    E errors out of N (the exact discrete sum, not the ``r + (1-r) ln(1-r)`` approximation), so a
    perfect ranking gives exactly 0. Conventions (ties, sign of the confidence) as :func:`aurc`.
    """
    conf, ok = _check_selective(confidence, correct)
    return aurc(conf, ok) - _optimal_aurc(ok.size, int((~ok).sum()))


def selective_risk_at(
    confidence: np.ndarray, correct: np.ndarray, coverages: np.ndarray
) -> np.ndarray:
    """The selective risk at each coverage ``c`` of ``coverages`` (in (0, 1]): the error rate of
    the ``ceil(c N)`` most confident examples (at least one; ties in input order), float64.
    Conventions (the sign of the confidence) as :func:`aurc`."""
    conf, ok = _check_selective(confidence, correct)
    shares = _as_array(coverages, "coverages", np.float64).ravel()
    if shares.size == 0 or not ((shares > 0) & (shares <= 1)).all():
        raise HydraError(f"coverages must be shares in (0, 1], got {shares.tolist()}")
    order = np.argsort(-conf, kind="stable")
    errors = np.cumsum(~ok[order])
    answered = np.maximum(1, np.ceil(shares * conf.size - 1e-9).astype(int))
    return errors[answered - 1] / answered


def classification_metrics(
    probs: np.ndarray,
    labels: np.ndarray,
    bins: int = ECE_BINS,
    confidence: np.ndarray | None = None,
) -> dict[str, float]:
    """``accuracy``, ``nll``, ``brier``, ``ece`` (``bins`` equal-width bins), ``aurc`` (raw) and
    ``eaurc`` (excess) of a classifier's ``probs`` [N, C] against ``labels`` [N].

    Correctness is ``argmax probs == label``. The confidence that ranks examples for AURC/E-AURC is
    ``msp = max_c probs`` unless ``confidence`` [N] is given (higher = more confident: pass e.g.
    ``-predictive_entropy`` or ``-mutual_information``). ECE always uses ``max_c probs``.
    """
    p, y = _check_probs_labels(probs, labels)
    bins = _check_bins(bins)
    correct = p.argmax(axis=1) == y
    conf = p.max(axis=1) if confidence is None else confidence
    conf, correct = _check_selective(conf, correct)
    return {
        "accuracy": accuracy(p, y),
        "nll": nll(p, y),
        "brier": brier(p, y),
        "ece": ece(p, y, bins),
        "aurc": aurc(conf, correct),
        "eaurc": excess_aurc(conf, correct),
    }
