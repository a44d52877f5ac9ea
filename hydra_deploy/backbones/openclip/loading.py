"""Building an OpenCLIP adapter: from a model name and pretrained tag (open_clip's hub), from a built
model, or rebuilt from an export's recorded arguments.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from hydra_deploy.backbones.base import RANDOM_WEIGHTS
from hydra_deploy.backbones.checkpoint import HUB_HOST, hub_unreachable_reason
from hydra_deploy.backbones.openclip.adapter import OpenClipAdapter, check_supported, open_clip
from hydra_deploy.backbones.openclip.zero_shot import (
    DEFAULT_TEMPLATES,
    ZeroShotClassifier,
    check_templates,
    class_weights_from_text,
    read_names,
)
from hydra_deploy.errors import BackboneError, CheckpointError, UnsupportedModelError, said, spelled

logger = logging.getLogger("hydra_deploy")


def _check_model_name(model_name: str) -> None:
    if model_name.startswith("local-dir:"):
        return
    if model_name.startswith("hf-hub:"):
        reason = hub_unreachable_reason(HUB_HOST)
        if reason:
            raise CheckpointError(
                f"openclip:{model_name} needs a download but {reason}; use a built-in model name "
                "with checkpoint='path/to/open_clip_model.safetensors', or 'local-dir:<folder>'"
            )
        return
    if open_clip.get_model_config(model_name) is None:
        close = difflib.get_close_matches(model_name, open_clip.list_models(), n=4, cutoff=0.5)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise BackboneError(
            f"unknown OpenCLIP model {model_name!r}.{hint} open_clip.list_models() lists the names"
        )


def _check_pretrained(model_name: str, pretrained: str) -> str:
    """A pretrained tag must be known and downloadable now."""
    cfg = open_clip.get_pretrained_cfg(model_name, pretrained)
    if not cfg:
        tags = open_clip.list_pretrained_tags_by_model(model_name)
        raise CheckpointError(
            f"pretrained={pretrained!r} is neither a file nor a pretrained tag of {model_name!r} "
            f"(tags: {', '.join(tags) or 'none'}); pass checkpoint='path/to/weights' for local weights"
        )
    host = HUB_HOST if cfg.get("hf_hub") else (urlparse(cfg.get("url", "")).hostname or HUB_HOST)
    reason = hub_unreachable_reason(host)
    if reason:
        raise CheckpointError(
            f"pretrained={pretrained!r} of {model_name!r} needs a download but {reason}; download "
            "the weights on a connected machine and pass the local file: "
            "checkpoint='path/to/open_clip_model.safetensors' (or .bin/.pt)"
        )
    return pretrained


def _tokenizer_for(model_name: str | None, clip: nn.Module) -> Callable[[list[str]], torch.Tensor]:
    context_length = getattr(clip, "context_length", None)
    if model_name is None:
        return open_clip.SimpleTokenizer(context_length=context_length or 77)
    try:
        return open_clip.get_tokenizer(model_name, context_length=context_length)
    except Exception as err:  # HF tokenizers download their files
        raise CheckpointError(
            f"cannot load the tokenizer of {model_name!r} ({type(err).__name__}: {str(err)[:200]}); "
            "models with Hugging Face tokenizers need the tokenizer files cached (or network)"
        ) from err


def wrap_openclip(
    module: nn.Module,
    checkpoint: str | os.PathLike | None = None,
    num_classes: int | None = None,
    *,
    classes: str | os.PathLike | Sequence[str] | None = None,
    templates: str | os.PathLike | Sequence[str] | None = None,
    tokenizer: Callable[[list[str]], torch.Tensor] | None = None,
    model_name: str | None = None,
    weights: str | None = None,
) -> OpenClipAdapter:
    """An adapter over a built open_clip model (CLIP / CustomTextCLIP) or a ZeroShotClassifier.

    For a CLIP model, the class weights come from its text tower: ``classes`` (names or a text
    file, required), ``templates`` (default :data:`DEFAULT_TEMPLATES`), ``tokenizer`` (default:
    ``open_clip.get_tokenizer(model_name)``, or open_clip's ``SimpleTokenizer`` without a name).
    ``checkpoint``: a local open_clip checkpoint loaded into the model first. The image tower's
    attention modules are replaced in place by gate-able equivalents (see the module docstring).
    """
    display = model_name or type(module).__name__
    if isinstance(module, ZeroShotClassifier):
        if checkpoint is not None or classes is not None or templates is not None:
            raise BackboneError(
                "a ZeroShotClassifier already holds its class weights; checkpoint, classes and "
                "templates apply only to a CLIP model"
            )
        _check_num_classes(num_classes, module.num_classes)
        return OpenClipAdapter(
            module, name=f"openclip:{display}", weights=weights or "module", model_name=model_name
        )
    if not (hasattr(module, "visual") and hasattr(module, "encode_text")):
        raise BackboneError(
            f"{type(module).__name__} is not an OpenCLIP model with an image and a text tower; pass "
            "the full CLIP model (open_clip.create_model(...)) so the text side can build the classifier"
        )
    check_supported(module.visual)  # refuse before the text tower does any work
    if checkpoint is not None:
        _load_checkpoint(module, checkpoint)
        weights = str(checkpoint)
    class_names = read_names(classes, "classes")
    template_list = (
        list(DEFAULT_TEMPLATES) if templates is None else read_names(templates, "templates")
    )
    check_templates(template_list)
    _check_num_classes(num_classes, len(class_names))
    if len(set(class_names)) != len(class_names):
        logger.warning("openclip: the class list holds duplicate names")
    tokenizer = tokenizer or _tokenizer_for(model_name, module)
    class_weights = class_weights_from_text(module, tokenizer, class_names, template_list)
    logit_bias = getattr(module, "logit_bias", None)
    classifier = ZeroShotClassifier(
        module.visual,
        class_weights,
        module.logit_scale.detach(),
        None if logit_bias is None else logit_bias.detach(),
        class_names,
    )
    logger.info(
        "openclip %s: zero-shot classifier over %d classes from %d prompt templates",
        display,
        len(class_names),
        len(template_list),
    )
    return OpenClipAdapter(
        classifier,
        name=f"openclip:{display}",
        weights=weights or "module",
        model_name=model_name,
        templates=template_list,
    )


def _check_num_classes(num_classes: int | None, actual: int) -> None:
    if num_classes is not None and num_classes != actual:
        raise BackboneError(
            f"num_classes={num_classes} but the zero-shot classifier has {actual} classes (one per "
            "class name); leave num_classes=None"
        )


def _load_checkpoint(clip: nn.Module, checkpoint: str | os.PathLike) -> None:
    path = Path(checkpoint).expanduser()
    if str(checkpoint) == "hub":
        raise CheckpointError(
            "checkpoint='hub' is the timm spelling; for OpenCLIP pass pretrained=<tag> (e.g. "
            "'laion2b_s34b_b79k', needs network) or checkpoint=<local file>"
        )
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not exist; pass a local open_clip checkpoint "
            "(.safetensors/.bin/.pt) or checkpoint=None for random weights"
        )
    try:
        open_clip.load_checkpoint(clip, str(path))
    except Exception as err:  # missing/unexpected keys, shape mismatch, corrupt file
        raise CheckpointError(
            f"cannot load checkpoint {str(path)!r} into the OpenCLIP model ({type(err).__name__}: "
            f"{str(err)[:300]}); check that the model name matches the checkpoint"
        ) from err


def load_openclip(
    model_name: str,
    checkpoint: str | os.PathLike | None = None,
    num_classes: int | None = None,
    classes: str | os.PathLike | Sequence[str] | None = None,
    templates: str | os.PathLike | Sequence[str] | None = None,
    pretrained: str | None = None,
    **kwargs: Any,
) -> OpenClipAdapter:
    """Build ``open_clip.create_model(model_name)`` and its zero-shot classifier -> adapter.

    ``checkpoint``: a local open_clip checkpoint file (the offline way to real weights);
    ``pretrained``: an open_clip pretrained tag (downloads; refused at once when offline) or a file;
    neither: random weights (logged). ``classes`` (required): class names or a text file with one
    per line; ``templates``: prompt templates with ``{}`` (default :data:`DEFAULT_TEMPLATES`).
    ``tokenizer`` may be passed in ``kwargs``; the rest goes to ``open_clip.create_model``
    (e.g. ``force_image_size``).
    """
    tokenizer = kwargs.pop("tokenizer", None)
    if classes is None:
        raise BackboneError(
            f"openclip:{model_name} needs the class names of the zero-shot classifier: "
            + spelled(
                "pass classes=[...] or a text file with one name per line",
                "pass --classes names.txt (a text file with one name per line)",
            )
        )
    _check_model_name(model_name)
    if checkpoint is not None and pretrained is not None:
        raise BackboneError("give checkpoint (a local file) or pretrained (a tag), not both")
    if pretrained is not None and Path(pretrained).expanduser().is_file():
        checkpoint, pretrained = pretrained, None  # a file: loaded as a checkpoint
    if pretrained is not None:
        pretrained = _check_pretrained(model_name, pretrained)
    class_names = read_names(classes, "classes")  # fail on a bad class file before building
    _check_num_classes(num_classes, len(class_names))
    try:
        clip = open_clip.create_model(model_name, pretrained=pretrained, **kwargs)
    except (TypeError, ValueError, AssertionError, RuntimeError) as err:
        raise BackboneError(
            f"open_clip cannot build {model_name!r} with {kwargs or 'default arguments'}: "
            f"{type(err).__name__}: {str(err)[:300]}"
        ) from err
    if checkpoint is None and pretrained is None and not model_name.startswith("local-dir:"):
        weights = "random"
        logger.warning(RANDOM_WEIGHTS, f"openclip:{model_name}", said("`checkpoint`=<file>"))
    else:
        weights = str(checkpoint or pretrained or model_name)
    return wrap_openclip(
        clip.eval(),
        checkpoint,
        None,
        classes=class_names,
        templates=templates,
        tokenizer=tokenizer or _tokenizer_for(model_name, clip),
        model_name=model_name,
        weights=weights,
    )


def build_visual(kwargs: dict[str, Any]) -> nn.Module:
    """A placeholder-weight open_clip VisionTransformer from ``constructor_kwargs()["vision"]``."""
    transformer = open_clip.transformer
    kwargs = dict(kwargs)
    eps = kwargs.pop("layer_norm_eps", 1e-5)
    quick_gelu = kwargs.pop("quick_gelu", False)
    approximate = kwargs.pop("gelu_approximate", "none")
    preprocess = kwargs.pop("preprocess_cfg", None)
    for key in ("num_classes", "logit_bias"):
        kwargs.pop(key, None)
    act = transformer.QuickGELU if quick_gelu else partial(nn.GELU, approximate=approximate)
    try:
        visual = transformer.VisionTransformer(
            **{
                **kwargs,
                "image_size": tuple(kwargs["image_size"]),
                "patch_size": tuple(kwargs["patch_size"]),
            },
            act_layer=act,
            norm_layer=partial(transformer.LayerNorm, eps=eps),
        )
    except (TypeError, AssertionError, KeyError) as err:
        raise UnsupportedModelError(
            f"cannot rebuild the OpenCLIP image tower from {kwargs}: {err}"
        ) from err
    if preprocess:
        visual.preprocess_cfg = dict(preprocess)
        visual.image_mean, visual.image_std = tuple(preprocess["mean"]), tuple(preprocess["std"])
    return visual.eval()


def rebuild_openclip(backbone_kwargs: dict[str, Any]) -> OpenClipAdapter:
    """An adapter of the recorded architecture with placeholder weights (zero class weights).

    For reloading an export folder: build, fuse, then load the saved state dict (which holds the
    image tower's weights, the class weights and the logit scale).
    """
    vision = backbone_kwargs["vision"]
    visual = build_visual(vision)
    classes = list(backbone_kwargs.get("classes") or [])
    num_classes = int(vision.get("num_classes", len(classes)))
    classifier = ZeroShotClassifier(
        visual,
        torch.zeros(num_classes, int(vision["output_dim"])),
        0.0,
        0.0 if vision.get("logit_bias") else None,
        classes or None,
    )
    name = backbone_kwargs.get("name") or f"openclip:{backbone_kwargs.get('model_name')}"
    return OpenClipAdapter(
        classifier,
        name=name,
        weights=str(backbone_kwargs.get("weights", "export")),
        model_name=backbone_kwargs.get("model_name"),
        templates=backbone_kwargs.get("templates"),
    )
