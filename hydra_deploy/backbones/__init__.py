"""Backbone loading: a short alias, a model name, a folder or a module -> an adapter.

:func:`load_backbone` asks the family registry (:mod:`hydra_deploy.families`) which family a name,
a folder or a module belongs to, and calls that family's loader or wrapper; the families' own
code lives in their modules (:mod:`.timm_loading` and :mod:`.timm_vit`, :mod:`.hf_bert`,
:mod:`.openclip`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from torch import nn

from hydra_deploy.backbones.base import AttentionWeights, BackboneAdapter
from hydra_deploy.backbones.timm_loading import ALIASES, resolve_name, set_preprocessing
from hydra_deploy.backbones.timm_loading import PREPROCESSING_KEYS as PREPROCESSING_KEYS
from hydra_deploy.backbones.timm_loading import check_file_shapes as check_file_shapes
from hydra_deploy.backbones.timm_loading import check_preprocessing as check_preprocessing
from hydra_deploy.backbones.timm_loading import wrap_vit as wrap_vit
from hydra_deploy.backbones.timm_vit import TimmVitAdapter
from hydra_deploy.errors import BackboneError, spelled
from hydra_deploy.families import (
    DEFAULT_FAMILY,
    Family,
    families,
    family_for_alias,
    family_for_folder,
    family_for_prefix,
    family_of_module,
    get_family,
)

__all__ = [
    "ALIASES",
    "AttentionWeights",
    "BackboneAdapter",
    "TimmVitAdapter",
    "load_backbone",
    "resolve_name",
]

logger = logging.getLogger("hydra_deploy")


def family_of_name(name: str | os.PathLike) -> Family:
    """The family a backbone name builds, decided without building it (as :func:`load_backbone`
    decides): a prefixed name's (``hf:``, ``openclip:``), a folder's (its ``config.json``), else
    the family of plain names (a timm ViT's)."""
    family, _ = _family_and_source(str(name))
    return family or get_family(DEFAULT_FAMILY)


def _family_and_source(name: str) -> tuple[Family | None, str]:
    """The family that builds ``name`` and what its loader gets.

    ``<prefix>:<rest>``: the prefix's family and ``rest`` (a Hugging Face folder goes to the
    family its ``model_type`` names); a folder: the family its ``config.json`` names; an alias:
    the family declaring it; else the family of plain names. (None, name): an unknown prefix.
    """
    prefix, sep, rest = name.partition(":")
    exists = Path(name).expanduser().exists()
    prefixed = family_for_prefix(prefix) if sep and not exists else None
    if prefixed is not None:
        folder = Path(rest).expanduser()
        recognised = family_for_folder(folder) if prefixed.model_types and folder.is_dir() else None
        return recognised or prefixed, rest
    if sep and len(prefix) > 1 and not exists:  # (one letter: a Windows drive)
        return None, name
    if Path(name).expanduser().is_dir():
        recognised = family_for_folder(Path(name).expanduser())
        if recognised is not None:
            return recognised, name
    return family_for_alias(name) or get_family(DEFAULT_FAMILY), name


def load_backbone(
    name_or_module: str | os.PathLike | nn.Module | BackboneAdapter,
    checkpoint: str | os.PathLike | None = None,
    num_classes: int | None = None,
    *,
    preprocessing: dict[str, Any] | None = None,
    **timm_kwargs: Any,
) -> BackboneAdapter:
    """Build or wrap a backbone and return its adapter.

    ``name_or_module``: an alias (``vit_b16``), any timm ViT name, a timm/HF folder whose
    ``config.json`` names the architecture, an existing timm ``VisionTransformer``, or an adapter
    (returned as is). ``checkpoint``: a local ``.safetensors``/``.pth``/``.pt`` file or folder;
    ``"hub"`` lets timm download the pretrained weights (needs network); ``None`` gives random
    weights (logged). ``num_classes`` sizes the classifier (default: the checkpoint's).

    A folder in timm's hub layout (``config.json`` with ``architecture``, ``num_classes``,
    ``model_args``, ``pretrained_cfg`` beside ``model.safetensors``) is parsed by timm's own
    ``load_model_config_from_path`` (what ``timm.create_model('local-dir:<folder>')`` reads):
    ``model_args`` are constructor arguments and the ``pretrained_cfg`` entries (mean, std,
    interpolation, crop_pct, crop_mode) replace the architecture's defaults. ``timm_kwargs`` are
    constructor arguments too (``embed_dim=64, depth=4, img_size=16, patch_size=4, in_chans=1``)
    and win over ``model_args``. A checkpoint that does not fit is explained from the file's own
    shapes, naming the constructor arguments to set.

    ``preprocessing`` (timm ViTs): how images are prepared for the model, as timm's data config:
    any of ``mean``, ``std`` (one value per channel, or one for all), ``interpolation``
    (``bilinear``, ``bicubic``, ...), ``crop_pct`` and ``crop_mode`` (``center``, ``squash``,
    ``border``); it wins over the checkpoint folder's ``pretrained_cfg`` and is kept in the model's
    ``pretrained_cfg``, so fine-tuning data, the fused model and the export's ``hydra.json`` use it.

    BERT classifiers also take ``new_classifier=True`` (see :func:`~hydra_deploy.backbones.hf_bert.
    load_bert`); other families refuse it. A Hugging Face folder (``hf:<folder>`` or the folder)
    is loaded by the family whose registered ``model_types`` hold its ``config.json``'s
    ``model_type``.
    """
    if preprocessing is not None and not _takes_preprocessing(name_or_module):
        raise BackboneError(
            "preprocessing= applies to timm ViT backbones; BERT models take text and OpenCLIP "
            "models use open_clip's own image preprocessing"
        )
    if isinstance(name_or_module, BackboneAdapter):
        _refuse_extra(name_or_module, checkpoint, num_classes, timm_kwargs)
        if preprocessing is not None:
            set_preprocessing(name_or_module.module, preprocessing)
        return name_or_module
    if isinstance(name_or_module, nn.Module):
        family = family_of_module(name_or_module)
        what = ("wrapper", type(name_or_module).__name__)
        return _build(
            family, what, name_or_module, checkpoint, num_classes, preprocessing, timm_kwargs
        )
    if not isinstance(name_or_module, (str, os.PathLike)):
        raise BackboneError(
            f"load_backbone expects a name, a folder or a timm VisionTransformer, "
            f"got {type(name_or_module).__name__}"
        )
    name = str(name_or_module)
    family, source = _family_and_source(name)
    if family is None:
        prefixed = [f.description for f in families() if f.prefix]
        raise BackboneError(
            f"unknown backbone family {name.partition(':')[0]!r} in {name!r}; use a timm ViT name "
            f"or alias ({', '.join(ALIASES)}), {', '.join(prefixed[:-1])} or {prefixed[-1]}"
        )
    return _build(
        family, ("loader", name), source, checkpoint, num_classes, preprocessing, timm_kwargs
    )


def _build(
    family: Family,
    what: tuple[str, str],
    source: Any,
    checkpoint: Any,
    num_classes: int | None,
    preprocessing: dict[str, Any] | None,
    kwargs: dict[str, Any],
) -> BackboneAdapter:
    """``family``'s loader or wrapper (``what``: the field, and the name errors give) called with
    the options that family takes."""
    field, name = what
    if not family.takes_new_classifier:
        _refuse_new_classifier(kwargs, name)
    if family.takes_preprocessing:
        kwargs = {**kwargs, "preprocessing": preprocessing}
    return family.resolve(field)(source, checkpoint, num_classes, **kwargs)


def _takes_preprocessing(name_or_module: Any) -> bool:
    """Whether ``load_backbone`` builds or wraps a model of a family that takes
    ``preprocessing=`` (timm ViTs) for this argument."""
    if isinstance(name_or_module, BackboneAdapter):
        return get_family(name_or_module.family).takes_preprocessing
    if isinstance(name_or_module, nn.Module):
        return family_of_module(name_or_module).takes_preprocessing
    family, _ = _family_and_source(str(name_or_module))
    return family is None or family.takes_preprocessing


def _refuse_new_classifier(kwargs: dict[str, Any], name: str) -> None:
    """``new_classifier`` is a BERT loader keyword: refused (when True) for the other families."""
    if kwargs.pop("new_classifier", False):
        raise BackboneError(
            f"{spelled('new_classifier=True', '--new-head')} applies to BERT classifiers "
            "(hf:<folder>), not "
            f"{name}; leave it out"
        )


def _refuse_extra(adapter: BackboneAdapter, checkpoint, num_classes, timm_kwargs) -> None:
    name = adapter.name
    if num_classes is not None and num_classes != adapter.num_classes:
        raise BackboneError(
            f"{name} has {adapter.num_classes} classes, not num_classes={num_classes}; "
            "leave num_classes=None for an already built backbone"
        )
    if checkpoint is not None or timm_kwargs:
        raise BackboneError(
            f"{name} is already built; checkpoint and timm keyword arguments apply only when "
            "load_backbone builds the model from a name"
        )
