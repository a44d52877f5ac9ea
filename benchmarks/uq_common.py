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
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import load_average, machine, note

from hydra_deploy.atomic import atomic_write_json, atomic_write_text
from hydra_deploy.backbones import load_backbone
from hydra_deploy.families import get_family
from hydra_deploy.fusion import HydraModel, fuse
from hydra_deploy.pruning import finetune_members, select_members
from hydra_deploy.specs import HydraSpec
from hydra_deploy.uncertainty import ensemble_scores
from hydra_deploy.uncertainty.metrics import (
    brier,
    ece,
    nll,
    ood_metrics,
    ood_score,
    reliability_bins,
)

ROWS = (
    "single",
    "single Taylor-pruned",
    "Hydra (Taylor)",
    "Hydra (Taylor, grouped MLP)",
    "Hydra (circuit)",
    "Hydra (circuit, fine-tuned)",
    "Hydra (circuit, OOD validation)",
    "Hydra (shared trunk)",
    "Hydra (fused deep ensemble)",
    "deep ensemble (one base)",
    "deep ensemble",
    "MC dropout",
)
#: Rows built from one trained base model (what a user with one checkpoint can make).
ONE_BASE_HYDRA = (
    "Hydra (Taylor)",
    "Hydra (Taylor, grouped MLP)",
    "Hydra (circuit)",
    "Hydra (circuit, fine-tuned)",
    "Hydra (circuit, OOD validation)",
    "Hydra (shared trunk)",
)
OOD_SCORES = ("msp", "mutual_information")
OOD_METRICS = ("auroc", "aupr", "fpr95")
CLASSIFICATION = ("accuracy", "ece", "nll", "brier")
HIGHER_IS_BETTER = {
    "accuracy": True,
    "ece": False,
    "nll": False,
    "brier": False,
    "auroc": True,
    "aupr": True,
    "fpr95": False,
}


@dataclass
class Recipe:
    """How long and how hard each stage trains (the same for every row)."""

    base_steps: int
    base_lr: float
    finetune_steps: int
    finetune_lr: float
    batch_size: int
    warmup_steps: int
    members: int = 3
    heads_per_member: int = 2
    mc_samples: int = 10
    taylor_examples: int = 512
    circuit_examples: int = 256
    eval_batch: int = 128
    latency_batch: int = 32
    latency_rounds: int = 30


@dataclass
class Task:
    """One benchmark: its data (tensors), how to make a fresh model, and the recipe."""

    name: str
    classes: list[str]
    train: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]
    shift: tuple[torch.Tensor, torch.Tensor]
    ood: dict[str, torch.Tensor]
    new_model: Callable[[int], Any]  # seed -> a backbone adapter (untrained or pretrained)
    recipe: Recipe
    description: dict[str, Any] = field(default_factory=dict)
    text: bool = False
    #: OOD inputs used only to choose heads (circuit, objective "ood"): one family, of another kind
    #: than every test OOD set; never evaluated as a test set.
    ood_validation: tuple[str, torch.Tensor] | None = None


# --------------------------------------------------------------------------------------------------
# command line


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
    parser.add_argument(
        "--out",
        type=Path,
        default=default_out,
        help=f"output folder for report.json, report.md and the PNGs (default {default_out})",
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
        help="torch intra-op threads (default: torch.get_num_threads() as found)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing report")
    parser.add_argument(
        "--render",
        action="store_true",
        help="train nothing: re-derive the tables, the 'why' section and report.md of the "
        "existing report.json in --out from its measurements",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress notes")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    if args.render and (args.overwrite or args.quick):
        parser.error(
            "--render re-derives an existing report; it takes neither --overwrite nor --quick"
        )
    report = args.out / "report.json"
    if report.exists() and not args.overwrite and not args.render:
        parser.error(f"{report} exists; pass --overwrite to replace it, or another --out")
    return args


# --------------------------------------------------------------------------------------------------
# models: forward passes, training stages


def _forward(model: Any, x: torch.Tensor) -> torch.Tensor:
    """Member logits [B, M, C] of a fused model or of one model (an adapter: M = 1)."""
    if isinstance(model, HydraModel):
        if get_family(model.family).text:  # stacked (input_ids, attention_mask)
            return model(x[:, 0], x[:, 1])
        return model(x)
    return model(x).unsqueeze(1)


def _trim(x: torch.Tensor, text: bool) -> torch.Tensor:
    """Text batches: drop the padding columns no example of the batch uses."""
    if not text:
        return x
    longest = int(x[:, 1].sum(1).max())
    return x[..., : max(longest, 1)]


def member_logits(model: Any, x: torch.Tensor, batch: int, text: bool) -> np.ndarray:
    """[N, M, C] float64, evaluated in batches (text sorted by length so batches pad less)."""
    order = torch.argsort(x[:, 1].sum(1)) if text else torch.arange(x.shape[0])
    out = []
    with torch.inference_mode():
        for start in range(0, x.shape[0], batch):
            idx = order[start : start + batch]
            out.append(_forward(model, _trim(x[idx], text)).double())
    logits = torch.cat(out)
    result = torch.empty_like(logits)
    result[order] = logits
    return result.numpy()


def mc_dropout_logits(
    adapter: Any, x: torch.Tensor, samples: int, batch: int, text: bool, seed: int
) -> np.ndarray:
    """[N, samples, C]: ``samples`` passes with dropout on (eval everywhere else)."""
    module = adapter.module
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        module.train()
        try:
            passes = [member_logits(adapter, x, batch, text)[:, 0] for _ in range(samples)]
        finally:
            module.eval()
    return np.stack(passes, axis=1)


def train_stage(
    adapter: Any,
    spec: HydraSpec,
    data: tuple,
    steps: int,
    lr: float,
    seed: int,
    recipe: Recipe,
    cache: Path | None,
    **options: Any,
) -> list[Any]:
    """``finetune_members`` for ``steps`` steps: one trained adapter per member of ``spec``."""
    members = finetune_members(
        adapter,
        spec,
        data,
        epochs=None,
        max_steps=steps,
        lr=lr,
        batch_size=recipe.batch_size,
        warmup_steps=min(recipe.warmup_steps, max(steps - 1, 0)),
        seed=seed,
        save_dir=cache,
        progress=False,
        eval_examples=128,
        **options,
    )
    return [load_backbone(m) for m in members]


def full_spec(adapter: Any, members: int = 1) -> HydraSpec:
    return HydraSpec.full(
        adapter.name, adapter.num_layers, adapter.num_heads, adapter.head_dim, members
    )


def member_spec(spec: HydraSpec, member: int) -> HydraSpec:
    """Member ``member`` of ``spec`` alone (M = 1, its own MLP)."""
    return spec.replace(members=[spec.members[member]], mlp_merge="grouped", meta={})


def train_steps(row: str, recipe: Recipe) -> int:
    """Optimizer steps spent on everything the row deploys (all stages, all members)."""
    M, base, tune = recipe.members, recipe.base_steps, recipe.finetune_steps
    if row in ("deep ensemble", "Hydra (fused deep ensemble)"):
        return M * (base + tune)
    if row in (
        "single",
        "single Taylor-pruned",
        "MC dropout",
        "Hydra (circuit)",
        "Hydra (circuit, OOD validation)",
    ):
        return base + tune  # circuit rows select on the single model with forward passes only
    return base + M * tune  # one base, M recovered / fine-tuned members


def _parameters(model: Any) -> int:
    module = model if isinstance(model, HydraModel) else model.module
    return int(sum(p.numel() for p in module.parameters()))


# --------------------------------------------------------------------------------------------------
# one seed


def build_rows(task: Task, seed: int, args: argparse.Namespace) -> tuple[dict, dict]:
    """Train and assemble every row for ``seed``. Returns (models, info)."""
    r = task.recipe
    M = r.members
    cache = None if args.cache is None else args.cache / f"seed{seed}"
    info: dict[str, Any] = {"seconds": {}}

    started = time.perf_counter()
    bases = []
    for m in range(M):
        fresh = task.new_model(seed * 100 + m)
        (base,) = train_stage(
            fresh,
            full_spec(fresh),
            task.train,
            r.base_steps,
            r.base_lr,
            seed * 100 + m,
            r,
            _sub(cache, f"base{m}"),
        )
        bases.append(base)
    info["seconds"]["base models"] = time.perf_counter() - started
    note(args, f"  seed {seed}: {M} base models trained ({info['seconds']['base models']:.0f} s)")

    started = time.perf_counter()
    ensemble = []
    for m, base in enumerate(bases):
        (member,) = train_stage(
            base,
            full_spec(base),
            task.train,
            r.finetune_steps,
            r.finetune_lr,
            seed * 100 + 50 + m,
            r,
            _sub(cache, f"de{m}"),
        )
        ensemble.append(member)
    single = ensemble[0]
    info["seconds"]["deep ensemble fine-tuning"] = time.perf_counter() - started

    started = time.perf_counter()
    taylor = select(bases[0], "taylor", task.train, seed, r, info)
    info["seconds"]["Taylor selection"] = time.perf_counter() - started
    started = time.perf_counter()
    taylor_members = train_stage(
        bases[0],
        taylor,
        task.train,
        r.finetune_steps,
        r.finetune_lr,
        seed * 100 + 80,
        r,
        _sub(cache, "taylor"),
    )
    info["seconds"]["Hydra (Taylor) fine-tuning"] = time.perf_counter() - started

    started = time.perf_counter()
    circuit = select(single, "circuit", task.train, seed, r, info)
    info["seconds"]["circuit selection"] = time.perf_counter() - started
    started = time.perf_counter()
    circuit_base = select(bases[0], "circuit", task.train, seed, r, info)
    circuit_members = train_stage(
        bases[0],
        circuit_base,
        task.train,
        r.finetune_steps,
        r.finetune_lr,
        seed * 100 + 90,
        r,
        _sub(cache, "circuit"),
    )
    info["seconds"]["circuit (fine-tuned) selection and fine-tuning"] = (
        time.perf_counter() - started
    )
    started = time.perf_counter()
    one_base = []
    for m in range(M):
        (member,) = train_stage(
            bases[0],
            full_spec(bases[0]),
            task.train,
            r.finetune_steps,
            r.finetune_lr,
            seed * 100 + 60 + m,
            r,
            _sub(cache, f"de1b{m}"),
        )
        one_base.append(member)
    info["seconds"]["deep ensemble (one base) fine-tuning"] = time.perf_counter() - started

    started = time.perf_counter()
    circuit_ood = None
    if task.ood_validation is not None:
        circuit_ood = select_members(
            single,
            M,
            heads_per_member=r.heads_per_member,
            method="circuit",
            data=task.train,
            ood_data=task.ood_validation[1],
            objective="ood",
            seed=seed,
            max_examples=r.circuit_examples,
        )
    info["seconds"]["circuit (OOD validation) selection"] = time.perf_counter() - started

    started = time.perf_counter()
    trunk_layers = max(1, bases[0].num_layers // 2)
    trunk_spec = _with_shared_trunk(taylor, trunk_layers)
    trunk_members = train_stage(
        bases[0],
        trunk_spec,
        task.train,
        r.finetune_steps,
        r.finetune_lr,
        seed * 100 + 80,
        r,
        _sub(cache, "trunk"),
        shared_layers=trunk_layers,
    )
    info["seconds"]["Hydra (shared trunk) fine-tuning"] = time.perf_counter() - started

    started = time.perf_counter()
    fused_members, fused_heads = [], []
    for m, base in enumerate(bases):
        own = select_members(
            base,
            1,
            heads_per_member=r.heads_per_member,
            method="taylor",
            data=task.train,
            seed=seed * 100 + m,
            max_examples=r.taylor_examples,
        )
        (member,) = train_stage(
            base,
            own,
            task.train,
            r.finetune_steps,
            r.finetune_lr,
            seed * 100 + 50 + m,
            r,
            _sub(cache, f"fused{m}"),
        )
        fused_members.append(member)
        fused_heads.append(own.members[0])
    fused_spec = taylor.replace(members=fused_heads, mlp_merge="grouped", meta={})
    info["seconds"]["Hydra (fused deep ensemble) selection and recovery"] = (
        time.perf_counter() - started
    )
    note(args, f"  seed {seed}: selection and fine-tuning done")

    models = {
        "single": single,
        "single Taylor-pruned": fuse([taylor_members[0]], member_spec(taylor, 0)).eval(),
        "Hydra (Taylor)": fuse(taylor_members, taylor, mlp_merge="average").eval(),
        "Hydra (Taylor, grouped MLP)": fuse(taylor_members, taylor, mlp_merge="grouped").eval(),
        "Hydra (circuit)": fuse(single, circuit, mlp_merge="average").eval(),
        "Hydra (circuit, fine-tuned)": fuse(
            circuit_members, circuit_base, mlp_merge="average"
        ).eval(),
        "Hydra (circuit, OOD validation)": None
        if circuit_ood is None
        else fuse(single, circuit_ood, mlp_merge="average").eval(),
        "Hydra (shared trunk)": fuse(trunk_members, trunk_spec, mlp_merge="average").eval(),
        "Hydra (fused deep ensemble)": fuse(fused_members, fused_spec, mlp_merge="grouped").eval(),
        "deep ensemble (one base)": one_base,
        "deep ensemble": ensemble,
    }
    if circuit_ood is None:
        raise ValueError(f"task {task.name} has no ood_validation family")
    assert models["Hydra (shared trunk)"].trunk_layers == trunk_layers
    specs = {
        "taylor": taylor,
        "circuit": circuit,
        "circuit (fine-tuned)": circuit_base,
        "circuit (OOD validation)": circuit_ood,
        "shared trunk": trunk_spec,
        "fused deep ensemble": fused_spec,
    }
    info["specs"] = {k: v.to_dict() for k, v in specs.items()}
    info["heads_overlap"] = {k: v.overlap().round(3).tolist() for k, v in specs.items()}
    return models, info


def _with_shared_trunk(spec: HydraSpec, layers: int) -> HydraSpec:
    """``spec`` with every member keeping member 0's heads in the first ``layers`` layers."""
    first = spec.members[0].heads
    members = [{"heads": [*first[:layers], *m.heads[layers:]]} for m in spec.members]
    return spec.replace(members=members, meta={})


def select(
    backbone: Any, method: str, data: tuple, seed: int, recipe: Recipe, info: dict
) -> HydraSpec:
    """``select_members`` with the recipe's counts (members come out distinct by construction)."""
    examples = recipe.taylor_examples if method == "taylor" else recipe.circuit_examples
    return select_members(
        backbone,
        recipe.members,
        heads_per_member=recipe.heads_per_member,
        method=method,
        data=data,
        seed=seed,
        max_examples=examples,
    )


def _sub(cache: Path | None, name: str) -> Path | None:
    return None if cache is None else cache / name


def evaluate_rows(task: Task, models: dict, seed: int) -> dict[str, dict[str, np.ndarray]]:
    """Member logits [N, M, C] of every row on every evaluation set."""
    r = task.recipe
    sets = {
        "id": task.test[0],
        "shift": task.shift[0],
        **{f"ood:{k}": v for k, v in task.ood.items()},
    }
    logits: dict[str, dict[str, np.ndarray]] = {}
    for row, model in models.items():
        if isinstance(model, list):  # the deep ensembles: one model per member
            logits[row] = {
                s: np.concatenate(
                    [member_logits(m, x, r.eval_batch, task.text) for m in model], axis=1
                )
                for s, x in sets.items()
            }
        else:
            logits[row] = {
                s: member_logits(model, x, r.eval_batch, task.text) for s, x in sets.items()
            }
    single = models["single"]
    logits["MC dropout"] = {
        s: mc_dropout_logits(single, x, r.mc_samples, r.eval_batch, task.text, seed + i)
        for i, (s, x) in enumerate(sets.items())
    }
    return logits


def score_row(logits: dict[str, np.ndarray], task: Task) -> dict[str, Any]:
    """Every metric of one row from its member logits per evaluation set."""
    scores = {s: ensemble_scores(v) for s, v in logits.items()}
    members = next(iter(logits.values())).shape[1]
    out: dict[str, Any] = {"members": members}
    for split, labels in (("id", task.test[1]), ("shift", task.shift[1])):
        probs, y = scores[split]["probs"].astype(np.float64), labels.numpy()
        out[split] = {
            "accuracy": float((probs.argmax(1) == y).mean()),
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


def latency(task: Task, models: dict) -> dict[str, dict[str, float]]:
    """Median ratio to the single model over interleaved rounds, one batch, PyTorch CPU."""
    r = task.recipe
    x = (
        _trim(task.test[0][: r.latency_batch], task.text)
        if task.text
        else task.test[0][: r.latency_batch]
    )
    single = models["single"]

    def run_mc() -> None:
        single.module.train()
        try:
            for _ in range(r.mc_samples):
                _forward(single, x)
        finally:
            single.module.eval()

    calls: dict[str, Callable[[], Any]] = {
        row: (lambda m=model: [_forward(e, x) for e in m])
        if isinstance(model, list)
        else (lambda m=model: _forward(m, x))
        for row, model in models.items()
    }
    calls["MC dropout"] = run_mc
    times: dict[str, list[float]] = {row: [] for row in calls}
    with torch.inference_mode():
        for fn in calls.values():  # warm-up
            fn()
        for _ in range(r.latency_rounds):
            for row, fn in calls.items():
                start = time.perf_counter()
                fn()
                times[row].append(time.perf_counter() - start)
    base = np.asarray(times["single"])
    return {
        row: {
            "median_ms": float(np.median(t) * 1e3),
            "ratio": float(np.median(np.asarray(t) / base)),
        }
        for row, t in times.items()
    }


# --------------------------------------------------------------------------------------------------
# aggregation, claims, tables


def _leaves(tree: Any, prefix: tuple = ()) -> dict[tuple, float]:
    if isinstance(tree, (dict, list)):
        out = {}
        for k, v in tree.items() if isinstance(tree, dict) else enumerate(tree):
            out.update(_leaves(v, (*prefix, k)))
        return out
    return {prefix: float(tree)}


def _set_path(tree: dict, path: tuple, value: Any) -> None:
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
            _set_path(
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


def _get(tree: dict, path: tuple) -> float:
    for k in path:
        tree = tree[k]
    return float(tree)


def claims(per_seed: list[dict[str, Any]], table: Sequence[tuple] = CLAIMS) -> list[dict[str, Any]]:
    """Paired comparisons over seeds: does ``row`` beat ``against`` by more than the margin?"""
    out = []
    for claim, row, against, path, margin in table:
        higher = HIGHER_IS_BETTER[path[-1]]
        diffs = [
            (_get(s["rows"][row], path) - _get(s["rows"][against], path)) * (1 if higher else -1)
            for s in per_seed
        ]
        wins = sum(d > margin for d in diffs)
        mean = float(np.mean(diffs))
        if wins == len(diffs):
            verdict = "holds (every seed)"
        elif mean > margin:
            verdict = f"holds on average ({wins}/{len(diffs)} seeds)"
        else:
            verdict = f"does not hold ({wins}/{len(diffs)} seeds)"
        out.append(
            {
                "claim": claim,
                "row": row,
                "against": against,
                "metric": ".".join(path),
                "margin": margin,
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


# --------------------------------------------------------------------------------------------------
# why: the measurements behind each target


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


def _stats(values: Sequence[float]) -> dict[str, Any]:
    values = [float(v) for v in values]
    std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return {"mean": float(np.mean(values)), "std": std, "values": values}


def diagnosis(report: dict[str, Any], costs: dict[str, float]) -> dict[str, Any]:
    """Per seed, paired: the measurements that say why each target of issue 19 holds or not.

    - the one-base ceiling: how far M unpruned fine-tunes of one base beat the single model (every
      one-base Hydra row's members are pruned fine-tunes of that same base);
    - the price of pruning: one member alone against the single model, and each row's members;
    - diversity: pairwise disagreement of each row's members;
    - the fused deep ensemble: its members against the deep ensemble's, and its cost (analytic
      MACs beside the measured latency).
    """
    seeds = report["per_seed"]

    def value(s: dict, row: str, *path: str) -> float:
        return _get(s["rows"][row], path)

    def paired(row: str, against: str, *path: str) -> dict[str, Any]:
        return _stats([value(s, row, *path) - value(s, against, *path) for s in seeds])

    def members_vs(row: str, against: str) -> dict[str, Any]:
        return _stats(
            [
                np.mean(s["rows"][row]["members_accuracy"])
                - np.mean(s["rows"][against]["members_accuracy"])
                for s in seeds
            ]
        )

    auroc = ("ood_mean", "msp", "auroc")
    rows = {}
    for row in (
        *ONE_BASE_HYDRA,
        "Hydra (fused deep ensemble)",
        "deep ensemble (one base)",
        "deep ensemble",
    ):
        rows[row] = {
            "member_accuracy_vs_single": members_vs(row, "single"),
            "disagreement": _stats([s["rows"][row]["disagreement"] for s in seeds]),
            "auroc_vs_single": paired(row, "single", *auroc),
            "auroc_vs_one_base_ensemble": paired(row, "deep ensemble (one base)", *auroc),
        }
    for row in rows:
        rows[row]["shift_ece_vs_one_base_ensemble"] = paired(
            "deep ensemble (one base)", row, "shift", "ece"
        )
        rows[row]["id_ece_vs_single"] = paired("single", row, "id", "ece")
    # one-base rows better calibrated under shift than the one-base ensemble on every seed, by
    # ECE and by NLL
    under_shift = [
        r
        for r in ONE_BASE_HYDRA
        if all(
            _get(s["rows"][r], ("shift", m))
            < _get(s["rows"]["deep ensemble (one base)"], ("shift", m))
            for s in seeds
            for m in ("ece", "nll")
        )
    ]
    ceiling = rows["deep ensemble (one base)"]["auroc_vs_single"]
    best = max(ONE_BASE_HYDRA, key=lambda r: rows[r]["auroc_vs_single"]["mean"])
    latency = report["latency"]
    return {
        "one_base_ceiling": {
            **ceiling,
            "seeds_above_1_point": sum(v > 0.01 for v in ceiling["values"]),
        },
        "pruned_member": {
            "accuracy": paired("single Taylor-pruned", "single", "id", "accuracy"),
            "auroc": paired("single Taylor-pruned", "single", *auroc),
        },
        "best_one_base_row": best,
        "better_calibrated_under_shift_than_one_base_ensemble": under_shift,
        "rows": rows,
        "fused": {
            "member_accuracy_vs_deep_ensemble": members_vs(
                "Hydra (fused deep ensemble)", "deep ensemble"
            ),
            "auroc_vs_deep_ensemble": paired(
                "Hydra (fused deep ensemble)", "deep ensemble", *auroc
            ),
            "latency_over_deep_ensemble": latency["Hydra (fused deep ensemble)"]["ratio"]
            / latency["deep ensemble"]["ratio"],
        },
        "costs": costs,
    }


def diagnosis_markdown(d: dict[str, Any]) -> list[str]:
    """The "why" section of report.md: a table of the measurements and what they imply."""

    def pts(cell: dict[str, Any]) -> str:
        return f"{cell['mean'] * 100:+.2f} ± {cell['std'] * 100:.2f}"

    rows, c, f = d["rows"], d["costs"], d["fused"]
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
    for row, r in rows.items():
        lines.append(
            f"| {row} | {pts(r['member_accuracy_vs_single'])} | "
            f"{r['disagreement']['mean'] * 100:.2f} | {pts(r['auroc_vs_single'])} | "
            f"{pts(r['auroc_vs_one_base_ensemble'])} |"
        )
    ceiling, pruned, best = d["one_base_ceiling"], d["pruned_member"], d["best_one_base_row"]
    n = len(ceiling["values"])
    one_base = rows["deep ensemble (one base)"]
    lines += [
        "",
        f"- **The ceiling of one base.** M unpruned fine-tunes of one base beat the single model "
        f"by {pts(ceiling)} AUROC points (above +1 on {ceiling['seeds_above_1_point']}/{n} "
        f"seeds); their members disagree on {one_base['disagreement']['mean'] * 100:.2f}% of the "
        f"test examples, against {rows['deep ensemble']['disagreement']['mean'] * 100:.2f}% for "
        "independently trained members, whose ensemble beats the single model by "
        f"{pts(rows['deep ensemble']['auroc_vs_single'])}. Every one-base Hydra row's members are pruned fine-tunes "
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
        ),
        f"- **The price of pruning.** One member alone (single Taylor-pruned) is "
        f"{pts(pruned['accuracy'])} accuracy and {pts(pruned['auroc'])} AUROC points against the "
        f"single model. The best one-base row, {best}, has members at "
        f"{pts(rows[best]['member_accuracy_vs_single'])} accuracy points and disagreeing on "
        f"{rows[best]['disagreement']['mean'] * 100:.2f}% of examples; it ends "
        f"{pts(rows[best]['auroc_vs_single'])} AUROC points against the single model and "
        f"{pts(rows[best]['auroc_vs_one_base_ensemble'])} against the one-base ensemble"
        + (
            ": members that disagree more because each is weaker do not separate OOD inputs better."
            if rows[best]["disagreement"]["mean"] > one_base["disagreement"]["mean"]
            and rows[best]["auroc_vs_one_base_ensemble"]["mean"] < 0
            else "."
        ),
        f"- **The fused deep ensemble** is {pts(f['auroc_vs_deep_ensemble'])} AUROC points against "
        f"the deep ensemble, its members {pts(f['member_accuracy_vs_deep_ensemble'])} accuracy "
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
        ),
    ]
    shift = d["better_calibrated_under_shift_than_one_base_ensemble"]
    if shift:
        lines.append(
            "- **Where the one-base rows pay: calibration under shift.** Better calibrated on the "
            "shifted test set than the one-base ensemble, by ECE and by NLL on every seed: "
            + "; ".join(
                f"{r} (ECE lower by "
                f"{pts(rows[r]['shift_ece_vs_one_base_ensemble']).lstrip('+')} points)"
                for r in shift
            )
            + ". In distribution their ECE against the single model's is "
            + ", ".join(f"{pts(rows[r]['id_ece_vs_single'])}" for r in shift)
            + " points (negative: worse): the gain is on shifted inputs only."
        )
    return lines
    return lines


def _pm(cell: dict[str, Any], scale: float = 1.0, digits: int = 2) -> str:
    return f"{cell['mean'] * scale:.{digits}f} ± {cell['std'] * scale:.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    agg, task = report["aggregate"], report["task"]
    n = report["settings"]["seeds"]
    lines = [
        f"# {task['title']}",
        "",
        f"Produced by `{report['command']}` on {report['finished']} "
        f"({report['seconds'] / 60:.1f} min, {n} seed(s); mean ± std over seeds; "
        f"{report['environment']['cpu_model']}, {report['environment']['torch_threads']} threads)"
        + (
            f"; the derived tables re-rendered from its measurements with `--render` on "
            f"{report['rendered']}."
            if "rendered" in report
            else "."
        ),
        "",
        task["summary"],
        "",
        "## In-distribution test set, and OOD detection averaged over the OOD sets",
        "",
        "Accuracy, ECE, AUROC, AUPR and FPR95 in %. OOD positive; MSP and mutual information (MI) "
        "as the OOD score; MI is zero for one model.",
        "",
        "| row | accuracy | ECE | NLL | Brier | AUROC MSP | AUROC MI | AUPR MSP | FPR95 MSP | "
        "FPR95 MI | params | latency x | train steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in ROWS:
        a = agg[row]
        mi = a["ood_mean"].get("mutual_information")
        lines.append(
            f"| {row} | {_pm(a['id']['accuracy'], 100)} | {_pm(a['id']['ece'], 100)} | "
            f"{_pm(a['id']['nll'], 1, 3)} | {_pm(a['id']['brier'], 1, 3)} | "
            f"{_pm(a['ood_mean']['msp']['auroc'], 100)} | "
            f"{_pm(mi['auroc'], 100) if mi else '—'} | {_pm(a['ood_mean']['msp']['aupr'], 100)} | "
            f"{_pm(a['ood_mean']['msp']['fpr95'], 100)} | {_pm(mi['fpr95'], 100) if mi else '—'} | "
            f"{report['parameters'][row] / 1e6:.3f} M | {report['latency'][row]['ratio']:.2f} | "
            f"{report['train_steps'][row]} |"
        )
    lines += [
        "",
        "## Members: each member's own accuracy and how often two members disagree",
        "",
        "Member accuracy in % (mean over seeds, per member); disagreement = fraction of test "
        "examples on which two members' argmaxes differ, averaged over pairs, in %.",
        "",
        "| row | member accuracy | disagreement |",
        "|---|---|---|",
    ]
    for row in ROWS:
        a = agg[row]
        accs = ", ".join(f"{v['mean'] * 100:.1f}" for v in a["members_accuracy"].values())
        dis = _pm(a["disagreement"], 100) if "disagreement" in a else "—"
        lines.append(f"| {row} | {accs} | {dis} |")
    lines += ["", "## Per OOD set (AUROC / FPR95 in %, MSP; MI in brackets)", ""]
    names = list(task["ood"])
    lines.append("| row | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    for row in ROWS:
        cells = []
        for name in names:
            per = agg[row]["ood"][name]
            cell = f"{_pm(per['msp']['auroc'], 100, 1)} / {_pm(per['msp']['fpr95'], 100, 1)}"
            if "mutual_information" in per:
                mi = per["mutual_information"]
                cell += f" [{_pm(mi['auroc'], 100, 1)} / {_pm(mi['fpr95'], 100, 1)}]"
            cells.append(cell)
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"## Under shift: {task['shift']}",
        "",
        "| row | accuracy | ECE | NLL | Brier |",
        "|---|---|---|---|---|",
    ]
    for row in ROWS:
        s = agg[row]["shift"]
        lines.append(
            f"| {row} | {_pm(s['accuracy'], 100)} | {_pm(s['ece'], 100)} | "
            f"{_pm(s['nll'], 1, 3)} | {_pm(s['brier'], 1, 3)} |"
        )
    lines += [
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
    lines += [
        "",
        "## Pareto fronts (rows no other row beats on both the metric and the cost)",
        "",
        "| metric vs cost | front (cheapest first) |",
        "|---|---|",
        *(f"| {k} | {', '.join(v)} |" for k, v in report["pareto"].items()),
        "",
        "See `pareto.png`.",
    ]
    if "diagnosis" in report:
        lines += diagnosis_markdown(report["diagnosis"])
    lines += ["", "## Setup", ""]
    lines += [f"- {k}: {v}" for k, v in task["details"].items()]
    r = report["settings"]["recipe"]
    lines += [
        f"- recipe: {r['base_steps']} base steps at lr {r['base_lr']:g} then {r['finetune_steps']} "
        f"fine-tuning steps at lr {r['finetune_lr']:g}, batch {r['batch_size']}, warm-up "
        f"{r['warmup_steps']}, AdamW (weight decay 0.05), cosine decay; M = {r['members']}, "
        f"{r['heads_per_member']} heads per member per layer; MC dropout {r['mc_samples']} passes",
        f"- latency: PyTorch CPU, batch {r['latency_batch']}, median over {r['latency_rounds']} "
        "interleaved rounds of the ratio to the single model (seed 0's models)",
        "- mean wall-clock seconds per seed: "
        + ", ".join(f"{k} {v:.0f}" for k, v in report["seconds_per_stage"].items()),
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# plots


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
    fig.tight_layout()
    fig.savefig(out / "pareto.png", dpi=90)
    plt.close(fig)
    return "pareto.png"


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

    written = []
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
    fig.tight_layout()
    fig.savefig(out / "reliability.png", dpi=90)
    plt.close(fig)
    written.append("reliability.png")

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
    fig.tight_layout()
    fig.savefig(out / "score_histograms.png", dpi=90)
    plt.close(fig)
    written.append("score_histograms.png")

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
    fig.tight_layout()
    fig.savefig(out / "auroc.png", dpi=90)
    plt.close(fig)
    written.append("auroc.png")
    return written


# --------------------------------------------------------------------------------------------------
# the run


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
    per_seed, pooled = [], {row: {} for row in ROWS}
    lat, params = None, None
    for seed in range(args.seeds):
        seed_start = time.perf_counter()
        models, info = build_rows(task, seed, args)
        eval_start = time.perf_counter()
        logits = evaluate_rows(task, models, seed)
        info["seconds"]["evaluation"] = time.perf_counter() - eval_start
        rows = {row: score_row(logits[row], task) for row in ROWS}
        for row in ROWS:
            for split, v in logits[row].items():
                pooled[row][split] = (
                    v if split not in pooled[row] else np.concatenate([pooled[row][split], v])
                )
        if seed == 0:
            lat = latency(task, models)
            params = {
                row: (sum(_parameters(e) for e in m) if isinstance(m, list) else _parameters(m))
                for row, m in models.items()
            }
            params["MC dropout"] = params["single"]
        info["seconds"]["total"] = time.perf_counter() - seed_start
        per_seed.append({"seed": seed, "rows": rows, **info})
        note(
            args,
            f"  seed {seed}: done in {info['seconds']['total']:.0f} s; single acc "
            f"{rows['single']['id']['accuracy']:.3f}, Hydra (Taylor) "
            f"{rows['Hydra (Taylor)']['id']['accuracy']:.3f}, circuit "
            f"{rows['Hydra (circuit)']['id']['accuracy']:.3f}",
        )

    args.out.mkdir(parents=True, exist_ok=True)
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
    }
    return finish(report, task, args)


def finish(report: dict[str, Any], task: Task, args: argparse.Namespace) -> int:
    """Everything derived from the measurements (claims, targets, Pareto fronts, the latency
    target, the "why" section, ``pareto.png``), then report.json and report.md."""
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
    plot = pareto_plot(args.out, report)
    if plot not in report["figures"]:
        report["figures"].append(plot)
    report = json.loads(json.dumps(report, default=_jsonable))
    atomic_write_json(args.out / "report.json", report)
    text = markdown(report)
    atomic_write_text(args.out / "report.md", text)
    print(text)
    note(args, f"wrote {args.out}/report.json, report.md and {', '.join(report['figures'])}")
    return 0


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
        for k in ("per_seed", "latency", "parameters", "aggregate", "task", "figures")
        if k not in report
    ]
    if missing or set(report.get("rows", ())) != set(ROWS):
        raise SystemExit(
            f"--render: {path} was written by another version of the benchmark "
            f"(missing {', '.join(missing) or 'rows of this version'}); run it again "
            "with --overwrite"
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


def _jsonable(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON-able: {type(value).__name__}")
