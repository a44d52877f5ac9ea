"""Evaluation metrics (numpy only). OOD detection treats OOD as the positive class by default."""

from __future__ import annotations

import numpy as np

from hydra_deploy.errors import HydraError


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
    (the Mann-Whitney U statistic). Refuses an empty side.
    """
    neg = np.asarray(scores_negative, dtype=np.float64).ravel()
    pos = np.asarray(scores_positive, dtype=np.float64).ravel()
    if neg.size == 0 or pos.size == 0:
        raise HydraError(
            f"AUROC needs both sides: got {neg.size} negatives and {pos.size} positives"
        )
    if not (np.isfinite(neg).all() and np.isfinite(pos).all()):
        raise HydraError("AUROC scores must be finite")
    ranks = _average_ranks(np.concatenate([neg, pos]))
    rank_sum_pos = ranks[neg.size :].sum()
    return float((rank_sum_pos - pos.size * (pos.size + 1) / 2.0) / (pos.size * neg.size))
