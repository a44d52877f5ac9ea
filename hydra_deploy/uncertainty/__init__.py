"""Uncertainty scores and metrics (numpy only: safe to import on an edge device)."""

from hydra_deploy.uncertainty.scores import SCALAR_SCORES, SCORE_NAMES, ensemble_scores

__all__ = ["SCALAR_SCORES", "SCORE_NAMES", "ensemble_scores"]
