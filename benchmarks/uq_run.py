"""The uncertainty benchmarks' shared protocol: train, build every row, score, aggregate, report.

``uq_digits.py`` and ``uq_wordnet.py`` each describe a :class:`Task` (data, a fresh model, a
training recipe) and call :func:`main`. Per seed, with ``M`` members:

1. **base models**: ``M`` full models, each trained ``base_steps`` from its own init (digits:
   random init; text: the pretrained encoder with a new random classifier) and data order;
2. **deep ensemble**: each base model fine-tuned ``finetune_steps`` more with all its heads. The
   **single model** is member 0 of this ensemble; **MC dropout** is the single model with dropout
   on at test time (``mc_samples`` passes);
3. **Hydra (Taylor)**: ``select_members(base 0, method="taylor")`` then each member fine-tuned
   ``finetune_steps`` from base 0 with its pruned heads held at zero (``finetune_members``), fused
   with the MLPs averaged (the paper) and, as a second row, kept per member (``grouped``: exact).
   **Single Taylor-pruned** is member 0 of it alone, physically pruned (fused with M = 1);
4. **Hydra (circuit)**: ``select_members(single, method="circuit")`` on in-distribution data
   only, no fine-tuning (the members share the single model's weights, so the average is exact);
5. **Hydra (circuit, fine-tuned)**: the ablation between 3 and 4: circuit selection on base 0,
   then the members fine-tuned exactly as Hydra (Taylor)'s are;
6. **Hydra (circuit, OOD validation)**: the paper's protocol without leaking the test: circuit
   selection on the single model with the OOD objective scored on the task's OOD *validation*
   family (``Task.ood_validation``, of another kind than every test OOD set), no fine-tuning;
7. **Hydra (shared trunk)**: Hydra (Taylor)'s members keeping member 0's heads in the first half
   of the layers, fine-tuned with those layers and the embeddings frozen, so the fused model
   computes them once;
8. **Hydra (fused deep ensemble)**: each base model pruned to its own Taylor heads (one member
   each), recovered ``finetune_steps``, fused with per-member MLPs: a deep ensemble at Hydra's cost;
9. **deep ensemble (one base)**: base 0 fine-tuned ``finetune_steps`` M times with other seeds
   and data orders, all heads: the competitor a user with one trained model has.

Selection draws each member from its own bootstrap resample with Gumbel noise (temperature 0.5);
a member that repeats an earlier one is changed by the cheapest head swap (``select_members``).

Every deployed model has seen exactly ``base_steps + finetune_steps`` optimizer steps with the same
recipe (AdamW, warm-up, cosine decay; ``finetune_members`` runs both stages), so the deep ensemble
gets the training budget of Hydra's members; training cost in total: deep ensemble
``M (base + finetune)``, Hydra (Taylor) ``base + M finetune``, Hydra (circuit) ``base + finetune``
plus forward passes, fused deep ensemble ``M (base + finetune)``, one-base deep ensemble
``base + M finetune``. Test OOD sets are never used for selection or training. Every row reports
its members' own accuracy and their pairwise disagreement; the report adds the targets of
issue 19 (margins per seed), Pareto fronts (OOD AUROC and ECE against CPU latency, parameters
and training steps) and ``pareto.png``.

Scores: accuracy, ECE (15 bins), NLL, Brier on the in-distribution test set and on a shifted copy
of it (same labels); AUROC, AUPR, FPR95 (OOD positive) per OOD set with MSP and mutual information
(MI is zero for one model: not reported there). Parameters are the deployed weights; latency is
the median over interleaved rounds of the ratio to the single model on one batch (PyTorch, CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import add_output_options, load_average, machine, note
from uq_decisions import (
    ALPHAS,
    CURVE_COVERAGE,
    DELTA,
    LOGITS_FILE,
    OOD_ALPHA,
    OTHER_RISKS,
    REPORTED_SET_METHODS,
    TARGET_RISK,
    decision_claims,
    decision_targets,
    decisions,
    load_logits,
    save_logits,
    split_parts,
)
from uq_plots import pareto_plot, plots, risk_coverage_plot
from uq_report import markdown
from uq_rows import TARGETS, aggregate, claims, cost_model, diagnosis, pareto, score_row, tree_stats
from uq_task import ROWS, Task
from uq_train import build_rows, evaluate_rows, latency, parameter_count, train_steps

from hydra_deploy.atomic import atomic_write_json, atomic_write_text


def parse_args(name: str, doc: str, argv: Sequence[str] | None, default_seeds: int = 3):
    default_out = Path(f"benchmarks/results/uq_{name}")
    parser = argparse.ArgumentParser(
        description=doc.strip().splitlines()[0],
        epilog=f"example:\n  .venv/bin/python benchmarks/uq_{name}.py --overwrite\n"
        f"  .venv/bin/python benchmarks/uq_{name}.py --seeds 1 --quick --out /tmp/uq_{name}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=default_seeds,
        help=f"independent repetitions, seeds 0..N-1 (default {default_seeds}; at least 1)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: a tenth of the training steps and small evaluation sets (not a result)",
    )
    add_output_options(
        parser,
        f"output folder for report.json, report.md and the PNGs (default {default_out})",
        default=default_out,
        overwrite_help="replace an existing report",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path(f"benchmarks/.cache/uq_{name}"),
        help="trained weights, reused by a rerun with the same settings (default %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch.get_num_threads() as found); on a machine "
        "that other work shares, 1: two threads that wait on each other slow training many-fold",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes, one torch thread each: the seeds train in parallel (seed 0 is then "
        "rebuilt from --cache for the latency table, measured alone) and the decision analysis "
        "runs in as many (default 1: seeds one after another; decisions in --threads processes)",
    )
    render = "train nothing: re-derive the tables, the 'why' section and report.md of the "
    parser.add_argument(
        "--render",
        action="store_true",
        help=render + "existing report.json in --out from its measurements",
    )
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    if args.workers is not None and args.workers < 1:
        parser.error("--workers must be >= 1")
    if args.render and (args.overwrite or args.quick):
        parser.error(
            "--render re-derives an existing report; it takes neither --overwrite nor --quick"
        )
    report = args.out / "report.json"
    if report.exists() and not args.overwrite and not args.render:
        parser.error(f"{report} exists; pass --overwrite to replace it, or another --out")
    return args


def main(
    task_factory: Callable[[argparse.Namespace], Task],
    name: str,
    doc: str,
    argv: Sequence[str] | None = None,
) -> int:
    args = parse_args(name, doc, argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.render:
        return render(task_factory, args)
    started = time.perf_counter()
    task = task_factory(args)
    note(
        args,
        f"{task.name}: {len(task.train[1])} train, {len(task.test[1])} test, "
        f"{len(task.shift[1])} shifted, OOD "
        + ", ".join(f"{k} {len(v)}" for k, v in task.ood.items()),
    )
    check_calibration(task)
    workers = min(args.workers or 1, args.seeds)
    if workers > 1 and args.cache is None:
        raise SystemExit(f"uq_{name}: --workers > 1 needs --cache (seed 0 is rebuilt from it)")
    done, models = run_seeds(task_factory, task, args, workers)
    per_seed, every = [done[s][0] for s in range(args.seeds)], {s: done[s][1] for s in done}
    pooled: dict[str, dict[str, np.ndarray]] = {
        row: {
            split: np.concatenate([every[s][row][split] for s in range(args.seeds)])
            for split in every[0][row]
        }
        for row in ROWS
    }
    lat = latency(task, models)  # alone: no seed is running any more
    params = {
        row: (sum(parameter_count(e) for e in m) if isinstance(m, list) else parameter_count(m))
        for row, m in models.items()
    }
    params["MC dropout"] = params["single"]
    del models

    args.out.mkdir(parents=True, exist_ok=True)
    save_logits(args.out / LOGITS_FILE, every, task)
    agg = aggregate(per_seed)
    labels = np.concatenate([task.test[1].numpy()] * args.seeds)
    figures = plots(args.out, pooled, labels, agg, list(task.ood))
    stages = per_seed[0]["seconds"].keys()
    report = {
        "benchmark": f"uq_{name}",
        "command": "python "
        + " ".join([f"benchmarks/uq_{name}.py", *(argv if argv is not None else sys.argv[1:])]),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": time.perf_counter() - started,
        "environment": {
            **machine(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "load_average": load_average(),
        },
        "settings": {"seeds": args.seeds, "quick": args.quick, "recipe": task.recipe.__dict__},
        "seed_workers": workers,
        "task": task.description,
        "rows": list(ROWS),
        "parameters": params,
        "train_steps": {row: train_steps(row, task.recipe) for row in ROWS},
        "latency": lat,
        "seconds_per_stage": {
            k: float(np.mean([s["seconds"][k] for s in per_seed])) for k in stages
        },
        "aggregate": agg,
        "per_seed": per_seed,
        "figures": figures,
        "logits": {"file": LOGITS_FILE, "sha256": _sha256(args.out / LOGITS_FILE)},
    }
    return finish(report, task, args)


def run_seeds(
    task_factory: Callable[[argparse.Namespace], Task],
    task: Task,
    args: argparse.Namespace,
    workers: int,
) -> tuple[dict[int, tuple[dict[str, Any], dict[str, dict[str, np.ndarray]]]], dict]:
    """Every seed's :func:`run_seed` (one after another, or in ``workers`` processes), and seed
    0's models for the latency table (kept, or rebuilt from --cache after the processes)."""
    if workers > 1:
        done = run_seeds_parallel(task_factory, args, workers)
        started = time.perf_counter()
        models, _ = build_rows(task, 0, args)  # from --cache: trained weights and selections
        note(args, f"  seed 0 rebuilt from {args.cache} ({time.perf_counter() - started:.0f} s)")
        return done, models
    done, models = {}, None
    for seed in range(args.seeds):
        done[seed], kept = run_seed(task, seed, args)
        if seed == 0:
            models = kept  # latency below, measured on seed 0's models
        del kept
    return done, models


def run_seed(
    task: Task, seed: int, args: argparse.Namespace
) -> tuple[tuple[dict[str, Any], dict[str, dict[str, np.ndarray]]], dict]:
    """Train, evaluate and score every row of one seed: ((its per-seed record, the member logits
    of every row), the models)."""
    seed_start = time.perf_counter()
    models, info = build_rows(task, seed, args)
    eval_start = time.perf_counter()
    logits = evaluate_rows(task, models, seed)
    info["seconds"]["evaluation"] = time.perf_counter() - eval_start
    rows = {row: score_row(logits[row], task) for row in ROWS}
    info["seconds"]["total"] = time.perf_counter() - seed_start
    note(
        args,
        f"  seed {seed}: done in {info['seconds']['total']:.0f} s; single acc "
        f"{rows['single']['id']['accuracy']:.3f}, Hydra (Taylor) "
        f"{rows['Hydra (Taylor)']['id']['accuracy']:.3f}, circuit "
        f"{rows['Hydra (circuit)']['id']['accuracy']:.3f}",
    )
    return ({"seed": seed, "rows": rows, **info}, {row: logits[row] for row in ROWS}), models


def _seed_job(
    task_factory: Callable[[argparse.Namespace], Task], args: argparse.Namespace, seed: int
) -> tuple[dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """One seed in a worker process (one torch thread): the task is made again there."""
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    task = task_factory(args)
    result, models = run_seed(task, seed, args)
    del models
    return result


def run_seeds_parallel(
    task_factory: Callable[[argparse.Namespace], Task], args: argparse.Namespace, workers: int
) -> dict[int, tuple[dict[str, Any], dict[str, dict[str, np.ndarray]]]]:
    """Every seed in its own process, ``workers`` at a time, one torch thread each: on a machine
    of C cores, C single-threaded processes train about C times faster than one process of C
    threads (whose threads wait on each other whenever the machine is busy). A seed's result
    does not depend on where it ran: each stage seeds its own generators."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")  # no fork of a process running torch
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = {
            seed: pool.submit(_seed_job, task_factory, args, seed) for seed in range(args.seeds)
        }
        return {seed: future.result() for seed, future in futures.items()}


def check_calibration(task: Task) -> None:
    """Refuse, before any training, a test set too small for the recipe's calibration parts, or
    a shifted set that is not the shifted copy of the first test examples."""
    count = len(task.test[1])
    try:
        split_parts(count, replace(task.recipe, splits=1), 0)
    except ValueError as err:
        raise SystemExit(f"{task.name}: {err}; change the recipe's calibration sizes") from None
    shift = task.shift[1]
    if len(shift) > count or not torch.equal(shift, task.test[1][: len(shift)]):
        raise SystemExit(
            f"{task.name}: the shifted set must be shifted copies of the first test examples, "
            "with their labels"
        )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def finish(report: dict[str, Any], task: Task, args: argparse.Namespace) -> int:
    """Everything derived from the measurements (the decisions, recomputed from ``logits.npz``;
    claims, targets, Pareto fronts, the latency target, the "why" section, ``pareto.png``), then
    report.json and report.md."""
    add_decisions(report, task, args)
    add_derived(report, task)
    for plot in (pareto_plot(args.out, report), risk_coverage_plot(args.out, report)):
        if plot not in report["figures"]:
            report["figures"].append(plot)
    report = json.loads(json.dumps(report, default=jsonable))
    atomic_write_json(args.out / "report.json", report)
    text = markdown(report)
    atomic_write_text(args.out / "report.md", text)
    print(text)
    note(args, f"wrote {args.out}/report.json, report.md and {', '.join(report['figures'])}")
    return 0


def add_decisions(report: dict[str, Any], task: Task, args: argparse.Namespace) -> None:
    """The decisions of every seed and row from the stored logits (and at each extra quantile
    part), their settings, aggregate, claims and targets; the time they took, on a run."""
    started = time.perf_counter()
    stored, labels = load_logits(args.out / report["logits"]["file"])
    workers = args.workers or args.threads or 1
    decided = decisions(stored, labels, task.recipe, workers=workers)
    for s in report["per_seed"]:
        s["decisions"] = decided[s["seed"]]
    report["decision_extra"] = {
        str(size): _extra_decisions(stored, labels, task, size, workers)
        for size in task.extra_quantile_parts
    }
    alpha, r = task.claim_alpha, task.recipe
    report["decision_settings"] = {
        "alphas": list(ALPHAS),
        "claim_alpha": alpha,
        "methods": list(REPORTED_SET_METHODS),
        "target_risk": TARGET_RISK,
        "other_risks": list(OTHER_RISKS),
        "selective_procedure": "graph",
        "delta": DELTA,
        "ood_alpha": OOD_ALPHA,
        "temperature_part": r.calibration_temperature,
        "quantile_part": r.calibration_quantile,
        "tested_part": len(labels) - r.calibration_temperature - r.calibration_quantile,
        "splits": r.splits,
        "curve_coverage": list(CURVE_COVERAGE),
    }
    report["decision_aggregate"] = {
        row: tree_stats([s["decisions"][row] for s in report["per_seed"]]) for row in ROWS
    }
    report["decision_claims"] = claims(
        report["per_seed"], decision_claims(alpha), key="decisions", strict=True
    )
    report["decision_targets"] = claims(
        report["per_seed"], decision_targets(alpha), key="decisions", strict=True
    )
    if "rendered" not in report:  # a render keeps the run's own timing
        elapsed = time.perf_counter() - started
        report["seconds_decisions"] = elapsed
        report["decision_workers"] = workers
        report["seconds"] += elapsed


def _extra_decisions(
    stored: dict, labels: np.ndarray, task: Task, size: int, workers: int
) -> dict[str, Any]:
    """The decisions with a quantile part of ``size`` (the same splits' temperature part, the
    rest tested), aggregated over seeds (temperature scaling left out: it is the recipe's)."""
    recipe = replace(task.recipe, calibration_quantile=size)
    extra = decisions(stored, labels, recipe, workers=workers)
    return {
        "quantile_part": size,
        "tested_part": len(labels) - recipe.calibration_temperature - size,
        "aggregate": {
            row: tree_stats(
                [
                    {k: v for k, v in extra[seed][row].items() if k != "scaling"}
                    for seed in sorted(extra)
                ]
            )
            for row in ROWS
        },
    }


def add_derived(report: dict[str, Any], task: Task) -> None:
    """The claims, targets, Pareto fronts, latency target and "why" of the measurements."""
    per_seed, lat = report["per_seed"], report["latency"]
    report["claims"] = claims(per_seed)
    report["targets"] = claims(per_seed, TARGETS)
    report["pareto"] = pareto(report)
    fused_vs_de = lat["Hydra (fused deep ensemble)"]["ratio"] / lat["deep ensemble"]["ratio"]
    report["latency_target"] = {
        "target": "Hydra (fused deep ensemble) at <= 0.8 x the deep ensemble's CPU latency",
        "ratio": fused_vs_de,
        "holds": bool(fused_vs_de <= 0.8),
    }
    quiet = logging.getLogger("hydra_deploy")
    level, _ = quiet.level, quiet.setLevel(logging.ERROR)  # a fresh model, only to count its MACs
    try:
        fresh = task.new_model(0)
    finally:
        quiet.setLevel(level)
    report["diagnosis"] = diagnosis(report, cost_model(fresh, task.recipe))


def render(task_factory: Callable[[argparse.Namespace], Task], args: argparse.Namespace) -> int:
    """``--render``: re-derive an existing report's tables and report.md from its measurements
    (per-seed scores, latency, parameters), without training or evaluating anything."""
    path = args.out / "report.json"
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"--render: {path} does not exist; run the benchmark first") from None
    except json.JSONDecodeError as err:
        raise SystemExit(
            f"--render: {path} is not valid JSON ({err}); run the benchmark again with --overwrite"
        ) from None
    missing = [
        k
        for k in ("per_seed", "latency", "parameters", "aggregate", "task", "figures", "logits")
        if k not in report
    ]
    if missing or set(report.get("rows", ())) != set(ROWS):
        raise SystemExit(
            f"--render: {path} was written by another version of the benchmark "
            f"(missing {', '.join(missing) or 'rows of this version'}); run it again "
            "with --overwrite"
        )
    logits = args.out / report["logits"]["file"]
    if not logits.is_file() or _sha256(logits) != report["logits"]["sha256"]:
        raise SystemExit(
            f"--render: {logits} is missing or is not the file {path} was measured with; run the "
            "benchmark again with --overwrite"
        )
    args.quick = report["settings"]["quick"]
    task = task_factory(args)
    if task.recipe.__dict__ != report["settings"]["recipe"]:
        raise SystemExit(
            f"--render: {path} was measured with another recipe than this script's; "
            "run the benchmark again with --overwrite"
        )
    report["rendered"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return finish(report, task, args)


def jsonable(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON-able: {type(value).__name__}")
