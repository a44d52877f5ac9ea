"""Loading the vit family: timm names and aliases, timm hub folders, checkpoints, preprocessing.

The vit family's loader (:func:`load_vit`) and wrapper (:func:`wrap_vit`), as the family registry
(:mod:`hydra_deploy.families`) names them; :func:`hydra_deploy.backbones.load_backbone` picks the
family and calls them.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
from pathlib import Path
from typing import Any

from torch import nn

from hydra_deploy.backbones.base import RANDOM_WEIGHTS, BackboneAdapter
from hydra_deploy.backbones.checkpoint import (
    folder_config,
    hub_unreachable_reason,
    load_into,
    read_state_dict,
)
from hydra_deploy.backbones.timm_vit import TimmVitAdapter, timm
from hydra_deploy.errors import BackboneError, CheckpointError, counted, said, spelled
from hydra_deploy.export_folder import (
    DECISIVE_PREPROCESSING,
    DEFAULTED,
    INTERPOLATIONS,
    default_preprocessing_warning,
)
from hydra_deploy.families import get_family

logger = logging.getLogger("hydra_deploy")

#: Short names -> timm model names (the vit family's ``aliases`` in the registry).
ALIASES: dict[str, str] = get_family("vit").aliases  # type: ignore[assignment]


def resolve_name(name: str) -> str:
    """An alias or timm ViT name -> the timm model name; unknown names get close suggestions."""
    timm_name = ALIASES.get(name, name)
    if timm.is_model(timm_name):
        return timm_name
    known = list(ALIASES) + timm.list_models("vit_*") + timm.list_models("deit_*")
    close = difflib.get_close_matches(name, known, n=4, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise BackboneError(
        f"unknown backbone {name!r}: not an alias ({', '.join(ALIASES)}) nor a timm model name.{hint}"
    )


#: The data-config entries ``preprocessing=`` may set (timm's ``resolve_data_config`` names).
PREPROCESSING_KEYS = ("mean", "std", "interpolation", "crop_pct", "crop_mode")


def check_preprocessing(preprocessing: Any, in_chans: int | None = None) -> dict[str, Any]:
    """Validate a ``preprocessing=`` mapping; returns it with mean/std as tuples of floats."""
    if not isinstance(preprocessing, dict):
        raise BackboneError(
            f"preprocessing must be a dict (e.g. {{'mean': (0.5,), 'std': (0.5,)}}), got "
            f"{type(preprocessing).__name__}"
        )
    unknown = sorted(set(preprocessing) - set(PREPROCESSING_KEYS))
    if unknown:
        raise BackboneError(
            f"preprocessing has unknown entries {unknown}; it takes {', '.join(PREPROCESSING_KEYS)} "
            "(the input size is the model's own: set img_size / in_chans as constructor arguments)"
        )
    out: dict[str, Any] = {}
    for key in ("mean", "std"):
        if preprocessing.get(key) is None:
            continue
        value = preprocessing[key]
        values = (value,) if isinstance(value, (int, float)) else value
        try:
            values = tuple(float(v) for v in values)
        except (TypeError, ValueError):
            raise BackboneError(
                f"preprocessing {key} must be numbers (one per channel), got {value!r}"
            ) from None
        if len(values) not in {1, in_chans or len(values)}:
            raise BackboneError(
                f"preprocessing {key} has {len(values)} values, the model has "
                f"{counted(in_chans, 'input channel')}: give one value per channel, or one for all"
            )
        if key == "std" and any(v <= 0 for v in values):
            raise BackboneError(f"preprocessing std must be positive, got {values}")
        out[key] = values
    interpolation = preprocessing.get("interpolation")
    if interpolation is not None:
        if interpolation not in INTERPOLATIONS:
            raise BackboneError(
                f"preprocessing interpolation {interpolation!r} is not one of {', '.join(INTERPOLATIONS)}"
            )
        out["interpolation"] = interpolation
    crop_pct = preprocessing.get("crop_pct")
    if crop_pct is not None:
        if isinstance(crop_pct, bool) or not isinstance(crop_pct, (int, float)) or crop_pct <= 0:
            raise BackboneError(
                f"preprocessing crop_pct must be a positive number (1.0: no crop), got {crop_pct!r}"
            )
        out["crop_pct"] = float(crop_pct)
    crop_mode = preprocessing.get("crop_mode")
    if crop_mode is not None:
        if crop_mode not in ("center", "squash", "border"):
            raise BackboneError(
                f"preprocessing crop_mode {crop_mode!r} is not one of center, squash, border"
            )
        out["crop_mode"] = crop_mode
    return out


def set_preprocessing(module: nn.Module, preprocessing: dict[str, Any]) -> None:
    """Record ``preprocessing`` in ``module.pretrained_cfg`` (where timm's data config reads it)."""
    in_chans = getattr(
        getattr(getattr(module, "patch_embed", None), "proj", None), "in_channels", None
    )
    values = check_preprocessing(preprocessing, in_chans)
    cfg = {**dict(getattr(module, "pretrained_cfg", None) or {}), **values}
    module.pretrained_cfg = cfg  # a new dict: timm's registry defaults stay as they are
    module.default_cfg = cfg  # timm's older alias
    defaulted = getattr(module, "preprocessing_defaulted", ())
    module.preprocessing_defaulted = tuple(k for k in defaulted if k not in values)


def load_vit(
    name: str,
    checkpoint=None,
    num_classes: int | None = None,
    *,
    preprocessing: dict[str, Any] | None = None,
    **timm_kwargs: Any,
) -> BackboneAdapter:
    """A timm ViT from an alias, a timm model name or a folder in timm's hub layout (the ``vit``
    family's loader; :func:`hydra_deploy.backbones.load_backbone` documents the arguments)."""
    if Path(name).expanduser().is_dir():  # a timm / HF hub folder: config.json names the model
        config = folder_config(name)
        if "architecture" not in config:
            raise BackboneError(
                f"folder {name!r} has no config.json with an 'architecture' entry; pass the model name "
                f"and the folder as checkpoint: load_backbone('vit_b16', checkpoint={name!r})"
            )
        checkpoint = name if checkpoint is None else checkpoint
        name = config["architecture"]
    timm_name = resolve_name(name)
    if preprocessing is not None:
        check_preprocessing(preprocessing)  # before any download or build
    kwargs = dict(timm_kwargs)
    if num_classes is not None:
        if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
            raise BackboneError(f"num_classes must be a positive integer, got {num_classes!r}")
        kwargs["num_classes"] = num_classes
    if checkpoint is None:
        model = _create(timm_name, pretrained=False, **kwargs)
        if preprocessing is not None:
            set_preprocessing(model, preprocessing)
        logger.warning(RANDOM_WEIGHTS, name, said("`checkpoint`=<file>"))
        return TimmVitAdapter(model, name=name)
    if str(checkpoint) == "hub":
        model = _from_hub(timm_name, kwargs)
        weights = "hub"
        if preprocessing is not None:
            set_preprocessing(model, preprocessing)
    else:
        model = _from_checkpoint(name, timm_name, checkpoint, num_classes, kwargs, preprocessing)
        weights = str(checkpoint)
    adapter = TimmVitAdapter(model, name=name, weights=weights)
    _warn_default_preprocessing(adapter, checkpoint)
    return adapter


def wrap_vit(
    module: nn.Module,
    checkpoint=None,
    num_classes: int | None = None,
    *,
    preprocessing: dict[str, Any] | None = None,
    **timm_kwargs: Any,
) -> BackboneAdapter:
    """A built timm VisionTransformer -> its adapter (the ``vit`` family's wrapper)."""
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
        _mark_default_preprocessing(module, folder_config(checkpoint), None)
    name = getattr(module, "pretrained_cfg", {}).get("architecture") or type(module).__name__
    adapter = TimmVitAdapter(module, name=name, weights=weights)
    if preprocessing is not None:
        set_preprocessing(module, preprocessing)
    _warn_default_preprocessing(adapter, checkpoint)
    return adapter


def _from_hub(timm_name: str, kwargs: dict[str, Any]) -> nn.Module:
    """timm's model with its pretrained weights downloaded from the hub."""
    _check_hub_reachable(timm_name)
    try:
        return _create(timm_name, pretrained=True, **kwargs)
    except BackboneError:
        raise
    except Exception as err:
        raise CheckpointError(
            f"could not download pretrained weights for {timm_name!r} from the hub "
            f"({type(err).__name__}: {str(err)[:200]}). Offline? Pass a local file instead: "
            "checkpoint='path/to/model.safetensors' (or a .pth state dict, or a timm/HF folder)"
        ) from err


def _from_checkpoint(
    name: str, timm_name: str, checkpoint, num_classes, kwargs: dict[str, Any], preprocessing
) -> nn.Module:
    """The model built as a local checkpoint (file or folder) says, its weights loaded."""
    state_dict = read_state_dict(checkpoint)
    config = folder_config(checkpoint)
    if num_classes is None:  # size the classifier like the checkpoint's
        head = state_dict.get("head.weight")
        if head is not None:
            kwargs["num_classes"] = int(head.shape[0])
        elif "num_classes" in config:
            kwargs["num_classes"] = int(config["num_classes"])
    if "architecture" in config:  # timm's hub layout: read the folder as timm does
        if _same_model(config["architecture"], timm_name):
            overlay, model_args = _hub_folder_config(checkpoint)
            for key, value in model_args.items():  # constructor arguments given win
                kwargs.setdefault(key, value)
            kwargs["pretrained_cfg_overlay"] = overlay
        else:
            logger.warning(
                "%s: the checkpoint's config.json is for %r; building %s as asked, without "
                "its model_args and pretrained_cfg",
                name,
                config["architecture"],
                timm_name,
            )
            config = {}
    model = _create(timm_name, pretrained=False, **kwargs)
    if preprocessing is not None:
        set_preprocessing(model, preprocessing)
    vision_transformer = timm.models.vision_transformer
    is_vit = isinstance(model, vision_transformer.VisionTransformer)
    if is_vit:
        check_file_shapes(state_dict, model, str(checkpoint), timm_name)
    _mark_default_preprocessing(model, config, preprocessing)
    if is_vit:
        try:
            state_dict = vision_transformer.checkpoint_filter_fn(state_dict, model)
        except Exception as err:
            raise CheckpointError(
                f"checkpoint {str(checkpoint)!r} cannot be converted for {timm_name}: {err}"
            ) from err
    load_into(model, state_dict, str(checkpoint))
    return model


def _check_hub_reachable(timm_name: str) -> None:
    """Fail at once, not after minutes of retries, when the model hub cannot be reached."""
    reason = hub_unreachable_reason()
    if reason is not None:
        raise CheckpointError(
            f"cannot download pretrained weights for {timm_name!r}: {reason}. Pass a local file "
            "instead: checkpoint='path/to/model.safetensors' (or a .pth state dict, or a timm/HF "
            "folder)"
        )


def _create(timm_name: str, **kwargs):
    try:
        return timm.create_model(timm_name, **kwargs)
    except (TypeError, AssertionError, ValueError) as err:  # timm checks many arguments with assert
        raise BackboneError(f"timm cannot build {timm_name!r} with {kwargs}: {err}") from err


def _hub_folder_config(checkpoint) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pretrained_cfg entries, model_args) of the config.json of a checkpoint in timm's hub layout.

    Parsed by timm's own ``load_model_config_from_path`` (new and legacy layouts); the
    pretrained_cfg entries overlay the architecture's registry default, so what the folder leaves
    out stays timm's default for the architecture, and keys timm's ``PretrainedCfg`` lacks (a
    legacy single-dict config's ``global_pool``) are dropped.
    """
    path = Path(checkpoint).expanduser().resolve()
    folder = path if path.is_dir() else path.parent
    try:
        pretrained_cfg, _, model_args = timm.models._hub.load_model_config_from_path(folder)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(
            f"cannot read {str(folder / 'config.json')!r} as timm's hub config ({type(err).__name__}: "
            f"{err}); it needs 'architecture', and 'model_args' / 'pretrained_cfg' as objects"
        ) from err
    if not isinstance(model_args, dict):
        raise CheckpointError(f"{str(folder / 'config.json')!r}: model_args must be an object")
    known = {f.name for f in dataclasses.fields(timm.models._pretrained.PretrainedCfg)}
    known -= {"file", "source", "architecture"}
    overlay = {key: value for key, value in (pretrained_cfg or {}).items() if key in known}
    return overlay, dict(model_args)


def _same_model(architecture: Any, timm_name: str) -> bool:
    """Whether a config.json's ``architecture`` names the model ``timm_name`` (tags ignored)."""
    if not isinstance(architecture, str):
        return False
    base = architecture.partition(".")[0]
    return ALIASES.get(base, base) == timm_name or (timm.is_model(base) and base == timm_name)


def _mark_default_preprocessing(model, config: dict, preprocessing) -> None:
    """Note on a model loaded from a local checkpoint which decisive preprocessing entries neither
    the checkpoint folder's config.json nor ``preprocessing=`` gave: timm's default for the
    architecture stands in for them, and the fused model's record says so."""
    recorded = config.get("pretrained_cfg") if "pretrained_cfg" in config else config
    given = set(recorded or {}) | set(preprocessing or {})
    model.preprocessing_defaulted = tuple(k for k in DECISIVE_PREPROCESSING if k not in given)


def _warn_default_preprocessing(adapter: BackboneAdapter, checkpoint) -> None:
    """One warning line when a local checkpoint comes without its preprocessing."""
    config = {**adapter.data_config(), DEFAULTED: adapter.preprocessing_defaulted}
    message = default_preprocessing_warning(f"{adapter.name}: checkpoint {checkpoint}", config)
    if message is not None:
        logger.warning("%s", message)


def _vit_shape_args(state_dict: dict, no_embed_class: bool) -> dict[str, Any]:
    """The constructor arguments a ViT state dict's shapes show (what they cannot show is left out)."""
    args: dict[str, Any] = {}
    patch = state_dict.get("patch_embed.proj.weight")
    cls_token = state_dict.get("cls_token")
    if cls_token is not None:
        args["embed_dim"] = int(cls_token.shape[-1])
    elif patch is not None:
        args["embed_dim"] = int(patch.shape[0])
    blocks = {key.split(".")[1] for key in state_dict if key.startswith("blocks.")}
    args["depth"] = len(blocks)
    args["class_token"] = cls_token is not None
    reg = state_dict.get("reg_token")
    args["reg_tokens"] = int(reg.shape[1]) if reg is not None and reg.dim() == 3 else 0
    if patch is not None and patch.dim() == 4:
        args["in_chans"] = int(patch.shape[1])
        ph, pw = int(patch.shape[2]), int(patch.shape[3])
        args["patch_size"] = ph if ph == pw else [ph, pw]
        pos = state_dict.get("pos_embed")
        if pos is not None and pos.dim() == 3:
            prefix = 0 if no_embed_class else args["class_token"] + args["reg_tokens"]
            grid = round((pos.shape[1] - prefix) ** 0.5)
            if grid * grid == pos.shape[1] - prefix:  # a square grid (else the size is not shown)
                args["img_size"] = grid * ph if ph == pw else [grid * ph, grid * pw]
    fc1 = state_dict.get("blocks.0.mlp.fc1.weight")
    if fc1 is not None and "embed_dim" in args:
        args["mlp_ratio"] = round(fc1.shape[0] / args["embed_dim"], 4)
    return args


def check_file_shapes(state_dict: dict, model: nn.Module, source: str, timm_name: str) -> None:
    """Refuse a checkpoint whose own shapes (before timm resamples them) show another architecture.

    timm's ``checkpoint_filter_fn`` resizes ``pos_embed`` and the patch embedding to fit the model,
    which would hide (or, for a matching width, silently change) the input size the checkpoint was
    trained at; the message names the constructor arguments to set instead.
    """
    no_embed_class = bool(getattr(model, "no_embed_class", False))
    file_args = _vit_shape_args(state_dict, no_embed_class)
    own_args = _vit_shape_args(model.state_dict(), no_embed_class)
    differ = [key for key in file_args if key in own_args and file_args[key] != own_args[key]]
    if not differ:
        return
    own = model.state_dict()
    shapes = "; ".join(
        f"{key}: file {tuple(state_dict[key].shape)} vs model {tuple(own[key].shape)}"
        for key in ("cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.mlp.fc1.weight")
        if key in state_dict and key in own and state_dict[key].shape != own[key].shape
    )
    wanted = ", ".join(f"{key}={_arg(file_args[key])}" for key in differ)
    flags = " ".join(f"--model-arg {key}={_arg(file_args[key])}" for key in differ)
    heads = getattr(model.blocks[0].attn, "num_heads", "?") if len(model.blocks) else "?"
    heads_hint = (
        f", and num_heads as trained: the weights do not show it (the model has {heads})"
        if {"embed_dim", "depth"} & set(differ)
        else ""
    )
    raise CheckpointError(
        f"checkpoint {source!r} does not fit the model ({timm_name} as built), it was trained "
        "with other constructor arguments: "
        f"the file has {wanted} where the model has "
        f"{', '.join(f'{key}={_arg(own_args[key])}' for key in differ)}"
        f"{f' ({shapes})' if shapes else ''}; build it with those constructor arguments "
        f"({spelled(f'load_backbone(..., {wanted})', flags)}; or model_args in the folder's "
        "config.json)"
        f"{heads_hint}"
    )


def _arg(value: Any) -> str:
    return json.dumps(value)
