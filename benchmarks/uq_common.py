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
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import load_average, machine, note

from hydra_deploy.atomic import atomic_path, atomic_write_json, atomic_write_text
from hydra_deploy.backbones import load_backbone
from hydra_deploy.decisions import (
    GRID_SIZE,
    accept_mask,
    calibrated_scores,
    class_room,
    conformal_quantile,
    fit_ood,
    fit_raps,
    fit_selective,
    fit_temperature,
    ood_mask,
    selective_grid,
    selective_start,
    set_members,
)
from hydra_deploy.errors import DataError
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
    "mean_size": False,
    "answered": True,
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
    #: the batch of a fused model's evaluation (None: ``eval_batch``); a fused text model runs
    #: faster on CPU in smaller batches than one model does
    eval_batch_fused: int | None = None
    #: the in-distribution test set is split at random, ``splits`` times per seed, into a
    #: temperature part, a quantile part and the tested rest (:func:`decide_row`)
    calibration_temperature: int = 200
    calibration_quantile: int = 200
    splits: int = 200


@dataclass
class Task:
    """One benchmark: its data (tensors), how to make a fresh model, and the recipe."""

    name: str
    classes: list[str]
    train: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]
    #: shifted copies of the first ``len(shift)`` test examples, in order, with their labels
    shift: tuple[torch.Tensor, torch.Tensor]
    ood: dict[str, torch.Tensor]
    new_model: Callable[[int], Any]  # seed -> a backbone adapter (untrained or pretrained)
    recipe: Recipe
    description: dict[str, Any] = field(default_factory=dict)
    text: bool = False
    #: OOD inputs used only to choose heads (circuit, objective "ood"): one family, of another kind
    #: than every test OOD set; never evaluated as a test set.
    ood_validation: tuple[str, torch.Tensor] | None = None
    #: the alpha of the decision claims: one whose 1 - alpha is above the single model's accuracy
    claim_alpha: float = 0.05
    #: quantile-part sizes whose decisions are measured beside the recipe's (the same splits'
    #: temperature part, another quantile part, the rest tested)
    extra_quantile_parts: tuple[int, ...] = ()


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
    taylor = select(bases[0], "taylor", task.train, seed, r, _sub(cache, "taylor.json"))
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
    circuit = select(single, "circuit", task.train, seed, r, _sub(cache, "circuit.json"))
    info["seconds"]["circuit selection"] = time.perf_counter() - started
    started = time.perf_counter()
    circuit_base = select(
        bases[0], "circuit", task.train, seed, r, _sub(cache, "circuit_base.json")
    )
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
        circuit_ood = cached_selection(
            _sub(cache, "circuit_ood.json"),
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
        own = cached_selection(
            _sub(cache, f"fused{m}.json"),
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
    backbone: Any, method: str, data: tuple, seed: int, recipe: Recipe, cache: Path | None
) -> HydraSpec:
    """``select_members`` with the recipe's counts (members come out distinct by construction)."""
    examples = recipe.taylor_examples if method == "taylor" else recipe.circuit_examples
    return cached_selection(
        cache,
        backbone,
        recipe.members,
        heads_per_member=recipe.heads_per_member,
        method=method,
        data=data,
        seed=seed,
        max_examples=examples,
    )


def _tensors_hash(*tensors: torch.Tensor) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach().cpu().contiguous()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def cached_selection(cache: Path | None, backbone: Any, members: int, **options: Any) -> HydraSpec:
    """``select_members(backbone, members, **options)``, stored in ``cache`` (a .json file) with
    its settings and the hashes of the backbone's weights and of the data; a later call with the
    same ones loads the spec instead of selecting again (circuit selection is minutes on a CPU).
    ``data`` and ``ood_data`` are tensors or tuples of tensors."""
    if cache is None:
        return select_members(backbone, members, **options)
    settings: dict[str, Any] = {"members": members}
    for key, value in sorted(options.items()):
        if key in ("data", "ood_data"):
            value = _tensors_hash(*(value if isinstance(value, tuple) else (value,)))
        settings[key] = value
    settings["backbone"] = _tensors_hash(*backbone.module.state_dict().values())
    if cache.is_file():
        stored = json.loads(cache.read_text())
        if stored.get("settings") == settings:
            return HydraSpec.from_dict(stored["spec"])
    spec = select_members(backbone, members, **options)
    cache.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(cache, {"settings": settings, "spec": spec.to_dict()})
    return spec


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
    seen: dict[int, dict[str, np.ndarray]] = {}  # a model in two rows (the single model is
    # member 0 of the deep ensemble) is evaluated once

    def of(model: Any) -> dict[str, np.ndarray]:
        if id(model) not in seen:
            fused = isinstance(model, HydraModel) and r.eval_batch_fused is not None
            batch = r.eval_batch_fused if fused else r.eval_batch
            seen[id(model)] = {
                s: member_logits(model, x, batch, task.text) for s, x in sets.items()
            }
        return seen[id(model)]

    logits: dict[str, dict[str, np.ndarray]] = {}
    for row, model in models.items():
        if isinstance(model, list):  # the deep ensembles: one model per member
            logits[row] = {s: np.concatenate([of(m)[s] for m in model], axis=1) for s in sets}
        else:
            logits[row] = of(model)
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
        try:
            diffs = [
                (_get(s[key][row], path) - _get(s[key][against], path)) * (1 if higher else -1)
                for s in per_seed
            ]
        except (KeyError, TypeError):  # an alpha too small for the quantile part
            out.append(
                {
                    "claim": claim,
                    "row": row,
                    "against": against,
                    "metric": ".".join(path),
                    "margin": margin,
                    "verdict": "not available (the metric was not measured)",
                }
            )
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
    if "decision_aggregate" in report:
        lines += decisions_markdown(report)
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
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# decisions: temperature scaling, prediction sets, answer-or-abstain, the OOD flag

#: the levels of the prediction sets (coverage 1 - alpha)
ALPHAS = (0.01, 0.02, 0.05, 0.1)
SET_METHODS = ("lac", "aps", "raps")
#: answer or abstain: the selective risk certified (the claims' and the tables'), the other risks
#: measured beside it, and the chance it is allowed to fail
TARGET_RISK = 0.05
OTHER_RISKS = (0.1,)
DELTA = 0.1
#: the OOD flag: at most this share of in-distribution inputs flagged
OOD_ALPHA = 0.05
#: the coverages at which the risk-coverage curve is read
CURVE_COVERAGE = tuple(round(0.05 * i, 2) for i in range(1, 21))
#: the splits' random generator is seeded by (SPLIT_SEED, seed)
SPLIT_SEED = 2025
LOGITS_FILE = "logits.npz"


def alpha_key(alpha: float) -> str:
    return f"{alpha:g}"


def split_parts(
    count: int, recipe: Recipe, seed: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``recipe.splits`` random (temperature rows, quantile rows, tested rows) of ``count``
    in-distribution test examples, the same for every row of a seed (paired comparisons)."""
    t, q = recipe.calibration_temperature, recipe.calibration_quantile
    if t < 1 or q < 1 or count - t - q < 1:
        raise ValueError(
            f"the in-distribution test set ({count} examples) cannot be split into a temperature "
            f"part of {t}, a quantile part of {q} and a tested part of at least one example"
        )
    rng = np.random.default_rng([SPLIT_SEED, seed])
    parts = []
    for _ in range(recipe.splits):
        order = rng.permutation(count)
        parts.append((np.sort(order[:t]), np.sort(order[t : t + q]), np.sort(order[t + q :])))
    return parts


def _sets(
    room: np.ndarray,
    top: np.ndarray,
    method: str,
    qhat: float,
    rows: np.ndarray | slice = slice(None),
) -> np.ndarray:
    """The library's sets (:func:`~hydra_deploy.decisions.set_members`) of ``rows`` from a class
    room computed once per split."""
    return set_members(room[rows], qhat, None if method == "lac" else top[rows])


def certify(
    confidence: np.ndarray,
    correct: np.ndarray,
    grid: np.ndarray,
    start: int,
    target_risk: float = TARGET_RISK,
    procedure: str = "graph",
) -> float | None:
    """:func:`~hydra_deploy.decisions.fit_selective`'s threshold at ``target_risk`` and DELTA
    (the library's default procedure, started at ``start``, or ``procedure``), or None where it
    refuses."""
    try:
        tau, _ = fit_selective(
            confidence, correct, grid, target_risk, DELTA, start=start, procedure=procedure
        )
    except DataError:
        return None
    return tau


def _risk_curve(confidence: np.ndarray, errors: np.ndarray) -> list[float]:
    """Selective risk of the most confident ``c`` share, at each coverage of CURVE_COVERAGE."""
    order = np.argsort(-confidence, kind="stable")
    cumulative = np.cumsum(errors[order])
    answered = np.maximum(1, np.ceil(np.asarray(CURVE_COVERAGE) * len(order) - 1e-9).astype(int))
    return [float(v) for v in cumulative[answered - 1] / answered]


def decide_row(
    logits: dict[str, np.ndarray],
    labels: np.ndarray,
    parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
    seed: int = 0,
) -> dict[str, Any]:
    """Temperature scaling and every decision of :mod:`hydra_deploy.decisions` for one row of one
    seed, over the random splits ``parts`` of the in-distribution test set.

    ``logits``: member logits per evaluation set (``id``, ``shift`` aligned with the first
    ``len(shift)`` ID examples, ``ood:<name>``). Per split: T fitted on the temperature part
    (:func:`fit_temperature`); RAPS's parameters and the selective grid on it too; every quantile
    (set thresholds per method and alpha, the selective threshold at TARGET_RISK and DELTA, the
    OOD threshold at OOD_ALPHA) on the quantile part; every metric on the tested part, on the
    shifted copies of the tested examples and on the OOD sets. Returns the means over splits
    (and the spread over splits of the coverages); an alpha too small for the quantile part is
    reported ``available: False`` with the reason."""
    y = np.asarray(labels, dtype=np.int64)
    shift_count = len(logits["shift"])
    oods = [k for k in logits if k.startswith("ood:")]
    raw = {k: calibrated_scores(v, 1.0) for k, v in logits.items()}
    values: dict[tuple, list] = {}
    refused: dict[tuple, str] = {}

    def put(key: tuple, value: Any) -> None:
        values.setdefault(key, []).append(value)

    for index, (t, q, tested) in enumerate(parts):
        temperature = fit_temperature(logits["id"][t], y[t])
        put(("temperature",), temperature)
        cal = {k: calibrated_scores(v, temperature) for k, v in logits.items()}
        shifted = tested[tested < shift_count]
        ys = y[shifted]
        # temperature-scaled metrics beside the raw ones, on the tested part
        for tag, sc in (("raw", raw), ("scaled", cal)):
            for where, s_id, rows, yy in (
                ("test", sc["id"], tested, y[tested]),
                ("shift", sc["shift"], shifted, ys),
            ):
                probs = s_id["probs"][rows]
                put(
                    ("scaling", where, tag, "accuracy"),
                    float((s_id["prediction"][rows] == yy).mean()),
                )
                put(("scaling", where, tag, "nll"), nll(probs, yy))
                put(("scaling", where, tag, "ece"), ece(probs, yy))
            for k in oods:
                m = ood_metrics(-sc["id"]["msp"][tested], -sc[k]["msp"])
                for metric in ("auroc", "fpr95"):
                    put(("scaling", "ood", k[4:], tag, metric), m[metric])
        # prediction sets
        tops = {k: v["prediction"] for k, v in cal.items()}
        rooms_cache: dict[tuple, dict[str, np.ndarray]] = {}
        for method in SET_METHODS:
            for alpha in ALPHAS:
                key = ("sets", method, alpha_key(alpha))
                if key in refused:
                    continue
                try:
                    lam, k_reg = (
                        fit_raps(cal["id"]["probs"][t], y[t], alpha)
                        if method == "raps"
                        else (0.0, 0)
                    )
                    if (method, lam, k_reg) not in rooms_cache:
                        rooms_cache[(method, lam, k_reg)] = {
                            k: class_room(v["probs"], method, lam=lam, k_reg=k_reg)
                            for k, v in cal.items()
                        }
                    rooms = rooms_cache[(method, lam, k_reg)]
                    qhat = conformal_quantile(1.0 - rooms["id"][q, y[q]], alpha)
                except DataError as err:
                    refused[key] = str(err)
                    continue
                sets = _sets(rooms["id"], tops["id"], method, qhat, tested)
                sizes = sets.sum(axis=1)
                put((*key, "coverage"), float(sets[np.arange(len(tested)), y[tested]].mean()))
                put((*key, "mean_size"), float(sizes.mean()))
                put((*key, "empty"), float((sizes == 0).mean()))
                if method == "raps":
                    put((*key, "lam"), lam)
                    put((*key, "k_reg"), k_reg)
                if len(shifted):
                    sets = _sets(rooms["shift"], tops["shift"], method, qhat, shifted)
                    put((*key, "shift_coverage"), float(sets[np.arange(len(ys)), ys].mean()))
                    put((*key, "shift_mean_size"), float(sets.sum(axis=1).mean()))
                for k in oods:
                    sets = _sets(rooms[k], tops[k], method, qhat)
                    put((*key, "ood_mean_size", k[4:]), float(sets.sum(axis=1).mean()))
        # answer or abstain at TARGET_RISK (msp), and at OTHER_RISKS
        msp = {k: v["msp"] for k, v in cal.items()}
        correct = tops["id"] == y
        grid = selective_grid(msp["id"][t])
        for risk_level in (TARGET_RISK, *OTHER_RISKS):
            start = selective_start(msp["id"][t], correct[t], grid, risk_level, len(q))
            certified = certify(msp["id"][q], correct[q], grid, start, risk_level)
            head = (
                ("selective",) if risk_level == TARGET_RISK else ("selective_at", f"{risk_level:g}")
            )
            put((*head, "refused"), float(certified is None))
            # what Bonferroni alone (the test before the graph test) answers on the same split
            before = certify(msp["id"][q], correct[q], grid, start, risk_level, "bonferroni")
            put(
                (*head, "bonferroni_answered"),
                0.0
                if before is None
                else float(accept_mask(msp["id"][tested], "msp", before).mean()),
            )
            wheres = (
                ("", msp["id"][tested], correct[tested]),
                ("shift_", msp["shift"][shifted], tops["shift"][shifted] == ys),
            )
            # the guarantee against a known population: the examples outside the temperature
            # part are the population, a quantile part is drawn from it with replacement (iid),
            # and the risk at its tau is the population's (no finite tested part, no overlap)
            population = np.setdiff1d(np.arange(len(y)), t)
            draw = np.random.default_rng([SPLIT_SEED, seed, index, 1]).choice(
                population, len(q), replace=True
            )
            drawn = certify(msp["id"][draw], correct[draw], grid, start, risk_level)
            if drawn is not None:  # refused: abstain on everything, no risk taken
                answered = accept_mask(msp["id"][population], "msp", drawn)
                wrong = ~correct[population][answered]
                drawn_risk = float(wrong.mean()) if answered.any() else 0.0
            put((*head, "population_exceeds"), float(drawn is not None and drawn_risk > risk_level))
            for where, conf, ok in wheres if risk_level == TARGET_RISK else wheres[:1]:
                # none certified: abstain on everything
                answered = (
                    np.zeros(len(conf), bool)
                    if certified is None
                    else accept_mask(conf, "msp", certified)
                )
                risk = float((~ok[answered]).mean()) if answered.any() else None
                put((*head, f"{where}answered"), float(answered.mean()))
                put((*head, f"{where}risk"), risk)
                put((*head, f"{where}exceeds"), float(risk is not None and risk > risk_level))
            if risk_level != TARGET_RISK:
                continue
            for k in oods:
                answered = (
                    np.zeros(len(msp[k]), bool)
                    if certified is None
                    else accept_mask(msp[k], "msp", certified)
                )
                put(("selective", "ood_answered", k[4:]), float(answered.mean()))
        put(("selective", "curve"), _risk_curve(msp["id"][tested], ~correct[tested]))
        # the OOD flag at OOD_ALPHA (msp)
        try:
            threshold = fit_ood(-msp["id"][q], OOD_ALPHA)
        except DataError as err:
            refused[("ood_flag",)] = str(err)
            continue
        put(("ood_flag", "test"), float(ood_mask(-msp["id"][tested], threshold).mean()))
        put(("ood_flag", "shift"), float(ood_mask(-msp["shift"][shifted], threshold).mean()))
        for k in oods:
            put(("ood_flag", "ood", k[4:]), float(ood_mask(-msp[k], threshold).mean()))

    out: dict[str, Any] = {"splits": len(parts)}
    for key, got in values.items():
        if key[-1] == "curve":
            _set_path(out, key, [float(v) for v in np.mean(got, axis=0)])
            continue
        present = [v for v in got if v is not None]
        _set_path(out, key, float(np.mean(present)) if present else None)
        if key[-1] in ("coverage", "shift_coverage", "temperature"):
            _set_path(out, (*key[:-1], f"{key[-1]}_std"), float(np.std(got)))
    for tag in ("raw", "scaled"):
        for metric in ("auroc", "fpr95"):
            _set_path(
                out,
                ("scaling", "ood_mean", tag, metric),
                float(np.mean([out["scaling"]["ood"][k[4:]][tag][metric] for k in oods])),
            )
    for key, reason in refused.items():
        if key[-1] == "reason":
            _set_path(out, key, reason)
        else:
            _set_path(out, key, {"available": False, "reason": reason})
    for method in SET_METHODS:
        for alpha in ALPHAS:
            cell = out["sets"][method][alpha_key(alpha)]
            cell.setdefault("available", True)
    return out


def _decide_one(
    job: tuple[dict[str, np.ndarray], np.ndarray, tuple[int, int, int], int],
) -> dict[str, Any]:
    logits, labels, sizes, seed = job
    t, q, splits = sizes
    recipe = Recipe(0, 0.0, 0, 0.0, 1, 0)
    recipe.calibration_temperature, recipe.calibration_quantile, recipe.splits = t, q, splits
    return decide_row(logits, labels, split_parts(len(labels), recipe, seed), seed)


def decisions(
    logits: dict[int, dict[str, dict[str, np.ndarray]]],
    labels: np.ndarray,
    recipe: Recipe,
    workers: int = 1,
) -> dict[int, dict[str, Any]]:
    """:func:`decide_row` for every seed and row of ``logits`` [seed][row][set], in ``workers``
    processes (the results do not depend on it)."""
    sizes = (recipe.calibration_temperature, recipe.calibration_quantile, recipe.splits)
    keys = [(seed, row) for seed in logits for row in ROWS]
    jobs = [(logits[seed][row], labels, sizes, seed) for seed, row in keys]
    if workers > 1 and len(jobs) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("spawn")  # no fork of a process running torch
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context) as pool:
            results = list(pool.map(_decide_one, jobs))
    else:
        results = [_decide_one(job) for job in jobs]
    out: dict[int, dict[str, Any]] = {}
    for (seed, row), result in zip(keys, results, strict=True):
        out.setdefault(seed, {})[row] = result
    return out


def _tree_stats(trees: Sequence[Any]) -> Any:
    """Mean, std (ddof 1) and values over seeds of every number of ``trees`` (the same shape);
    lists element by element; None skipped; anything else (a reason) taken from the first."""
    first = trees[0]
    if isinstance(first, dict):
        return {
            k: _tree_stats([t[k] for t in trees if isinstance(t, dict) and k in t]) for k in first
        }
    if isinstance(first, list):
        return [_tree_stats([t[i] for t in trees]) for i in range(len(first))]
    if isinstance(first, bool) or (not isinstance(first, (int, float)) and first is not None):
        return first
    present = [float(v) for v in trees if v is not None]
    if not present:
        return None
    return _stats(present)


def save_logits(
    path: Path, logits: dict[int, dict[str, dict[str, np.ndarray]]], task: Task
) -> None:
    """Every seed's member logits per row and evaluation set (float16) and the labels, written
    atomically: what ``--render`` recomputes the decisions from."""
    arrays = {
        f"{seed}/{row}/{s}": v.astype(np.float16)
        for seed, rows in logits.items()
        for row, sets in rows.items()
        for s, v in sets.items()
    }
    arrays["labels/id"] = task.test[1].numpy().astype(np.int64)
    arrays["labels/shift"] = task.shift[1].numpy().astype(np.int64)
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        np.savez_compressed(handle, **arrays)


def load_logits(path: Path) -> tuple[dict[int, dict[str, dict[str, np.ndarray]]], np.ndarray]:
    """(logits [seed][row][set] as float64, the ID labels) of :func:`save_logits`."""
    logits: dict[int, dict[str, dict[str, np.ndarray]]] = {}
    with np.load(path) as stored:
        labels = stored["labels/id"]
        for name in stored.files:
            if name.startswith("labels/"):
                continue
            seed, row, s = name.split("/", 2)
            logits.setdefault(int(seed), {}).setdefault(row, {})[s] = stored[name].astype(
                np.float64
            )
    return logits, labels


def decision_claims(alpha: float) -> tuple[tuple, ...]:
    """(claim, row, against, path, margin) of the decisions, at the claim alpha."""
    size = ("sets", "lac", alpha_key(alpha), "mean_size")
    answered = ("selective", "answered")
    pct = f"{(1 - alpha) * 100:g}%"
    return tuple(
        (
            f"{row} + T {verb} {against} + T",
            row,
            against,
            path,
            0.0,
        )
        for row in ("Hydra (Taylor)", "Hydra (Taylor, grouped MLP)", "Hydra (fused deep ensemble)")
        for against in ("single", "deep ensemble")
        for path, verb in (
            (size, f"gives smaller {pct} LAC sets than"),
            (answered, f"answers more at {TARGET_RISK:.0%} selective risk than"),
        )
    )


def decision_targets(alpha: float) -> tuple[tuple, ...]:
    size = ("sets", "lac", alpha_key(alpha), "mean_size")
    answered = ("selective", "answered")
    pct = f"{(1 - alpha) * 100:g}%"
    return (
        (
            f"Hydra (Taylor) + T gives smaller mean {pct} LAC sets than single + T",
            "Hydra (Taylor)",
            "single",
            size,
            0.0,
        ),
        (
            f"Hydra (Taylor) + T answers more at {TARGET_RISK:.0%} selective risk than single + T",
            "Hydra (Taylor)",
            "single",
            answered,
            0.0,
        ),
        (
            f"Hydra (fused deep ensemble) + T within 0.03 of the deep ensemble + T on the mean "
            f"{pct} LAC set size",
            "Hydra (fused deep ensemble)",
            "deep ensemble",
            size,
            -0.03,
        ),
        (
            f"Hydra (fused deep ensemble) + T within 0.03 of the deep ensemble + T on the share "
            f"answered at {TARGET_RISK:.0%} selective risk",
            "Hydra (fused deep ensemble)",
            "deep ensemble",
            answered,
            -0.03,
        ),
    )


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
    d, agg = report["decision_settings"], report["decision_aggregate"]
    alpha, key = d["claim_alpha"], alpha_key(d["claim_alpha"])
    oods = list(report["task"]["ood"])
    n_t, n_q, n_x, splits = d["temperature_part"], d["quantile_part"], d["tested_part"], d["splits"]
    single_acc = report["aggregate"]["single"]["id"]["accuracy"]["mean"]
    lines = [
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
        "| row | T | accuracy | NLL | ECE | shift accuracy | shift NLL | shift ECE |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in ROWS:
        sc = agg[row]["scaling"]
        lines.append(
            f"| {row} | {_dm(agg[row]['temperature'], 1, 2)} | "
            f"{_before_after(sc['test'], 'accuracy', 100, 2)} | "
            f"{_before_after(sc['test'], 'nll', 1, 3)} | {_before_after(sc['test'], 'ece', 100, 2)} | "
            f"{_before_after(sc['shift'], 'accuracy', 100, 2)} | "
            f"{_before_after(sc['shift'], 'nll', 1, 3)} | "
            f"{_before_after(sc['shift'], 'ece', 100, 2)} |"
        )
    lines += _temperature_notes(agg, n_t)
    lines += [
        "",
        "OOD detection with the calibrated MSP (raw → T; AUROC / FPR95 in %; mean over the OOD "
        "sets, then per set):",
        "",
        "| row | AUROC (mean) | FPR95 (mean) | " + " | ".join(f"AUROC {n}" for n in oods) + " |",
        "|---|---|---|" + "---|" * len(oods),
    ]
    for row in ROWS:
        sc = agg[row]["scaling"]
        lines.append(
            f"| {row} | {_before_after(sc['ood_mean'], 'auroc', 100, 2)} | "
            f"{_before_after(sc['ood_mean'], 'fpr95', 100, 2)} | "
            + " | ".join(_before_after(sc["ood"][n], "auroc", 100, 2) for n in oods)
            + " |"
        )
    lines += [
        "",
        "## Decisions: prediction sets, answer or abstain, the OOD flag (each row + T)",
        "",
        "On each split, with T from the temperature part (`hydra_deploy.decisions`):",
        "",
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
        "",
        f"Mean over the {splits} splits, then mean ± std over seeds, in % (set sizes in classes). "
        f"At alpha = {alpha:g}: 1 - alpha = {1 - alpha:.0%} is "
        + ("above" if 1 - alpha > single_acc else "NOT above")
        + f" the single model's accuracy ({single_acc * 100:.1f}%), so the sets must hold more "
        "than the top class to cover.",
        "",
        f"| row | LAC size | LAC coverage | APS size | APS coverage | RAPS size | RAPS coverage | "
        f"answered at {d['target_risk']:.0%} risk | risk of the answered | "
        + " | ".join(f"answered: {n}" for n in oods)
        + " | flagged: ID | "
        + " | ".join(f"flagged: {n}" for n in oods)
        + " |",
        "|---|" + "---|" * (9 + 2 * len(oods)),
    ]
    notes: dict[str, str] = {}
    for row in ROWS:
        a = agg[row]
        cells = []
        for method in SET_METHODS:
            cell = a["sets"][method][key]
            if cell.get("available") is False:
                notes[f"{method.upper()} at alpha {key}"] = cell["reason"]
                cells += ["n/a", "n/a"]
            else:
                cells += [_dm(cell["mean_size"], 1, 2), _dm(cell["coverage"])]
        sel, flag = a["selective"], a["ood_flag"]
        lines.append(
            f"| {row} | "
            + " | ".join(cells)
            + f" | {_dm(sel['answered'])} | {_dm(sel['risk'])} | "
            + " | ".join(_dm(sel["ood_answered"][n]) for n in oods)
            + f" | {_dm(flag.get('test'))} | "
            + " | ".join(_dm(flag.get("ood", {}).get(n)) for n in oods)
            + " |"
        )
    lines += _selective_notes(agg, d)
    lines += [
        "",
        "Mean set size (coverage in brackets) at every alpha, in classes (%):",
        "",
        "| row | method | " + " | ".join(f"alpha {alpha_key(a)}" for a in d["alphas"]) + " |",
        "|---|---|" + "---|" * len(d["alphas"]),
    ]
    for row in ROWS:
        for method in SET_METHODS:
            cells = []
            for a in d["alphas"]:
                cell = agg[row]["sets"][method][alpha_key(a)]
                if cell.get("available") is False:
                    notes[f"{method.upper()} at alpha {alpha_key(a)}"] = cell["reason"]
                    cells.append("n/a")
                else:
                    cells.append(
                        f"{cell['mean_size']['mean']:.2f} ({cell['coverage']['mean'] * 100:.1f})"
                    )
            lines.append(f"| {row} | {method.upper()} | " + " | ".join(cells) + " |")
    flag = agg["single"]["ood_flag"]
    if flag.get("available") is False:
        notes["the OOD flag"] = flag["reason"]
    if notes:
        lines += ["", "Not available:", ""]
        lines += [f"- {k}: {v}" for k, v in notes.items()]
    lines += [
        "",
        "Risk-coverage (`risk_coverage.png`): the error rate of the most confident share of the "
        "tested part (calibrated MSP), mean over splits and seeds, in %:",
        "",
        "| row | " + " | ".join(f"{c:.0%}" for c in (0.5, 0.8, 0.9, 1.0)) + " |",
        "|---|---|---|---|---|",
    ]
    grid = d["curve_coverage"]
    for row in ROWS:
        curve = agg[row]["selective"]["curve"]
        lines.append(
            f"| {row} | "
            + " | ".join(f"{curve[grid.index(c)]['mean'] * 100:.2f}" for c in (0.5, 0.8, 0.9, 1.0))
            + " |"
        )
    lines += [
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
        "| row | LAC coverage | APS coverage | RAPS coverage | spread over splits (LAC, "
        f"alpha {key}) | risk > {d['target_risk']:.0%} | refused | answered | flagged: ID |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    misses = []
    for row in ROWS:
        a = agg[row]
        cov = []
        for method in SET_METHODS:
            parts = []
            for al in d["alphas"]:
                cell = a["sets"][method][alpha_key(al)]
                if cell.get("available") is False:
                    parts.append("n/a")
                    continue
                mean = cell["coverage"]["mean"]
                parts.append(f"{mean * 100:.1f}")
                spread = cell["coverage_std"]["mean"] / np.sqrt(splits)
                if mean < 1 - al - 2 * spread:
                    misses.append(f"{row} {method.upper()} at alpha {alpha_key(al)}")
            cov.append(" / ".join(parts))
        lac = a["sets"]["lac"][key]
        spread = "n/a" if lac.get("available") is False else _dm(lac["coverage_std"])
        sel = a["selective"]
        lines.append(
            f"| {row} | {' | '.join(cov)} | {spread} | {_dm(sel['exceeds'])} | "
            f"{_dm(sel['refused'])} | {_dm(sel['answered'])} | {_dm(a['ood_flag'].get('test'))} |"
        )
    lines += [
        "",
        "Mean coverage below 1 - alpha by more than twice its Monte-Carlo error (std over splits "
        f"/ sqrt({splits})), seeds averaged: " + (", ".join(misses) if misses else "none") + ".",
        "",
        f"## Under shift: {report['task']['shift']} (no guarantee holds)",
        "",
        "The decisions fitted on in-distribution data, applied to the shifted copies of the tested "
        f"examples. Nothing is promised here: the coverage at alpha = {key} would be "
        f"{1 - alpha:.0%} on exchangeable data; this is what it is. In %, sizes in classes.",
        "",
        "| row | LAC coverage | LAC size | APS coverage | APS size | RAPS coverage | RAPS size | "
        f"answered at {d['target_risk']:.0%} | risk of the answered | splits with risk > "
        f"{d['target_risk']:.0%} | flagged as OOD |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in ROWS:
        a = agg[row]
        cells = []
        for method in SET_METHODS:
            cell = a["sets"][method][key]
            if cell.get("available") is False:
                cells += ["n/a", "n/a"]
            else:
                cells += [_dm(cell["shift_coverage"]), _dm(cell["shift_mean_size"], 1, 2)]
        sel = a["selective"]
        lines.append(
            f"| {row} | {' | '.join(cells)} | {_dm(sel['shift_answered'])} | "
            f"{_dm(sel['shift_risk'])} | {_dm(sel['shift_exceeds'])} | "
            f"{_dm(a['ood_flag'].get('shift'))} |"
        )
    lines += [
        *selective_markdown(report),
        "",
        "## Decision claims and targets, paired per seed (each row + T)",
        "",
        f"Alpha = {key}; set sizes in classes (advantage = how many fewer classes), answered "
        "share in points of %. A claim or target holds only where it holds on every seed.",
        "",
        "| claim | metric | advantage | per seed | verdict |",
        "|---|---|---|---|---|",
    ]

    def scale(c: dict[str, Any]) -> float:
        return 1.0 if c["metric"].endswith("mean_size") else 100.0

    for c in report["decision_claims"]:
        lines.append(_claim_line(c, scale(c), with_margin=False))
    lines += [
        "",
        "Targets (issue 25): the margin is what the advantage must exceed on every seed; "
        "'shortfall' is the worst seed's advantage minus the margin (negative: missed by that "
        "much).",
        "",
        "| target | metric | margin | advantage | per seed | shortfall | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in report["decision_targets"]:
        lines.append(_claim_line(c, scale(c), with_margin=True))
    return lines


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
    level = delta / 2 + delta / (2 * GRID_SIZE)  # the start's level, before any rejection
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
    fig.tight_layout()
    fig.savefig(out / "risk_coverage.png", dpi=90)
    plt.close(fig)
    return "risk_coverage.png"


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
    check_calibration(task)
    workers = min(args.workers or 1, args.seeds)
    if workers > 1 and args.cache is None:
        raise SystemExit(f"uq_{name}: --workers > 1 needs --cache (seed 0 is rebuilt from it)")
    if workers == 1:
        done, models = {}, None
        for seed in range(args.seeds):
            done[seed], kept = run_seed(task, seed, args)
            if seed == 0:
                models = kept  # latency below, measured on seed 0's models
            del kept
    else:
        done = run_seeds_parallel(task_factory, args, workers)
        started_rebuild = time.perf_counter()
        models, _ = build_rows(task, 0, args)  # from --cache: trained weights and selections
        note(
            args,
            f"  seed 0 rebuilt from {args.cache} ({time.perf_counter() - started_rebuild:.0f} s)",
        )
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
        row: (sum(_parameters(e) for e in m) if isinstance(m, list) else _parameters(m))
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
    """Everything derived from the measurements (claims, targets, Pareto fronts, the latency
    target, the "why" section, ``pareto.png``; the decisions, recomputed from ``logits.npz``),
    then report.json and report.md."""
    started = time.perf_counter()
    stored, labels = load_logits(args.out / report["logits"]["file"])
    workers = args.workers or args.threads or 1
    decided = decisions(stored, labels, task.recipe, workers=workers)
    for s in report["per_seed"]:
        s["decisions"] = decided[s["seed"]]
    report["decision_extra"] = {}
    for size in task.extra_quantile_parts:
        recipe = replace(task.recipe, calibration_quantile=size)
        extra = decisions(stored, labels, recipe, workers=workers)
        report["decision_extra"][str(size)] = {
            "quantile_part": size,
            "tested_part": len(labels) - recipe.calibration_temperature - size,
            "aggregate": {
                row: _tree_stats(
                    [
                        {k: v for k, v in extra[seed][row].items() if k != "scaling"}
                        for seed in sorted(extra)
                    ]
                )
                for row in ROWS
            },
        }
    alpha = task.claim_alpha
    report["decision_settings"] = {
        "alphas": list(ALPHAS),
        "claim_alpha": alpha,
        "methods": list(SET_METHODS),
        "target_risk": TARGET_RISK,
        "other_risks": list(OTHER_RISKS),
        "selective_procedure": "graph",
        "delta": DELTA,
        "ood_alpha": OOD_ALPHA,
        "temperature_part": task.recipe.calibration_temperature,
        "quantile_part": task.recipe.calibration_quantile,
        "tested_part": len(labels)
        - task.recipe.calibration_temperature
        - task.recipe.calibration_quantile,
        "splits": task.recipe.splits,
        "curve_coverage": list(CURVE_COVERAGE),
    }
    report["decision_aggregate"] = {
        row: _tree_stats([s["decisions"][row] for s in report["per_seed"]]) for row in ROWS
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
    for plot in (pareto_plot(args.out, report), risk_coverage_plot(args.out, report)):
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


def _jsonable(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON-able: {type(value).__name__}")
