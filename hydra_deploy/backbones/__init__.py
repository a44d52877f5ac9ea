"""Backbone registry and loading: a short alias, a timm name, a folder or a module -> an adapter."""

from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path
from typing import Any

from torch import nn

from hydra_deploy.backbones.base import AttentionWeights, BackboneAdapter
from hydra_deploy.backbones.checkpoint import folder_config, load_into, read_state_dict
from hydra_deploy.backbones.timm_vit import TimmVitAdapter
from hydra_deploy.errors import BackboneError, CheckpointError

__all__ = [
    "ALIASES",
    "AttentionWeights",
    "BackboneAdapter",
    "TimmVitAdapter",
    "load_backbone",
    "resolve_name",
]

logger = logging.getLogger("hydra_deploy")

#: Short names -> timm model names.
ALIASES: dict[str, str] = {
    "vit_ti16": "vit_tiny_patch16_224",
    "vit_s16": "vit_small_patch16_224",
    "vit_b16": "vit_base_patch16_224",
    "vit_l16": "vit_large_patch16_224",
}


def resolve_name(name: str) -> str:
    """An alias or timm ViT name -> the timm model name; unknown names get close suggestions."""
    import timm

    timm_name = ALIASES.get(name, name)
    if timm.is_model(timm_name):
        return timm_name
    known = list(ALIASES) + timm.list_models("vit_*") + timm.list_models("deit_*")
    close = difflib.get_close_matches(name, known, n=4, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise BackboneError(
        f"unknown backbone {name!r}: not an alias ({', '.join(ALIASES)}) nor a timm model name.{hint}"
    )


def load_backbone(
    name_or_module: str | os.PathLike | nn.Module | BackboneAdapter,
    checkpoint: str | os.PathLike | None = None,
    num_classes: int | None = None,
    **timm_kwargs: Any,
) -> BackboneAdapter:
    """Build or wrap a backbone and return its adapter.

    ``name_or_module``: an alias (``vit_b16``), any timm ViT name, a timm/HF folder whose
    ``config.json`` names the architecture, an existing timm ``VisionTransformer``, or an adapter
    (returned as is). ``checkpoint``: a local ``.safetensors``/``.pth``/``.pt`` file or folder;
    ``"hub"`` lets timm download the pretrained weights (needs network); ``None`` gives random
    weights (logged). ``num_classes`` sizes the classifier (default: the checkpoint's).
    BERT classifiers also take ``new_classifier=True`` (see :func:`~hydra_deploy.backbones.hf_bert.
    load_bert`); other families refuse it.
    """
    if isinstance(name_or_module, BackboneAdapter):
        _refuse_extra(name_or_module, checkpoint, num_classes, timm_kwargs)
        return name_or_module
    if isinstance(name_or_module, nn.Module):
        family = module_family(name_or_module)
        if family == "bert":
            from hydra_deploy.backbones.hf_bert import wrap_bert

            return wrap_bert(name_or_module, checkpoint, num_classes, **timm_kwargs)
        _refuse_new_classifier(timm_kwargs, type(name_or_module).__name__)
        if family == "openclip":
            from hydra_deploy.backbones.openclip import wrap_openclip

            return wrap_openclip(name_or_module, checkpoint, num_classes, **timm_kwargs)
        return _wrap_module(name_or_module, checkpoint, num_classes, timm_kwargs)
    if not isinstance(name_or_module, (str, os.PathLike)):
        raise BackboneError(
            f"load_backbone expects a name, a folder or a timm VisionTransformer, "
            f"got {type(name_or_module).__name__}"
        )
    name = str(name_or_module)
    prefix, sep, rest = name.partition(":")
    if sep and prefix in FAMILY_PREFIXES and not Path(name).expanduser().exists():
        if prefix == "openclip":
            from hydra_deploy.backbones.openclip import load_openclip

            _refuse_new_classifier(timm_kwargs, name)
            return load_openclip(rest, checkpoint, num_classes, **timm_kwargs)
        from hydra_deploy.backbones.hf_bert import load_bert

        return load_bert(rest, checkpoint, num_classes, **timm_kwargs)
    if sep and len(prefix) > 1 and not Path(name).expanduser().exists():
        raise BackboneError(
            f"unknown backbone family {prefix!r} in {name!r}; use a timm ViT name or alias "
            f"({', '.join(ALIASES)}), 'hf:<folder>' for a Hugging Face BERT classifier or "
            "'openclip:<model name>'"
        )
    if Path(name).expanduser().is_dir() and _is_hf_folder(name):  # transformers' config.json
        from hydra_deploy.backbones.hf_bert import load_bert

        return load_bert(name, checkpoint, num_classes, **timm_kwargs)
    if Path(name).expanduser().is_dir():  # a timm / HF hub folder: config.json names the model
        config = folder_config(name)
        if "architecture" not in config:
            raise BackboneError(
                f"folder {name!r} has no config.json with an 'architecture' entry; pass the model name "
                f"and the folder as checkpoint: load_backbone('vit_b16', checkpoint={name!r})"
            )
        checkpoint = name if checkpoint is None else checkpoint
        name = config["architecture"]
    _refuse_new_classifier(timm_kwargs, name)
    return _build_timm(name, checkpoint, num_classes, timm_kwargs)


def _refuse_new_classifier(kwargs: dict[str, Any], name: str) -> None:
    """``new_classifier`` is a BERT loader keyword: refused (when True) for the other families."""
    if kwargs.pop("new_classifier", False):
        raise BackboneError(
            f"new_classifier=True (--new-head) applies to BERT classifiers (hf:<folder>), not "
            f"{name}; leave it out"
        )


#: ``family:`` prefixes of backbone names that are not timm ViTs.
FAMILY_PREFIXES = ("hf", "openclip")


def module_family(module: nn.Module) -> str:
    """The family of a built model, from the library that defines its class."""
    origin = type(module).__module__
    if origin.startswith("transformers."):
        return "bert"
    if origin.startswith("open_clip") or origin == "hydra_deploy.backbones.openclip":
        return "openclip"  # open_clip's CLIP, or our ZeroShotClassifier wrapping its image tower
    return "vit"


def _is_hf_folder(folder: str) -> bool:
    """A transformers checkpoint folder: its config.json has ``model_type`` (timm's has none)."""
    import json

    config = Path(folder).expanduser() / "config.json"
    try:
        return "model_type" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


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


def _wrap_module(module: nn.Module, checkpoint, num_classes, timm_kwargs) -> BackboneAdapter:
    if timm_kwargs:
        raise BackboneError(
            f"timm keyword arguments {sorted(timm_kwargs)} apply only when building from a name"
        )
    if num_classes is not None and getattr(module, "num_classes", None) != num_classes:
        raise BackboneError(
            f"the model has {getattr(module, 'num_classes', '?')} classes, not num_classes={num_classes}; "
            "call model.reset_classifier(num_classes) yourself or leave num_classes=None"
        )
    weights = "module"
    if checkpoint is not None:
        if str(checkpoint) == "hub":
            raise CheckpointError("checkpoint='hub' needs a model name, not a built module")
        load_into(module, read_state_dict(checkpoint), str(checkpoint))
        weights = str(checkpoint)
    name = getattr(module, "pretrained_cfg", {}).get("architecture") or type(module).__name__
    return TimmVitAdapter(module, name=name, weights=weights)


def _build_timm(name: str, checkpoint, num_classes, timm_kwargs) -> BackboneAdapter:
    import timm

    timm_name = resolve_name(name)
    kwargs = dict(timm_kwargs)
    if num_classes is not None:
        if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
            raise BackboneError(f"num_classes must be a positive integer, got {num_classes!r}")
        kwargs["num_classes"] = num_classes

    if checkpoint is None:
        adapter = TimmVitAdapter(_create(timm, timm_name, pretrained=False, **kwargs), name=name)
        logger.warning(
            "%s: random weights (no checkpoint given); pass checkpoint=<file> for trained weights",
            name,
        )
        return adapter
    if str(checkpoint) == "hub":
        _check_hub_reachable(timm_name)
        try:
            model = _create(timm, timm_name, pretrained=True, **kwargs)
        except BackboneError:
            raise
        except Exception as err:
            raise CheckpointError(
                f"could not download pretrained weights for {timm_name!r} from the hub "
                f"({type(err).__name__}: {str(err)[:200]}). Offline? Pass a local file instead: "
                "checkpoint='path/to/model.safetensors' (or a .pth state dict, or a timm/HF folder)"
            ) from err
        weights = "hub"
    else:
        state_dict = read_state_dict(checkpoint)
        if num_classes is None:  # size the classifier like the checkpoint's
            config = folder_config(checkpoint)
            head = state_dict.get("head.weight")
            if head is not None:
                kwargs["num_classes"] = int(head.shape[0])
            elif "num_classes" in config:
                kwargs["num_classes"] = int(config["num_classes"])
        model = _create(timm, timm_name, pretrained=False, **kwargs)
        from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

        if isinstance(model, VisionTransformer):
            try:
                state_dict = checkpoint_filter_fn(state_dict, model)
            except Exception as err:
                raise CheckpointError(
                    f"checkpoint {str(checkpoint)!r} cannot be converted for {timm_name}: {err}"
                ) from err
        load_into(model, state_dict, str(checkpoint))
        weights = str(checkpoint)
    return TimmVitAdapter(model, name=name, weights=weights)


HUB_HOST = "huggingface.co"


def _check_hub_reachable(timm_name: str, timeout_s: float = 3.0) -> None:
    """Fail at once, not after minutes of retries, when the model hub cannot be reached."""
    import socket

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
        reason = "HF_HUB_OFFLINE is set"
    else:
        try:
            socket.create_connection((HUB_HOST, 443), timeout=timeout_s).close()
            return
        except OSError as err:
            reason = f"{HUB_HOST} is unreachable ({err})"
    raise CheckpointError(
        f"cannot download pretrained weights for {timm_name!r}: {reason}. Pass a local file "
        "instead: checkpoint='path/to/model.safetensors' (or a .pth state dict, or a timm/HF folder)"
    )


def _create(timm, timm_name: str, **kwargs):
    try:
        return timm.create_model(timm_name, **kwargs)
    except (TypeError, AssertionError) as err:  # timm checks many arguments with assert
        raise BackboneError(f"timm cannot build {timm_name!r} with {kwargs}: {err}") from err
