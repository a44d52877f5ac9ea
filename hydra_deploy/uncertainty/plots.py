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
