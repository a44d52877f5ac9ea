"""Plots of an evaluation (matplotlib, imported lazily with the Agg backend; PNG files)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.errors import HydraError
from hydra_deploy.optional import require


def _pyplot():
    matplotlib = require("matplotlib", purpose="drawing plots", error=HydraError)
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _floats(values: Any) -> np.ndarray:
    return np.asarray([np.nan if v is None else v for v in values], dtype=np.float64)


def _save(fig: Any, path: str | os.PathLike) -> Path:
    plt = _pyplot()
    path = Path(path)
    try:
        fig.savefig(path, format="png", dpi=100)
    except OSError as err:
        raise HydraError(f"cannot write {path}: {err}") from err
    finally:
        plt.close(fig)
    return path


def reliability_diagram(bins_table: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Reliability diagram (accuracy against confidence per bin, with the diagonal and the bin
    counts) from :func:`~hydra_deploy.uncertainty.metrics.reliability_bins` or its JSON form
    (``None`` for an empty bin's accuracy and confidence). Writes a PNG at ``path``."""
    plt = _pyplot()
    edges = _floats(bins_table["edges"])
    count = np.asarray(bins_table["count"], dtype=np.int64)
    acc = _floats(bins_table["accuracy"])
    conf = _floats(bins_table["confidence"])
    filled = count > 0
    widths = np.diff(edges)
    total = max(int(count.sum()), 1)
    ece = float((count[filled] * np.abs(acc[filled] - conf[filled])).sum() / total)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(5, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    top.bar(
        edges[:-1][filled],
        acc[filled],
        width=widths[filled],
        align="edge",
        edgecolor="black",
        color="tab:blue",
        label="accuracy",
    )
    top.bar(
        edges[:-1][filled],
        (conf - acc)[filled],
        bottom=acc[filled],
        width=widths[filled],
        align="edge",
        color="tab:red",
        alpha=0.3,
        hatch="//",
        label="gap",
    )
    top.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
    top.set(
        xlim=(0, 1),
        ylim=(0, 1),
        ylabel="accuracy",
        title=f"Reliability ({len(count)} bins, ECE {ece:.4f})",
    )
    top.legend(loc="upper left")
    bottom.bar(edges[:-1], count, width=widths, align="edge", color="gray", edgecolor="black")
    bottom.set(xlabel="confidence (max probability)", ylabel="count")
    fig.tight_layout()
    return _save(fig, path)


def score_histograms(
    id_scores: Any,
    ood_scores_by_name: Mapping[str, Any],
    score_name: str,
    path: str | os.PathLike,
    bins: int = 30,
) -> Path:
    """Histograms (densities) of one score on the ID data and on each OOD set. Writes a PNG."""
    plt = _pyplot()
    sets = {"ID": np.asarray(id_scores, dtype=np.float64).ravel()}
    sets.update(
        {str(n): np.asarray(v, dtype=np.float64).ravel() for n, v in ood_scores_by_name.items()}
    )
    every = np.concatenate([v[np.isfinite(v)] for v in sets.values()])
    if every.size == 0:
        raise HydraError(f"no finite {score_name} values to plot")
    low, high = float(every.min()), float(every.max())
    if high <= low:
        low, high = low - 0.5, high + 0.5
    edges = np.linspace(low, high, bins + 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in sets.items():
        values = values[np.isfinite(values)]
        if values.size:
            ax.hist(
                values,
                bins=edges,
                density=True,
                histtype="stepfilled",
                alpha=0.35,
                label=f"{name} (n={values.size})",
            )
    ax.set(xlabel=score_name, ylabel="density", title=f"{score_name}: ID vs OOD")
    ax.legend()
    fig.tight_layout()
    return _save(fig, path)


def risk_coverage_points(confidence: Any, correct: Any) -> tuple[np.ndarray, np.ndarray]:
    """(coverage, selective risk) at every distinct threshold of ``confidence``, from the highest
    down: answering the examples whose confidence is at least the threshold."""
    conf = np.asarray(confidence, dtype=np.float64).ravel()
    errors = ~np.asarray(correct, dtype=bool).ravel()
    if conf.size == 0 or conf.size != errors.size:
        raise HydraError(
            f"a risk-coverage curve needs one correctness per confidence, got {conf.size} "
            f"confidences and {errors.size} correctness values"
        )
    order = np.argsort(-conf, kind="stable")
    conf, errors = conf[order], errors[order]
    last = np.r_[conf[1:] != conf[:-1], True]  # the last example of each run of equal values
    answered = np.arange(1, conf.size + 1)[last]
    return answered / conf.size, np.cumsum(errors)[last] / answered


def risk_coverage_curve(
    confidence: Any,
    correct: Any,
    path: str | os.PathLike,
    *,
    target_risk: float | None = None,
    tau_point: tuple[float, float] | None = None,
    score_name: str = "calibrated confidence",
) -> Path:
    """Selective risk (error rate of the answered examples) against coverage (share answered)
    over the thresholds of ``confidence`` (:func:`risk_coverage_points`), with the target risk
    (a horizontal line) and the chosen threshold's (coverage, risk) marked. Writes a PNG."""
    plt = _pyplot()
    coverage, risk = risk_coverage_points(confidence, correct)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.step(coverage, risk, where="post", color="tab:blue", label=f"thresholds of {score_name}")
    if target_risk is not None:
        ax.axhline(target_risk, color="tab:red", linestyle="--", linewidth=1, label="target risk")
    if tau_point is not None:
        ax.plot(
            [tau_point[0]],
            [tau_point[1]],
            marker="o",
            color="black",
            linestyle="none",
            label=f"chosen tau ({100 * tau_point[0]:.1f}% answered)",
        )
    top = max(float(np.max(risk)), target_risk or 0.0, tau_point[1] if tau_point else 0.0)
    ax.set(
        xlim=(0, 1),
        ylim=(0, max(0.05, 1.1 * top)),
        xlabel="coverage (share answered)",
        ylabel="selective risk (error rate when answering)",
        title=f"Risk-coverage (n={len(np.ravel(confidence))})",
    )
    ax.legend(loc="best")
    fig.tight_layout()
    return _save(fig, path)


def set_size_histogram(
    sizes_by_name: Mapping[str, Any], classes: int, path: str | os.PathLike
) -> Path:
    """The share of examples with each prediction-set size (0 .. ``classes``), one group of
    bars per data set (the ID data, each OOD set). Writes a PNG."""
    plt = _pyplot()
    if not sizes_by_name:
        raise HydraError("no prediction-set sizes to plot")
    sizes = np.arange(classes + 1)
    width = 0.8 / len(sizes_by_name)
    fig, ax = plt.subplots(figsize=(max(6, 0.4 * (classes + 1)), 4))
    for offset, (name, values) in enumerate(sizes_by_name.items()):
        values = np.asarray(values, dtype=np.int64).ravel()
        share = np.bincount(np.clip(values, 0, classes), minlength=classes + 1) / max(
            values.size, 1
        )
        ax.bar(
            sizes - 0.4 + width * (offset + 0.5),
            share,
            width=width,
            label=f"{name} (n={values.size}, mean {values.mean() if values.size else 0:.2f})",
        )
    ax.set(
        xlabel="prediction-set size (classes)",
        ylabel="share of examples",
        title="Prediction-set sizes",
        ylim=(0, 1),
    )
    ax.set_xticks(sizes if classes <= 30 else np.linspace(0, classes, 11).round().astype(int))
    ax.legend()
    fig.tight_layout()
    return _save(fig, path)
