"""Building a Hydra model in one call: backbone, members' heads, fine-tuning, fusion.

:func:`build_hydra` is what ``hydra-fuse`` and ``hydra-export`` run, as a library function with
its options in typed groups (:mod:`hydra_deploy.options`; the commands only parse flags into
them)::

    from hydra_deploy.options import FinetuneOptions, LoadOptions, SelectionOptions
    from hydra_deploy.pipeline import build_hydra

    built = build_hydra("vit_b16", load=LoadOptions(checkpoint="vit_b16.safetensors"),
                        select=SelectionOptions(members=3, heads_per_member=4, calib="train/"),
                        finetune=FinetuneOptions(data="train/", epochs=1))
    built.hydra        # the fused HydraModel; built.spec, built.backbone, built.members

The groups' fields are also keyword arguments (``build_hydra("vit_b16", members=3,
heads_per_member=4, calib="train/", finetune="train/", epochs=1)``), under their flags' names
where those differ: ``finetune`` (the data), ``finetune_steps``, ``finetune_batch_size``,
``finetune_dir``.

Several checkpoints of one architecture (``checkpoint=[a, b, c]``) become one member each (a
deep ensemble fused into one network), heads chosen per checkpoint, MLPs kept per member.

Errors about the arguments are :class:`~hydra_deploy.errors.ParameterError`: their message names
the parameters (``members``), and the commands say their flags (``--members``) instead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from hydra_deploy.backbones import load_backbone
from hydra_deploy.errors import ParameterError, SpecError, said
from hydra_deploy.families import family_for_prefix
from hydra_deploy.fusion import fuse as fuse_members  # build_hydra's ``fuse`` is its options
from hydra_deploy.options import (
    FinetuneOptions,
    FuseOptions,
    LoadOptions,
    SelectionOptions,
)
from hydra_deploy.pruning import finetune_members, select_members
from hydra_deploy.pruning.finetune import FinetunedMembers
from hydra_deploy.specs import HydraSpec

__all__ = ["Built", "build_hydra", "choose_spec", "resolve_members"]

logger = logging.getLogger("hydra_deploy")


class _SpecMismatch(SpecError, ParameterError):
    """A spec file made for another architecture (a SpecError that names its parameters)."""


class Built(NamedTuple):
    """What :func:`build_hydra` made: the backbone, the spec as fused, the members (the backbone
    itself when nothing was fine-tuned, else the fine-tuned members with ``.history``) and the
    fused model."""

    backbone: Any
    spec: Any
    members: Any
    hydra: Any


def _checkpoints(checkpoint: Any) -> list:
    if checkpoint is None:
        return []
    if isinstance(checkpoint, (str, os.PathLike)):
        return [checkpoint]
    return list(checkpoint)


def resolve_members(checkpoint: Any = None, members: int | None = None, spec: Any = None) -> int:
    """The member count: one per checkpoint when several are given (a differing ``members`` is
    refused), else ``members``, else 3."""
    checkpoints = _checkpoints(checkpoint)
    if len(checkpoints) > 1:
        if members is not None and members != len(checkpoints):
            raise ParameterError(
                f"`members` {members} disagrees with the {len(checkpoints)} checkpoints given "
                "(one member per checkpoint); leave `members` out or give as many checkpoints"
            )
        if spec is not None:
            raise ParameterError(
                "`spec` with several `checkpoint` files is not supported: the heads are chosen "
                "per checkpoint (`calib`, `importance`, `heads_per_member`)"
            )
        return len(checkpoints)
    return 3 if members is None else members


def choose_spec(
    backbone: Any,
    options: SelectionOptions | None = None,
    *,
    backbone_name: str | None = None,
    **keywords: Any,
):
    """The HydraSpec ``options`` ask for (its fields may also be given as keywords, which win):
    read from ``spec`` (a JSON file), drawn at random (no ``calib``), or selected on ``calib``
    data by ``importance`` (default taylor when data is given)."""
    options = dataclasses.replace(options or SelectionOptions(), **keywords)
    if options.spec is not None:
        return _read_spec(options.spec, backbone, backbone_name or backbone.name)
    members = 3 if options.members is None else options.members
    k, keep_ratio = options.heads_per_member, options.keep_ratio
    if k is None and keep_ratio is None:
        k = max(1, backbone.num_heads // max(members, 1))
    kept = k if keep_ratio is None else keep_ratio * backbone.num_heads
    keeps_all = not isinstance(kept, Sequence) and kept >= backbone.num_heads
    if members == 1 and keeps_all and options.importance is None:
        logger.info(
            "one member keeping all %d heads per layer: the plain model (the single-model "
            "baseline to compare a Hydra export with)",
            backbone.num_heads,
        )
        return HydraSpec.full(
            backbone.name, backbone.num_layers, backbone.num_heads, backbone.head_dim, members=1
        )
    method = options.method
    if method != "random" and not options.calib:
        raise ParameterError(
            f"`importance` {method} needs `calib` (an image folder or .npz; text: .tsv or .npz)"
        )
    if method == "random" and not options.importance:
        logger.info(
            said(
                "no `calib` data: heads are drawn at random (seed %d); pass `calib`=DATA to "
                "choose them by importance"
            ),
            options.seed,
        )
    if method != "random" and (options.shared_layers or options.disjoint):
        raise ParameterError("`shared_layers` and `disjoint` apply to `importance` random only")
    if method == "random" and keep_ratio is None:
        return HydraSpec.random(
            backbone.name,
            backbone.num_layers,
            backbone.num_heads,
            backbone.head_dim,
            members=members,
            heads_per_member=k,
            shared_layers=options.shared_layers,
            disjoint=options.disjoint,
            seed=options.seed,
        )
    chosen = dataclasses.replace(options, members=members, heads_per_member=k, importance=method)
    return select_members(backbone, options=chosen)


def _read_spec(path: Any, backbone: Any, name: str):
    """The spec file ``path``, refused unless it fits ``backbone``'s geometry."""
    loaded = HydraSpec.from_json(path)
    wrong = [
        f"{k}={getattr(loaded, k)} (backbone has {getattr(backbone, k)})"
        for k in ("num_layers", "num_heads", "head_dim")
        if getattr(loaded, k) != getattr(backbone, k)
    ]
    if wrong:
        made_for = (
            f"it was made for {loaded.backbone!r}: pass `backbone` {loaded.backbone}, or "
            if loaded.backbone != name
            else ""
        )
        raise _SpecMismatch(
            f"`spec` {path} does not fit `backbone` {name}: {', '.join(wrong)}; "
            f"{made_for}write a spec for this backbone with hydra-fuse --backbone "
            f"{name} ... --save-spec FILE"
        )
    return loaded


#: build_hydra's parameter of each group
_GROUP_PARAMETERS = {
    LoadOptions: "load",
    SelectionOptions: "select",
    FinetuneOptions: "finetune",
    FuseOptions: "fuse",
}


def _keyword_targets() -> dict[str, list[tuple[type, str]]]:
    """build_hydra's keyword -> the (group, field) pairs it sets: every field a flag sets (or a
    group's flags), by its ``keyword`` name where it has one (``finetune_steps``)."""
    targets: dict[str, list[tuple[type, str]]] = {}
    for group in _GROUP_PARAMETERS:
        for f in dataclasses.fields(group):
            flag = f.metadata["flag"]
            if flag is None and f.metadata["group"] is None:
                continue  # library only: the group's own call sets it
            keyword = f.metadata["keyword"] or f.name  # finetune_steps for max_steps, ...
            targets.setdefault(keyword, []).append((group, f.name))
    return targets


def _groups(groups: dict[type, Any], keywords: dict[str, Any]) -> list[Any]:
    """The option groups: those given, the others built from ``keywords`` (or defaults)."""
    targets = _keyword_targets()
    values: dict[type, dict[str, Any]] = {group: {} for group in groups}
    for keyword, value in keywords.items():
        if keyword not in targets:
            raise TypeError(f"build_hydra() got an unexpected keyword argument {keyword!r}")
        for group, name in targets[keyword]:
            if groups[group] is not None:
                raise ParameterError(
                    f"`{keyword}` is set by `{_GROUP_PARAMETERS[group]}` too: give it there "
                    f"({group.__name__}({name}=...))"
                )
            values[group][name] = value
    return [
        given if given is not None else group(**values[group]) for group, given in groups.items()
    ]


def _check_load(backbone: Any, load: LoadOptions) -> None:
    """Refuse load options the backbone's family does not take."""
    zero_shot = [k for k in ("classes", "templates") if getattr(load, k)]
    if zero_shot and not str(backbone).startswith("openclip:"):
        raise ParameterError(
            "/".join(f"`{k}`" for k in zero_shot) + " apply to zero-shot OpenCLIP backbones "
            "(`backbone` openclip:<model name>)"
        )
    prefix, sep, _ = str(backbone).partition(":")
    prefixed = family_for_prefix(prefix) if sep else None
    if (
        (load.model_args or load.preprocessing)
        and prefixed is not None
        and not prefixed.takes_preprocessing
    ):
        raise ParameterError("`model_args` and `preprocessing` apply to timm ViT backbones")


def _tuning_without_data(tune: FinetuneOptions) -> bool:
    """Fine-tuning options given without fine-tuning data."""
    return not tune.given and bool(tune.max_steps or tune.save_dir or tune.warmup_steps)


def build_hydra(
    backbone: Any,
    *,
    load: LoadOptions | None = None,
    select: SelectionOptions | None = None,
    finetune: FinetuneOptions | None = None,
    fuse: FuseOptions | None = None,
    progress: bool = True,
    **keywords: Any,
) -> Built:
    """Backbone, spec, (fine-tuned) members and the fused model.

    ``backbone``: what :func:`~hydra_deploy.backbones.load_backbone` takes (an alias, a timm name,
    ``hf:<folder>``, ``openclip:<name>``, a folder); ``load`` (:class:`LoadOptions`): one
    ``checkpoint`` or several (a fused deep ensemble), ``num_classes``, ``new_classifier`` (BERT),
    ``model_args`` (timm constructor arguments), ``preprocessing`` (timm data config),
    ``classes``/``templates`` (zero-shot OpenCLIP). ``select`` (:class:`SelectionOptions`):
    ``members`` copies keeping ``heads_per_member`` heads per layer (or ``keep_ratio`` of them),
    from ``spec`` (a JSON file), at random, or chosen on ``calib`` data by ``importance``. With
    ``finetune`` (:class:`FinetuneOptions`) ``data`` each member is fine-tuned before it is fused
    by ``fuse`` (:class:`FuseOptions`: ``mlp_merge``, ``lowering``). Groups left out are built
    from ``keywords`` (the groups' fields, see the module docstring; ``finetune`` may be the
    data itself), else their defaults; ``seed`` seeds random weights too.
    """

    if finetune is not None and not isinstance(finetune, FinetuneOptions):
        keywords, finetune = {"finetune": finetune, **keywords}, None  # the data, as before
    groups = {LoadOptions: load, SelectionOptions: select, FinetuneOptions: finetune}
    load, select, tune, fusing = _groups({**groups, FuseOptions: fuse}, keywords)

    torch.manual_seed(select.seed)  # random weights (no checkpoint) repeat from run to run
    _check_load(backbone, load)
    select = dataclasses.replace(
        select, members=resolve_members(load.checkpoint, select.members, select.spec)
    )
    checkpoints = _checkpoints(load.checkpoint) or [None]
    if len(checkpoints) > 1:
        return _fuse_checkpoints(backbone, checkpoints, load, select, tune, fusing, progress)
    model = load_backbone(backbone, checkpoint=checkpoints[0], **load.load_kwargs())
    chosen = choose_spec(model, select, backbone_name=str(backbone))
    fused_members = model
    if tune.given:
        fused_members = finetune_members(model, chosen, options=tune, progress=progress)
    elif _tuning_without_data(tune) or tune.shared_parts != "per-member":
        raise ParameterError(
            "`finetune_steps`, `finetune_dir`, `warmup_steps` and `shared_parts` need `finetune` "
            "DATA"
        )
    hydra = fuse_members(fused_members, chosen, fusing.mlp_merge, lowering=fusing.lowering)
    return Built(model, hydra.spec, fused_members, hydra)  # the spec as fused (its mlp_merge)


def _check_ensemble(tune: FinetuneOptions, fusing: FuseOptions) -> None:
    """Refuse the options a deep ensemble of several checkpoints cannot take."""
    if fusing.mlp_merge == "average":
        raise ParameterError(
            "`mlp_merge` average with several `checkpoint` files would average the MLPs of "
            "independently trained models, whose hidden units do not correspond; use "
            "`mlp_merge` grouped (the default for several checkpoints)"
        )
    if _tuning_without_data(tune):
        raise ParameterError(
            "`finetune_steps`, `finetune_dir` and `warmup_steps` need `finetune` DATA"
        )
    if tune.shared_parts != "per-member":
        raise ParameterError(
            "`shared_parts` applies to members fine-tuned from one checkpoint; independently "
            "trained checkpoints have their own embeddings and classifiers"
        )


def _check_same_architecture(checkpoints: list, models: list) -> None:
    """Refuse checkpoints whose models differ from the first one's."""
    first = models[0]
    for checkpoint, other in zip(checkpoints[1:], models[1:], strict=True):
        fields = ("family", "num_layers", "num_heads", "head_dim", "embed_dim", "num_classes")
        wrong = [
            f"{k} {getattr(other, k)} (vs {getattr(first, k)})"
            for k in fields
            if getattr(other, k) != getattr(first, k)
        ]
        own = {k: tuple(v.shape) for k, v in first.module.state_dict().items()}
        theirs = {k: tuple(v.shape) for k, v in other.module.state_dict().items()}
        if not wrong and own != theirs:
            wrong = ["other weight shapes"]
        if wrong:
            raise ParameterError(
                f"`checkpoint` {checkpoint} is not the architecture of {checkpoints[0]}: "
                f"{', '.join(wrong)}; every checkpoint of a fused deep ensemble must be the same "
                "`backbone` with the same classes"
            )


def _fuse_checkpoints(
    backbone: Any,
    checkpoints: list,
    load: LoadOptions,
    select: SelectionOptions,
    tune: FinetuneOptions,
    fusing: FuseOptions,
    progress: bool,
) -> Built:
    """A deep ensemble fused into one network: one member per checkpoint, heads chosen on each
    checkpoint's own model (:func:`choose_spec` with one member, seed ``seed + m``), fine-tuned on
    its own when asked, fused with per-member MLPs."""
    _check_ensemble(tune, fusing)
    models = [load_backbone(backbone, checkpoint=c, **load.load_kwargs()) for c in checkpoints]
    _check_same_architecture(checkpoints, models)
    first = models[0]
    if select.heads_per_member is None and select.keep_ratio is None:
        select = dataclasses.replace(
            select, heads_per_member=max(1, first.num_heads // len(checkpoints))
        )
    heads, members, history = [], [], []
    for m, model in enumerate(models):
        own = dataclasses.replace(select, members=1, seed=select.seed + m)
        own_spec = choose_spec(model, own, backbone_name=str(backbone))
        heads.append(own_spec.members[0])
        member = model
        if tune.given:
            save_dir = None if tune.save_dir is None else Path(tune.save_dir) / f"checkpoint{m}"
            own_tune = dataclasses.replace(tune, seed=tune.seed + m, save_dir=save_dir)
            tuned = finetune_members(model, own_spec, options=own_tune, progress=progress)
            member = tuned[0]
            history.append({**tuned.history[0], "member": m, "checkpoint": str(checkpoints[m])})
        members.append(member)
    spec = HydraSpec(
        first.name,
        first.num_layers,
        first.num_heads,
        first.head_dim,
        heads,
        mlp_merge="grouped",
        importance=select.method,
        seed=select.seed,
        meta={"checkpoints": [str(c) for c in checkpoints]},
    )
    hydra = fuse_members(members, spec, "grouped", lowering=fusing.lowering)
    tuned_members = FinetunedMembers([getattr(m, "module", m) for m in members], history)
    return Built(first, hydra.spec, tuned_members if tune.given else first, hydra)
