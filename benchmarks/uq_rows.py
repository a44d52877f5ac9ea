"""The uncertainty benchmarks' rows scored and compared: every metric of a row (from
``hydra_deploy.uncertainty``), the aggregate over seeds, the paired claims and targets, the Pareto
fronts and the measurements behind each target ("why")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from uq_task import HIGHER_IS_BETTER, ONE_BASE_HYDRA, OOD_METRICS, OOD_SCORES, ROWS, Recipe, Task

from hydra_deploy.uncertainty import ensemble_scores
from hydra_deploy.uncertainty.metrics import (
    accuracy,
    brier,
    ece,
    nll,
    ood_metrics,
    ood_score,
)


def score_row(logits: dict[str, np.ndarray], task: Task) -> dict[str, Any]:
    """Every metric of one row from its member logits per evaluation set."""
    scores = {s: ensemble_scores(v) for s, v in logits.items()}
    members = next(iter(logits.values())).shape[1]
    out: dict[str, Any] = {"members": members}
    for split, labels in (("id", task.test[1]), ("shift", task.shift[1])):
        probs, y = scores[split]["probs"].astype(np.float64), labels.numpy()
        out[split] = {
            "accuracy": accuracy(probs, y),
            "ece": ece(probs, y),
            "nll": nll(probs, y),
            "brier": brier(probs, y),
        }
    member_pred = logits["id"].argmax(2)  # [N, M]
    y = task.test[1].numpy()
    out["members_accuracy"] = [float(v) for v in (member_pred == y[:, None]).mean(0)]
    if members > 1:  # fraction of examples on which two members' argmaxes differ, over pairs
        pairs = [(a, b) for a in range(members) for b in range(a + 1, members)]
        out["disagreement"] = float(
            np.mean([(member_pred[:, a] != member_pred[:, b]).mean() for a, b in pairs])
        )
    out["ood"] = {}
    for name in task.ood:
        per = {}
        for score in OOD_SCORES:
            if score == "mutual_information" and members == 1:
                continue
            per[score] = ood_metrics(
                ood_score(scores["id"], score), ood_score(scores[f"ood:{name}"], score)
            )
        out["ood"][name] = per
    out["ood_mean"] = {
        score: {m: float(np.mean([out["ood"][n][score][m] for n in task.ood])) for m in OOD_METRICS}
        for score in OOD_SCORES
        if score in out["ood"][next(iter(task.ood))]
    }
    return out


def _leaves(tree: Any, prefix: tuple = ()) -> dict[tuple, float]:
    if isinstance(tree, (dict, list)):
        out = {}
        for k, v in tree.items() if isinstance(tree, dict) else enumerate(tree):
            out.update(_leaves(v, (*prefix, k)))
        return out
    return {prefix: float(tree)}


def set_path(tree: dict, path: tuple, value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def aggregate(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean, standard deviation (ddof 1; 0 for one seed) and the values of every metric."""
    out: dict[str, Any] = {}
    for row in ROWS:
        leaves = [_leaves(s["rows"][row]) for s in per_seed]
        for path in leaves[0]:
            values = [leaf[path] for leaf in leaves]
            std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
            set_path(
                out, (row, *path), {"mean": float(np.mean(values)), "std": std, "values": values}
            )
    return out


CLAIM_METRICS = (
    (("ood_mean", "msp", "auroc"), "detects OOD better than"),
    (("ood_mean", "msp", "fpr95"), "has a lower FPR95 than"),
    (("id", "ece"), "is better calibrated than"),
    (("shift", "ece"), "is better calibrated under shift than"),
    (("shift", "nll"), "has a lower NLL under shift than"),
)


# (claim, row, against, metric path, margin): the row beats ``against`` on a seed when its
# advantage exceeds ``margin`` (same units as the metric: 0.01 = 1 point of AUROC).
CLAIMS = (
    *(
        (f"{row} {verb} the {name}", row, against, path, 0.0)
        for against, name in (
            ("single", "single model"),
            ("deep ensemble (one base)", "deep ensemble of one base"),
        )
        for row in ONE_BASE_HYDRA
        for path, verb in CLAIM_METRICS
    ),
    *(
        (
            f"Hydra (fused deep ensemble) {verb} the deep ensemble",
            "Hydra (fused deep ensemble)",
            "deep ensemble",
            path,
            0.0,
        )
        for path, verb in CLAIM_METRICS
    ),
    *(
        (
            f"Hydra (Taylor) {verb} one of its members alone",
            "Hydra (Taylor)",
            "single Taylor-pruned",
            path,
            0.0,
        )
        for path, verb in CLAIM_METRICS[3:]
    ),
    (
        "Taylor pruning hurts calibration under shift (ECE)",
        "single",
        "single Taylor-pruned",
        ("shift", "ece"),
        0.0,
    ),
    (
        "Taylor pruning hurts calibration under shift (NLL)",
        "single",
        "single Taylor-pruned",
        ("shift", "nll"),
        0.0,
    ),
)


# The targets a user adopts the tool for (issue 19), per seed, paired.
TARGETS = (
    *(
        (
            f"{row} beats the single model by >= 1 AUROC point",
            row,
            "single",
            ("ood_mean", "msp", "auroc"),
            0.01,
        )
        for row in ONE_BASE_HYDRA
    ),
    *(
        (
            f"{row} has a lower FPR95 than the single model",
            row,
            "single",
            ("ood_mean", "msp", "fpr95"),
            0.0,
        )
        for row in ONE_BASE_HYDRA
    ),
    *(
        (
            f"{row} matches or beats the one-base deep ensemble on AUROC",
            row,
            "deep ensemble (one base)",
            ("ood_mean", "msp", "auroc"),
            -1e-12,
        )
        for row in ONE_BASE_HYDRA
    ),
    (
        "Hydra (fused deep ensemble) within 1 AUROC point of the deep ensemble",
        "Hydra (fused deep ensemble)",
        "deep ensemble",
        ("ood_mean", "msp", "auroc"),
        -0.01,
    ),
)


def get_path(tree: dict, path: tuple) -> float:
    for k in path:
        tree = tree[k]
    return float(tree)


def claims(
    per_seed: list[dict[str, Any]],
    table: Sequence[tuple] = CLAIMS,
    *,
    key: str = "rows",
    strict: bool = False,
) -> list[dict[str, Any]]:
    """Paired comparisons over seeds: does ``row`` beat ``against`` by more than the margin?

    ``key``: where each seed keeps its rows' metrics (``rows``, or ``decisions``). ``strict``: a
    claim holds only where it holds on every seed (no "holds on average")."""
    out = []
    for claim, row, against, path, margin in table:
        higher = HIGHER_IS_BETTER[path[-1]]
        head = {"claim": claim, "row": row, "against": against, "metric": ".".join(path)}
        head["margin"] = margin
        try:
            diffs = [
                (get_path(s[key][row], path) - get_path(s[key][against], path))
                * (1 if higher else -1)
                for s in per_seed
            ]
        except (KeyError, TypeError):  # an alpha too small for the quantile part
            out.append({**head, "verdict": "not available (the metric was not measured)"})
            continue
        wins = sum(d > margin for d in diffs)
        mean = float(np.mean(diffs))
        if wins == len(diffs):
            verdict = "holds (every seed)"
        elif mean > margin and not strict:
            verdict = f"holds on average ({wins}/{len(diffs)} seeds)"
        else:
            verdict = f"does not hold ({wins}/{len(diffs)} seeds)"
        out.append(
            {
                **head,
                "advantage_mean": mean,
                "advantage_std": float(np.std(diffs, ddof=1)) if len(diffs) > 1 else 0.0,
                "advantage_per_seed": [float(d) for d in diffs],
                "seeds_better": wins,
                "verdict": verdict,
            }
        )
    return out


def pareto(report: dict[str, Any]) -> dict[str, Any]:
    """Per metric (OOD AUROC with MSP, higher better; ECE, lower better) and per cost (CPU latency
    ratio, deployed parameters, training steps): the rows no other row beats on both."""
    agg = report["aggregate"]
    costs = {
        "latency_ratio": {r: report["latency"][r]["ratio"] for r in ROWS},
        "parameters": {r: float(report["parameters"][r]) for r in ROWS},
        "train_steps": {r: float(report["train_steps"][r]) for r in ROWS},
    }
    metrics = {
        "auroc_msp": ({r: agg[r]["ood_mean"]["msp"]["auroc"]["mean"] for r in ROWS}, True),
        "ece": ({r: agg[r]["id"]["ece"]["mean"] for r in ROWS}, False),
    }
    out: dict[str, Any] = {}
    for metric, (values, higher) in metrics.items():
        gain = {r: values[r] if higher else -values[r] for r in ROWS}
        for cost, spent in costs.items():
            front = [r for r in ROWS if not any(_dominates(o, r, gain, spent) for o in ROWS)]
            out[f"{metric} vs {cost}"] = sorted(front, key=lambda r, spent=spent: spent[r])
    return out


def _dominates(a: str, b: str, gain: dict[str, float], cost: dict[str, float]) -> bool:
    """``a`` is at least as good and as cheap as ``b``, and strictly one of them."""
    return (
        a != b
        and cost[a] <= cost[b]
        and gain[a] >= gain[b]
        and (cost[a] < cost[b] or gain[a] > gain[b])
    )


def cost_model(adapter: Any, recipe: Recipe) -> dict[str, float]:
    """Analytic multiply-accumulates (matrix products, ``adapter.macs``) behind the latency target.

    Every attention term (Q/K/V, scores, output projection) scales with the heads kept; the MLP,
    the embedding and the classifier run whole once per stream. So a fused deep ensemble whose
    members keep k of H heads costs ``rest + (1 - rest) k / H`` of the deep ensemble's MACs,
    ``rest`` being the share of one model's MACs outside attention.
    """
    L, H, k, M = adapter.num_layers, adapter.num_heads, recipe.heads_per_member, recipe.members
    single = adapter.macs()
    rest = adapter.macs([[0]] * L) / single
    fused = adapter.macs([[k] * M] * L, embed_streams=M, head_streams=M) / (M * single)
    hydra = adapter.macs([[k] * M] * L, embed_streams=1, head_streams=M) / single
    # the most heads per member that keep the fused deep ensemble at <= 0.8 x (analytic)
    fitting = [j for j in range(1, H + 1) if rest + (1 - rest) * j / H <= 0.8 + 1e-9]
    return {
        "single_macs": float(single),
        "non_attention_share": float(rest),
        "fused_deep_ensemble_over_deep_ensemble": float(fused),
        "hydra_over_single": float(hydra),
        "heads": H,
        "heads_per_member": k,
        "max_heads_for_0.8x": max(fitting) if fitting else 0,
    }


def stats(values: Sequence[float]) -> dict[str, Any]:
    values = [float(v) for v in values]
    std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return {"mean": float(np.mean(values)), "std": std, "values": values}


def tree_stats(trees: Sequence[Any]) -> Any:
    """Mean, std (ddof 1) and values over seeds of every number of ``trees`` (the same shape);
    lists element by element; None skipped; anything else (a reason) taken from the first."""
    first = trees[0]
    if isinstance(first, dict):
        return {
            k: tree_stats([t[k] for t in trees if isinstance(t, dict) and k in t]) for k in first
        }
    if isinstance(first, list):
        return [tree_stats([t[i] for t in trees]) for i in range(len(first))]
    if isinstance(first, bool) or (not isinstance(first, (int, float)) and first is not None):
        return first
    present = [float(v) for v in trees if v is not None]
    if not present:
        return None
    return stats(present)


@dataclass
class _Paired:
    """Per-seed paired differences of the rows' metrics: mean, std and values over seeds."""

    seeds: list[dict[str, Any]]

    def __call__(self, row: str, against: str, *path: str) -> dict[str, Any]:
        """``row`` minus ``against`` on the metric at ``path``."""
        return stats(
            [
                get_path(s["rows"][row], path) - get_path(s["rows"][against], path)
                for s in self.seeds
            ]
        )

    def members(self, row: str, against: str) -> dict[str, Any]:
        """The mean of ``row``'s members' own accuracies minus ``against``'s."""
        return stats(
            [
                np.mean(s["rows"][row]["members_accuracy"])
                - np.mean(s["rows"][against]["members_accuracy"])
                for s in self.seeds
            ]
        )


_AUROC = ("ood_mean", "msp", "auroc")
#: the rows the "why" section measures
_WHY_ROWS = (
    *ONE_BASE_HYDRA,
    "Hydra (fused deep ensemble)",
    "deep ensemble (one base)",
    "deep ensemble",
)


def _row_why(paired: _Paired, row: str) -> dict[str, Any]:
    """One row's members, diversity, detection and calibration against the single model and the
    one-base ensemble."""
    return {
        "member_accuracy_vs_single": paired.members(row, "single"),
        "disagreement": stats([s["rows"][row]["disagreement"] for s in paired.seeds]),
        "auroc_vs_single": paired(row, "single", *_AUROC),
        "auroc_vs_one_base_ensemble": paired(row, "deep ensemble (one base)", *_AUROC),
        "shift_ece_vs_one_base_ensemble": paired("deep ensemble (one base)", row, "shift", "ece"),
        "id_ece_vs_single": paired("single", row, "id", "ece"),
    }


def _better_under_shift(seeds: list[dict[str, Any]]) -> list[str]:
    """The one-base rows better calibrated under shift than the one-base ensemble on every seed,
    by ECE and by NLL."""
    return [
        r
        for r in ONE_BASE_HYDRA
        if all(
            get_path(s["rows"][r], ("shift", m))
            < get_path(s["rows"]["deep ensemble (one base)"], ("shift", m))
            for s in seeds
            for m in ("ece", "nll")
        )
    ]


def diagnosis(report: dict[str, Any], costs: dict[str, float]) -> dict[str, Any]:
    """Per seed, paired: the measurements that say why each target of issue 19 holds or not.

    - the one-base ceiling: how far M unpruned fine-tunes of one base beat the single model (every
      one-base Hydra row's members are pruned fine-tunes of that same base);
    - the price of pruning: one member alone against the single model, and each row's members;
    - diversity: pairwise disagreement of each row's members;
    - the fused deep ensemble: its members against the deep ensemble's, and its cost (analytic
      MACs beside the measured latency).
    """
    paired = _Paired(report["per_seed"])
    rows = {row: _row_why(paired, row) for row in _WHY_ROWS}
    ceiling = rows["deep ensemble (one base)"]["auroc_vs_single"]
    latency = report["latency"]
    fused, de = "Hydra (fused deep ensemble)", "deep ensemble"
    return {
        "one_base_ceiling": {
            **ceiling,
            "seeds_above_1_point": sum(v > 0.01 for v in ceiling["values"]),
        },
        "pruned_member": {
            "accuracy": paired("single Taylor-pruned", "single", "id", "accuracy"),
            "auroc": paired("single Taylor-pruned", "single", *_AUROC),
        },
        "best_one_base_row": max(ONE_BASE_HYDRA, key=lambda r: rows[r]["auroc_vs_single"]["mean"]),
        "better_calibrated_under_shift_than_one_base_ensemble": _better_under_shift(
            report["per_seed"]
        ),
        "rows": rows,
        "fused": {
            "member_accuracy_vs_deep_ensemble": paired.members(fused, de),
            "auroc_vs_deep_ensemble": paired(fused, de, *_AUROC),
            "latency_over_deep_ensemble": latency[fused]["ratio"] / latency[de]["ratio"],
        },
        "costs": costs,
    }
