"""Head importance: which attention heads a classifier relies on.

- ``taylor`` (Michel et al. 2019): a gate on every head's output; the importance of head h is the
  mean over examples of ``|dLoss/dgate_h|``, divided by the tokens per example (text: each
  example's real tokens, the sum of its attention mask; padding never counts), optionally
  L2-normalised per layer. First-order: it predicts the loss change of switching the head off.
- ``circuit`` (HeadMap-style, forward passes only): layer by layer, each head is switched off on
  top of the heads already pruned in earlier layers, and scored by how much the objective worsens;
  with ``keep`` the ``keep[l]`` heads scoring highest stay and the rest are pruned before the next
  layer. Objectives: ``"loss"`` (mean cross-entropy) or ``"ood"`` (the AUROC with which the
  ensemble's maximum softmax probability separates in-distribution from OOD data).
- ``random``: a seeded baseline.

Scores are ``float64`` arrays [num_layers, num_heads]; higher means more important.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hydra_deploy.backbones import BackboneAdapter, load_backbone
from hydra_deploy.errors import DataError, HydraError
from hydra_deploy.progress import progress, track
from hydra_deploy.pruning.data import (
    LabelledData,
    _refuse_non_numeric,
    _refuse_nonfinite,
    _refuse_unpreprocessed,
    is_text_backbone,
    load_data,
    load_inputs,
)
from hydra_deploy.uncertainty.metrics import auroc

logger = logging.getLogger("hydra_deploy")

METHODS = ("taylor", "circuit", "random")
OBJECTIVES = ("loss", "ood")

#: chooses ``k`` of the candidate heads of one layer from their scores -> chosen head indices
Chooser = Callable[[np.ndarray, np.ndarray, int], np.ndarray]


def top_k(candidates: np.ndarray, scores: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` highest-scoring candidates (ties broken by the lower head index)."""
    order = np.lexsort((candidates, -scores))
    return np.sort(candidates[order[:k]])


def head_importance(
    backbone: Any,
    data: Any = None,
    method: str = "taylor",
    *,
    keep: int | Sequence[int] | None = None,
    ood_data: Any = None,
    objective: str = "loss",
    normalize: bool = True,
    base_mask: np.ndarray | None = None,
    batch_size: int = 32,
    max_examples: int | None = 512,
    confident_fraction: float = 1.0,
    seed: int = 0,
) -> np.ndarray:
    """Importance of every head, [num_layers, num_heads] (see the module docstring).

    ``data``: labelled in-distribution data (anything ``load_data`` takes; not needed for
    ``random``). ``keep`` (circuit): heads kept per layer during the greedy pass (an int or one per
    layer); None scores every head with all others on. ``ood_data``: OOD inputs for
    ``objective="ood"``. ``normalize`` (taylor): divide each layer by its L2 norm.
    ``base_mask`` [L, H]: heads already off (0) before scoring. ``max_examples``: data used (the
    first N). ``confident_fraction`` (circuit): score on this fraction of examples with the lowest
    loss, as HeadMap does (1.0: all).
    """
    backbone = load_backbone(backbone)
    if method == "random":
        return np.random.default_rng(seed).random((backbone.num_layers, backbone.num_heads))
    if method not in METHODS:
        raise HydraError(f"unknown importance method {method!r}; choose one of {METHODS}")
    if data is None:
        raise DataError(f"method {method!r} needs labelled data (data=...)")
    data = load_data(data, backbone, max_examples=max_examples)
    if method == "taylor":
        if objective != "loss":
            raise HydraError(
                "taylor importance uses the training loss; objective='ood' is for circuit"
            )
        return taylor_importance(
            backbone, data, normalize=normalize, base_mask=base_mask, batch_size=batch_size
        )
    scores, _ = circuit_search(
        backbone,
        data,
        keep=keep,
        ood_data=ood_data,
        objective=objective,
        base_mask=base_mask,
        batch_size=batch_size,
        max_examples=max_examples,
        confident_fraction=confident_fraction,
    )
    return scores


# --- Taylor ----------------------------------------------------------------------------------------
def taylor_importance(
    backbone: BackboneAdapter,
    data: LabelledData,
    *,
    normalize: bool = True,
    base_mask: np.ndarray | None = None,
    batch_size: int = 32,
) -> np.ndarray:
    """Mean over examples of ``|dLoss/dgate|`` per head and token; per-layer L2 norm if asked.

    Tokens per example: ``backbone.num_tokens`` for images; for text each example's own count of
    real tokens (its attention mask summed), so padding does not dilute the scores.
    """
    L, H = backbone.num_layers, backbone.num_heads
    mask = _mask_tensor(backbone, base_mask)
    total = torch.zeros(L, H, dtype=torch.float64)
    examples = 0
    text = is_text_backbone(backbone)
    was_training = backbone.module.training
    backbone.module.eval()
    shown = progress(len(data), desc="head importance (taylor)", unit="example")
    try:
        for x, y in data.loader(batch_size):
            gates = mask.expand(x.shape[0], L, H).clone().requires_grad_(True)  # one per example
            with backbone.head_gates(gates):
                loss = F.cross_entropy(backbone(x), y, reduction="sum")
            (grad,) = torch.autograd.grad(loss, gates)
            if text:  # per token of each example: divide by its real-token count
                tokens = _real_tokens(backbone, x).double()
                total += (grad.abs().double() / tokens[:, None, None]).sum(0)
            else:
                total += grad.abs().sum(0).double()
            examples += x.shape[0]
            shown.update(x.shape[0])
    finally:
        shown.close()
        backbone.module.train(was_training)
    per_token = examples if text else examples * backbone.num_tokens
    importance = (total / per_token).numpy()
    if normalize:
        norms = np.linalg.norm(importance, axis=1, keepdims=True)
        importance = importance / np.where(norms > 0, norms, 1.0)
    return importance


# --- circuit ---------------------------------------------------------------------------------------
def circuit_search(
    backbone: BackboneAdapter,
    data: LabelledData,
    *,
    keep: int | Sequence[int] | None = None,
    ood_data: Any = None,
    objective: str = "loss",
    base_mask: np.ndarray | None = None,
    ensemble_masks: Sequence[np.ndarray] = (),
    chooser: Chooser = top_k,
    batch_size: int = 32,
    max_examples: int | None = 512,
    confident_fraction: float = 1.0,
    conditioning: str = "member",
) -> tuple[np.ndarray, np.ndarray]:
    """The greedy layer-by-layer pass. Returns (scores [L, H], kept mask [L, H]).

    ``ensemble_masks``: head masks of the members already chosen; with ``objective="ood"`` the
    objective is that of the ensemble under construction (those members plus this one);
    ``chooser`` picks the kept heads of a layer from its scores. ``conditioning``: what earlier
    layers look like while a layer's heads are scored: ``"member"`` (default) the member as it
    will be (the heads pruned so far masked), ``"headmap"`` HeadMap's own search (Wang et al.,
    2025: the circuit heads found so far masked, every other head on).
    """
    if conditioning not in CONDITIONINGS:
        raise HydraError(
            f"unknown circuit conditioning {conditioning!r}; choose one of {CONDITIONINGS}"
        )
    if objective not in OBJECTIVES:
        raise HydraError(f"unknown circuit objective {objective!r}; choose one of {OBJECTIVES}")
    L, H = backbone.num_layers, backbone.num_heads
    keep_per_layer = _keep_per_layer(keep, L, H)
    mask = _mask_tensor(backbone, base_mask).clone()
    module = backbone.module
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            x, y = _tensors(data)
            x_ood = _ood_inputs(ood_data, backbone, max_examples) if objective == "ood" else None
            if objective == "ood" and x_ood is None:
                raise DataError("objective='ood' needs ood_data (inputs the model should flag)")
            if confident_fraction < 1.0:
                x, y = _most_confident(backbone, x, y, mask, confident_fraction, batch_size)
            ensemble = None
            if objective == "ood" and len(ensemble_masks):
                ensemble = _ensemble_probs(backbone, ensemble_masks, (x, x_ood), batch_size)
            evaluate = _objective(objective, y, ensemble)
            hidden = [backbone.embed(x)] + ([backbone.embed(x_ood)] if x_ood is not None else [])
            scores = np.full((L, H), np.nan)
            # what the scoring sees: the member so far ("member"), or every head but the
            # circuit heads found so far ("headmap")
            condition = mask if conditioning == "member" else mask.clone()
            for layer in track(range(L), desc="head importance (circuit search)", unit="layer"):
                base = evaluate(_logits_from(backbone, hidden, layer, condition, batch_size))
                candidates = np.flatnonzero(mask[layer].numpy() > 0)
                for head in candidates:
                    trial = condition.clone()
                    trial[layer, head] = 0.0
                    worse = evaluate(_logits_from(backbone, hidden, layer, trial, batch_size))
                    scores[layer, head] = worse - base
                k = keep_per_layer[layer]
                chosen = candidates
                if k is not None and k < len(candidates):
                    chosen = chooser(candidates, scores[layer, candidates], k)
                    pruned = np.setdiff1d(candidates, chosen)
                    mask[layer, torch.as_tensor(pruned, dtype=torch.long)] = 0.0
                if conditioning == "headmap":  # the circuit heads are masked from now on
                    condition[layer] = 1.0
                    condition[layer, torch.as_tensor(chosen, dtype=torch.long)] = 0.0
                # the next layer's input, with this layer as the scoring sees it
                with backbone.head_gates(condition):
                    hidden = [
                        _batched(lambda h, i=layer: backbone.run_layers(h, i, i + 1), h, batch_size)
                        for h in hidden
                    ]
    finally:
        module.train(was_training)
    return scores, mask.numpy()


CONDITIONINGS = ("member", "headmap")


def _objective(objective: str, y: torch.Tensor, ensemble_probs) -> Callable[[list], float]:
    """A "badness" of logits (higher is worse): mean cross-entropy, or minus the OOD AUROC."""
    if objective == "loss":
        return lambda logits: float(F.cross_entropy(logits[0], y))

    def negative_auroc(logits: list) -> float:
        probs_id, probs_ood = (lg.softmax(-1) for lg in logits)
        if ensemble_probs is not None:
            sum_id, sum_ood, count = ensemble_probs
            probs_id = (sum_id + probs_id) / (count + 1)
            probs_ood = (sum_ood + probs_ood) / (count + 1)
        msp_id, msp_ood = probs_id.max(-1).values, probs_ood.max(-1).values
        return -auroc(-msp_id.numpy(), -msp_ood.numpy())  # OOD positive, score = -MSP

    return negative_auroc


def _ensemble_probs(backbone, masks, inputs, batch_size: int):
    """(ID softmax sum, OOD softmax sum, count) of fixed members on the given inputs."""
    sums = [0.0, 0.0]
    for mask in masks:
        with backbone.head_gates(mask):
            for i, x in enumerate(inputs):
                sums[i] = sums[i] + _batched(backbone, x, batch_size).softmax(-1)
    return sums[0], sums[1], len(masks)


def _logits_from(backbone, hidden: list, layer: int, mask: torch.Tensor, batch_size: int) -> list:
    """Logits of each cached input set, running layers ``layer..L-1`` under ``mask``."""
    L = backbone.num_layers
    with backbone.head_gates(mask):
        return [
            _batched(lambda h: backbone.classify(backbone.run_layers(h, layer, L)), h, batch_size)
            for h in hidden
        ]


def _batched(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batch_size: int):
    return torch.cat([fn(x[i : i + batch_size]) for i in range(0, x.shape[0], batch_size)])


def _most_confident(backbone, x, y, mask, fraction: float, batch_size: int):
    if not 0.0 < fraction <= 1.0:
        raise HydraError(f"confident_fraction must be in (0, 1], got {fraction}")
    with backbone.head_gates(mask):
        logits = _batched(backbone, x, batch_size)
    losses = F.cross_entropy(logits, y, reduction="none")
    count = max(1, round(fraction * len(y)))
    order = torch.argsort(losses)[:count]
    return x[order], y[order]


# --- helpers ---------------------------------------------------------------------------------------
def _keep_per_layer(keep, L: int, H: int) -> list[int | None]:
    if keep is None:
        return [None] * L
    values = [keep] * L if isinstance(keep, (int, np.integer)) else list(keep)
    if len(values) != L:
        raise HydraError(f"keep has {len(values)} entries, expected one per layer ({L})")
    for layer, k in enumerate(values):
        if not 0 <= int(k) <= H:
            raise HydraError(f"keep[{layer}]={k} is outside 0..{H} (heads per layer)")
    return [int(k) for k in values]


def _mask_tensor(backbone: BackboneAdapter, base_mask) -> torch.Tensor:
    if base_mask is None:
        return torch.ones(backbone.num_layers, backbone.num_heads)
    return backbone._check_mask(torch.as_tensor(np.asarray(base_mask, dtype=np.float32)))


def _tensors(data: LabelledData) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*data.loader(256), strict=True)
    return torch.cat(xs), torch.cat(ys)


def _real_tokens(backbone: BackboneAdapter, x: torch.Tensor) -> torch.Tensor:
    """Real (non-padding) tokens of each text example [B]: its attention mask summed."""
    return backbone.text_inputs(x)["attention_mask"].sum(1).clamp(min=1)


def _npz_inputs(path) -> np.ndarray:
    try:
        with np.load(path) as archive:
            if "x" not in archive.files:
                raise DataError(f"ood_data: {str(path)!r} has no 'x' array (has {archive.files})")
            return archive["x"]
    except DataError:
        raise
    except Exception as err:
        raise DataError(f"ood_data: cannot read {str(path)!r}: {err}") from err


def _ood_inputs(ood_data: Any, backbone: BackboneAdapter, max_examples: int | None):
    """OOD inputs as a tensor: an array of inputs, or any labelled data (labels ignored).

    Text backbones take the text formats of :func:`~hydra_deploy.pruning.data.load_inputs` (a
    .tsv/.txt file, a .npz, token arrays or dicts, labelled data) and give [N, 2|3, L] int64.
    """
    if ood_data is None:
        return None
    if is_text_backbone(backbone):
        return load_inputs(ood_data, backbone, max_examples=max_examples, name="ood_data")
    if isinstance(ood_data, (str, os.PathLike)) and str(ood_data).endswith(".npz"):
        ood_data = _npz_inputs(ood_data)  # OOD sets need no labels: x alone is enough
    if isinstance(ood_data, (np.ndarray, torch.Tensor)):
        _refuse_non_numeric(ood_data, "inputs", "ood_data")  # strings, objects
        x = torch.as_tensor(ood_data)
        _refuse_unpreprocessed(x, "ood_data", backbone)  # uint8 raw pixels, ints
        x = x.float()
    else:
        # image folders, labelled data: read with the backbone's preprocessing, labels ignored
        x = load_inputs(ood_data, backbone, max_examples=max_examples, name="ood_data")
    expected = (backbone.in_chans, *backbone.img_size)
    if x.dim() == 0 or tuple(x.shape[1:]) != expected:
        raise DataError(
            f"ood_data inputs have shape {list(x.shape[1:])}, expected {list(expected)} per "
            "example; preprocess them to the backbone's input size"
        )
    x = x[:max_examples] if max_examples else x
    if x.shape[0] == 0:
        raise DataError("ood_data is empty (0 examples); give at least one input")
    _refuse_nonfinite(x, "ood_data")
    return x
