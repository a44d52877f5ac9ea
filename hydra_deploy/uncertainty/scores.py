"""Uncertainty scores from member logits (numpy only; natural log).

- probs = mean over members of softmax(logits_m); msp = max_c probs
- predictive_entropy = H[probs]; expected_entropy = mean_m H[softmax(logits_m)]
- mutual_information = predictive_entropy - expected_entropy, clipped at 0
- disagreement = fraction of members whose argmax differs from the ensemble's argmax
"""

from __future__ import annotations

import numpy as np

from hydra_deploy.errors import HydraError

SCORE_NAMES = ("probs", "msp", "predictive_entropy", "expected_entropy", "mutual_information",
               "disagreement")  # fmt: skip


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def ensemble_scores(member_logits: np.ndarray) -> dict[str, np.ndarray]:
    """Scores of member logits [batch, M, C] (computed in float64, returned as float32)."""
    logits = np.asarray(member_logits, dtype=np.float64)
    if logits.ndim != 3 or 0 in logits.shape:
        raise HydraError(
            f"member_logits must be [batch, members, classes] with no empty axis, got {logits.shape}"
        )
    if not np.isfinite(logits).all():
        raise HydraError("member_logits holds NaN or infinite values")
    log_p = _log_softmax(logits)  # [B, M, C]
    member_probs = np.exp(log_p)
    probs = member_probs.mean(axis=1)  # [B, C]
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(probs > 0, probs * np.log(probs), 0.0)
    predictive = -plogp.sum(axis=-1)
    expected = -(member_probs * log_p).sum(axis=-1).mean(axis=1)
    votes = logits.argmax(axis=-1)  # [B, M]
    disagreement = (votes != probs.argmax(axis=-1)[:, None]).mean(axis=1)
    scores = {
        "probs": probs,
        "msp": probs.max(axis=-1),
        "predictive_entropy": predictive,
        "expected_entropy": expected,
        "mutual_information": np.maximum(predictive - expected, 0.0),
        "disagreement": disagreement,
    }
    return {k: v.astype(np.float32) for k, v in scores.items()}
