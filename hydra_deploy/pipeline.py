"""Building a Hydra model in one call: backbone, members' heads, fine-tuning, fusion.

:func:`build_hydra` is what ``hydra-fuse`` and ``hydra-export`` run, as a library function with
keyword arguments (the commands only parse flags into them)::

    from hydra_deploy.pipeline import build_hydra

    built = build_hydra("vit_b16", checkpoint="vit_b16.safetensors", members=3,
                        heads_per_member=4, calib="train/", finetune="train/", epochs=1)
    built.hydra        # the fused HydraModel; built.spec, built.backbone, built.members

Several checkpoints of one architecture (``checkpoint=[a, b, c]``) become one member each (a
deep ensemble fused into one network), heads chosen per checkpoint, MLPs kept per member.

Errors about the arguments are :class:`~hydra_deploy.errors.ParameterError`: their message names
the parameters (``members``), and the commands say their flags (``--members``) instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

from hydra_deploy.errors import ParameterError, SpecError
from hydra_deploy.families import family_for_prefix

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
    *,
    members: int = 3,
    spec: Any = None,
    heads_per_member: int | Sequence[int] | None = None,
    keep_ratio: float | None = None,
    importance: str | None = None,
    calib: Any = None,
    ood: Any = None,
    objective: str | None = None,
    conditioning: str = "member",
    temperature: float = 0.5,
    max_examples: int = 512,
    shared_layers: int = 0,
    disjoint: bool = False,
    seed: int = 0,
    backbone_name: str | None = None,
):
    """The HydraSpec asked for: read from ``spec`` (a JSON file), drawn at random (no ``calib``),
    or selected on ``calib`` data by ``importance`` (default taylor when data is given)."""
    from hydra_deploy.pruning import select_members
    from hydra_deploy.specs import HydraSpec

    name = backbone_name or backbone.name
    if spec is not None:
        loaded = HydraSpec.from_json(spec)
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
                f"`spec` {spec} does not fit `backbone` {name}: {', '.join(wrong)}; "
                f"{made_for}write a spec for this backbone with hydra-fuse --backbone "
                f"{name} ... --save-spec FILE"
            )
        return loaded
    if members < 1:
        raise ParameterError(f"`members` must be at least 1, got {members}")
    if keep_ratio is not None and not 0.0 < keep_ratio <= 1.0:
        raise ParameterError(
            f"`keep_ratio` must be within (0, 1] (the fraction of each layer's heads a member "
            f"keeps; 1 keeps all), got {keep_ratio}"
        )
    k = heads_per_member
    if k is None and keep_ratio is None:
        k = max(1, backbone.num_heads // max(members, 1))
    kept = k if keep_ratio is None else keep_ratio * backbone.num_heads
    keeps_all = not isinstance(kept, Sequence) and kept >= backbone.num_heads
    if members == 1 and keeps_all and importance is None:
        logger.info(
            "one member keeping all %d heads per layer: the plain model (the single-model "
            "baseline to compare a Hydra export with)",
            backbone.num_heads,
        )
        return HydraSpec.full(
            backbone.name, backbone.num_layers, backbone.num_heads, backbone.head_dim, members=1
        )
    method = importance or ("taylor" if calib else "random")
    if method != "random" and not calib:
        raise ParameterError(
            f"`importance` {method} needs `calib` (an image folder or .npz; text: .tsv or .npz)"
        )
    if method == "random" and not importance:
        logger.info(
            "no calib data: heads are drawn at random (seed %d); pass calib data to choose "
            "them by importance",
            seed,
        )
    if method != "random" and (shared_layers or disjoint):
        raise ParameterError("`shared_layers` and `disjoint` apply to `importance` random only")
    if method == "random" and keep_ratio is None:
        return HydraSpec.random(
            backbone.name,
            backbone.num_layers,
            backbone.num_heads,
            backbone.head_dim,
            members=members,
            heads_per_member=k,
            shared_layers=shared_layers,
            disjoint=disjoint,
            seed=seed,
        )
    return select_members(
        backbone,
        members,
        heads_per_member=k,
        keep_ratio=keep_ratio,
        method=method,
        data=calib,
        ood_data=ood,
        seed=seed,
        objective=objective,
        temperature=temperature,
        max_examples=max_examples,
        conditioning=conditioning,
    )


def build_hydra(
    backbone: Any,
    *,
    checkpoint: Any = None,
    num_classes: int | None = None,
    new_classifier: bool = False,
    model_args: dict[str, Any] | None = None,
    preprocessing: dict[str, Any] | None = None,
    classes: Any = None,
    templates: Any = None,
    members: int | None = None,
    spec: Any = None,
    heads_per_member: int | Sequence[int] | None = None,
    keep_ratio: float | None = None,
    importance: str | None = None,
    calib: Any = None,
    ood: Any = None,
    objective: str | None = None,
    conditioning: str = "member",
    temperature: float = 0.5,
    max_examples: int = 512,
    shared_layers: int = 0,
    disjoint: bool = False,
    seed: int = 0,
    finetune: Any = None,
    epochs: float = 1.0,
    finetune_steps: int | None = None,
    lr: float = 1e-4,
    warmup_steps: int = 0,
    finetune_batch_size: int = 32,
    finetune_dir: Any = None,
    shared_parts: str = "per-member",
    mlp_merge: str | None = None,
    lowering: str | None = None,
    progress: bool = True,
) -> Built:
    """Backbone, spec, (fine-tuned) members and the fused model.

    ``backbone``: what :func:`~hydra_deploy.backbones.load_backbone` takes (an alias, a timm name,
    ``hf:<folder>``, ``openclip:<name>``, a folder), with ``checkpoint`` (one, or several for a
    fused deep ensemble), ``num_classes``, ``new_classifier`` (BERT), ``model_args`` (timm
    constructor arguments), ``preprocessing`` (timm data config) and ``classes``/``templates``
    (zero-shot OpenCLIP). Members: ``members`` copies keeping ``heads_per_member`` heads per layer
    (or ``keep_ratio`` of them), from ``spec`` (a JSON file), at random, or chosen on ``calib``
    data by ``importance`` (``select_members``'s options). With ``finetune`` data each member is
    fine-tuned (``finetune_members``'s options) before ``fuse`` (``mlp_merge``, ``lowering``:
    default ``fuse``'s).
    """
    import torch

    from hydra_deploy.backbones import load_backbone
    from hydra_deploy.fusion import DEFAULT_LOWERING, fuse

    lowering = lowering or DEFAULT_LOWERING

    torch.manual_seed(seed)  # random weights (no checkpoint) repeat from run to run
    zero_shot = {k: v for k, v in (("classes", classes), ("templates", templates)) if v}
    if zero_shot and not str(backbone).startswith("openclip:"):
        raise ParameterError(
            "/".join(f"`{k}`" for k in zero_shot) + " apply to zero-shot OpenCLIP backbones "
            "(`backbone` openclip:<model name>)"
        )
    model_args = dict(model_args or {})
    prefix, sep, _ = str(backbone).partition(":")
    prefixed = family_for_prefix(prefix) if sep else None
    if (model_args or preprocessing) and prefixed is not None and not prefixed.takes_preprocessing:
        raise ParameterError("`model_args` and `preprocessing` apply to timm ViT backbones")
    extra = {"preprocessing": preprocessing} if preprocessing else {}
    new_head = {"new_classifier": True} if new_classifier else {}
    members = resolve_members(checkpoint, members, spec)
    load_kwargs = dict(num_classes=num_classes, **zero_shot, **model_args, **extra, **new_head)
    selection = dict(
        heads_per_member=heads_per_member,
        keep_ratio=keep_ratio,
        importance=importance,
        calib=calib,
        ood=ood,
        objective=objective,
        conditioning=conditioning,
        temperature=temperature,
        max_examples=max_examples,
        shared_layers=shared_layers,
        disjoint=disjoint,
        backbone_name=str(backbone),
    )
    tuning = dict(
        epochs=epochs,
        lr=lr,
        batch_size=finetune_batch_size,
        max_steps=finetune_steps,
        progress=progress,
        warmup_steps=warmup_steps,
    )
    checkpoints = _checkpoints(checkpoint) or [None]
    if len(checkpoints) > 1:
        if mlp_merge == "average":
            raise ParameterError(
                "`mlp_merge` average with several `checkpoint` files would average the MLPs of "
                "independently trained models, whose hidden units do not correspond; use "
                "`mlp_merge` grouped (the default for several checkpoints)"
            )
        if not finetune and (finetune_steps or finetune_dir or warmup_steps):
            raise ParameterError(
                "`finetune_steps`, `finetune_dir` and `warmup_steps` need `finetune` DATA"
            )
        if shared_parts != "per-member":
            raise ParameterError(
                "`shared_parts` applies to members fine-tuned from one checkpoint; independently "
                "trained checkpoints have their own embeddings and classifiers"
            )
        return _fuse_checkpoints(
            backbone,
            checkpoints,
            load_kwargs,
            selection,
            tuning,
            seed,
            finetune,
            finetune_dir,
            lowering,
        )
    model = load_backbone(backbone, checkpoint=checkpoints[0], **load_kwargs)
    chosen = choose_spec(model, members=members, spec=spec, seed=seed, **selection)
    fused_members = model
    if finetune:
        from hydra_deploy.pruning import finetune_members

        fused_members = finetune_members(
            model,
            chosen,
            finetune,
            seed=seed,
            save_dir=finetune_dir,
            shared_parts=shared_parts,
            **tuning,
        )
    elif finetune_steps or finetune_dir or warmup_steps or shared_parts != "per-member":
        raise ParameterError(
            "`finetune_steps`, `finetune_dir`, `warmup_steps` and `shared_parts` need `finetune` "
            "DATA"
        )
    hydra = fuse(fused_members, chosen, mlp_merge, lowering=lowering)
    return Built(model, hydra.spec, fused_members, hydra)  # the spec as fused (its mlp_merge)


def _fuse_checkpoints(
    backbone, checkpoints, load_kwargs, selection, tuning, seed, finetune, finetune_dir, lowering
) -> Built:
    """A deep ensemble fused into one network: one member per checkpoint, heads chosen on each
    checkpoint's own model (:func:`choose_spec` with one member, seed ``seed + m``), fine-tuned on
    its own when asked, fused with per-member MLPs."""
    from hydra_deploy.backbones import load_backbone
    from hydra_deploy.fusion import fuse
    from hydra_deploy.pruning.finetune import FinetunedMembers
    from hydra_deploy.specs import HydraSpec

    models = [load_backbone(backbone, checkpoint=c, **load_kwargs) for c in checkpoints]
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
    selection = dict(selection)
    if selection["heads_per_member"] is None and selection["keep_ratio"] is None:
        selection["heads_per_member"] = max(1, first.num_heads // len(checkpoints))
    heads, members, history = [], [], []
    for m, model in enumerate(models):
        own_spec = choose_spec(model, members=1, seed=seed + m, **selection)
        heads.append(own_spec.members[0])
        member = model
        if finetune:
            from hydra_deploy.pruning import finetune_members

            save_dir = None if finetune_dir is None else finetune_dir / f"checkpoint{m}"
            tuned = finetune_members(
                model,
                own_spec,
                finetune,
                seed=seed + m,
                shared_parts="per-member",
                save_dir=save_dir,
                **tuning,
            )
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
        importance=selection["importance"] or ("taylor" if selection["calib"] else "random"),
        seed=seed,
        meta={"checkpoints": [str(c) for c in checkpoints]},
    )
    hydra = fuse(members, spec, "grouped", lowering=lowering)
    tuned_members = FinetunedMembers([getattr(m, "module", m) for m in members], history)
    return Built(first, hydra.spec, tuned_members if finetune else first, hydra)
