"""The uncertainty benchmarks' report.md: the tables and notes written from report.json."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from uq_decisions import REPORTED_SET_METHODS, alpha_key
from uq_task import ONE_BASE_HYDRA, ROWS

from hydra_deploy.decisions import GRID_SIZE, selective_levels


def _pm(cell: dict[str, Any], scale: float = 1.0, digits: int = 2) -> str:
    return f"{cell['mean'] * scale:.{digits}f} ± {cell['std'] * scale:.{digits}f}"


def _row_table(header: Sequence[str], cells: Callable[[str], Sequence[str]]) -> list[str]:
    """A markdown table of one line per row of the protocol (:data:`ROWS`): ``header`` (the row's
    column first) and its rule, then each row's name and ``cells(row)``."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *(f"| {row} | " + " | ".join(cells(row)) + " |" for row in ROWS),
    ]


def markdown(report: dict[str, Any]) -> str:
    """report.md: the rows' scores, the decisions, the claims and targets, the Pareto fronts, the
    "why" section and the setup."""
    lines = [*_title(report), *_scores_sections(report)]
    if "decision_aggregate" in report:
        lines += decisions_markdown(report)
    lines += _claims_sections(report)
    if "diagnosis" in report:
        lines += diagnosis_markdown(report["diagnosis"])
    lines += _setup_section(report)
    return "\n".join(lines)


def _title(report: dict[str, Any]) -> list[str]:
    task, n = report["task"], report["settings"]["seeds"]
    return [
        f"# {task['title']}",
        "",
        f"Produced by `{report['command']}` on {report['finished']} "
        f"({report['seconds'] / 60:.1f} min, {n} seed(s); mean ± std over seeds; "
        f"{report['environment']['cpu_model']}, {report['environment']['torch_threads']} "
        f"thread(s) per process, {report.get('seed_workers', 1)} seed(s) at a time)"
        + (
            f"; the derived tables re-rendered from its measurements with `--render` on "
            f"{report['rendered']}."
            if "rendered" in report
            else "."
        ),
        "",
        task["summary"],
    ]


def _scores_sections(report: dict[str, Any]) -> list[str]:
    """Every row's scores: in distribution with the OOD means, its members, per OOD set, under
    shift."""
    agg, task = report["aggregate"], report["task"]

    def scores(row: str) -> list[str]:
        a = agg[row]
        mi = a["ood_mean"].get("mutual_information")
        return [
            _pm(a["id"]["accuracy"], 100),
            _pm(a["id"]["ece"], 100),
            _pm(a["id"]["nll"], 1, 3),
            _pm(a["id"]["brier"], 1, 3),
            _pm(a["ood_mean"]["msp"]["auroc"], 100),
            _pm(mi["auroc"], 100) if mi else "—",
            _pm(a["ood_mean"]["msp"]["aupr"], 100),
            _pm(a["ood_mean"]["msp"]["fpr95"], 100),
            _pm(mi["fpr95"], 100) if mi else "—",
            f"{report['parameters'][row] / 1e6:.3f} M",
            f"{report['latency'][row]['ratio']:.2f}",
            f"{report['train_steps'][row]}",
        ]

    def members(row: str) -> list[str]:
        a = agg[row]
        accs = ", ".join(f"{v['mean'] * 100:.1f}" for v in a["members_accuracy"].values())
        return [accs, _pm(a["disagreement"], 100) if "disagreement" in a else "—"]

    def per_ood(row: str) -> list[str]:
        cells = []
        for name in task["ood"]:
            per = agg[row]["ood"][name]
            cell = f"{_pm(per['msp']['auroc'], 100, 1)} / {_pm(per['msp']['fpr95'], 100, 1)}"
            if "mutual_information" in per:
                mi = per["mutual_information"]
                cell += f" [{_pm(mi['auroc'], 100, 1)} / {_pm(mi['fpr95'], 100, 1)}]"
            cells.append(cell)
        return cells

    def shift(row: str) -> list[str]:
        s = agg[row]["shift"]
        return [
            _pm(s["accuracy"], 100),
            _pm(s["ece"], 100),
            _pm(s["nll"], 1, 3),
            _pm(s["brier"], 1, 3),
        ]

    return [
        "",
        "## In-distribution test set, and OOD detection averaged over the OOD sets",
        "",
        "Accuracy, ECE, AUROC, AUPR and FPR95 in %. OOD positive; MSP and mutual information (MI) "
        "as the OOD score; MI is zero for one model.",
        "",
        *_row_table(
            (
                "row",
                *("accuracy", "ECE", "NLL", "Brier", "AUROC MSP", "AUROC MI", "AUPR MSP"),
                *("FPR95 MSP", "FPR95 MI", "params", "latency x", "train steps"),
            ),
            scores,
        ),
        "",
        "## Members: each member's own accuracy and how often two members disagree",
        "",
        "Member accuracy in % (mean over seeds, per member); disagreement = fraction of test "
        "examples on which two members' argmaxes differ, averaged over pairs, in %.",
        "",
        *_row_table(("row", "member accuracy", "disagreement"), members),
        "",
        "## Per OOD set (AUROC / FPR95 in %, MSP; MI in brackets)",
        "",
        *_row_table(("row", *task["ood"]), per_ood),
        "",
        f"## Under shift: {task['shift']}",
        "",
        *_row_table(("row", "accuracy", "ECE", "NLL", "Brier"), shift),
    ]


def _claims_sections(report: dict[str, Any]) -> list[str]:
    """The paper's claims, the targets (with the latency target) and the Pareto fronts."""
    lines = [
        "",
        "## The paper's claims, tested",
        "",
        "Advantage = how much the first row beats the second, per seed, paired (positive = the claim "
        "goes the paper's way; AUROC, FPR95 and ECE in points of %).",
        "",
        "| claim | metric | advantage | verdict |",
        "|---|---|---|---|",
    ]
    for c in report["claims"]:
        scale = 1 if c["metric"].endswith("nll") else 100
        lines.append(
            f"| {c['claim']} | {c['metric']} | {c['advantage_mean'] * scale:+.2f} ± "
            f"{c['advantage_std'] * scale:.2f} | {c['verdict']} |"
        )
    lines += [
        "",
        "## Targets (what a user adopts Hydra for), per seed, paired",
        "",
        "A target holds on a seed when the advantage exceeds the margin (points of %).",
        "",
        "| target | metric | margin | advantage | verdict |",
        "|---|---|---|---|---|",
    ]
    for c in report["targets"]:
        lines.append(
            f"| {c['claim']} | {c['metric']} | {c['margin'] * 100:+.1f} | "
            f"{c['advantage_mean'] * 100:+.2f} ± {c['advantage_std'] * 100:.2f} | {c['verdict']} |"
        )
    t = report["latency_target"]
    lines.append(
        f"| {t['target']} | latency (seed 0) | — | {t['ratio']:.2f} x | "
        f"{'holds' if t['holds'] else 'does not hold'} |"
    )
    return [
        *lines,
        "",
        "## Pareto fronts (rows no other row beats on both the metric and the cost)",
        "",
        "| metric vs cost | front (cheapest first) |",
        "|---|---|",
        *(f"| {k} | {', '.join(v)} |" for k, v in report["pareto"].items()),
        "",
        "See `pareto.png`.",
    ]


def _setup_section(report: dict[str, Any]) -> list[str]:
    r = report["settings"]["recipe"]
    return [
        "",
        "## Setup",
        "",
        *(f"- {k}: {v}" for k, v in report["task"]["details"].items()),
        f"- recipe: {r['base_steps']} base steps at lr {r['base_lr']:g} then {r['finetune_steps']} "
        f"fine-tuning steps at lr {r['finetune_lr']:g}, batch {r['batch_size']}, warm-up "
        f"{r['warmup_steps']}, AdamW (weight decay 0.05), cosine decay; M = {r['members']}, "
        f"{r['heads_per_member']} heads per member per layer; MC dropout {r['mc_samples']} passes",
        f"- latency: PyTorch CPU, batch {r['latency_batch']}, median over {r['latency_rounds']} "
        "interleaved rounds of the ratio to the single model (seed 0's models, after every "
        "seed has finished)",
        "- mean wall-clock seconds per seed"
        + (
            f" ({report['seed_workers']} seeds at a time, in processes sharing the cores)"
            if report.get("seed_workers", 1) > 1
            else ""
        )
        + ": "
        + ", ".join(f"{k} {v:.0f}" for k, v in report["seconds_per_stage"].items()),
        f"- decisions (temperature scaling, sets, answer or abstain, OOD flag; "
        f"{report['decision_settings']['splits']} splits per seed, every row, "
        f"{report.get('decision_workers', 1)} process(es)): "
        f"{report.get('seconds_decisions', 0):.0f} s for the whole run",
        "",
    ]


def _pts(cell: dict[str, Any]) -> str:
    """A paired difference in points of %, signed, with its std over seeds."""
    return f"{cell['mean'] * 100:+.2f} ± {cell['std'] * 100:.2f}"


def diagnosis_markdown(d: dict[str, Any]) -> list[str]:
    """The "why" section of report.md: a table of the measurements and what they imply."""
    lines = [
        "",
        "## Why: the measurements behind each target",
        "",
        "Per seed, paired, in points of % (mean ± std over seeds). Member accuracy: the mean of "
        "the row's members' own accuracies against the single model's; AUROC with MSP, averaged "
        "over the OOD sets.",
        "",
        "| row | member accuracy vs single | disagreement | AUROC vs single | AUROC vs one-base "
        "ensemble |",
        "|---|---|---|---|---|",
    ]
    for row, r in d["rows"].items():
        lines.append(
            f"| {row} | {_pts(r['member_accuracy_vs_single'])} | "
            f"{r['disagreement']['mean'] * 100:.2f} | {_pts(r['auroc_vs_single'])} | "
            f"{_pts(r['auroc_vs_one_base_ensemble'])} |"
        )
    return [*lines, "", _ceiling_note(d), _pruning_note(d), _fused_note(d), *_shift_note(d)]


def _ceiling_note(d: dict[str, Any]) -> str:
    """How far M unpruned fine-tunes of one base get: the ceiling of every one-base row."""
    rows, ceiling = d["rows"], d["one_base_ceiling"]
    n = len(ceiling["values"])
    one_base = rows["deep ensemble (one base)"]
    return (
        f"- **The ceiling of one base.** M unpruned fine-tunes of one base beat the single model "
        f"by {_pts(ceiling)} AUROC points (above +1 on {ceiling['seeds_above_1_point']}/{n} "
        f"seeds); their members disagree on {one_base['disagreement']['mean'] * 100:.2f}% of the "
        f"test examples, against {rows['deep ensemble']['disagreement']['mean'] * 100:.2f}% for "
        "independently trained members, whose ensemble beats the single model by "
        f"{_pts(rows['deep ensemble']['auroc_vs_single'])}. Every one-base Hydra row's members are pruned fine-tunes "
        "of that same base: "
        + (
            "the diversity to meet the target exists on every seed; what the pruned members lose "
            "decides."
            if ceiling["seeds_above_1_point"] == n
            else f"this ceiling itself clears +1 on {ceiling['seeds_above_1_point']}/{n} seeds, so a "
            "one-base row would have to beat unpruned fine-tunes of its own base to clear it on "
            "every seed"
            + (
                " (none does here)."
                if all(rows[r]["auroc_vs_one_base_ensemble"]["mean"] < 0 for r in ONE_BASE_HYDRA)
                else "."
            )
        )
    )


def _pruning_note(d: dict[str, Any]) -> str:
    """What one pruned member loses, and what the best one-base row ends with."""
    rows, pruned, best = d["rows"], d["pruned_member"], d["best_one_base_row"]
    one_base = rows["deep ensemble (one base)"]
    return (
        f"- **The price of pruning.** One member alone (single Taylor-pruned) is "
        f"{_pts(pruned['accuracy'])} accuracy and {_pts(pruned['auroc'])} AUROC points against the "
        f"single model. The best one-base row, {best}, has members at "
        f"{_pts(rows[best]['member_accuracy_vs_single'])} accuracy points and disagreeing on "
        f"{rows[best]['disagreement']['mean'] * 100:.2f}% of examples; it ends "
        f"{_pts(rows[best]['auroc_vs_single'])} AUROC points against the single model and "
        f"{_pts(rows[best]['auroc_vs_one_base_ensemble'])} against the one-base ensemble"
        + (
            ": members that disagree more because each is weaker do not separate OOD inputs better."
            if rows[best]["disagreement"]["mean"] > one_base["disagreement"]["mean"]
            and rows[best]["auroc_vs_one_base_ensemble"]["mean"] < 0
            else "."
        )
    )


def _fused_note(d: dict[str, Any]) -> str:
    """The fused deep ensemble against the deep ensemble: its detection and its cost."""
    c, f = d["costs"], d["fused"]
    return (
        f"- **The fused deep ensemble** is {_pts(f['auroc_vs_deep_ensemble'])} AUROC points against "
        f"the deep ensemble, its members {_pts(f['member_accuracy_vs_deep_ensemble'])} accuracy "
        f"points against the deep ensemble's. Cost: {f['latency_over_deep_ensemble']:.2f} x the "
        f"deep ensemble's measured CPU latency, {c['fused_deep_ensemble_over_deep_ensemble']:.2f} "
        f"x its MACs (analytic, matrix products). With {c['heads_per_member']} of {c['heads']} "
        f"heads kept, attention is cut but the MLP, embedding and classifier "
        f"({c['non_attention_share'] * 100:.0f}% of one model's MACs) run whole per member, so no "
        f"head count brings it below {c['non_attention_share']:.2f} x; "
        + (
            f"0.8 x (analytic) needs at most {c['max_heads_for_0.8x']} heads per member per layer."
            if c["max_heads_for_0.8x"]
            else "0.8 x is out of reach by pruning heads alone (it needs narrower per-member MLPs)."
        )
        + (
            " Measured latency sits above the analytic ratio: per-stream work that is not a "
            "matrix product (norms, activations, softmax, the grouped MLP's reshapes) weighs at "
            "this width."
            if f["latency_over_deep_ensemble"] > c["fused_deep_ensemble_over_deep_ensemble"]
            else ""
        )
    )


def _shift_note(d: dict[str, Any]) -> list[str]:
    """The one-base rows better calibrated under shift than the one-base ensemble, if any."""
    rows, lines = d["rows"], []
    shift = d["better_calibrated_under_shift_than_one_base_ensemble"]
    if shift:
        lines.append(
            "- **Where the one-base rows pay: calibration under shift.** Better calibrated on the "
            "shifted test set than the one-base ensemble, by ECE and by NLL on every seed: "
            + "; ".join(
                f"{r} (ECE lower by "
                f"{_pts(rows[r]['shift_ece_vs_one_base_ensemble']).lstrip('+')} points)"
                for r in shift
            )
            + ". In distribution their ECE against the single model's is "
            + ", ".join(f"{_pts(rows[r]['id_ece_vs_single'])}" for r in shift)
            + " points (negative: worse): the gain is on shifted inputs only."
        )
    return lines


def _dm(cell: Any, scale: float = 100.0, digits: int = 1) -> str:
    """mean ± std over seeds of an aggregated decision cell, or n/a."""
    if not isinstance(cell, dict) or "mean" not in cell:
        return "n/a"
    return f"{cell['mean'] * scale:.{digits}f} ± {cell['std'] * scale:.{digits}f}"


def _before_after(cell: dict[str, Any], metric: str, scale: float, digits: int) -> str:
    raw, scaled = cell["raw"][metric], cell["scaled"][metric]
    return (
        f"{raw['mean'] * scale:.{digits}f} → {scaled['mean'] * scale:.{digits}f} ± "
        f"{scaled['std'] * scale:.{digits}f}"
    )


def decisions_markdown(report: dict[str, Any]) -> list[str]:
    """The sections of report.md on temperature scaling and the decisions built on it."""
    return [
        *_scaling_section(report),
        *_decisions_section(report),
        *_validity_section(report),
        *_shift_decisions_section(report),
        *selective_markdown(report),
        *_decision_claims_section(report),
    ]


def _set_cells(cell: dict[str, Any], *metrics: tuple[str, float, int]) -> list[str]:
    """A set method's cells at one alpha (``_dm`` of each (metric, scale, digits)), or n/a."""
    if cell.get("available") is False:
        return ["n/a"] * len(metrics)
    return [_dm(cell[metric], scale, digits) for metric, scale, digits in metrics]


def _method_cells(sets: dict[str, Any], key: str, *metrics: tuple[str, float, int]) -> list[str]:
    """:func:`_set_cells` of every reported set method at alpha ``key``, in the tables' order."""
    return [v for m in REPORTED_SET_METHODS for v in _set_cells(sets[m][key], *metrics)]


def _scaling_section(report: dict[str, Any]) -> list[str]:
    """Temperature scaling: what T does to every row's scores, in distribution, under shift and
    on the OOD sets."""
    d, agg = report["decision_settings"], report["decision_aggregate"]
    oods = list(report["task"]["ood"])
    n_t, n_q, n_x, splits = d["temperature_part"], d["quantile_part"], d["tested_part"], d["splits"]

    def scaled(row: str) -> list[str]:
        sc = agg[row]["scaling"]
        return [
            _dm(agg[row]["temperature"], 1, 2),
            *(
                _before_after(sc[where], metric, scale, digits)
                for where in ("test", "shift")
                for metric, scale, digits in (("accuracy", 100, 2), ("nll", 1, 3), ("ece", 100, 2))
            ),
        ]

    def ood(row: str) -> list[str]:
        sc = agg[row]["scaling"]
        return [
            _before_after(sc["ood_mean"], "auroc", 100, 2),
            _before_after(sc["ood_mean"], "fpr95", 100, 2),
            *(_before_after(sc["ood"][n], "auroc", 100, 2) for n in oods),
        ]

    return [
        "",
        "## Temperature scaling: T fitted on held-out in-distribution data",
        "",
        f"Per seed, the in-distribution test set is split at random {splits} times into a "
        f"temperature part ({n_t} examples), a quantile part ({n_q}) and a tested part (the other "
        f"{n_x}); the same splits for every row. T (one for all members, "
        "`hydra_deploy.decisions.fit_temperature`) is fitted on the temperature part only; every "
        "metric is measured on the tested part (ID), on the shifted copies of the tested examples "
        "(shift) and on the OOD sets, without T (raw) → with it; mean over the splits, then mean "
        "± std over seeds of the scaled value. Accuracy, ECE, AUROC and FPR95 (MSP, OOD positive) "
        "in %. Computed from the stored member logits (`logits.npz`, float16), as everything in "
        "the decision sections.",
        "",
        *_row_table(
            ("row", "T", "accuracy", "NLL", "ECE", "shift accuracy", "shift NLL", "shift ECE"),
            scaled,
        ),
        *_temperature_notes(agg, n_t),
        "",
        "OOD detection with the calibrated MSP (raw → T; AUROC / FPR95 in %; mean over the OOD "
        "sets, then per set):",
        "",
        *_row_table(
            ("row", "AUROC (mean)", "FPR95 (mean)", *(f"AUROC {n}" for n in oods)),
            ood,
        ),
    ]


def _promises(d: dict[str, Any]) -> list[str]:
    """What each decision promises (and that nothing holds under shift)."""
    return [
        "- **Prediction sets** (split conformal): the threshold is the conformal quantile of the "
        "quantile part's scores. LAC: the classes with calibrated p >= 1 - qhat (may be empty); "
        "APS: classes added by decreasing p until the quantile; RAPS: APS plus a penalty on "
        "low-ranked classes (k_reg and lambda chosen on the temperature part). *What it promises*: "
        "over test data exchangeable with the calibration data, the set holds the true class with "
        "probability at least 1 - alpha, marginally: on average over calibration draws and test "
        "inputs, not for each class or each input. An alpha below 1 / (n + 1) of the quantile "
        "part cannot be met and is reported n/a.",
        f"- **Answer or abstain** at a {d['target_risk']:.0%} selective risk: answer when the "
        "calibrated MSP passes tau, the lowest threshold of a 50-point grid (fixed on the "
        "temperature part) whose exact binomial test on the quantile part certifies it (Learn then "
        f"Test, Bonferroni). *What it promises*: P(selective risk > {d['target_risk']:.0%}) <= "
        f"delta = {d['delta']:g} over calibration draws, the risk being the expected error rate "
        "among answered inputs of exchangeable data. 'Answered' is the share of tested inputs "
        "answered (the coverage at that risk); where no threshold is certified the row abstains "
        "on everything.",
        f"- **OOD flag** at alpha_ood = {d['ood_alpha']:g} (MSP): flag an input whose MSP is "
        f"below the conformal quantile of the quantile part's: at most {d['ood_alpha']:.0%} of "
        "in-distribution inputs are flagged (in expectation). It promises nothing on OOD inputs: "
        "the flag rates on the OOD sets are what it catches.",
        "- **Under shift none of these guarantees holds**: the shifted inputs are not "
        "exchangeable with the calibration data; the section after the next shows what the "
        "decisions measure there.",
    ]


def _decisions_section(report: dict[str, Any]) -> list[str]:
    """What each decision promises, and every row's sets (at the claim alpha and at every
    alpha), answered share, flag rates and risk-coverage curve."""
    d, agg = report["decision_settings"], report["decision_aggregate"]
    alpha, key = d["claim_alpha"], alpha_key(d["claim_alpha"])
    oods = list(report["task"]["ood"])
    single_acc = report["aggregate"]["single"]["id"]["accuracy"]["mean"]

    def decided(row: str) -> list[str]:
        a = agg[row]
        sel, flag = a["selective"], a["ood_flag"]
        return [
            *_method_cells(a["sets"], key, ("mean_size", 1, 2), ("coverage", 100, 1)),
            _dm(sel["answered"]),
            _dm(sel["risk"]),
            *(_dm(sel["ood_answered"][n]) for n in oods),
            _dm(flag.get("test")),
            *(_dm(flag.get("ood", {}).get(n)) for n in oods),
        ]

    lines = [
        "",
        "## Decisions: prediction sets, answer or abstain, the OOD flag (each row + T)",
        "",
        "On each split, with T from the temperature part (`hydra_deploy.decisions`):",
        "",
        *_promises(d),
        "",
        f"Mean over the {d['splits']} splits, then mean ± std over seeds, in % (set sizes in "
        f"classes). At alpha = {alpha:g}: 1 - alpha = {1 - alpha:.0%} is "
        + ("above" if 1 - alpha > single_acc else "NOT above")
        + f" the single model's accuracy ({single_acc * 100:.1f}%), so the sets must hold more "
        "than the top class to cover.",
        "",
        *_row_table(
            (
                "row",
                *(
                    f"{m.upper()} {what}"
                    for m in REPORTED_SET_METHODS
                    for what in ("size", "coverage")
                ),
                f"answered at {d['target_risk']:.0%} risk",
                "risk of the answered",
                *(f"answered: {n}" for n in oods),
                "flagged: ID",
                *(f"flagged: {n}" for n in oods),
            ),
            decided,
        ),
        *_selective_notes(agg, d),
        "",
        "Mean set size (coverage in brackets) at every alpha, in classes (%):",
        "",
        "| row | method | " + " | ".join(f"alpha {alpha_key(a)}" for a in d["alphas"]) + " |",
        "|---|---|" + "---|" * len(d["alphas"]),
    ]
    for row in ROWS:
        for method in REPORTED_SET_METHODS:
            cells = []
            for a in d["alphas"]:
                cell = agg[row]["sets"][method][alpha_key(a)]
                if cell.get("available") is False:
                    cells.append("n/a")
                else:
                    cells.append(
                        f"{cell['mean_size']['mean']:.2f} ({cell['coverage']['mean'] * 100:.1f})"
                    )
            lines.append(f"| {row} | {method.upper()} | " + " | ".join(cells) + " |")
    return [*lines, *_unavailable_notes(report), *_risk_coverage_table(report)]


def _unavailable_notes(report: dict[str, Any]) -> list[str]:
    """Why a set (at an alpha) or the OOD flag was not measured, as the library refused it."""
    d, agg = report["decision_settings"], report["decision_aggregate"]
    notes: dict[str, str] = {}
    at_claim = [(row, method, d["claim_alpha"]) for row in ROWS for method in REPORTED_SET_METHODS]
    every = [(r, m, a) for r in ROWS for m in REPORTED_SET_METHODS for a in d["alphas"]]
    for row, method, alpha in (*at_claim, *every):  # the tables' order
        cell = agg[row]["sets"][method][alpha_key(alpha)]
        if cell.get("available") is False:
            notes[f"{method.upper()} at alpha {alpha_key(alpha)}"] = cell["reason"]
    flag = agg["single"]["ood_flag"]
    if flag.get("available") is False:
        notes["the OOD flag"] = flag["reason"]
    if not notes:
        return []
    return ["", "Not available:", "", *(f"- {k}: {v}" for k, v in notes.items())]


def _risk_coverage_table(report: dict[str, Any]) -> list[str]:
    d, agg = report["decision_settings"], report["decision_aggregate"]
    grid, shown = d["curve_coverage"], (0.5, 0.8, 0.9, 1.0)

    def read(row: str) -> list[str]:
        curve = agg[row]["selective"]["curve"]
        return [f"{curve[grid.index(c)]['mean'] * 100:.2f}" for c in shown]

    return [
        "",
        "Risk-coverage (`risk_coverage.png`): the error rate of the most confident share of the "
        "tested part (calibrated MSP), mean over splits and seeds, in %:",
        "",
        *_row_table(("row", *(f"{c:.0%}" for c in shown)), read),
    ]


def _validity_section(report: dict[str, Any]) -> list[str]:
    """Does each guarantee hold as measured over the random splits?"""
    d, agg = report["decision_settings"], report["decision_aggregate"]
    key, splits, n_x = alpha_key(d["claim_alpha"]), d["splits"], d["tested_part"]
    misses = []

    def coverages(row: str, method: str) -> str:
        parts = []
        for al in d["alphas"]:
            cell = agg[row]["sets"][method][alpha_key(al)]
            if cell.get("available") is False:
                parts.append("n/a")
                continue
            mean = cell["coverage"]["mean"]
            parts.append(f"{mean * 100:.1f}")
            spread = cell["coverage_std"]["mean"] / np.sqrt(splits)
            if mean < 1 - al - 2 * spread:
                misses.append(f"{row} {method.upper()} at alpha {alpha_key(al)}")
        return " / ".join(parts)

    def validity(row: str) -> list[str]:
        a = agg[row]
        sel = a["selective"]
        return [
            *(coverages(row, method) for method in REPORTED_SET_METHODS),
            *_set_cells(a["sets"]["lac"][key], ("coverage_std", 100, 1)),
            _dm(sel["exceeds"]),
            _dm(sel["refused"]),
            _dm(sel["answered"]),
            _dm(a["ood_flag"].get("test")),
        ]

    table = _row_table(
        (
            "row",
            *(f"{m.upper()} coverage" for m in REPORTED_SET_METHODS),
            f"spread over splits (LAC, alpha {key})",
            f"risk > {d['target_risk']:.0%}",
            "refused",
            "answered",
            "flagged: ID",
        ),
        validity,
    )
    return [
        "",
        f"## Validity over the {splits} random splits",
        "",
        "Does each guarantee hold as measured? Coverage: the mean over the splits of the tested "
        "part's coverage (the guarantee is on this mean: it should be at or above 1 - alpha, up "
        "to the Monte-Carlo error of the splits), then mean ± std over seeds, in %, at alpha "
        + " / ".join(alpha_key(a) for a in d["alphas"])
        + f". Risk > {d['target_risk']:.0%}: the share of splits whose tested part's selective "
        f"risk exceeds the target (the guarantee bounds the share of calibration draws whose "
        f"*expected* risk does, by delta = {d['delta']:g}; the tested part's own {n_x} examples "
        "add sampling noise on top). Refused: the share of splits where no threshold was "
        f"certified. Flagged: the share of tested ID inputs flagged as OOD (at most "
        f"{d['ood_alpha']:.0%} in expectation).",
        "",
        *table,
        "",
        "Mean coverage below 1 - alpha by more than twice its Monte-Carlo error (std over splits "
        f"/ sqrt({splits})), seeds averaged: " + (", ".join(misses) if misses else "none") + ".",
    ]


def _shift_decisions_section(report: dict[str, Any]) -> list[str]:
    """The decisions fitted in distribution, applied to the shifted copies: no guarantee."""
    d, agg = report["decision_settings"], report["decision_aggregate"]
    alpha, key = d["claim_alpha"], alpha_key(d["claim_alpha"])

    def shifted(row: str) -> list[str]:
        a = agg[row]
        sel = a["selective"]
        return [
            *_method_cells(a["sets"], key, ("shift_coverage", 100, 1), ("shift_mean_size", 1, 2)),
            _dm(sel["shift_answered"]),
            _dm(sel["shift_risk"]),
            _dm(sel["shift_exceeds"]),
            _dm(a["ood_flag"].get("shift")),
        ]

    return [
        "",
        f"## Under shift: {report['task']['shift']} (no guarantee holds)",
        "",
        "The decisions fitted on in-distribution data, applied to the shifted copies of the tested "
        f"examples. Nothing is promised here: the coverage at alpha = {key} would be "
        f"{1 - alpha:.0%} on exchangeable data; this is what it is. In %, sizes in classes.",
        "",
        *_row_table(
            (
                "row",
                *(
                    f"{m.upper()} {what}"
                    for m in REPORTED_SET_METHODS
                    for what in ("coverage", "size")
                ),
                f"answered at {d['target_risk']:.0%}",
                "risk of the answered",
                f"splits with risk > {d['target_risk']:.0%}",
                "flagged as OOD",
            ),
            shifted,
        ),
    ]


def _decision_claims_section(report: dict[str, Any]) -> list[str]:
    key = alpha_key(report["decision_settings"]["claim_alpha"])

    def scale(c: dict[str, Any]) -> float:
        return 1.0 if c["metric"].endswith("mean_size") else 100.0

    return [
        "",
        "## Decision claims and targets, paired per seed (each row + T)",
        "",
        f"Alpha = {key}; set sizes in classes (advantage = how many fewer classes), answered "
        "share in points of %. A claim or target holds only where it holds on every seed.",
        "",
        "| claim | metric | advantage | per seed | verdict |",
        "|---|---|---|---|---|",
        *(_claim_line(c, scale(c), with_margin=False) for c in report["decision_claims"]),
        "",
        "Targets (issue 25): the margin is what the advantage must exceed on every seed; "
        "'shortfall' is the worst seed's advantage minus the margin (negative: missed by that "
        "much).",
        "",
        "| target | metric | margin | advantage | per seed | shortfall | verdict |",
        "|---|---|---|---|---|---|---|",
        *(_claim_line(c, scale(c), with_margin=True) for c in report["decision_targets"]),
    ]


def _temperature_notes(agg: dict[str, Any], n_t: int) -> list[str]:
    """Where T made the tested part's or the shifted set's NLL worse (T is fitted on few errors)."""
    notes = []
    for where, name in (("test", "the tested part"), ("shift", "the shifted copies")):
        worse = [
            (row, agg[row]["temperature"]["mean"], agg[row]["scaling"][where])
            for row in ROWS
            if agg[row]["scaling"][where]["scaled"]["nll"]["mean"]
            > 1.02 * agg[row]["scaling"][where]["raw"]["nll"]["mean"]
        ]
        if worse:
            notes.append(
                f"- T raises the NLL of {name} by more than 2% for "
                + "; ".join(
                    f"{row} (T {t:.2f}: {c['raw']['nll']['mean']:.3f} → "
                    f"{c['scaled']['nll']['mean']:.3f})"
                    for row, t, c in worse
                )
                + "."
            )
    if notes:
        notes.insert(
            0,
            f"- T minimises the NLL of the {n_t} temperature examples; a row that errs on few of "
            "them gets a T that fits those few errors (T < 1 sharpens), which need not carry over "
            "to other data:",
        )
        notes.insert(0, "")
    return notes


def _selective_notes(agg: dict[str, Any], d: dict[str, Any]) -> list[str]:
    """How answer-or-abstain tests its thresholds, and why it is sometimes refused: the fewest
    answered quantile examples that can certify the target risk, with no error among them."""
    risk, delta, n_q = d["target_risk"], d["delta"], d["quantile_part"]
    level = float(selective_levels(GRID_SIZE, delta, "graph", start=0)[0])  # the start's level
    fewest = int(np.ceil(np.log(level) / np.log(1 - risk)))
    refused = [
        f"{row} ({agg[row]['selective']['refused']['mean']:.0%})"
        for row in ROWS
        if agg[row]["selective"]["refused"]["mean"] > 0.1
    ]
    return [
        "",
        f"- Answer or abstain (`fit_selective`, procedure `{d.get('selective_procedure', 'bonferroni')}`): "
        f"each of up to {GRID_SIZE} thresholds (quantiles of the temperature part's MSP) is "
        f'tested for "selective risk > {risk:.0%}" with its exact binomial p-value, at '
        f"family-wise error {delta:g}: half of delta on a fixed sequence down from the threshold "
        "the temperature part predicts easiest to certify, half spread over the grid "
        "(Bonferroni), each certified threshold passing its level to the next lower one. Even at "
        f"the start ({level:g}), at least {fewest} answered quantile examples are needed with no "
        f"error among them ((1 - {risk:g})^{fewest} <= {level:g}), {fewest / n_q:.0%} of the "
        f"quantile part's {n_q}; each error needs more. "
        + (
            "Refused (abstain on everything) on more than 10% of the splits: "
            + ", ".join(refused)
            + "; the answered share counts those splits as 0."
            if refused
            else "No row is refused on more than 10% of the splits."
        ),
    ]


def selective_markdown(report: dict[str, Any]) -> list[str]:
    """The answer-or-abstain table: every risk measured, at the recipe's quantile part and at
    each extra one."""
    d, agg = report["decision_settings"], report["decision_aggregate"]
    risks = [d["target_risk"], *d.get("other_risks", [])]
    parts = [(d["quantile_part"], d["tested_part"], agg)] + [
        (e["quantile_part"], e["tested_part"], e["aggregate"])
        for e in report.get("decision_extra", {}).values()
    ]

    def cell(a: dict[str, Any], risk: float) -> dict[str, Any]:
        return a["selective"] if risk == d["target_risk"] else a["selective_at"][f"{risk:g}"]

    header = [
        f"q={n_q}, {risk:.0%}: {what}"
        for n_q, _, _ in parts
        for risk in risks
        for what in (
            "answered",
            "Bonferroni answered",
            "risk",
            "splits > target",
            "population > target",
        )
    ]
    lines = [
        "",
        "## Answer or abstain at each risk and quantile part",
        "",
        f"The share answered (%), beside what Bonferroni alone (every threshold at delta / "
        f"{GRID_SIZE}, the test used before the graph test) answers on the same splits, the selective risk of "
        f"the answered on the tested part (%), and the share of splits whose tested risk exceeds "
        f"the target (delta = {d['delta']:g}); "
        f"mean ± std over seeds. The same {d['splits']} splits' temperature parts "
        f"({d['temperature_part']} examples); "
        + "; ".join(f"a quantile part of {n_q}, {n_x} tested" for n_q, n_x, _ in parts)
        + ". A split's tested risk is itself an estimate from its tested part (a few hundred "
        "answered examples, drawn from the same finite pool as the quantile part, so a quantile "
        "part with fewer errors than its share leaves more to the tested part), and a threshold "
        "whose true risk is just under the target exceeds it on many tested parts: the share of "
        "splits above the target measures the guarantee only up to that noise. 'population > "
        "target' measures it exactly: the examples outside the temperature part are taken as the "
        "population, a quantile part of the same size is drawn from it with replacement, and the "
        "population's own risk at the tau fitted on it is compared with the target; the "
        f"guarantee is that this happens on at most {d['delta']:g} of the draws.",
        "",
        "| row | " + " | ".join(header) + " |",
        "|---|" + "---|" * len(header),
    ]
    for row in ROWS:
        cells = []
        for _, _, a in parts:
            for risk in risks:
                c = cell(a[row], risk)
                cells += [
                    _dm(c["answered"]),
                    _dm(c.get("bonferroni_answered")),
                    _dm(c["risk"]),
                    _dm(c["exceeds"]),
                    _dm(c.get("population_exceeds")),
                ]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return lines


def _claim_line(c: dict[str, Any], scale: float, *, with_margin: bool) -> str:
    if "advantage_mean" not in c:
        cells = ["n/a"] * (5 if with_margin else 3)
        return f"| {c['claim']} | {c['metric']} | " + " | ".join(cells) + f" | {c['verdict']} |"
    digits = 3 if scale == 1.0 else 2
    seeds = ", ".join(f"{v * scale:+.{digits}f}" for v in c["advantage_per_seed"])
    advantage = (
        f"{c['advantage_mean'] * scale:+.{digits}f} ± {c['advantage_std'] * scale:.{digits}f}"
    )
    if not with_margin:
        return f"| {c['claim']} | {c['metric']} | {advantage} | {seeds} | {c['verdict']} |"
    shortfall = (min(c["advantage_per_seed"]) - c["margin"]) * scale
    return (
        f"| {c['claim']} | {c['metric']} | {c['margin'] * scale:+.{digits}f} | {advantage} | "
        f"{seeds} | {shortfall:+.{digits}f} | {c['verdict']} |"
    )
