"""Options shared by the commands that build a Hydra model (hydra-fuse, hydra-export).

They map one to one onto the keyword arguments of :func:`hydra_deploy.pipeline.build_hydra`
(which calls ``load_backbone``, ``select_members``, ``finetune_members`` and ``fuse``); this
module parses flags into them and spells the library's parameter names as flags in its errors.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hydra_deploy.errors import HydraError, ParameterError
from hydra_deploy.export_folder import INTERPOLATIONS
from hydra_deploy.families import get_family

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


#: how the commands spell the library's parameters in its messages (others: ``--name-with-dashes``)
FLAGS = {
    "model_args": "--model-arg",
    "preprocessing": "the image preprocessing flags (--mean, --std, --interpolation, --crop-pct, "
    "--crop-mode)",
    "new_classifier": "--new-head",
}


def _flagged(call):
    """``call()``, its ParameterError spelled with the commands' flags (the same error type)."""
    try:
        return call()
    except ParameterError as err:
        err.args = (err.for_command(FLAGS),)
        raise


def resolve_members(args: argparse.Namespace) -> int:
    """``args.members`` filled in: the number of checkpoints when several are given (a differing
    ``--members`` is refused), else 3 by default."""
    from hydra_deploy import pipeline

    args.members = _flagged(
        lambda: pipeline.resolve_members(args.checkpoint or None, args.members, args.spec)
    )
    return args.members


def build_hydra(args: argparse.Namespace, progress: bool = True):
    """:func:`hydra_deploy.pipeline.build_hydra` with the flags' values: (backbone, spec, members,
    hydra)."""
    from hydra_deploy import pipeline

    kwargs = dict(
        checkpoint=args.checkpoint or None,
        num_classes=args.num_classes,
        new_classifier=bool(args.new_head),
        model_args=parse_model_args(getattr(args, "model_arg", None) or []),
        preprocessing=preprocessing_from_args(args),
        classes=args.classes,
        templates=args.templates,
        members=args.members,
        spec=args.spec,
        heads_per_member=args.heads_per_member,
        keep_ratio=args.keep_ratio,
        importance=args.importance,
        calib=args.calib,
        ood=args.ood,
        objective=args.objective,
        conditioning=args.conditioning,
        temperature=args.temperature,
        max_examples=args.max_examples,
        shared_layers=args.shared_layers,
        disjoint=args.disjoint,
        seed=args.seed,
        finetune=args.finetune,
        epochs=args.epochs,
        finetune_steps=args.finetune_steps,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        finetune_batch_size=args.finetune_batch_size,
        finetune_dir=args.finetune_dir,
        shared_parts=args.shared_parts,
        mlp_merge=args.mlp_merge,
        lowering=args.lowering,
    )
    resolve_members(args)
    return _flagged(lambda: pipeline.build_hydra(args.backbone, progress=progress, **kwargs))
