"""Options shared by the commands that build a Hydra model (hydra-fuse, hydra-export).

The flags are the fields of the option groups of :mod:`hydra_deploy.options` (``LoadOptions``,
``PreprocessingOptions``, ``SelectionOptions``, ``FinetuneOptions``, ``FuseOptions``): this module
adds them to a parser, reads them back into the groups, calls
:func:`hydra_deploy.pipeline.build_hydra` with them, and spells the library's parameter names as
flags in its errors.
"""

from __future__ import annotations

import argparse
from typing import Any

from hydra_deploy.errors import HydraError, ParameterError
from hydra_deploy.export_folder import DEFAULTED, INTERPOLATIONS
from hydra_deploy.families import get_family
from hydra_deploy.optional import lazy_module
from hydra_deploy.options import (
    CROP_MODES,
    DEFAULT_LOWERING,
    LOWERINGS,
    PARAMETER_FLAGS,
    FinetuneOptions,
    FuseOptions,
    LoadOptions,
    PreprocessingOptions,
    SelectionOptions,
    add_options,
    from_args,
    parse_model_args,
)

# the stages, imported when a command builds (``--help`` imports no torch)
backbones = lazy_module("hydra_deploy.backbones")
pipeline = lazy_module("hydra_deploy.pipeline")

__all__ = [
    "CROP_MODES",
    "DEFAULT_LOWERING",
    "FLAGS",
    "INTERPOLATIONS",
    "LOWERINGS",
    "add_build_arguments",
    "add_preprocessing_arguments",
    "build_hydra",
    "override_preprocessing",
    "parse_model_args",
    "preprocessing_from_args",
    "resolve_members",
]

BACKBONE_HELP = (
    "alias (vit_ti16, vit_s16, vit_b16, vit_l16), timm ViT name or folder; "
    "hf:<folder> (or a transformers folder) for a BERT classifier; openclip:<model name>"
)


def add_build_arguments(p: argparse.ArgumentParser, backbone_required: bool = True) -> None:
    """``--backbone`` (build_hydra's positional argument) and every option group's flags."""
    model = p.add_argument_group(LoadOptions.SECTION)
    model.add_argument("--backbone", required=backbone_required, help=BACKBONE_HELP)
    add_options(p, LoadOptions, section=model)  # and PreprocessingOptions' group
    for group in (SelectionOptions, FinetuneOptions, FuseOptions):
        add_options(p, group)


def add_preprocessing_arguments(p: argparse.ArgumentParser) -> None:
    """Image preprocessing (timm ViTs): load_backbone's ``preprocessing=`` entries, one flag each."""
    add_options(p, PreprocessingOptions)


def preprocessing_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``preprocessing=`` mapping the flags give (None when no flag is given)."""
    return _flagged(lambda: from_args(PreprocessingOptions, args).as_dict())


def override_preprocessing(hydra: Any, preprocessing: dict[str, Any]) -> dict[str, Any]:
    """A rebuilt image model's recorded preprocessing with the flags' entries put in."""
    recorded = getattr(hydra, "preprocessing", None)
    family = getattr(hydra, "family", None)
    if not (family and get_family(family).takes_preprocessing) or not isinstance(recorded, dict):
        raise HydraError(
            "--mean, --std, --interpolation, --crop-pct and --crop-mode apply to timm ViT exports"
        )
    channels = int(recorded["input_size"][0])
    values = backbones.check_preprocessing(preprocessing, channels)
    for key in ("mean", "std"):
        if key in values and len(values[key]) == 1:
            values[key] = values[key] * channels
    merged = {**recorded, **values}
    defaulted = [k for k in recorded.get(DEFAULTED) or () if k not in values]
    merged.pop(DEFAULTED, None)
    return {**merged, DEFAULTED: defaulted} if defaulted else merged


#: how the commands spell the library's parameters in its messages (others: ``--name-with-dashes``)
FLAGS = PARAMETER_FLAGS


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
    args.members = _flagged(
        lambda: pipeline.resolve_members(args.checkpoint or None, args.members, args.spec)
    )
    return args.members


def build_hydra(args: argparse.Namespace, progress: bool = True):
    """:func:`hydra_deploy.pipeline.build_hydra` with the flags' values: (backbone, spec, members,
    hydra)."""

    def build():
        load = from_args(LoadOptions, args)  # --model-arg parsed first, as before
        resolve_members(args)
        return pipeline.build_hydra(
            args.backbone,
            load=load,
            select=from_args(SelectionOptions, args),
            finetune=from_args(FinetuneOptions, args),
            fuse=from_args(FuseOptions, args),
            progress=progress,
        )

    return _flagged(build)
