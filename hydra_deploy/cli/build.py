"""Options shared by the commands that build a Hydra model (hydra-fuse, hydra-export).

They map one to one onto the library: ``load_backbone`` (model), ``HydraSpec.random`` /
``select_members`` / ``HydraSpec.from_json`` (members), ``finetune_members`` and ``fuse``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hydra_deploy.errors import HydraError, SpecError
from hydra_deploy.export_folder import INTERPOLATIONS
from hydra_deploy.families import family_for_prefix, get_family

# hydra_deploy.fusion.grouped's, repeated so that parsing arguments needs no torch (tested equal)
LOWERINGS = ("bmm", "loop", "dense", "conv1d", "einsum")
DEFAULT_LOWERING = "loop"


def add_build_arguments(p: argparse.ArgumentParser, backbone_required: bool = True) -> None:
    model = p.add_argument_group("model")
    model.add_argument(
        "--backbone",
        required=backbone_required,
        help="alias (vit_ti16, vit_s16, vit_b16, vit_l16), timm ViT name or folder; "
        "hf:<folder> (or a transformers folder) for a BERT classifier; openclip:<model name>",
    )
    model.add_argument(
        "--checkpoint",
        nargs="+",
        metavar="FILE",
        help="local .safetensors/.pth file or folder; 'hub' downloads (needs network); omitted: "
        "random weights. Several checkpoints of one architecture (a deep ensemble): one member "
        "each, heads chosen per member, fused into one network with per-member MLPs",
    )
    model.add_argument(
        "--num-classes", type=int, help="classifier size (default: the checkpoint's, else timm's)"
    )
    model.add_argument(
        "--new-head",
        action="store_true",
        help="BERT: replace the checkpoint's classifier by a new random one of --num-classes "
        "classes (without it, a --num-classes other than the checkpoint's is refused)",
    )
    model.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="timm ViT constructor argument, repeatable (load_backbone's keyword arguments; win "
        "over a folder's config.json model_args): --model-arg embed_dim=64 --model-arg depth=4 "
        "--model-arg img_size=16 --model-arg patch_size=4 --model-arg in_chans=1; VALUE is JSON "
        "(4, 2.0, true, [16, 16]) or else a string (avg)",
    )
    model.add_argument(
        "--classes",
        help="openclip: a text file of class names, one per line (the zero-shot classifier)",
    )
    model.add_argument(
        "--templates",
        help="openclip: a text file of prompt templates with {} for the class name "
        "(default: a small built-in set)",
    )

    add_preprocessing_arguments(p)

    members = p.add_argument_group("members")
    members.add_argument(
        "--spec", type=Path, help="HydraSpec JSON file (instead of choosing heads)"
    )
    members.add_argument(
        "--members",
        "-m",
        type=int,
        default=None,
        help="M (default 3; with several --checkpoint files, one member per checkpoint)",
    )
    members.add_argument(
        "--heads-per-member",
        "-k",
        type=int,
        help="heads each member keeps per layer (default: num_heads // M)",
    )
    members.add_argument(
        "--keep-ratio",
        type=float,
        help="fraction of each layer's heads a member keeps (instead of -k)",
    )
    members.add_argument(
        "--importance",
        choices=("random", "taylor", "circuit"),
        default=None,
        help="how heads are chosen (default: taylor with --calib, else random)",
    )
    members.add_argument(
        "--calib",
        help="labelled data to score heads on: image folder (class "
        "per sub-folder) or .npz with x (preprocessed floats) and y (labels); text models: .tsv "
        "(label<TAB>text) or .npz with input_ids, attention_mask and y",
    )
    members.add_argument(
        "--ood",
        help="OOD inputs for the circuit OOD objective: folder or .npz; text models also .txt "
        "(one text per line) or .tsv",
    )
    members.add_argument(
        "--objective",
        choices=("loss", "ood"),
        help="circuit objective (default: ood with --ood, else loss)",
    )
    members.add_argument(
        "--conditioning",
        choices=("member", "headmap"),
        default="member",
        help="circuit: score each layer with the heads pruned so far masked (member, default) or "
        "with the circuit heads found so far masked (headmap: HeadMap's own search)",
    )
    members.add_argument(
        "--temperature",
        type=float,
        default=0.5,
        help="0: each member keeps its top heads; higher: more diverse draws",
    )
    members.add_argument(
        "--max-examples", type=int, default=512, help="examples used to score heads (default 512)"
    )
    members.add_argument(
        "--shared-layers",
        type=int,
        default=0,
        help="random heads: leading layers all members share (a shared trunk)",
    )
    members.add_argument(
        "--disjoint",
        action="store_true",
        help="random heads: members keep disjoint heads per layer",
    )
    members.add_argument(
        "--seed", type=int, default=0, help="seed of everything random (random weights too)"
    )

    tune = p.add_argument_group("fine-tuning")
    tune.add_argument(
        "--finetune",
        metavar="DATA",
        help="fine-tune every member on this labelled data (folder or .npz; text: .tsv or .npz)",
    )
    tune.add_argument("--epochs", type=float, default=1.0, help="fine-tuning epochs (default 1)")
    tune.add_argument("--finetune-steps", type=int, help="stop each member after this many steps")
    tune.add_argument("--lr", type=float, default=1e-4, help="fine-tuning learning rate")
    tune.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        help="linear learning-rate warm-up steps before the cosine decay (default 0)",
    )
    tune.add_argument("--finetune-batch-size", type=int, default=32)
    tune.add_argument(
        "--finetune-dir", type=Path, help="save members here and resume from them on a later run"
    )
    tune.add_argument(
        "--shared-parts",
        choices=("per-member", "frozen", "averaged"),
        default="per-member",
        help="embeddings, final norm, pooler and classifier: fine-tuned in every member (default; "
        "the export stores M copies), frozen, or fine-tuned then averaged (both: one copy, near "
        "one model's size)",
    )

    fusion = p.add_argument_group("fusion")
    fusion.add_argument(
        "--mlp-merge",
        choices=("average", "grouped"),
        default=None,
        help="average: one MLP of the members' mean weights (paper); "
        "grouped: every member keeps its own MLP",
    )
    fusion.add_argument(
        "--lowering",
        "--grouped-linear",
        dest="lowering",
        default=DEFAULT_LOWERING,
        choices=LOWERINGS,
        help="how grouped projections run and export (default loop: one MatMul per "
        "member on a 2-D weight, fastest on the CPU; bmm: one batched MatMul; "
        "einsum writes Einsum nodes)",
    )


CROP_MODES = ("center", "squash", "border")


def add_preprocessing_arguments(p: argparse.ArgumentParser) -> None:
    """Image preprocessing (timm ViTs): load_backbone's ``preprocessing=`` entries, one flag each."""
    prep = p.add_argument_group(
        "image preprocessing (timm ViTs; default: the checkpoint folder's config.json "
        "pretrained_cfg, else timm's default for the architecture)"
    )
    prep.add_argument(
        "--mean",
        type=float,
        nargs="+",
        metavar="M",
        help="normalization mean, one per channel or one for all (e.g. 0.5)",
    )
    prep.add_argument(
        "--std",
        type=float,
        nargs="+",
        metavar="S",
        help="normalization std, one per channel or one for all (e.g. 0.5)",
    )
    prep.add_argument("--interpolation", choices=INTERPOLATIONS, help="resize interpolation")
    prep.add_argument(
        "--crop-pct",
        type=float,
        help="center-crop fraction: resize to size / crop_pct, then crop (1.0: no crop)",
    )
    prep.add_argument(
        "--crop-mode",
        choices=CROP_MODES,
        help="center (resize the shorter side), squash (both sides) or border (pad)",
    )


def preprocessing_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``preprocessing=`` mapping the flags give (None when no flag is given)."""
    given = {
        key: getattr(args, key, None)
        for key in ("mean", "std", "interpolation", "crop_pct", "crop_mode")
    }
    given = {key: value for key, value in given.items() if value is not None}
    return given or None


def override_preprocessing(hydra: Any, preprocessing: dict[str, Any]) -> dict[str, Any]:
    """A rebuilt image model's recorded preprocessing with the flags' entries put in."""
    from hydra_deploy.backbones import check_preprocessing

    recorded = getattr(hydra, "preprocessing", None)
    family = getattr(hydra, "family", None)
    if not (family and get_family(family).takes_preprocessing) or not isinstance(recorded, dict):
        raise HydraError(
            "--mean, --std, --interpolation, --crop-pct and --crop-mode apply to timm ViT exports"
        )
    channels = int(recorded["input_size"][0])
    values = check_preprocessing(preprocessing, channels)
    for key in ("mean", "std"):
        if key in values and len(values[key]) == 1:
            values[key] = values[key] * channels
    return {**recorded, **values}


def parse_model_args(pairs: list[str]) -> dict[str, Any]:
    """``--model-arg KEY=VALUE`` pairs -> constructor keyword arguments (VALUE as JSON, else text)."""
    import json

    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise HydraError(
                f"--model-arg {pair!r} is not KEY=VALUE (e.g. --model-arg embed_dim=64)"
            )
        if key in ("num_classes", "pretrained", "checkpoint_path", "preprocessing"):
            flag = {"num_classes": "--num-classes", "preprocessing": "--mean/--std/..."}.get(
                key, "--checkpoint"
            )
            raise HydraError(f"--model-arg {key}=... is set with {flag}, not --model-arg")
        if key in kwargs:
            raise HydraError(f"--model-arg {key} is given twice ({kwargs[key]!r} and {text!r})")
        try:
            kwargs[key] = json.loads(text)
        except ValueError:
            kwargs[key] = text
    return kwargs


def resolve_members(args: argparse.Namespace) -> int:
    """``args.members`` filled in: the number of checkpoints when several are given (a differing
    ``--members`` is refused), else 3 by default."""
    checkpoints = args.checkpoint or []
    if len(checkpoints) > 1:
        if args.members is not None and args.members != len(checkpoints):
            raise HydraError(
                f"--members {args.members} disagrees with the {len(checkpoints)} checkpoints given "
                "(one member per checkpoint); leave --members out or give as many checkpoints"
            )
        if args.spec is not None:
            raise HydraError(
                "--spec with several --checkpoint files is not supported: the heads are chosen "
                "per checkpoint (--calib, --importance, --heads-per-member)"
            )
        args.members = len(checkpoints)
    elif args.members is None:
        args.members = 3
    return args.members


def choose_spec(args: argparse.Namespace, backbone: Any):
    """The HydraSpec the arguments ask for: read, drawn at random, or selected on data."""
    import logging

    from hydra_deploy.pruning import select_members
    from hydra_deploy.specs import HydraSpec

    if args.spec is not None:
        spec = HydraSpec.from_json(args.spec)
        wrong = [
            f"{k}={getattr(spec, k)} (backbone has {getattr(backbone, k)})"
            for k in ("num_layers", "num_heads", "head_dim")
            if getattr(spec, k) != getattr(backbone, k)
        ]
        if wrong:
            made_for = (
                f"it was made for {spec.backbone!r}: pass --backbone {spec.backbone}, or "
                if spec.backbone != args.backbone
                else ""
            )
            raise SpecError(
                f"--spec {args.spec} does not fit --backbone {args.backbone}: {', '.join(wrong)}; "
                f"{made_for}write a spec for this backbone with hydra-fuse --backbone "
                f"{args.backbone} ... --save-spec FILE"
            )
        return spec
    if args.members < 1:
        raise HydraError(f"--members must be at least 1, got {args.members}")
    if args.keep_ratio is not None and not 0.0 < args.keep_ratio <= 1.0:
        raise HydraError(
            f"--keep-ratio must be within (0, 1] (the fraction of each layer's heads a member "
            f"keeps; 1 keeps all), got {args.keep_ratio}"
        )
    k = args.heads_per_member
    if k is None and args.keep_ratio is None:
        k = max(1, backbone.num_heads // max(args.members, 1))
    keeps_all = (k if args.keep_ratio is None else args.keep_ratio * backbone.num_heads) >= (
        backbone.num_heads
    )
    if args.members == 1 and keeps_all and args.importance is None:
        logging.getLogger("hydra_deploy").info(
            "one member keeping all %d heads per layer: the plain model (the single-model "
            "baseline to compare a Hydra export with)",
            backbone.num_heads,
        )
        return HydraSpec.full(
            backbone.name, backbone.num_layers, backbone.num_heads, backbone.head_dim, members=1
        )
    importance = args.importance or ("taylor" if args.calib else "random")
    if importance != "random" and not args.calib:
        raise HydraError(
            f"--importance {importance} needs --calib (an image folder or .npz; text: .tsv or .npz)"
        )
    if importance == "random" and not args.importance:
        logging.getLogger("hydra_deploy").info(
            "no --calib data: heads are drawn at random (seed %d); pass --calib DATA to choose "
            "them by importance",
            args.seed,
        )
    if importance != "random" and (args.shared_layers or args.disjoint):
        raise HydraError("--shared-layers and --disjoint apply to --importance random only")
    if importance == "random" and args.keep_ratio is None:
        return HydraSpec.random(
            backbone.name,
            backbone.num_layers,
            backbone.num_heads,
            backbone.head_dim,
            members=args.members,
            heads_per_member=k,
            shared_layers=args.shared_layers,
            disjoint=args.disjoint,
            seed=args.seed,
        )
    return select_members(
        backbone,
        args.members,
        heads_per_member=k,
        keep_ratio=args.keep_ratio,
        method=importance,
        data=args.calib,
        ood_data=args.ood,
        seed=args.seed,
        objective=args.objective,
        temperature=args.temperature,
        max_examples=args.max_examples,
        conditioning=args.conditioning,
    )


def build_hydra(args: argparse.Namespace, progress: bool = True):
    """Backbone, spec, (fine-tuned) members and the fused model, as the arguments ask.

    Returns (backbone, spec, members, hydra); ``members`` is the backbone itself when nothing was
    fine-tuned, else the list of fine-tuned members (with ``.history``).
    """
    import torch

    from hydra_deploy.backbones import load_backbone
    from hydra_deploy.fusion import fuse

    torch.manual_seed(args.seed)  # random weights (no checkpoint) repeat from run to run
    zero_shot = {k: v for k, v in (("classes", args.classes), ("templates", args.templates)) if v}
    if zero_shot and not str(args.backbone).startswith("openclip:"):
        raise HydraError(
            f"--{'/--'.join(zero_shot)} apply to zero-shot OpenCLIP backbones "
            "(--backbone openclip:<model name>)"
        )
    model_args = parse_model_args(getattr(args, "model_arg", None) or [])
    preprocessing = preprocessing_from_args(args)
    prefix, sep, _ = str(args.backbone).partition(":")
    prefixed = family_for_prefix(prefix) if sep else None
    if (model_args or preprocessing) and prefixed is not None and not prefixed.takes_preprocessing:
        raise HydraError(
            "--model-arg and the image preprocessing flags (--mean, --std, --interpolation, "
            "--crop-pct, --crop-mode) apply to timm ViT backbones"
        )
    extra = {"preprocessing": preprocessing} if preprocessing else {}
    new_head = {"new_classifier": True} if args.new_head else {}
    resolve_members(args)
    load_kwargs = dict(num_classes=args.num_classes, **zero_shot, **model_args, **extra, **new_head)
    checkpoints = args.checkpoint or [None]
    if len(checkpoints) > 1:
        return _build_from_checkpoints(args, checkpoints, load_kwargs, progress)
    backbone = load_backbone(args.backbone, checkpoint=checkpoints[0], **load_kwargs)
    spec = choose_spec(args, backbone)
    members = backbone
    if args.finetune:
        from hydra_deploy.pruning import finetune_members

        members = finetune_members(
            backbone,
            spec,
            args.finetune,
            epochs=args.epochs,
            lr=args.lr,
            batch_size=args.finetune_batch_size,
            max_steps=args.finetune_steps,
            seed=args.seed,
            save_dir=args.finetune_dir,
            progress=progress,
            shared_parts=args.shared_parts,
            warmup_steps=args.warmup_steps,
        )
    elif (
        args.finetune_steps
        or args.finetune_dir
        or args.warmup_steps
        or args.shared_parts != "per-member"
    ):
        raise HydraError(
            "--finetune-steps, --finetune-dir, --warmup-steps and --shared-parts need --finetune DATA"
        )
    hydra = fuse(members, spec, args.mlp_merge, lowering=args.lowering)
    return backbone, hydra.spec, members, hydra  # the spec as fused (its mlp_merge)


def _build_from_checkpoints(
    args: argparse.Namespace, checkpoints: list, load_kwargs: dict, progress: bool
):
    """A deep ensemble fused into one network: one member per checkpoint, heads chosen on each
    checkpoint's own model (``choose_spec`` with one member, seed ``seed + m``), fine-tuned on
    its own when asked, fused with per-member MLPs."""
    import copy

    from hydra_deploy.backbones import load_backbone
    from hydra_deploy.fusion import fuse
    from hydra_deploy.pruning.finetune import FinetunedMembers
    from hydra_deploy.specs import HydraSpec

    if args.mlp_merge == "average":
        raise HydraError(
            "--mlp-merge average with several --checkpoint files would average the MLPs of "
            "independently trained models, whose hidden units do not correspond; use --mlp-merge "
            "grouped (the default for several checkpoints)"
        )
    backbones = [load_backbone(args.backbone, checkpoint=c, **load_kwargs) for c in checkpoints]
    first = backbones[0]
    for checkpoint, other in zip(checkpoints[1:], backbones[1:], strict=True):
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
            raise HydraError(
                f"--checkpoint {checkpoint} is not the architecture of {checkpoints[0]}: "
                f"{', '.join(wrong)}; every checkpoint of a fused deep ensemble must be the same "
                "--backbone with the same classes"
            )
    k = args.heads_per_member
    if k is None and args.keep_ratio is None:
        k = max(1, first.num_heads // len(checkpoints))
    heads, members, history = [], [], []
    for m, backbone in enumerate(backbones):
        one = copy.copy(args)
        one.members, one.heads_per_member, one.seed = 1, k, args.seed + m
        one.checkpoint = [checkpoints[m]]
        own_spec = choose_spec(one, backbone)
        heads.append(own_spec.members[0])
        member = backbone
        if args.finetune:
            from hydra_deploy.pruning import finetune_members

            tuned = finetune_members(
                backbone,
                own_spec,
                args.finetune,
                epochs=args.epochs,
                lr=args.lr,
                batch_size=args.finetune_batch_size,
                max_steps=args.finetune_steps,
                seed=args.seed + m,
                progress=progress,
                shared_parts="per-member",
                warmup_steps=args.warmup_steps,
                save_dir=None
                if args.finetune_dir is None
                else args.finetune_dir / f"checkpoint{m}",
            )
            member = tuned[0]
            history.append({**tuned.history[0], "member": m, "checkpoint": str(checkpoints[m])})
        members.append(member)
    if not args.finetune and (args.finetune_steps or args.finetune_dir or args.warmup_steps):
        raise HydraError("--finetune-steps, --finetune-dir and --warmup-steps need --finetune DATA")
    if args.shared_parts != "per-member":
        raise HydraError(
            "--shared-parts applies to members fine-tuned from one checkpoint; independently "
            "trained checkpoints have their own embeddings and classifiers"
        )
    spec = HydraSpec(
        first.name,
        first.num_layers,
        first.num_heads,
        first.head_dim,
        heads,
        mlp_merge="grouped",
        importance=args.importance or ("taylor" if args.calib else "random"),
        seed=args.seed,
        meta={"checkpoints": [str(c) for c in checkpoints]},
    )
    hydra = fuse(members, spec, "grouped", lowering=args.lowering)
    tuned_members = FinetunedMembers([getattr(m, "module", m) for m in members], history)
    return first, hydra.spec, tuned_members if args.finetune else first, hydra
