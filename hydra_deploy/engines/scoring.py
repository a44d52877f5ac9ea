"""The one scoring step: a runner's member logits for a batch, and the ensemble's scores of them.

``hydra-run``, ``hydra-eval``, ``hydra-serve`` and ``hydra-score-dataset`` each read their inputs
their own way (files, a data set, requests, a Ray dataset) and lay the answer out their own way
(rows, a report, Triton outputs, Parquet columns); between the two they all call
:func:`run_member_logits` and :func:`score_batch`, so a model without ``member_logits`` gets one
message, every score comes from :func:`~hydra_deploy.uncertainty.ensemble_scores` and every
decision (when the export holds them: ``runner.decisions``) from
:func:`~hydra_deploy.decisions.apply_decisions`.

numpy only (edge-safe).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from hydra_deploy.decisions import apply_decisions
from hydra_deploy.errors import RunnerError
from hydra_deploy.uncertainty.scores import ensemble_scores

if TYPE_CHECKING:
    from hydra_deploy.engines.runner_base import Runner

__all__ = ["DECISION_FIELDS", "check_member_logits", "run_member_logits", "score_batch"]

MEMBER_LOGITS = "member_logits"
#: What :func:`score_batch` adds for an export with decisions (those of its rules that it holds).
DECISION_FIELDS = ("calibrated_probs", "confidence", "prediction_set", "accept", "ood_flag")


def check_member_logits(runner: Runner, output_names: Any) -> None:
    """A RunnerError unless the model has the ``member_logits`` output a Hydra export has."""
    names = list(output_names)
    if MEMBER_LOGITS not in names:
        where = getattr(runner, "path", None) or "the model"
        raise RunnerError(
            f"{where} has no '{MEMBER_LOGITS}' output (outputs: {names}); is it a Hydra export?"
        )


def run_member_logits(
    runner: Runner,
    inputs: np.ndarray | Mapping[str, np.ndarray],
    *,
    batch_size: int | None = None,
    allow_nonfinite: bool = False,
) -> np.ndarray:
    """``runner(inputs)``'s member logits [batch, M, C]. ``allow_nonfinite`` passes inputs and
    logits holding NaN/inf through (the runners' option; only asked for when set)."""
    options: dict[str, Any] = {"batch_size": batch_size}
    if allow_nonfinite:
        options["allow_nonfinite"] = True
    outputs = runner(inputs, **options)
    check_member_logits(runner, outputs)
    return np.asarray(outputs[MEMBER_LOGITS])


def score_batch(
    runner: Runner,
    inputs: np.ndarray | Mapping[str, np.ndarray],
    *,
    batch_size: int | None = None,
    allow_nonfinite: bool = False,
    decisions: bool = True,
) -> dict[str, np.ndarray]:
    """Member logits and every ensemble score of one batch: ``member_logits`` plus what
    :func:`~hydra_deploy.uncertainty.ensemble_scores` returns (``probs``, the scalar scores,
    ``prediction``, ``member_probs``).

    When the runner holds decisions (``runner.decisions``) and ``decisions`` is true, also what
    :func:`~hydra_deploy.decisions.apply_decisions` returns: ``calibrated_probs``, ``confidence``
    and ``prediction_set`` / ``accept`` / ``ood_flag`` for the rules it holds; ``prediction`` is
    then the argmax of the calibrated probabilities (the class the set and the answer are about).
    The scores stay those of the raw probabilities."""
    logits = run_member_logits(
        runner, inputs, batch_size=batch_size, allow_nonfinite=allow_nonfinite
    )
    scores = {MEMBER_LOGITS: logits, **ensemble_scores(logits, allow_nonfinite=allow_nonfinite)}
    record = getattr(runner, "decisions", None) if decisions else None
    if record is not None:
        scores.update(apply_decisions(logits, record, allow_nonfinite=allow_nonfinite))
    return scores
