"""Is the base model trained to convergence? Validation accuracy and NLL against the step budget.

The uncertainty benchmarks train every base model for ``base_steps`` (AdamW, warm-up, cosine
decay to 0). This script trains the task's base model (seed 0) from scratch for several budgets,
each with its own full schedule, on the first 80 % of the training set, and scores each on the
last 20 % (never on a test set), so the budget the benchmarks use can be read off the curve:
converged when doubling it no longer lowers the validation NLL.

Run it from the repository root (digits: about 3 minutes on 2 cores; wordnet: about 20)::

    .venv/bin/python benchmarks/uq_curve.py --task digits --overwrite
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from common import note
from uq_sweep import add_folder_options, folders, make_task, run_header, split_train
from uq_train import full_spec, member_logits, train_stage

from hydra_deploy.atomic import atomic_write_json, atomic_write_text
from hydra_deploy.uncertainty import ensemble_scores
from hydra_deploy.uncertainty.metrics import ece, nll

BUDGETS = {"digits": (150, 300, 600, 1200, 2400), "wordnet": (100, 200, 400, 800)}


def main(argv: Sequence[str] | None = None, task_factory: Callable[[Any], Any] = make_task) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.strip().splitlines()[0],
        epilog="example:\n  .venv/bin/python benchmarks/uq_curve.py --task digits --overwrite",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--task", choices=tuple(BUDGETS), default="digits")
    parser.add_argument("--budgets", type=int, nargs="+", help="step budgets (default per task)")
    parser.add_argument("--quick", action="store_true", help="a smoke run (not a result)")
    add_folder_options(parser, "uq_curve")
    args = parser.parse_args(argv)
    out, cache = folders(parser, args, "uq_curve")
    budgets = args.budgets or BUDGETS[args.task]
    if any(b < 1 for b in budgets):
        parser.error("--budgets must be positive step counts")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    task = task_factory(args)
    r = task.recipe
    fit, val = split_train(task)
    y = val[1].numpy()
    points = []
    for steps in sorted(set(budgets)):
        t0 = time.perf_counter()
        fresh = task.new_model(0)
        (model,) = train_stage(
            fresh, full_spec(fresh), fit, steps, r.base_lr, 0, r, cache / f"steps{steps}"
        )
        probs = ensemble_scores(member_logits(model, val[0], r.eval_batch, task.text))["probs"]
        probs = probs.astype(np.float64)
        points.append(
            {
                "steps": steps,
                "accuracy": float((probs.argmax(1) == y).mean()),
                "nll": nll(probs, y),
                "ece": ece(probs, y),
                "seconds": time.perf_counter() - t0,
            }
        )
        note(
            args,
            f"  {steps} steps: val accuracy {points[-1]['accuracy']:.4f}, NLL "
            f"{points[-1]['nll']:.4f}",
        )
    used = r.base_steps
    report = {
        "benchmark": "uq_curve",
        "task": task.name,
        "quick": args.quick,
        **run_header("uq_curve", argv, started),
        "recipe": r.__dict__,
        "benchmark_base_steps": used,
        "validation": f"last 20% of the training set ({len(y)} examples), seed 0",
        "points": points,
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "report.json", json.loads(json.dumps(report, default=float)))
    lines = [
        f"# Base-model training curve on {task.name}",
        "",
        f"Produced by `{report['command']}` on {report['finished']} "
        f"({report['seconds'] / 60:.1f} min). Each budget is a separate run with its own schedule "
        f"(lr {r.base_lr:g}, batch {r.batch_size}, warm-up {r.warmup_steps}); validation: "
        f"{report['validation']}. The benchmark trains its bases {used} steps.",
        "",
        "| steps | val accuracy | val NLL | val ECE |",
        "|---|---|---|---|",
        *(
            f"| {p['steps']}{' (benchmark)' if p['steps'] == used else ''} | "
            f"{p['accuracy'] * 100:.2f} | {p['nll']:.4f} | {p['ece'] * 100:.2f} |"
            for p in points
        ),
        "",
    ]
    text = "\n".join(lines)
    atomic_write_text(out / "report.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
