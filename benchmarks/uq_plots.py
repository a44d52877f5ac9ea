"""The uncertainty benchmarks' figures: reliability, score histograms, AUROC per OOD set, the
Pareto fronts and the risk-coverage curves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from uq_task import OOD_SCORES, ROWS

from hydra_deploy.uncertainty import ensemble_scores
from hydra_deploy.uncertainty.metrics import (
    ece,
    reliability_bins,
)


def _save(plt: Any, fig: Any, out: Path, name: str) -> str:
    """``fig`` laid out, written to ``out / name`` (90 dpi) and closed; returns ``name``."""
    fig.tight_layout()
    fig.savefig(out / name, dpi=90)
    plt.close(fig)
    return name


def risk_coverage_plot(out: Path, report: dict[str, Any]) -> str:
    """Selective risk against coverage (calibrated MSP, tested part, mean over splits and seeds),
    with the target risk and each row's certified operating point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d, agg = report["decision_settings"], report["decision_aggregate"]
    shown = (
        "single",
        "Hydra (Taylor)",
        "Hydra (Taylor, grouped MLP)",
        "Hydra (fused deep ensemble)",
        "deep ensemble (one base)",
        "deep ensemble",
        "MC dropout",
    )
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for i, row in enumerate(shown):
        curve = [c["mean"] * 100 for c in agg[row]["selective"]["curve"]]
        color = f"C{i}"
        ax.plot(np.asarray(d["curve_coverage"]) * 100, curve, color=color, label=row)
        sel = agg[row]["selective"]
        if sel["risk"] is not None:
            ax.plot(sel["answered"]["mean"] * 100, sel["risk"]["mean"] * 100, "o", color=color)
    ax.axhline(d["target_risk"] * 100, color="k", ls="--", lw=0.8, label="target risk")
    ax.set_xlabel("coverage: share answered (%)")
    ax.set_ylabel("selective risk: error rate of the answered (%)")
    ax.set_title(
        f"Risk-coverage with T (tested part). Dots: the rule certified at "
        f"{d['target_risk']:.0%}, delta {d['delta']:g}\n(mean share answered, refused splits as "
        "0; mean risk of the splits that answered): certification is conservative",
        fontsize=8,
    )
    ax.legend(fontsize=7)
    return _save(plt, fig, out, "risk_coverage.png")


def pareto_plot(out: Path, report: dict[str, Any]) -> str:
    """OOD AUROC (MSP) and ECE against latency ratio, parameters and training steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = report["aggregate"]
    costs = (
        (
            "latency_ratio",
            "CPU latency (x single)",
            {r: report["latency"][r]["ratio"] for r in ROWS},
        ),
        ("parameters", "deployed parameters (M)", {r: report["parameters"][r] / 1e6 for r in ROWS}),
        ("train_steps", "optimizer steps in all", report["train_steps"]),
    )
    metrics = (
        ("auroc_msp", "OOD AUROC, MSP (%)", {r: agg[r]["ood_mean"]["msp"]["auroc"] for r in ROWS}),
        ("ece", "ECE (%)", {r: agg[r]["id"]["ece"] for r in ROWS}),
    )
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    markers = dict(zip(ROWS, "os^v<>DPX*hp", strict=False))
    for i, (metric, label, cells) in enumerate(metrics):
        for j, (cost, cost_label, spent) in enumerate(costs):
            ax = axes[i, j]
            front = report["pareto"][f"{metric} vs {cost}"]
            for row in ROWS:
                ax.errorbar(
                    spent[row],
                    cells[row]["mean"] * 100,
                    yerr=cells[row]["std"] * 100,
                    marker=markers[row],
                    capsize=2,
                    ls="none",
                    label=row,
                    mfc="none" if row not in front else None,
                )
            line = sorted(front, key=lambda r: spent[r])
            ax.plot([spent[r] for r in line], [cells[r]["mean"] * 100 for r in line], "k--", lw=0.8)
            ax.set_xlabel(cost_label)
            ax.set_ylabel(label)
            if cost != "latency_ratio":
                ax.set_xscale("log")
    axes[0, 0].legend(fontsize=6, ncol=2)
    fig.suptitle("Pareto fronts (filled markers and the dashed line; mean ± std over seeds)")
    return _save(plt, fig, out, "pareto.png")


def plots(
    out: Path,
    pooled: dict[str, dict[str, np.ndarray]],
    labels: np.ndarray,
    agg: dict[str, Any],
    ood_names: list[str],
) -> list[str]:
    """Reliability diagrams, score histograms and an AUROC chart; returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return [
        _reliability_plot(plt, out, pooled, labels),
        _histograms_plot(plt, out, pooled, ood_names),
        _auroc_plot(plt, out, agg, ood_names),
    ]


def _reliability_plot(
    plt: Any, out: Path, pooled: dict[str, dict[str, np.ndarray]], labels: np.ndarray
) -> str:
    """Every row's reliability diagram on the ID test set, all seeds pooled."""
    grid_rows = -(-len(ROWS) // 4)
    fig, axes = plt.subplots(grid_rows, 4, figsize=(16, 4 * grid_rows), sharex=True, sharey=True)
    for ax, row in zip(axes.ravel(), ROWS, strict=False):
        probs = ensemble_scores(pooled[row]["id"])["probs"].astype(np.float64)
        table = reliability_bins(probs, labels)
        centers = (table["edges"][:-1] + table["edges"][1:]) / 2
        filled = table["count"] > 0
        ax.bar(
            centers[filled],
            table["accuracy"][filled],
            width=1 / len(centers),
            alpha=0.7,
            edgecolor="k",
            label="accuracy",
        )
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ax.set_title(f"{row}\nECE {ece(probs, labels) * 100:.2f}%", fontsize=9)
        ax.set_xlabel("confidence (max prob)")
    for ax in axes[:, 0]:
        ax.set_ylabel("accuracy")
    fig.suptitle("Reliability on the in-distribution test set (all seeds pooled)")
    return _save(plt, fig, out, "reliability.png")


def _histograms_plot(
    plt: Any, out: Path, pooled: dict[str, dict[str, np.ndarray]], ood_names: list[str]
) -> str:
    """MSP and MI on the ID test set and the OOD sets, for four rows, all seeds pooled."""
    shown = ["single", "Hydra (Taylor)", "Hydra (circuit)", "deep ensemble"]
    fig, axes = plt.subplots(2, len(shown), figsize=(4 * len(shown), 7))
    for col, row in enumerate(shown):
        scores = {s: ensemble_scores(v) for s, v in pooled[row].items()}
        for r_i, score in enumerate(OOD_SCORES):
            ax = axes[r_i, col]
            if score == "mutual_information" and pooled[row]["id"].shape[1] == 1:
                ax.text(0.5, 0.5, "MI = 0 for one model", ha="center", va="center")
                ax.set_axis_off()
                continue
            sets = {"ID": scores["id"][score]}
            sets.update({n: scores[f"ood:{n}"][score] for n in ood_names})
            every = np.concatenate(list(sets.values()))
            edges = np.linspace(float(every.min()), float(every.max()) + 1e-9, 31)
            for name, values in sets.items():
                ax.hist(
                    values, bins=edges, density=True, histtype="stepfilled", alpha=0.35, label=name
                )
            ax.set_title(f"{row}: {score}", fontsize=9)
            ax.legend(fontsize=7)
    fig.suptitle("Scores on the ID test set and the OOD sets (all seeds pooled)")
    return _save(plt, fig, out, "score_histograms.png")


def _auroc_plot(plt: Any, out: Path, agg: dict[str, Any], ood_names: list[str]) -> str:
    """The AUROC (MSP) of every row per OOD set, mean ± std over seeds."""
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(ROWS)
    x = np.arange(len(ood_names))
    for i, row in enumerate(ROWS):
        means = [agg[row]["ood"][n]["msp"]["auroc"]["mean"] * 100 for n in ood_names]
        stds = [agg[row]["ood"][n]["msp"]["auroc"]["std"] * 100 for n in ood_names]
        ax.bar(x + (i - len(ROWS) / 2 + 0.5) * width, means, width, yerr=stds, capsize=2, label=row)
    ax.set_xticks(x, ood_names)
    ax.set_ylabel("AUROC (MSP), %")
    low = min(agg[r]["ood"][n]["msp"]["auroc"]["mean"] for r in ROWS for n in ood_names) * 100
    ax.set_ylim(max(0.0, low - 10), 100)
    ax.legend(fontsize=7, ncol=4)
    ax.set_title("OOD detection per set (mean ± std over seeds)")
    return _save(plt, fig, out, "auroc.png")
