"""Uncertainty scores from member logits (numpy only; natural log).

For member logits ``z[b, m, c]`` (batch, member, class):

- member_probs = softmax_c(z[b, m]); probs = mean over members of member_probs
- prediction = argmax_c probs; msp = max_c probs
- predictive_entropy = H[probs]; expected_entropy = mean_m H[member_probs[m]]
- mutual_information = predictive_entropy - expected_entropy, clipped at 0
- disagreement = fraction of members whose argmax differs from the ensemble's prediction

Everything is computed in float64 from a max-shifted log-softmax, so any finite logits (+/-1e4,
float16 arrays, float64 up to its maximum) give finite scores; 0 log 0 counts as 0.
"""

from __future__ import annotations

import numpy as np

from hydra_deploy.errors import HydraError, counted, spelled

SCORE_NAMES = (
    "probs",
    "msp",
    "predictive_entropy",
    "expected_entropy",
    "mutual_information",
    "disagreement",
)
"""The float scores that the exported ensemble head (``uq_outputs``) also computes, plus
disagreement. :func:`ensemble_scores` returns these and ``prediction`` and ``member_probs``."""

SCALAR_SCORES = (
    "msp",
    "predictive_entropy",
    "expected_entropy",
    "mutual_information",
    "disagreement",
)
"""Scores with one value per example (what ``hydra-run`` prints and writes, ``hydra-serve``
answers and ``hydra-score-dataset`` stores as columns)."""

GRAPH_SCORES = ("probs", "predictive_entropy", "expected_entropy", "mutual_information", "msp")
"""The scores the exported ensemble head (``uq_outputs``) computes in the graph, in the order of
the graph's outputs after ``member_logits``."""


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # -inf for logits ~9e307 apart: probability 0, as it should
        shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _refuse_nonfinite(logits: np.ndarray) -> None:
    bad = ~np.isfinite(logits)
    example, member, _ = np.unravel_index(int(np.argmax(bad)), logits.shape)
    count = int(bad.any(axis=(1, 2)).sum())
    raise HydraError(
        f"member_logits holds NaN or infinite values in {count} of "
        f"{counted(logits.shape[0], 'example')} (first: example {example}, member {member}); the "
        "model or engine overflowed (an FP16 engine? compare it with hydra-compare), or "
        + spelled("pass allow_nonfinite=True", "run it with hydra-run --allow-nonfinite")
        + " to get NaN scores and prediction -1 for those examples"
    )


def ensemble_scores(
    member_logits: np.ndarray, *, allow_nonfinite: bool = False, dtype: type = np.float32
) -> dict[str, np.ndarray]:
    """Uncertainty scores of member logits ``[batch, members, classes]``.

    Returns a dict of numpy arrays: ``probs`` [B, C], ``member_probs`` [B, M, C], ``prediction``
    [B] (int64, argmax of probs), and ``msp``, ``predictive_entropy``, ``expected_entropy``,
    ``mutual_information``, ``disagreement`` [B]. Floats are computed in float64 and returned as
    float32 (``dtype=np.float64`` keeps the float64 values); any float dtype goes in (float16
    included).

    Non-finite logits (NaN, +/-inf) raise :class:`HydraError` unless ``allow_nonfinite``: then the
    examples holding them get NaN in every float score and prediction -1, and the others are
    scored as usual.
    """
    try:
        logits = np.asarray(member_logits)
    except (ValueError, TypeError) as err:  # ragged nested lists
        raise HydraError(
            f"member_logits is not an array numpy can hold ({err}); pass the runner's "
            "outputs['member_logits']"
        ) from None
    if logits.ndim != 3 or 0 in logits.shape:
        raise HydraError(
            f"member_logits must be [batch, members, classes] with no empty axis, got "
            f"{logits.shape}; pass the runner's outputs['member_logits']"
        )
    if not (np.issubdtype(logits.dtype, np.floating) or np.issubdtype(logits.dtype, np.integer)):
        raise HydraError(f"member_logits must be a float array, got dtype {logits.dtype}")
    logits = logits.astype(np.float64)
    finite = np.isfinite(logits).all(axis=(1, 2))  # [B]
    if not finite.all():
        if not allow_nonfinite:
            _refuse_nonfinite(logits)
        logits = np.where(finite[:, None, None], logits, 0.0)  # scored, then replaced by NaN

    log_p = _log_softmax(logits)  # [B, M, C]
    member_probs = np.exp(log_p)
    probs = member_probs.mean(axis=1)  # [B, C]
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(probs > 0, probs * np.log(probs), 0.0)
    predictive = -plogp.sum(axis=-1)
    # 0 log 0 = 0 also where log_p is -inf (logits over ~9e307 apart overflow the shift)
    with np.errstate(invalid="ignore"):
        member_plogp = np.where(member_probs > 0, member_probs * log_p, 0.0)
    expected = -member_plogp.sum(axis=-1).mean(axis=1)
    prediction = probs.argmax(axis=-1)
    votes = logits.argmax(axis=-1)  # [B, M]
    disagreement = (votes != prediction[:, None]).mean(axis=1)
    scores = {
        "probs": probs,
        "member_probs": member_probs,
        "msp": probs.max(axis=-1),
        "predictive_entropy": predictive,
        "expected_entropy": expected,
        "mutual_information": np.maximum(predictive - expected, 0.0),
        "disagreement": disagreement,
    }
    out = {k: v.astype(dtype) for k, v in scores.items()}
    out["prediction"] = prediction.astype(np.int64)
    if not finite.all():
        for name, value in out.items():
            if name == "prediction":
                value[~finite] = -1
            else:
                value[~finite] = np.nan
    return out
