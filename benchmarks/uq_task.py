"""The uncertainty benchmarks' tasks: the rows compared, a task's data and model, its training
recipe (what ``uq_digits.py`` and ``uq_wordnet.py`` describe and ``uq_run.main`` runs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

#: Rows built from one trained base model (what a user with one checkpoint can make).
ONE_BASE_HYDRA = (
    "Hydra (Taylor)",
    "Hydra (Taylor, grouped MLP)",
    "Hydra (circuit)",
    "Hydra (circuit, fine-tuned)",
    "Hydra (circuit, OOD validation)",
    "Hydra (shared trunk)",
)
#: Every row of the protocol, in the report's order.
ROWS = (
    "single",
    "single Taylor-pruned",
    *ONE_BASE_HYDRA,
    "Hydra (fused deep ensemble)",
    "deep ensemble (one base)",
    "deep ensemble",
    "MC dropout",
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
