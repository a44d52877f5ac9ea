"""Uncertainty scores and metrics (numpy only: safe to import on an edge device)."""

from hydra_deploy.uncertainty.metrics import (
    ECE_BINS,
    accuracy,
    aupr,
    aurc,
    auroc,
    brier,
    classification_metrics,
    ece,
    excess_aurc,
    fpr_at_tpr,
    nll,
    ood_metrics,
    ood_score,
    reliability_bins,
)
from hydra_deploy.uncertainty.scores import (
    GRAPH_SCORES,
    SCALAR_SCORES,
    SCORE_NAMES,
    ensemble_scores,
)

__all__ = [
    "ECE_BINS",
    "GRAPH_SCORES",
    "SCALAR_SCORES",
    "SCORE_NAMES",
    "accuracy",
    "aupr",
    "aurc",
    "auroc",
    "brier",
    "classification_metrics",
    "ece",
    "ensemble_scores",
    "excess_aurc",
    "fpr_at_tpr",
    "nll",
    "ood_metrics",
    "ood_score",
    "reliability_bins",
]
