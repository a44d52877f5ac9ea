"""Fine-tuning the members one by one, each with its pruned heads held at zero.

Member ``m`` starts as a copy of the backbone. Its pruned heads (those not in
``spec.members[m].heads[l]``) are zeroed in the weights (timm ViT: their Q/K/V rows of
``attn.qkv`` and their columns of ``attn.proj``; BERT: their rows of ``attention.self.query/key/
value`` and their columns of ``attention.output.dense``) and gated off in every forward, and the
zeroed slices are written back to zero after every optimizer step, so neither weight decay nor
momentum can revive them. The result is M modules of the backbone's own class (timm
``VisionTransformer`` or transformers ``BertForSequenceClassification``) ready for
``fuse(members, spec, "grouped")``. Text data is anything ``load_data`` takes for a text backbone
(a .tsv file, token arrays, ...); batches are the stacked [B, 2|3, L] token tensor.

Recipe: cross-entropy, AdamW (weight decay on matrices only, not on biases, norms, position
embeddings or class tokens), linear warm-up for ``warmup_steps`` then cosine decay to 0. Member m
uses seed ``seed + m`` for the shuffling and for dropout, so a call is reproducible bit for bit.

With ``save_dir`` every finished member is written as ``member_{m}.safetensors`` (atomically) plus
``member_{m}.json`` (its settings, losses and the weights' SHA-256); a later call with the same
settings (:class:`~hydra_deploy.options.FinetuneOptions`' recorded fields) loads it instead of
training it again.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hydra_deploy.atomic import atomic_path, atomic_write_json
from hydra_deploy.backbones import BackboneAdapter, load_backbone
from hydra_deploy.errors import CheckpointError, FinetuneError, ParameterError, SpecError
from hydra_deploy.export_folder import file_sha256
from hydra_deploy.families import families, family_of_module
from hydra_deploy.optional import lazy_module
from hydra_deploy.options import SHARED_PARTS, FinetuneOptions
from hydra_deploy.progress import progress as shown
from hydra_deploy.pruning.data import LabelledData, load_data
from hydra_deploy.specs import HydraSpec

__all__ = [
    "FORMAT",
    "SHARED_PARTS",
    "FinetuneError",
    "FinetuneOptions",
    "FinetunedMembers",
    "finetune_members",
    "zero_pruned_heads",
]

safetensors_torch = lazy_module(
    "safetensors.torch", purpose="saving fine-tuned members", error=CheckpointError
)

logger = logging.getLogger("hydra_deploy")

FORMAT = "hydra-finetune/1"
"""The format string of ``member_{m}.json``."""

#: What a saved member is compared on besides FinetuneOptions' recorded fields.
_IDENTITY_KEYS = ("heads", "backbone", "data")
_FINGERPRINT_SAMPLE = 64  # examples hashed to recognise the training data


class FinetunedMembers(list):
    """The M fine-tuned member modules (the backbone's class, e.g. timm ``VisionTransformer`` or
    transformers ``BertForSequenceClassification``, in eval mode), in member order.

    ``history[m]`` describes how member m was obtained: ``member``, ``steps``, ``epochs`` (epochs
    actually trained, ``steps / steps_per_epoch``), ``lr``, ``seed`` (the member's own seed),
    ``loss_before`` / ``loss_after`` (masked cross-entropy on the fixed evaluation examples),
    ``resumed`` (loaded from ``save_dir``) and ``seconds``.
    """

    def __init__(self, modules: Sequence[nn.Module] = (), history: Sequence[dict] = ()) -> None:
        super().__init__(modules)
        self.history: list[dict[str, Any]] = list(history)


# --------------------------------------------------------------------------------------------------
# zeroing


#: A tensor viewing one layer's weights with a head axis, and the index of that axis.
HeadView = tuple[torch.Tensor, int]


def _head_views(module: nn.Module) -> tuple[int, list[list[HeadView]]]:
    """(heads per layer, per layer the views of every weight that holds one slice per head), as
    the module's family declares them (the registry's ``head_views``: a timm ViT's ``attn.qkv``
    and ``attn.proj``, a BERT's ``attention.self.query/key/value`` and ``attention.output.dense``).
    The views share storage with the parameters (detached), so writing into them writes the
    weights."""
    family = family_of_module(module)
    if family.head_views is None:
        raise FinetuneError(
            f"{type(module).__name__} is a {family.name} model, whose family declares no "
            "head_views; fine-tuning supports the families that do: "
            + ", ".join(f.name for f in families() if f.head_views)
        )
    return family.resolve("head_views")(module)


def _head_slice(axis: int, heads: list[int]) -> tuple:
    """The index selecting ``heads`` along dimension ``axis``."""
    return (slice(None),) * axis + (heads,)


def _pruned_heads(kept_heads: Sequence[Sequence[int]], num_heads: int) -> list[list[int]]:
    return [sorted(set(range(num_heads)) - {int(h) for h in kept}) for kept in kept_heads]


@torch.no_grad()
def zero_pruned_heads(module: nn.Module, kept_heads: Sequence[Sequence[int]]) -> nn.Module:
    """Zero, in place, every head not in ``kept_heads[l]``; returns ``module``.

    timm ViT: a pruned head's Q, K and V rows of ``blocks[l].attn.qkv.weight`` (and ``.bias``) and
    its columns of ``blocks[l].attn.proj.weight`` become 0. Hugging Face BERT: its rows of
    ``attention.self.query/key/value`` (weights and biases) and its columns of
    ``attention.output.dense.weight``. It then contributes nothing, with or without a gate.
    ``kept_heads`` is ``spec.members[m].heads`` (one sequence of head indices per layer).
    """
    H, views = _head_views(module)
    if len(kept_heads) != len(views):
        raise SpecError(
            f"kept_heads lists {len(kept_heads)} layers but the model has {len(views)} blocks"
        )
    for layer, (layer_views, pruned) in enumerate(
        zip(views, _pruned_heads(kept_heads, H), strict=True)
    ):
        bad = [h for h in kept_heads[layer] if not 0 <= int(h) < H]
        if bad:
            raise SpecError(f"layer {layer}: head(s) {bad} out of range 0..{H - 1}")
        if not pruned:
            continue
        for tensor, axis in layer_views:
            tensor[_head_slice(axis, pruned)] = 0
    return module


def _pruned_slices_are_zero(module: nn.Module, kept_heads: Sequence[Sequence[int]]) -> bool:
    H, views = _head_views(module)
    for layer_views, pruned in zip(views, _pruned_heads(kept_heads, H), strict=True):
        if not pruned:
            continue
        if any(bool(t[_head_slice(axis, pruned)].any()) for t, axis in layer_views):
            return False
    return True


# --------------------------------------------------------------------------------------------------
# argument checks


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _total_steps(epochs: float | None, max_steps: int | None, steps_per_epoch: int) -> int:
    """``max_steps`` when given (it overrides ``epochs``), else ``ceil(epochs * steps_per_epoch)``."""
    if max_steps is not None:
        return int(max_steps)
    return max(1, math.ceil(round(float(epochs) * steps_per_epoch, 6)))  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# fingerprints (so that a saved member is never reused for another backbone or other data)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()


def _backbone_fingerprint(module: nn.Module) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(_tensor_bytes(tensor))
    return digest.hexdigest()


def _data_fingerprint(data: LabelledData) -> dict[str, Any]:
    digest = hashlib.blake2b(digest_size=16)
    n = len(data)
    for index in np.unique(np.linspace(0, n - 1, min(n, _FINGERPRINT_SAMPLE)).round().astype(int)):
        x, y = data.dataset[int(index)]
        digest.update(_tensor_bytes(torch.as_tensor(x)))
        digest.update(str(int(y)).encode())
    return {"examples": n, "sample_hash": digest.hexdigest()}


# --------------------------------------------------------------------------------------------------
# training one member


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


@torch.no_grad()
def _masked_loss(
    adapter: BackboneAdapter,
    mask: torch.Tensor,
    data: LabelledData,
    batch_size: int,
    *,
    desc: str = "masked loss",
    progress: bool = False,
) -> float:
    """Mean cross-entropy of the masked model on ``data`` (eval mode); ``progress``: shown as
    ``desc`` (:mod:`hydra_deploy.progress`)."""
    module = adapter.module
    was_training = module.training
    module.eval()
    device = _device_of(module)
    total, count = 0.0, 0
    with shown(len(data), desc=desc, unit="example", enabled=progress) as bar:
        for x, y in data.loader(batch_size=batch_size, shuffle=False):
            logits = adapter.forward(x.to(device), mask)
            total += float(nn.functional.cross_entropy(logits, y.to(device), reduction="sum"))
            count += y.numel()
            bar.update(y.numel())
    module.train(was_training)
    return total / count


def _param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (timm's convention), none on biases, norms, tokens, pos_embed."""
    skip = set(module.no_weight_decay()) if hasattr(module, "no_weight_decay") else set()
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim <= 1 or name in skip else decay).append(param)
    return [
        {"params": decay, "weight_decay": float(weight_decay)},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _lr_lambda(warmup_steps: int, total_steps: int):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _train_member(
    adapter: BackboneAdapter,
    kept_heads: Sequence[Sequence[int]],
    mask: torch.Tensor,
    data: LabelledData,
    options: FinetuneOptions,
    *,
    total_steps: int,
    seed: int,
    desc: str,
    shown_as: str,
    progress: bool,
) -> None:
    """Train ``adapter.module`` in place for ``total_steps`` AdamW steps with ``mask`` applied;
    ``desc`` names the member in errors, ``shown_as`` in its progress (``progress``: a bar in a
    terminal, a line every 30 s in a log: :mod:`hydra_deploy.progress`)."""
    module = adapter.module
    device = _device_of(module)
    optimizer = torch.optim.AdamW(
        _param_groups(module, float(options.weight_decay)), lr=float(options.lr)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _lr_lambda(options.warmup_steps, total_steps)
    )
    loader = data.loader(batch_size=options.batch_size, shuffle=True, seed=seed)
    module.train()
    step = 0
    torch.manual_seed(seed)  # dropout (the caller's RNG state is restored by finetune_members)
    with (
        shown(total_steps, desc=shown_as, unit="step", enabled=progress) as bar,
        adapter.head_gates(mask),
    ):
        while step < total_steps:
            for x, y in loader:  # each pass over the loader is a new seeded shuffle
                logits = adapter(x.to(device))  # the adapter reads any input form (text too)
                loss = nn.functional.cross_entropy(
                    logits, y.to(device), label_smoothing=float(options.label_smoothing)
                )
                loss_value = loss.item()
                if not math.isfinite(loss_value):
                    raise FinetuneError(
                        f"{desc}: the training loss became {loss_value} at step {step}; "
                        "lower lr or add warmup_steps"
                    )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                zero_pruned_heads(module, kept_heads)
                step += 1
                bar.describe(f"{shown_as}, loss {loss_value:.4f}")
                bar.update(1)
                if step >= total_steps:
                    break
    module.eval()
    optimizer.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------------
# saving and resuming


def _save_weights(module: nn.Module, path: Path) -> None:
    """``safetensors.torch.save_file`` to a temporary name in the folder, fsync, ``os.replace``."""
    state = {k: v.detach().to("cpu").contiguous() for k, v in module.state_dict().items()}
    with atomic_path(path) as tmp:
        safetensors_torch.save_file(state, str(tmp), metadata={"format": FORMAT})


def _delete_hint(path: Path) -> str:
    """What to do about a bad saved member (``path`` is its .json or .safetensors)."""
    pair = f"{path.stem}.safetensors and {path.stem}.json"
    return (
        f"delete {pair} in {str(path.parent)!r} (the member is then retrained) or pass resume=False"
    )


def _read_record(json_path: Path) -> dict[str, Any] | None:
    """The saved member's JSON record, None when there is none; CheckpointError when unreadable."""
    if not json_path.exists():
        return None
    try:
        record = json.loads(json_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"saved member record {str(json_path)!r} is unreadable ({err}); {_delete_hint(json_path)}"
        ) from err
    if (
        not isinstance(record, dict)
        or record.get("format") != FORMAT
        or not isinstance(record.get("settings"), dict)
    ):
        raise CheckpointError(
            f"saved member record {str(json_path)!r} is not a {FORMAT} record; "
            f"{_delete_hint(json_path)}"
        )
    return record


def _differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The settings of a saved member that differ from the current ones (a setting its record
    lacks, written before that option existed, counts as the option's default)."""
    defaults = FinetuneOptions.recorded_defaults()
    out = []
    for key in (*_IDENTITY_KEYS, *defaults):
        old = saved.get(key, defaults.get(key))
        new = current[key]
        if old == new or (key == "epochs" and current["max_steps"] is not None):
            continue  # with max_steps set, epochs does not change the training
        if key in _IDENTITY_KEYS:
            out.append(f"{key} differ")
        else:
            out.append(f"{key}={old!r} -> {new!r}")
    return out


def _load_member(
    backbone: BackboneAdapter,
    weights_path: Path,
    record: dict[str, Any],
    kept_heads: Sequence[Sequence[int]],
) -> nn.Module:
    try:
        sha = file_sha256(weights_path)
        if sha != record.get("weights_sha256"):
            raise CheckpointError(
                f"saved member {str(weights_path)!r} does not match the SHA-256 recorded in its "
                f"json (the file is corrupt or was replaced); {_delete_hint(weights_path)}"
            )
        state = safetensors_torch.load_file(str(weights_path))
        module = copy.deepcopy(backbone.module)
        module.load_state_dict(state, strict=True)
    except CheckpointError:
        raise
    except (
        Exception
    ) as err:  # safetensors' SafetensorError, OSError, load_state_dict's RuntimeError
        raise CheckpointError(
            f"cannot load saved member {str(weights_path)!r} ({type(err).__name__}: "
            f"{str(err)[:200]}); {_delete_hint(weights_path)}"
        ) from err
    if not _pruned_slices_are_zero(module, kept_heads):
        raise CheckpointError(
            f"saved member {str(weights_path)!r} has non-zero weights in heads the spec prunes; "
            f"{_delete_hint(weights_path)}"
        )
    return module.eval()


# --------------------------------------------------------------------------------------------------
# the public entry point


def finetune_members(
    backbone: BackboneAdapter | nn.Module,
    spec: HydraSpec,
    train_data: Any = None,
    epochs: float | None = 1.0,
    lr: float = 1e-4,
    *,
    batch_size: int = 32,
    weight_decay: float = 0.05,
    warmup_steps: int = 0,
    max_steps: int | None = None,
    seed: int = 0,
    save_dir: str | os.PathLike | None = None,
    resume: bool = True,
    progress: bool = True,
    eval_examples: int = 512,
    shared_parts: str = "per-member",
    shared_layers: int = 0,
    options: FinetuneOptions | None = None,
) -> FinetunedMembers:
    """Fine-tune one copy of ``backbone`` per member of ``spec``, pruned heads held at zero.

    The settings are ``options`` (a :class:`~hydra_deploy.options.FinetuneOptions`, whose
    ``data`` stands in for ``train_data``) or the keywords of the same names (``save_dir`` is
    its ``save_dir``), not both. ``epochs`` may be fractional (``ceil(epochs *
    steps_per_epoch)`` steps, the last epoch cut short); ``max_steps``, when given, fixes the
    number of steps instead (as in Hugging Face's Trainer it overrides ``epochs``, which may then
    be None). ``lr`` is the peak learning rate: linear warm-up over ``warmup_steps``, then cosine
    decay to 0. Member m uses seed ``seed + m`` for shuffling and dropout; the caller's global RNG
    state is left untouched. ``eval_examples`` fixed, evenly spaced examples of ``train_data``
    measure each member's masked loss before and after. With ``save_dir``, finished members are
    saved and, with ``resume``, reused when their saved settings match (a mismatch is logged and
    the member retrained). ``progress``: each member's steps (and its loss before and after)
    shown through :mod:`hydra_deploy.progress`: a bar on stderr in a terminal, an INFO line every
    30 s in a log; False: none. ``shared_parts`` (see ``SHARED_PARTS``): ``"frozen"`` or
    ``"averaged"`` keep the embeddings, final norm, pooler and classifier equal across members, so
    the fused model stores them once (near one model's size); ``"per-member"`` (default)
    fine-tunes every weight of every member. ``shared_layers``: the first n layers stay frozen;
    the spec's members must keep the same heads there, so that the fused model computes those
    layers once (a shared trunk; with ``shared_parts="per-member"`` the embeddings are frozen
    too, since the trunk starts there).

    Returns a :class:`FinetunedMembers` list of M modules of the backbone's class in eval mode.
    """
    adapter = load_backbone(backbone)
    adapter.check_spec(spec, "finetune_members")
    keywords = dict(
        epochs=epochs,
        lr=lr,
        batch_size=batch_size,
        weight_decay=weight_decay,
        warmup_steps=warmup_steps,
        max_steps=max_steps,
        seed=seed,
        save_dir=save_dir,
        shared_parts=shared_parts,
        shared_layers=shared_layers,
    )
    options = _settings(options, train_data, keywords)
    if not _is_int(eval_examples) or eval_examples < 1:
        raise FinetuneError(f"eval_examples must be an int >= 1, got {eval_examples!r}")
    plan = _plan(adapter, spec, options, eval_examples)
    members, history = [], []
    # Eval loaders draw their base seed from the global RNG and training reseeds it: fork it.
    device = _device_of(adapter.module)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for m in range(spec.num_members):
            module, entry = _member(adapter, spec, m, plan, resume=resume, progress=progress)
            members.append(module)
            history.append(entry)
    if options.shared_parts == "averaged":
        _average(members, plan.shared_names)
    for entry in history:
        entry["shared_parts"], entry["shared_layers"] = options.shared_parts, options.shared_layers
    return FinetunedMembers(members, history)


def _settings(
    options: FinetuneOptions | None, train_data: Any, keywords: dict[str, Any]
) -> FinetuneOptions:
    """``options`` with ``train_data`` put in, or the options the keywords give."""
    if options is None:
        if train_data is None:
            raise FinetuneError("finetune_members needs train_data (labelled data to train on)")
        return FinetuneOptions(data=train_data, **keywords)
    defaults = {f.name: f.default for f in dataclasses.fields(FinetuneOptions)}
    mixed = [k for k, v in keywords.items() if v != defaults[k]]
    if mixed:
        raise ParameterError(
            f"{', '.join(f'`{k}`' for k in mixed)} given besides `options`: set "
            "FinetuneOptions' fields instead"
        )
    if train_data is not None:
        if options.data is not None and options.data is not train_data:
            raise ParameterError("give `train_data` or the options' data, not both")
        options = dataclasses.replace(options, data=train_data)
    if options.data is None:
        raise FinetuneError("finetune_members needs train_data (labelled data to train on)")
    return options


@dataclasses.dataclass
class _Plan:
    """What the members' fine-tuning shares: the settings, data, steps, frozen parameters."""

    options: FinetuneOptions
    data: LabelledData
    eval_data: LabelledData
    steps_per_epoch: int
    total_steps: int
    shared_names: list[str]
    frozen_names: list[str]
    folder: Path | None
    settings: dict[str, Any]  # the recorded settings but the member's heads


def _plan(
    adapter: BackboneAdapter, spec: HydraSpec, options: FinetuneOptions, eval_examples: int
) -> _Plan:
    shared_names = _shared_names(adapter, options.shared_parts)
    trunk_names = _trunk_names(adapter, spec, options.shared_layers)
    frozen = {*trunk_names, *(shared_names if options.shared_parts == "frozen" else ())}
    data = load_data(options.data, adapter, name="train_data")
    steps_per_epoch = math.ceil(len(data) / options.batch_size)
    total_steps = _total_steps(options.epochs, options.max_steps, steps_per_epoch)
    if options.warmup_steps >= total_steps:
        logger.warning(
            "warmup_steps=%d >= the %d training steps: the learning rate never reaches lr=%g",
            options.warmup_steps,
            total_steps,
            options.lr,
        )
    n = len(data)
    eval_data = data.subset(
        np.unique(np.linspace(0, n - 1, min(n, eval_examples)).round().astype(int)).tolist()
    )
    folder = None if options.save_dir is None else Path(options.save_dir).expanduser()
    settings = options.record()
    if folder is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CheckpointError(f"cannot create save_dir {str(folder)!r}: {err}") from err
        settings["backbone"] = _backbone_fingerprint(adapter.module)
        settings["data"] = _data_fingerprint(data)
    plan = _Plan(
        options,
        data,
        eval_data,
        steps_per_epoch,
        total_steps,
        shared_names,
        sorted(frozen),
        folder,
        settings,
    )
    _log_plan(adapter, spec, plan)
    return plan


def _log_plan(adapter: BackboneAdapter, spec: HydraSpec, plan: _Plan) -> None:
    options = plan.options
    logger.info(
        "fine-tuning %d members of %s: %d steps each (%.3g epochs of %d examples, batch %d), "
        "lr %g, weight decay %g, warm-up %d; embeddings, final norm and classifier %s",
        spec.num_members,
        adapter.name,
        plan.total_steps,
        plan.total_steps / plan.steps_per_epoch,
        len(plan.data),
        options.batch_size,
        options.lr,
        options.weight_decay,
        options.warmup_steps,
        {
            "per-member": "tuned per member (stored per member)",
            "frozen": "frozen (stored once)",
            "averaged": "tuned, then averaged (stored once)",
        }[options.shared_parts],
    )


def _member(
    adapter: BackboneAdapter, spec: HydraSpec, m: int, plan: _Plan, *, resume: bool, progress: bool
) -> tuple[nn.Module, dict[str, Any]]:
    """Member ``m``, loaded from ``plan.folder`` when saved with the same settings, else trained
    (and saved there)."""
    start = time.perf_counter()
    kept_heads = spec.members[m].heads
    settings = {"heads": [list(h) for h in kept_heads], **plan.settings}
    paths = None
    if plan.folder is not None:
        paths = (plan.folder / f"member_{m}.safetensors", plan.folder / f"member_{m}.json")
        if resume:
            resumed = _resumed(adapter, m, paths, settings, kept_heads, plan, start)
            if resumed is not None:
                return resumed
    mask = torch.as_tensor(spec.head_mask(m), device=_device_of(adapter.module))
    options = plan.options
    module = zero_pruned_heads(copy.deepcopy(adapter.module), kept_heads)
    member = load_backbone(module)  # an adapter over the copy (gates, masked forward)
    shown_as = f"fine-tuning member {m} ({m + 1} of {spec.num_members})"  # as member_{m}.json
    loss_before = _masked_loss(
        member,
        mask,
        plan.eval_data,
        options.batch_size,
        desc=f"{shown_as}: loss before",
        progress=progress,
    )
    with _frozen(module, plan.frozen_names):
        _train_member(
            member,
            kept_heads,
            mask,
            plan.data,
            options,
            total_steps=plan.total_steps,
            seed=options.seed + m,
            desc=f"member {m}",
            shown_as=shown_as,
            progress=progress,
        )
    loss_after = _masked_loss(
        member,
        mask,
        plan.eval_data,
        options.batch_size,
        desc=f"{shown_as}: loss after",
        progress=progress,
    )
    seconds = time.perf_counter() - start
    logger.info(
        "member %d: %d steps, masked loss %.4f -> %.4f on %d examples (%.1f s)",
        m,
        plan.total_steps,
        loss_before,
        loss_after,
        len(plan.eval_data),
        seconds,
    )
    entry = {
        "member": m,
        "steps": plan.total_steps,
        "epochs": plan.total_steps / plan.steps_per_epoch,
        "lr": float(options.lr),
        "seed": options.seed + m,
        "loss_before": loss_before,
        "loss_after": loss_after,
        "resumed": False,
        "seconds": seconds,
    }
    if paths is not None:
        _save_member(module, *paths, settings, entry, len(plan.eval_data))
    return module.eval(), entry


def _resumed(
    adapter: BackboneAdapter,
    m: int,
    paths: tuple[Path, Path],
    settings: dict[str, Any],
    kept_heads: Sequence[Sequence[int]],
    plan: _Plan,
    start: float,
) -> tuple[nn.Module, dict[str, Any]] | None:
    """The saved member ``m`` and its history entry, None when none is saved with ``settings``."""
    weights_path, json_path = paths
    record = _read_record(json_path)
    if record is None:
        return None
    diff = _differences(record["settings"], settings)
    if not weights_path.is_file():
        diff = [f"{weights_path.name} is missing"]
    if diff:
        logger.warning(
            "member %d: not reusing the member saved in %s (%s); retraining it",
            m,
            plan.folder,
            "; ".join(diff),
        )
        return None
    module = _load_member(adapter, weights_path, record, kept_heads)
    entry = {
        "member": m,
        "steps": record.get("steps"),
        "epochs": record.get("epochs_trained"),
        "lr": float(plan.options.lr),
        "seed": plan.options.seed + m,
        "loss_before": record.get("loss_before"),
        "loss_after": record.get("loss_after"),
        "resumed": True,
        "seconds": time.perf_counter() - start,
    }
    logger.info("member %d: loaded from %s (settings match)", m, weights_path)
    return module, entry


def _trunk_names(adapter: BackboneAdapter, spec: HydraSpec, shared_layers: Any) -> list[str]:
    """Parameters frozen for a shared trunk of ``shared_layers`` layers (and the embeddings)."""
    L = adapter.num_layers
    if not _is_int(shared_layers) or not 0 <= shared_layers <= L:
        raise FinetuneError(f"shared_layers must be an int in 0..{L}, got {shared_layers!r}")
    if shared_layers == 0:
        return []
    differ = [
        layer
        for layer in range(shared_layers)
        if len({member.heads[layer] for member in spec.members}) > 1
    ]
    if differ:
        raise FinetuneError(
            f"shared_layers={shared_layers}: the members keep different heads in layer(s) "
            f"{differ}; give them the same heads there (HydraSpec.random(..., shared_layers=n)) "
            "or lower shared_layers"
        )
    prefixes = tuple(adapter.layer_parameter_prefix.format(layer) for layer in range(shared_layers))
    return [
        name
        for name, _ in adapter.module.named_parameters()
        if name.startswith(prefixes + adapter.embedding_parameter_prefixes)
    ]


def _shared_names(adapter: BackboneAdapter, shared_parts: Any) -> list[str]:
    """Names of the parameters ``shared_parts`` keeps equal across members (none: per-member)."""
    if shared_parts not in SHARED_PARTS:
        raise FinetuneError(
            f"shared_parts must be one of {', '.join(map(repr, SHARED_PARTS))}, got {shared_parts!r}"
        )
    if shared_parts == "per-member":
        return []
    prefixes = adapter.shared_parameter_prefixes
    names = [name for name, _ in adapter.module.named_parameters() if name.startswith(prefixes)]
    if not names:
        raise FinetuneError(
            f"shared_parts={shared_parts!r}: the {adapter.family} backbone {adapter.name} declares "
            "no shared parts (embeddings, classifier); use shared_parts='per-member'"
        )
    return names


@contextlib.contextmanager
def _frozen(module: nn.Module, names: Sequence[str]):
    """``requires_grad=False`` on the named parameters while the context is open."""
    params = dict(module.named_parameters())
    frozen = [params[name] for name in names if params[name].requires_grad]
    for param in frozen:
        param.requires_grad_(False)
    try:
        yield
    finally:
        for param in frozen:
            param.requires_grad_(True)


@torch.no_grad()
def _average(members: Sequence[nn.Module], names: Sequence[str]) -> None:
    """Give every member the mean over members of each named parameter (in place)."""
    tables = [dict(member.named_parameters()) for member in members]
    for name in names:
        mean = torch.stack([table[name].detach() for table in tables]).mean(0)
        for table in tables:
            table[name].copy_(mean)


def _save_member(
    module: nn.Module,
    weights_path: Path,
    json_path: Path,
    settings: dict[str, Any],
    entry: dict[str, Any],
    eval_count: int,
) -> None:
    """Weights first, then the record: a record on disk always describes the weights beside it."""
    try:
        with contextlib.suppress(FileNotFoundError):
            json_path.unlink()  # a stale record must never vouch for the new weights
        _save_weights(module, weights_path)
        atomic_write_json(
            json_path,
            {
                "format": FORMAT,
                "member": entry["member"],
                "settings": settings,
                "member_seed": entry["seed"],
                "steps": entry["steps"],
                "epochs_trained": entry["epochs"],
                "loss_before": entry["loss_before"],
                "loss_after": entry["loss_after"],
                "eval_examples": eval_count,
                "seconds": entry["seconds"],
                "weights": weights_path.name,
                "weights_sha256": file_sha256(weights_path),
            },
        )
    except OSError as err:
        raise CheckpointError(
            f"cannot save member {entry['member']} to {str(weights_path.parent)!r}: {err}"
        ) from err
