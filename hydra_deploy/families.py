"""The model families, each declared once: what differs between a timm ViT, a BERT and an OpenCLIP.

A :class:`Family` says how a backbone of the family is named (``hf:<folder>``, its short aliases)
and how a model folder of it is recognised (a Hugging Face ``config.json``'s ``model_type``), what
its inputs are (images or text, their names, the dynamic axes), which functions load, wrap and
rebuild it, which class fuses it, what members must share to be fused (its architecture
signature), which weights hold one slice per head (fine-tuning zeroes pruned heads there), and
which components of an exported fused model are per member (reload). Every stage asks the
registry (:func:`get_family`, :func:`family_for_prefix`, :func:`family_for_folder`,
:func:`family_of_module`) instead of testing family names itself, so adding a family (a RoBERTa, a
SigLIP) is one :func:`register` call here or in the backbone module that implements it, naming the
functions that module defines; the tests run over every registered family.

The functions and classes are named as ``"module:attribute"`` strings and imported when first
used: this module imports the standard library only, so the edge runtime (engines, scoring) can
ask whether a model takes text without importing torch, and the import order holds (Optimum's
per-architecture ``OnnxConfig`` and timm's ``@register_model`` are the models followed).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hydra_deploy.errors import BackboneError

__all__ = [
    "DEFAULT_FAMILY",
    "Family",
    "families",
    "family_for_alias",
    "family_for_folder",
    "family_for_model_type",
    "family_for_prefix",
    "family_names",
    "family_of_module",
    "get_family",
    "register",
]

IMAGES, TEXT = "images", "text"
#: the family of a plain model name (no ``<prefix>:``) and of a module no family claims
DEFAULT_FAMILY = "vit"


@dataclass(frozen=True)
class Family:
    """One model family, as every stage needs it."""

    name: str  # hydra.json's "family", the adapters' and fused models' ``family``
    description: str
    input_kind: str  # "images" or "text"
    input_names: tuple[str, ...]
    #: ``load_backbone("<prefix>:<rest>")`` builds one (None: plain names, see DEFAULT_FAMILY)
    prefix: str | None
    #: module-name prefixes of the model classes of this family (``load_backbone(module)``)
    module_origins: tuple[str, ...]
    #: "module:function" strings, imported when used:
    #: loader(rest, checkpoint, num_classes, **kwargs) -> adapter (``prefix`` names, the family's
    #: folders, and for DEFAULT_FAMILY plain names)
    loader: str | None
    #: wrapper(module, checkpoint, num_classes, **kwargs) -> adapter (a built model)
    wrapper: str
    #: the HydraModel subclass that fuses members of this family
    fused_class: str
    #: rebuild(backbone_kwargs) -> an nn.Module or adapter with placeholder weights (reload)
    rebuild: str
    #: the fused model's components and their names in one member (``module``), read by fusion
    #: and by the export reload: ``embeds``, ``embed_params``, ``block`` (``{}`` = layer index),
    #: ``block_parts`` (role -> submodule of one member's block: ``norm1``, ``ls1``, ``attn``,
    #: ``norm2``, ``ls2`` where the block has them, ``mlp``, and the MLP's ``fc1``, ``act``,
    #: ``fc2``), ``final`` (component -> (member name, the number of dimensions its saved weight
    #: has when per member))
    member_layout: Mapping[str, Any] = field(default_factory=dict)
    #: ``load_backbone`` options only this family takes
    takes_new_classifier: bool = False
    takes_preprocessing: bool = False
    #: short names -> the model names the loader builds (``vit_b16`` -> ``vit_base_patch16_224``);
    #: ``load_backbone(alias)`` hands the alias to this family's loader, which resolves it
    aliases: Mapping[str, str] = field(default_factory=dict)
    #: Hugging Face ``config.json`` ``model_type`` values of the folders this family loads
    model_types: tuple[str, ...] = ()
    #: architecture(adapter) -> {what: value}: fusion refuses members that differ in any entry
    #: (:func:`hydra_deploy.fusion.model.check_same_architecture`; what names it in the error)
    architecture: str | None = None
    #: head_views(module) -> (heads per layer, per layer [(a view of a weight, its head axis)]):
    #: the weights holding one slice per head, where fine-tuning zeroes the pruned heads (None:
    #: members of this family are not fine-tuned)
    head_views: str | None = None

    @property
    def text(self) -> bool:
        return self.input_kind == TEXT

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """ONNX dynamic axes of the inputs: the batch, and a text model's sequence."""
        axes = {0: "batch", 1: "sequence"} if self.text else {0: "batch"}
        return {name: dict(axes) for name in self.input_names}

    def resolve(self, what: str) -> Any:
        """The function or class a field names (``"loader"``, ``"wrapper"``, ``"fused_class"``,
        ``"rebuild"``, ``"architecture"``, ``"head_views"``), imported now."""
        target = getattr(self, what)
        if not isinstance(target, str):
            raise BackboneError(f"the {self.name} family has no {what}")
        module, _, attribute = target.partition(":")
        return getattr(importlib.import_module(module), attribute)


_REGISTRY: dict[str, Family] = {}


def register(family: Family, *, replace: bool = False) -> Family:
    """Add a family to the registry (``replace``: redefine one of the same name)."""
    if family.input_kind not in (IMAGES, TEXT):
        raise BackboneError(
            f"family {family.name!r}: input_kind must be {IMAGES!r} or {TEXT!r}, "
            f"got {family.input_kind!r}"
        )
    clash = [
        other.name
        for other in _REGISTRY.values()
        if other.name != family.name and family.prefix and other.prefix == family.prefix
    ]
    if clash:
        raise BackboneError(f"family {family.name!r}: prefix {family.prefix!r} is {clash[0]!r}'s")
    claims = (("model_type", family.model_types, family_for_model_type),)
    claims += (("alias", tuple(family.aliases), family_for_alias),)
    for what, names, owner_of in claims:
        for claimed in names:
            owner = owner_of(claimed)
            if owner is not None and owner.name != family.name:
                raise BackboneError(
                    f"family {family.name!r}: {what} {claimed!r} is {owner.name!r}'s"
                )
    if family.name in _REGISTRY and not replace:
        raise BackboneError(f"family {family.name!r} is registered already; pass replace=True")
    _REGISTRY[family.name] = family
    return family


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    return tuple(_REGISTRY.values())


def family_names() -> tuple[str, ...]:
    """The names of the registered families (hydra.json's ``family`` must be one)."""
    return tuple(_REGISTRY)


def get_family(name: Any) -> Family:
    """The family called ``name``; an unknown name is refused with the known ones."""
    family = _REGISTRY.get(name) if isinstance(name, str) else None
    if family is None:
        raise BackboneError(
            f"unknown model family {name!r:.60}; this version knows {', '.join(family_names())}"
        )
    return family


def family_for_prefix(prefix: str) -> Family | None:
    """The family a ``"<prefix>:..."`` backbone name belongs to, if any."""
    return next((f for f in _REGISTRY.values() if f.prefix and f.prefix == prefix), None)


def family_for_alias(name: str) -> Family | None:
    """The family that declares ``name`` among its short aliases, if any."""
    return next((f for f in _REGISTRY.values() if name in f.aliases), None)


def family_for_model_type(model_type: str) -> Family | None:
    """The family that claims a Hugging Face ``model_type`` (``"bert"``), if any."""
    return next((f for f in _REGISTRY.values() if model_type in f.model_types), None)


def family_for_folder(folder: Any) -> Family | None:
    """The family that loads a model folder, recognised from its ``config.json``.

    A Hugging Face folder (its config has ``model_type``) belongs to the family whose
    ``model_types`` claim that type; an unclaimed type to the first family that loads Hugging Face
    folders, whose loader names the types it takes. None: no config, or not a Hugging Face one (a
    timm hub folder names its ``architecture``: DEFAULT_FAMILY's loader reads it).
    """
    try:
        with open(f"{folder}/config.json", encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or "model_type" not in config:
        return None
    claimed = family_for_model_type(str(config["model_type"]))
    return claimed or next((f for f in _REGISTRY.values() if f.model_types), None)


def family_of_module(module: Any) -> Family:
    """The family of a built model, from the library that defines its class (DEFAULT_FAMILY when
    no other family claims it: its adapter then says whether it is one)."""
    origin = type(module).__module__
    for family in _REGISTRY.values():
        if any(origin == o or origin.startswith(o + ".") for o in family.module_origins):
            return family
    return get_family(DEFAULT_FAMILY)


# --- the families this version implements ----------------------------------------------------------
register(
    Family(
        name="vit",
        description="timm VisionTransformer (ViT, DeiT and relatives)",
        input_kind=IMAGES,
        input_names=("pixel_values",),
        prefix=None,
        module_origins=("timm",),
        loader="hydra_deploy.backbones.timm_loading:load_vit",  # timm names, aliases, folders
        wrapper="hydra_deploy.backbones.timm_loading:wrap_vit",
        fused_class="hydra_deploy.fusion.vit:HydraViT",
        rebuild="hydra_deploy.backbones.timm_vit:build_vit",
        member_layout={
            "embeds": ("patch_embed", "norm_pre", "cls_token", "reg_token", "pos_embed"),
            "embed_params": ("cls_token", "reg_token", "pos_embed"),
            "block": "blocks.{}",
            "block_parts": {
                "norm1": "norm1",
                "attn": "attn",
                "ls1": "ls1",
                "norm2": "norm2",
                "mlp": "mlp",
                "fc1": "mlp.fc1",
                "act": "mlp.act",
                "fc2": "mlp.fc2",
                "ls2": "ls2",
            },
            "final": {"norm": ("norm", 2), "fc_norm": ("fc_norm", 2), "head": ("head", 3)},
        },
        takes_preprocessing=True,
        aliases={
            "vit_ti16": "vit_tiny_patch16_224",
            "vit_s16": "vit_small_patch16_224",
            "vit_b16": "vit_base_patch16_224",
            "vit_l16": "vit_large_patch16_224",
        },
        architecture="hydra_deploy.backbones.timm_vit:architecture_signature",
        head_views="hydra_deploy.backbones.timm_vit:head_views",
    )
)
register(
    Family(
        name="bert",
        description="'hf:<folder>' for a Hugging Face BERT sequence classifier",
        input_kind=TEXT,
        input_names=("input_ids", "attention_mask", "token_type_ids"),
        prefix="hf",
        module_origins=("transformers",),
        loader="hydra_deploy.backbones.hf_bert:load_bert",
        wrapper="hydra_deploy.backbones.hf_bert:wrap_bert",
        fused_class="hydra_deploy.fusion.bert:HydraBert",
        rebuild="hydra_deploy.backbones.hf_bert:rebuild_bert",
        member_layout={
            "embeds": ("bert.embeddings",),
            "embed_params": (),
            "block": "bert.encoder.layer.{}",
            "block_parts": {  # post-norm: attn, norm1, mlp, norm2
                "attn": "attention.self",
                "norm1": "attention.output.LayerNorm",
                "mlp": "intermediate",
                "fc1": "intermediate.dense",
                "act": "intermediate.intermediate_act_fn",
                "fc2": "output.dense",
                "norm2": "output.LayerNorm",
            },
            "final": {
                "pooler.linear": ("bert.pooler.dense", 3),
                "classifier.linear": ("classifier", 3),
            },
        },
        takes_new_classifier=True,
        model_types=("bert",),
        architecture="hydra_deploy.backbones.hf_bert:architecture_signature",
        head_views="hydra_deploy.backbones.hf_bert:head_views",
    )
)
register(
    Family(
        name="openclip",
        description="'openclip:<model name>' for an OpenCLIP image tower used zero-shot",
        input_kind=IMAGES,
        input_names=("pixel_values",),
        prefix="openclip",
        # open_clip's CLIP, or our ZeroShotClassifier wrapping its image tower
        module_origins=("open_clip", "hydra_deploy.backbones.openclip"),
        loader="hydra_deploy.backbones.openclip.loading:load_openclip",
        wrapper="hydra_deploy.backbones.openclip.loading:wrap_openclip",
        fused_class="hydra_deploy.fusion.openclip:HydraOpenClip",
        rebuild="hydra_deploy.backbones.openclip.loading:rebuild_openclip",
        member_layout={
            "embeds": (
                "visual.conv1",
                "visual.ln_pre",
                "visual.class_embedding",
                "visual.positional_embedding",
            ),
            "embed_params": ("class_embedding", "positional_embedding"),
            "block": "visual.transformer.resblocks.{}",
            "block_parts": {
                "norm1": "ln_1",
                "attn": "attn",
                "ls1": "ls_1",
                "norm2": "ln_2",
                "mlp": "mlp",
                "fc1": "mlp.c_fc",
                "act": "mlp.gelu",
                "fc2": "mlp.c_proj",
                "ls2": "ls_2",
            },
            "final": {"ln_post": ("visual.ln_post", 2), "proj": ("visual.proj", 3)},
        },
        architecture="hydra_deploy.backbones.openclip.adapter:architecture_signature",
    )
)
