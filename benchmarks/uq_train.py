"""The uncertainty benchmarks' models: forward passes, the training stages, every row of one seed
built (``build_rows``), its member logits on every evaluation set and its CPU latency."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import note
from uq_task import Recipe, Task

from hydra_deploy.atomic import atomic_write_json
from hydra_deploy.backbones import load_backbone
from hydra_deploy.families import get_family
from hydra_deploy.fusion import HydraModel, fuse
from hydra_deploy.pruning import finetune_members, select_members
from hydra_deploy.specs import HydraSpec


def _forward(model: Any, x: torch.Tensor) -> torch.Tensor:
    """Member logits [B, M, C] of a fused model or of one model (an adapter: M = 1)."""
    if isinstance(model, HydraModel):
        if get_family(model.family).text:  # stacked (input_ids, attention_mask)
            return model(x[:, 0], x[:, 1])
        return model(x)
    return model(x).unsqueeze(1)


def trim_padding(x: torch.Tensor, text: bool) -> torch.Tensor:
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
            out.append(_forward(model, trim_padding(x[idx], text)).double())
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


def parameter_count(model: Any) -> int:
    module = model if isinstance(model, HydraModel) else model.module
    return int(sum(p.numel() for p in module.parameters()))


@dataclass
class _SeedStages:
    """The training stages of one seed: each stage's seed (``seed * 100 + offset``), its cache
    entry under ``--cache``/seed<seed> and its wall-clock seconds in ``seconds``."""

    task: Task
    seed: int
    cache: Path | None
    seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        started = time.perf_counter()
        yield
        self.seconds[stage] = time.perf_counter() - started

    def train(
        self,
        adapter: Any,
        spec: HydraSpec,
        offset: int,
        entry: str,
        *,
        base: bool = False,
        **options: Any,
    ) -> list[Any]:
        """``train_stage`` of ``spec`` from ``adapter``: the recipe's base stage, or its
        fine-tuning stage."""
        r = self.task.recipe
        steps, lr = (r.base_steps, r.base_lr) if base else (r.finetune_steps, r.finetune_lr)
        return train_stage(
            adapter,
            spec,
            self.task.train,
            steps,
            lr,
            self.seed * 100 + offset,
            r,
            _sub(self.cache, entry),
            **options,
        )

    def base_model(self, m: int) -> Any:
        """Base model ``m``: a fresh model trained the recipe's base steps, all heads."""
        fresh = self.task.new_model(self.seed * 100 + m)
        return self.train(fresh, full_spec(fresh), m, f"base{m}", base=True)[0]

    def select(self, backbone: Any, method: str, entry: str) -> HydraSpec:
        return select(
            backbone, method, self.task.train, self.seed, self.task.recipe, _sub(self.cache, entry)
        )


def _circuit_ood(stages: _SeedStages, single: Any) -> HydraSpec:
    """Circuit selection on the single model with the OOD objective on the task's OOD
    validation family (never a test set)."""
    task, r = stages.task, stages.task.recipe
    if task.ood_validation is None:
        raise ValueError(f"task {task.name} has no ood_validation family")
    return cached_selection(
        _sub(stages.cache, "circuit_ood.json"),
        single,
        r.members,
        heads_per_member=r.heads_per_member,
        method="circuit",
        data=task.train,
        ood_data=task.ood_validation[1],
        objective="ood",
        seed=stages.seed,
        max_examples=r.circuit_examples,
    )


def _fused_deep_ensemble(
    stages: _SeedStages, bases: list[Any], taylor: HydraSpec
) -> tuple[list[Any], HydraSpec]:
    """Each base model pruned to its own Taylor heads (one member each) and recovered: the
    members and the spec of their fusion (per-member MLPs)."""
    r = stages.task.recipe
    members, heads = [], []
    for m, base in enumerate(bases):
        own = cached_selection(
            _sub(stages.cache, f"fused{m}.json"),
            base,
            1,
            heads_per_member=r.heads_per_member,
            method="taylor",
            data=stages.task.train,
            seed=stages.seed * 100 + m,
            max_examples=r.taylor_examples,
        )
        members += stages.train(base, own, 50 + m, f"fused{m}")
        heads.append(own.members[0])
    return members, taylor.replace(members=heads, mlp_merge="grouped", meta={})


def build_rows(task: Task, seed: int, args: argparse.Namespace) -> tuple[dict, dict]:
    """Train and assemble every row for ``seed``. Returns (models, info)."""
    M = task.recipe.members
    stages = _SeedStages(task, seed, None if args.cache is None else args.cache / f"seed{seed}")
    with stages.timed("base models"):
        bases = [stages.base_model(m) for m in range(M)]
    note(args, f"  seed {seed}: {M} base models trained ({stages.seconds['base models']:.0f} s)")
    with stages.timed("deep ensemble fine-tuning"):
        ensemble = [stages.train(b, full_spec(b), 50 + m, f"de{m}")[0] for m, b in enumerate(bases)]
    single = ensemble[0]
    with stages.timed("Taylor selection"):
        taylor = stages.select(bases[0], "taylor", "taylor.json")
    with stages.timed("Hydra (Taylor) fine-tuning"):
        taylor_members = stages.train(bases[0], taylor, 80, "taylor")
    with stages.timed("circuit selection"):
        circuit = stages.select(single, "circuit", "circuit.json")
    with stages.timed("circuit (fine-tuned) selection and fine-tuning"):
        circuit_base = stages.select(bases[0], "circuit", "circuit_base.json")
        circuit_members = stages.train(bases[0], circuit_base, 90, "circuit")
    with stages.timed("deep ensemble (one base) fine-tuning"):
        one_base = [
            stages.train(bases[0], full_spec(bases[0]), 60 + m, f"de1b{m}")[0] for m in range(M)
        ]
    with stages.timed("circuit (OOD validation) selection"):
        circuit_ood = _circuit_ood(stages, single)
    with stages.timed("Hydra (shared trunk) fine-tuning"):
        trunk_layers = max(1, bases[0].num_layers // 2)
        trunk_spec = _with_shared_trunk(taylor, trunk_layers)
        trunk_members = stages.train(bases[0], trunk_spec, 80, "trunk", shared_layers=trunk_layers)
    with stages.timed("Hydra (fused deep ensemble) selection and recovery"):
        fused_members, fused_spec = _fused_deep_ensemble(stages, bases, taylor)
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
        "Hydra (circuit, OOD validation)": fuse(single, circuit_ood, mlp_merge="average").eval(),
        "Hydra (shared trunk)": fuse(trunk_members, trunk_spec, mlp_merge="average").eval(),
        "Hydra (fused deep ensemble)": fuse(fused_members, fused_spec, mlp_merge="grouped").eval(),
        "deep ensemble (one base)": one_base,
        "deep ensemble": ensemble,
    }
    assert models["Hydra (shared trunk)"].trunk_layers == trunk_layers
    specs = {
        "taylor": taylor,
        "circuit": circuit,
        "circuit (fine-tuned)": circuit_base,
        "circuit (OOD validation)": circuit_ood,
        "shared trunk": trunk_spec,
        "fused deep ensemble": fused_spec,
    }
    info = {
        "seconds": stages.seconds,
        "specs": {k: v.to_dict() for k, v in specs.items()},
        "heads_overlap": {k: v.overlap().round(3).tolist() for k, v in specs.items()},
    }
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


def latency(task: Task, models: dict) -> dict[str, dict[str, float]]:
    """Median ratio to the single model over interleaved rounds, one batch, PyTorch CPU."""
    r = task.recipe
    x = (
        trim_padding(task.test[0][: r.latency_batch], task.text)
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
