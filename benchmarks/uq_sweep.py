"""Find the Hydra recipe: one seed, one factor at a time, chosen on validation data only.

The main benchmarks (``uq_digits.py``, ``uq_wordnet.py``) compare fixed rows over three seeds.
This sweep asks which settings of a Hydra built from ONE trained base model buy the most OOD
detection for their cost, without ever looking at a test OOD set:

- the task's training set is split: the first 80 % trains (base model, members), the last 20 %
  is the in-distribution *validation* set;
- the task's OOD validation family (digits: scrambled training digits; text: adjective glosses)
  is split in two halves: the first is what circuit selection with the OOD objective may score
  heads on, the second is the OOD side of the validation AUROC every row is ranked by;
- the test sets (ID test, the test OOD families) are scored too and written beside, marked as
  not used for any choice: they show whether the validation ranking transfers.

Every variant starts from the same base model (``base_steps``) and changes one setting of the
base recipe (Taylor heads, k heads per member, Gumbel temperature, bootstrap, M, MLP merge,
recovery steps, shared parts, per-member head counts, circuit with the OOD objective). The
single model and the one-base deep ensemble get each recovery budget the variants use. The
variant ranked first on validation AUROC (MSP), among those whose validation accuracy is
within 1 point of the single model's, is the recommended recipe; the main benchmarks then test
it over three seeds.

Run it from the repository root (digits: about 10 minutes on 2 cores)::

    .venv/bin/python benchmarks/uq_sweep.py --task digits --overwrite
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import add_output_options, machine, note
from uq_train import full_spec, member_logits, train_stage

from hydra_deploy.atomic import atomic_write_json, atomic_write_text
from hydra_deploy.fusion import fuse
from hydra_deploy.pruning import select_members
from hydra_deploy.uncertainty import ensemble_scores
from hydra_deploy.uncertainty.metrics import ece, nll, ood_metrics, ood_score

ACCURACY_SLACK = 0.01  # a variant may lose at most 1 point of validation accuracy to the single


@dataclass(frozen=True)
class Variant:
    """One Hydra recipe built from base model 0."""

    name: str
    method: str = "taylor"  # "taylor" or "circuit-ood" (circuit, OOD objective, no fine-tuning)
    conditioning: str = "member"  # circuit: "member" or "headmap"
    heads: int = 2  # heads per member per layer
    member_heads: tuple[int, ...] | None = None  # per-member counts instead of ``heads``
    temperature: float = 0.5
    resample: bool = True
    members: int = 3
    mlp_merge: str = "average"
    recovery_steps: int | None = None  # None: the task's finetune_steps
    shared_parts: str = "per-member"
    extra: dict[str, Any] = field(default_factory=dict)


def variants(num_heads: int, finetune_steps: int) -> list[Variant]:
    """The base recipe and one change at a time (plus circuit with the OOD objective)."""
    third, half, two_thirds = (
        max(1, num_heads // 3),
        max(1, num_heads // 2),
        max(1, 2 * num_heads // 3),
    )
    base = Variant("base recipe", heads=third)
    return [
        base,
        replace(base, name=f"k = {half} (1/2)", heads=half),
        replace(base, name=f"k = {two_thirds} (2/3)", heads=two_thirds),
        replace(base, name="temperature 0", temperature=0.0),
        replace(base, name="no bootstrap", resample=False),
        replace(base, name="M = 5", members=5),
        replace(base, name="grouped MLP", mlp_merge="grouped"),
        replace(
            base,
            name=f"recovery x2 ({2 * finetune_steps} steps)",
            recovery_steps=2 * finetune_steps,
        ),
        replace(base, name="shared parts frozen", shared_parts="frozen"),
        replace(base, name="shared parts averaged", shared_parts="averaged"),
        replace(
            base,
            name=f"per-member counts {third}/{half}/{two_thirds}",
            member_heads=(third, half, two_thirds),
        ),
        replace(base, name=f"k = {half}, grouped MLP", heads=half, mlp_merge="grouped"),
        replace(base, name="circuit, OOD objective", method="circuit-ood"),
        replace(
            base,
            name="circuit, OOD objective, HeadMap conditioning",
            method="circuit-ood",
            conditioning="headmap",
        ),
        replace(base, name=f"circuit, OOD objective, k = {half}", method="circuit-ood", heads=half),
    ]


def split_train(task: Any, fraction: float = 0.8) -> tuple[tuple, tuple]:
    x, y = task.train
    cut = int(len(y) * fraction)
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def row_metrics(
    logits: dict[str, np.ndarray], labels: dict[str, np.ndarray], ood_sets: dict[str, list[str]]
) -> dict[str, Any]:
    """Accuracy/ECE/NLL on the labelled sets, AUROC/FPR95 (MSP) of each OOD group, members."""
    scores = {k: ensemble_scores(v) for k, v in logits.items()}
    out: dict[str, Any] = {}
    for split, y in labels.items():
        probs = scores[split]["probs"].astype(np.float64)
        out[split] = {
            "accuracy": float((probs.argmax(1) == y).mean()),
            "ece": ece(probs, y),
            "nll": nll(probs, y),
        }
        pred = logits[split].argmax(2)
        out[split]["members_accuracy"] = [float(v) for v in (pred == y[:, None]).mean(0)]
        M = pred.shape[1]
        if M > 1:
            out[split]["disagreement"] = float(
                np.mean(
                    [(pred[:, a] != pred[:, b]).mean() for a in range(M) for b in range(a + 1, M)]
                )
            )
    for group, (id_split, names) in ood_sets.items():
        per = [
            ood_metrics(ood_score(scores[id_split], "msp"), ood_score(scores[n], "msp"))
            for n in names
        ]
        out[group] = {m: float(np.mean([p[m] for p in per])) for m in ("auroc", "fpr95")}
    return out


def run_header(script: str, argv: Sequence[str] | None, started: float) -> dict[str, Any]:
    """The command, finish time, duration and environment every report of these scripts opens with."""
    return {
        "command": f"python benchmarks/{script}.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": time.perf_counter() - started,
        "environment": {
            **machine(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
    }


def make_task(args: argparse.Namespace) -> Any:
    """The task ``--task`` names (its module's ``make_task``)."""
    if args.task == "digits":
        import uq_digits as module
    else:
        import uq_wordnet as module
    return module.make_task(args)


def add_folder_options(parser: argparse.ArgumentParser, name: str) -> None:
    """``--out``, ``--cache`` (each by default under benchmarks/, per task), ``--overwrite`` and
    ``--quiet`` of a one-seed study (this sweep, ``uq_curve.py``)."""
    parser.add_argument("--cache", type=Path, help=f"default benchmarks/.cache/{name}_<task>")
    add_output_options(parser, f"default benchmarks/results/{name}_<task>")


def folders(
    parser: argparse.ArgumentParser, args: argparse.Namespace, name: str
) -> tuple[Path, Path]:
    """(the report's folder, the cache) of ``args.task``; an existing report needs --overwrite."""
    out = args.out or Path(f"benchmarks/results/{name}_{args.task}")
    cache = args.cache or Path(f"benchmarks/.cache/{name}_{args.task}")
    if (out / "report.json").exists() and not args.overwrite:
        parser.error(f"{out / 'report.json'} exists; pass --overwrite or another --out")
    return out, cache


@dataclass
class _Sweep:
    """One seed of the sweep: the task's fit / validation split, the evaluation sets, and where
    each trained stage is cached."""

    task: Any
    seed: int
    cache: Path
    fit: tuple
    select_ood: Any  # the half of the OOD validation family heads are chosen on
    sets: dict[str, Any]
    labels: dict[str, np.ndarray]
    ood_groups: dict[str, tuple[str, list[str]]]

    @classmethod
    def of(cls, task: Any, seed: int, cache: Path) -> tuple[_Sweep, dict[str, str]]:
        """The sweep of ``task`` and a description of its validation data."""
        fit, val = split_train(task)
        val_ood_name, val_ood = task.ood_validation
        half = len(val_ood) // 2
        select_ood, score_ood = val_ood[:half], val_ood[half:]
        sweep = cls(
            task,
            seed,
            cache,
            fit,
            select_ood,
            sets={
                "val": val[0],
                "val_ood": score_ood,
                "test": task.test[0],
                **{f"test_ood:{k}": v for k, v in task.ood.items()},
            },
            labels={"val": val[1].numpy(), "test": task.test[1].numpy()},
            ood_groups={
                "val_ood": ("val", ["val_ood"]),
                "test_ood": ("test", [f"test_ood:{k}" for k in task.ood]),
            },
        )
        validation = {
            "id": f"last 20% of the training set ({len(val[1])} examples)",
            "ood": f"{val_ood_name}: {half} to select on, {len(score_ood)} to score",
        }
        return sweep, validation

    def train(
        self,
        adapter: Any,
        spec: Any,
        steps: int,
        offset: int,
        entry: str,
        lr: float | None = None,
        **options: Any,
    ) -> list[Any]:
        """``train_stage`` on the fit part (at the recipe's fine-tuning lr unless ``lr``), seeded
        ``seed * 100 + offset``, cached in ``entry``."""
        r = self.task.recipe
        lr = r.finetune_lr if lr is None else lr
        seed = self.seed * 100 + offset
        return train_stage(
            adapter, spec, self.fit, steps, lr, seed, r, self.cache / entry, **options
        )

    def metrics(self, model: Any) -> dict[str, Any]:
        """:func:`row_metrics` of a model (or a list of models: one member each)."""
        r, text = self.task.recipe, self.task.text
        models = model if isinstance(model, list) else [model]
        logits = {
            k: np.concatenate([member_logits(m, x, r.eval_batch, text) for m in models], axis=1)
            for k, x in self.sets.items()
        }
        return row_metrics(logits, self.labels, self.ood_groups)


def _baselines(sweep: _Sweep, base: Any, budgets: list[int]) -> tuple[dict[str, Any], Any]:
    """The single model and the one-base deep ensemble at every recovery budget; (their rows, the
    single model of the recipe's budget)."""
    r = sweep.task.recipe
    rows, single_model = {}, None
    for steps in budgets:
        single = sweep.train(base, full_spec(base), steps, 50, f"single{steps}")
        rows[f"single ({steps} recovery steps)"] = {
            **sweep.metrics(single[0]),
            "train_steps": r.base_steps + steps,
            "members": 1,
            "baseline": True,
        }
        one_base = [
            sweep.train(base, full_spec(base), steps, 60 + m, f"de1b{steps}_{m}")[0]
            for m in range(r.members)
        ]
        rows[f"deep ensemble (one base, {steps} steps)"] = {
            **sweep.metrics(one_base),
            "train_steps": r.base_steps + r.members * steps,
            "members": r.members,
            "baseline": True,
        }
        if steps == r.finetune_steps:
            single_model = single[0]
    return rows, single_model


def _variant_row(sweep: _Sweep, v: Variant, base: Any, single_model: Any) -> dict[str, Any]:
    """Variant ``v`` selected, recovered and fused; its row."""
    t0, r = time.perf_counter(), sweep.task.recipe
    steps = v.recovery_steps or r.finetune_steps
    heads = (
        dict(member_heads=list(v.member_heads))
        if v.member_heads
        else dict(heads_per_member=v.heads)
    )
    members_count = len(v.member_heads) if v.member_heads else v.members
    common = dict(
        data=sweep.fit, seed=sweep.seed, temperature=v.temperature, resample=v.resample, **heads
    )
    if v.method == "circuit-ood":  # the paper's zero-shot protocol, on validation OOD only
        spec = select_members(
            single_model,
            members_count,
            method="circuit",
            ood_data=sweep.select_ood,
            objective="ood",
            max_examples=r.circuit_examples,
            conditioning=v.conditioning,
            **common,
        )
        model = fuse(single_model, spec, mlp_merge="average").eval()
        train = r.base_steps + r.finetune_steps
    else:
        spec = select_members(
            base,
            members_count,
            method="taylor",
            max_examples=r.taylor_examples,
            mlp_merge=v.mlp_merge,
            **common,
        )
        parts = (v.heads, v.member_heads, v.temperature, v.resample, members_count, steps)
        tag = "_".join(str(x) for x in (*parts, v.shared_parts))
        members = sweep.train(base, spec, steps, 80, f"hydra_{tag}", shared_parts=v.shared_parts)
        model = fuse(members, spec, mlp_merge=v.mlp_merge).eval()
        train = r.base_steps + members_count * steps
    return {
        **sweep.metrics(model),
        "train_steps": train,
        "members": members_count,
        "parameters": model.num_parameters(),
        "per_member": model.per_member_parts(),
        "variant": v.__dict__,
        "baseline": False,
        "seconds": time.perf_counter() - t0,
    }


def main(argv: Sequence[str] | None = None, task_factory: Callable[[Any], Any] = make_task) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.strip().splitlines()[0],
        epilog="example:\n  .venv/bin/python benchmarks/uq_sweep.py --task digits --overwrite",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--task", choices=("digits", "wordnet"), default="digits")
    parser.add_argument("--seed", type=int, default=0, help="the one seed (default 0)")
    parser.add_argument("--quick", action="store_true", help="a smoke run (not a result)")
    parser.add_argument("--only", nargs="*", help="run only the variants with these names")
    add_folder_options(parser, "uq_sweep")
    args = parser.parse_args(argv)
    out, cache = folders(parser, args, "uq_sweep")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()

    task = task_factory(args)
    if task.ood_validation is None:
        parser.error(f"task {task.name} has no OOD validation family")
    r, seed = task.recipe, args.seed
    sweep, validation = _Sweep.of(task, seed, cache / f"seed{seed}")
    note(
        args,
        f"{task.name}: {len(sweep.fit[1])} fit, {len(sweep.labels['val'])} val, "
        f"{len(sweep.select_ood)} + {len(sweep.sets['val_ood'])} {task.ood_validation[0]} "
        f"(select / score), test OOD {', '.join(task.ood)}",
    )
    fresh = task.new_model(seed * 100)
    (base,) = sweep.train(fresh, full_spec(fresh), r.base_steps, 0, "base", r.base_lr)
    note(args, f"  base model: {r.base_steps} steps ({time.perf_counter() - started:.0f} s)")

    all_variants = variants(base.num_heads, r.finetune_steps)
    if args.only:
        all_variants = [v for v in all_variants if v.name in args.only or v.name == "base recipe"]
    budgets = sorted({v.recovery_steps or r.finetune_steps for v in all_variants})
    rows, single_model = _baselines(sweep, base, budgets)
    note(args, f"  baselines done ({time.perf_counter() - started:.0f} s)")
    for v in all_variants:
        rows[v.name] = row = _variant_row(sweep, v, base, single_model)
        note(
            args,
            f"  {v.name}: val AUROC {row['val_ood']['auroc']:.3f}, val acc "
            f"{row['val']['accuracy']:.3f} ({row['seconds']:.0f} s)",
        )

    single_row = rows[f"single ({r.finetune_steps} recovery steps)"]
    eligible = [
        n
        for n, row in rows.items()
        if not row["baseline"]
        and row["val"]["accuracy"] >= single_row["val"]["accuracy"] - ACCURACY_SLACK
    ]
    ranked = sorted(eligible, key=lambda n: -rows[n]["val_ood"]["auroc"])
    report = {
        "benchmark": "uq_sweep",
        "task": task.name,
        "seed": seed,
        "quick": args.quick,
        **run_header("uq_sweep", argv, started),
        "recipe": r.__dict__,
        "validation": validation,
        "choice_rule": "highest validation OOD AUROC (MSP) among variants whose validation "
        f"accuracy is at most {ACCURACY_SLACK * 100:.0f} point below the single "
        "model's; test sets never used",
        "ranking": ranked,
        "recommended": ranked[0] if ranked else None,
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "report.json", json.loads(json.dumps(report, default=float)))
    text = markdown(report)
    atomic_write_text(out / "report.md", text)
    print(text)
    return 0


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Recipe sweep on {report['task']} (seed {report['seed']}, one seed)",
        "",
        f"Produced by `{report['command']}` on {report['finished']} "
        f"({report['seconds'] / 60:.1f} min). Validation: ID {report['validation']['id']}; OOD "
        f"{report['validation']['ood']}. Choice: {report['choice_rule']}.",
        "",
        "Validation columns decide; test columns (ID test set, mean over the test OOD sets) are "
        "shown only to see whether the choice transfers. AUROC/FPR95 with MSP, in %.",
        "",
        "| row | val acc | val ECE | val AUROC | val FPR95 | test acc | test ECE | test AUROC | "
        "test FPR95 | member val acc | disagreement | train steps | params |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in report["rows"].items():
        v, t = row["val"], row["test"]
        members = ", ".join(f"{a * 100:.1f}" for a in v["members_accuracy"])
        dis = f"{v['disagreement'] * 100:.1f}" if "disagreement" in v else "—"
        params = f"{row['parameters'] / 1e6:.3f} M" if "parameters" in row else "—"
        mark = " **(recommended)**" if name == report["recommended"] else ""
        lines.append(
            f"| {name}{mark} | {v['accuracy'] * 100:.2f} | {v['ece'] * 100:.2f} | "
            f"{row['val_ood']['auroc'] * 100:.2f} | {row['val_ood']['fpr95'] * 100:.2f} | "
            f"{t['accuracy'] * 100:.2f} | {t['ece'] * 100:.2f} | {row['test_ood']['auroc'] * 100:.2f} | "
            f"{row['test_ood']['fpr95'] * 100:.2f} | {members} | {dis} | {row['train_steps']} | "
            f"{params} |"
        )
    lines += ["", f"Ranking on validation: {', '.join(report['ranking']) or 'none eligible'}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
