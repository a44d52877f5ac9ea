"""Adapter over an OpenCLIP model used zero-shot: the image tower plus a text-derived classifier.

The classifier is the one of CLIP's zero-shot recipe: for every class, the prompts made from the
templates ("a photo of a {}.") are encoded by the text tower, normalised, averaged over templates
and normalised again, giving class weights W [C, E]. Then

    logits = logit_scale.exp() * normalize(image_features) @ W.T  (+ logit_bias, SigLIP models)

The text side is computed once, when the adapter is built, and stored as a buffer; Hydra members
share it and differ only in the image tower's attention heads. The module the adapter exposes
(:class:`ZeroShotClassifier`) holds the image tower and that classifier only.

Head gates. ``nn.MultiheadAttention`` applies its output projection inside
``F.multi_head_attention_forward`` (or a fused native kernel), where no module hook can reach the
concatenated head outputs. The adapter therefore replaces, in place, every image-tower block's
``attn`` by a :class:`GatedMultiheadAttention` holding the *same* parameter objects (same state-dict
keys: ``in_proj_weight``, ``in_proj_bias``, ``out_proj.*``). It computes the same function with
explicit steps (input projection, ``F.scaled_dot_product_attention``, then ``self.out_proj`` called
as a module), so a forward pre-hook on ``out_proj`` sees the heads' outputs [B, N, H*hd] and
:meth:`BackboneAdapter.head_gates` can scale them. The passed model's image tower keeps computing
the same function (to float rounding); its text tower is untouched.
"""

from __future__ import annotations

import difflib
import logging
import os
import socket
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import torch.nn.functional as F
from torch import nn

from hydra_deploy.backbones.base import AttentionWeights, BackboneAdapter
from hydra_deploy.errors import BackboneError, CheckpointError, UnsupportedModelError

logger = logging.getLogger("hydra_deploy")

#: The prompt templates used when none are given: the 7 templates OpenAI selected for ImageNet
#: ("Prompt_Engineering_for_ImageNet.ipynb"; open_clip's ``SIMPLE_IMAGENET_TEMPLATES``).
DEFAULT_TEMPLATES: tuple[str, ...] = (
    "itap of a {}.",
    "a bad photo of the {}.",
    "a origami {}.",
    "a photo of the large {}.",
    "a {} in a video game.",
    "art of the {}.",
    "a photo of the small {}.",
)

#: open_clip's eval ``resize_mode`` -> timm's ``crop_mode`` (with ``crop_pct=1.0``).
_CROP_MODES = {"shortest": "center", "squash": "squash", "longest": "border"}
SUPPORTED_POOLS = ("tok", "avg")
HUB_HOST = "huggingface.co"


# --------------------------------------------------------------------------------------------------
# the gate-able attention


class GatedMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` (self-attention, packed in-projection) with a hookable out_proj.

    Built from an existing module by :meth:`from_multihead`, sharing its parameters. Called like
    the original (``attn(q, k, v, need_weights=False, attn_mask=None)``) and returns
    ``(output, None)``. The output projection runs as ``self.out_proj(heads)`` with ``heads``
    [B, N, H*hd], head h in columns ``h*hd:(h+1)*hd``, which is where the adapter's gates act.
    """

    def __init__(self, attn: nn.MultiheadAttention) -> None:
        super().__init__()
        self.embed_dim = attn.embed_dim
        self.num_heads = attn.num_heads
        self.head_dim = attn.head_dim
        self.batch_first = attn.batch_first
        self.dropout = attn.dropout
        self.in_proj_weight = attn.in_proj_weight  # [3D, D], rows (q|k|v, head, d): shared
        self.in_proj_bias = attn.in_proj_bias  # [3D] or None
        self.out_proj = attn.out_proj  # the gate target

    @classmethod
    def from_multihead(cls, attn: nn.MultiheadAttention) -> GatedMultiheadAttention:
        problems = []
        if not attn._qkv_same_embed_dim:
            problems.append("separate q/k/v projection weights (kdim/vdim)")
        if attn.bias_k is not None or attn.bias_v is not None:
            problems.append("add_bias_kv")
        if attn.add_zero_attn:
            problems.append("add_zero_attn")
        if problems:
            raise UnsupportedModelError(
                f"attention with {', '.join(problems)} is not supported (open_clip's image tower "
                "uses plain packed self-attention)"
            )
        return cls(attn)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, None]:
        if need_weights:
            raise UnsupportedModelError("GatedMultiheadAttention does not return attention weights")
        if key_padding_mask is not None:
            raise UnsupportedModelError("GatedMultiheadAttention does not take key_padding_mask")
        key = query if key is None else key
        value = key if value is None else value
        if not self.batch_first:  # [N, B, D] -> [B, N, D]
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        H, hd = self.num_heads, self.head_dim
        B, N = query.shape[:2]
        if key is query and value is query:  # self-attention: one packed projection
            q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        else:
            weights = self.in_proj_weight.chunk(3)
            biases = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
            q, k, v = (
                F.linear(t, w, b)
                for t, w, b in zip((query, key, value), weights, biases, strict=True)
            )
        q, k, v = (t.reshape(B, -1, H, hd).transpose(1, 2) for t in (q, k, v))  # [B, H, N, hd]
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # True = masked out (torch MHA)
            attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(
                attn_mask, -torch.inf
            )
        heads = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.dropout if self.training else 0.0
        )  # [B, H, N, hd]
        heads = heads.transpose(1, 2).reshape(B, N, H * hd)  # [B, N, H*hd]: the gates act here
        out = self.out_proj(heads)  # [B, N, D]
        return (out if self.batch_first else out.transpose(0, 1)), None


def install_gates(visual: nn.Module) -> None:
    """Replace every image-tower block's MultiheadAttention by a GatedMultiheadAttention (idempotent)."""
    for block in visual.transformer.resblocks:
        if not isinstance(block.attn, GatedMultiheadAttention):
            block.attn = GatedMultiheadAttention.from_multihead(block.attn)


# --------------------------------------------------------------------------------------------------
# the zero-shot classifier


def zero_shot_logits(
    features: torch.Tensor,
    class_weights: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``logit_scale.exp() * normalize(features) @ class_weights.T (+ logit_bias)``: [..., E] -> [..., C]."""
    # F.normalize written out: it exports as ReduceL2, whose opset-18 form does not convert to 17
    norm = (features * features).sum(dim=-1, keepdim=True).clamp_min(1e-24).sqrt()  # max(|x|, eps)
    logits = logit_scale.exp() * (features / norm) @ class_weights.T
    return logits if logit_bias is None else logits + logit_bias


class ZeroShotClassifier(nn.Module):
    """An OpenCLIP image tower and fixed text-derived class weights: images -> class logits.

    ``class_weights`` [C, E] (rows L2-normalised), ``logit_scale`` (log of the temperature, as
    open_clip stores it) and ``logit_bias`` (SigLIP; None otherwise) are buffers: they are saved in
    the state dict but never trained.
    """

    def __init__(
        self,
        visual: nn.Module,
        class_weights: torch.Tensor,
        logit_scale: torch.Tensor | float,
        logit_bias: torch.Tensor | float | None = None,
        class_names: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        self.visual = visual
        dtype = class_weights.dtype
        self.register_buffer("class_weights", class_weights.detach().clone())
        self.register_buffer("logit_scale", torch.as_tensor(logit_scale, dtype=dtype).reshape(()))
        bias = None if logit_bias is None else torch.as_tensor(logit_bias, dtype=dtype).reshape(())
        self.register_buffer("logit_bias", None if bias is None else bias.detach().clone())
        self.class_names = None if class_names is None else [str(c) for c in class_names]

    @property
    def num_classes(self) -> int:
        return int(self.class_weights.shape[0])

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Image features [B, E] (before normalisation) -> logits [B, C]."""
        return zero_shot_logits(features, self.class_weights, self.logit_scale, self.logit_bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = self.visual(pixel_values)  # open_clip's own image-tower forward
        if isinstance(features, tuple):  # output_tokens=True: (pooled, tokens)
            features = features[0]
        return self.logits(features)


def read_names(value: str | os.PathLike | Sequence[str] | None, what: str) -> list[str]:
    """A list of names, or a text file with one per line (blank lines skipped) -> names."""
    option = "--classes names.txt" if what == "classes" else "--templates templates.txt"
    if value is None:
        raise BackboneError(
            f"an OpenCLIP zero-shot classifier needs {what}: pass {what}=[...] or a text file with "
            f"one entry per line ({option})"
        )
    if isinstance(value, (str, os.PathLike)):
        path = Path(value).expanduser()
        if not path.is_file():
            raise BackboneError(
                f"{what} file {str(path)!r} does not exist; pass a text file with one entry per "
                f"line ({option}) or a list"
            )
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise BackboneError(f"cannot read the {what} file {str(path)!r}: {err}") from err
        names = [line.strip() for line in lines if line.strip()]
        source = f"{what} file {str(path)!r}"
    else:
        names = [str(v).strip() for v in value]
        source = f"the {what} list"
        if any(not n for n in names):
            raise BackboneError(f"{source} holds empty entries")
    if not names:
        raise BackboneError(f"{source} is empty; give at least one entry ({option})")
    return names


def check_templates(templates: Sequence[str]) -> None:
    """Every template must place the class name with ``{}`` or ``{c}`` (``str.format``)."""
    for template in templates:
        try:
            filled = template.format("\0", c="\0")
        except (IndexError, KeyError, ValueError) as err:
            raise BackboneError(
                f"prompt template {template!r} is not a format string with one {{}} or {{c}} "
                f"placeholder: {err}"
            ) from err
        if "\0" not in filled:
            raise BackboneError(
                f"prompt template {template!r} has no placeholder; write it like 'a photo of a {{}}.'"
            )


@torch.no_grad()
def class_weights_from_text(
    clip: nn.Module,
    tokenizer: Callable[[list[str]], torch.Tensor],
    classes: Sequence[str],
    templates: Sequence[str],
    batch_size: int = 256,
) -> torch.Tensor:
    """Zero-shot class weights [C, E]: normalize(mean over templates of normalised text embeddings).

    The same recipe as ``open_clip.build_zero_shot_classifier`` (which returns the transpose).
    """
    check_templates(templates)
    prompts = [t.format(c, c=c) for c in classes for t in templates]  # class-major
    device = next(clip.parameters()).device
    was_training = clip.training
    clip.eval()
    try:
        embeddings = []
        for start in range(0, len(prompts), batch_size):
            tokens = tokenizer(prompts[start : start + batch_size]).to(device)
            embeddings.append(clip.encode_text(tokens, normalize=True))
    except (IndexError, RuntimeError) as err:
        raise BackboneError(
            f"the text tower cannot encode the tokenizer's output ({type(err).__name__}: "
            f"{str(err)[:200]}); does the tokenizer match the model?"
        ) from err
    finally:
        clip.train(was_training)
    per_prompt = torch.cat(embeddings).reshape(len(classes), len(templates), -1)  # [C, T, E]
    return F.normalize(per_prompt.mean(dim=1), dim=-1)  # [C, E]


# --------------------------------------------------------------------------------------------------
# support checks


def _is_identity(module: nn.Module | None) -> bool:
    return module is None or isinstance(module, nn.Identity)


def check_supported(visual: nn.Module) -> None:
    """Raise UnsupportedModelError naming every feature of the image tower the fused model lacks."""
    from open_clip.transformer import ResidualAttentionBlock, VisionTransformer

    if not isinstance(visual, VisionTransformer):
        kind = type(visual).__name__
        hint = {
            "ModifiedResNet": "ResNet image towers (RN50, ...) have no attention heads to prune",
            "TimmModel": "timm-based image towers (ConvNeXt, ...) are not supported",
        }.get(kind, "only open_clip's VisionTransformer image tower is supported")
        raise UnsupportedModelError(f"the OpenCLIP image tower is a {kind}: {hint}")
    problems: list[str] = []
    if getattr(visual, "attn_pool", None) is not None:
        problems.append("attentional pooling (CoCa-style attn_pool)")
    if visual.pool_type not in SUPPORTED_POOLS:
        problems.append(f"pool_type={visual.pool_type!r} (supported: {', '.join(SUPPORTED_POOLS)})")
    if visual.proj is None:
        problems.append("no output projection (proj=None)")
    if not getattr(visual.transformer, "batch_first", True):
        problems.append("a sequence-first (batch_first=False) transformer; update open_clip")
    if not (_is_identity(visual.ln_pre) or isinstance(visual.ln_pre, nn.LayerNorm)):
        problems.append(f"ln_pre is {type(visual.ln_pre).__name__}")
    if not isinstance(visual.ln_post, nn.LayerNorm):
        problems.append(f"ln_post is {type(visual.ln_post).__name__}")
    heads = set()
    for index, block in enumerate(visual.transformer.resblocks):
        where = f"block {index}"
        if type(block) is not ResidualAttentionBlock:
            problems.append(
                f"{where} is {type(block).__name__} (custom blocks: qk_norm, scaled cosine "
                "attention, head scaling); only ResidualAttentionBlock is supported"
            )
            continue
        if hasattr(block, "ln_1_kv"):
            problems.append(f"{where}: cross-attention")
        attn = block.attn
        if not isinstance(attn, (nn.MultiheadAttention, GatedMultiheadAttention)):
            problems.append(f"{where}: attention {type(attn).__name__}")
            continue
        heads.add((attn.num_heads, attn.head_dim))
        for norm_name in ("ln_1", "ln_2"):
            if not isinstance(getattr(block, norm_name), nn.LayerNorm):
                problems.append(f"{where}: {norm_name} is not a LayerNorm")
        for ls_name in ("ls_1", "ls_2"):
            ls = getattr(block, ls_name)
            if not (_is_identity(ls) or hasattr(ls, "gamma")):
                problems.append(f"{where}: {ls_name} is {type(ls).__name__}")
        mlp = block.mlp
        if not (
            isinstance(getattr(mlp, "c_fc", None), nn.Linear)
            and isinstance(getattr(mlp, "c_proj", None), nn.Linear)
            and len(mlp) == 3
        ):
            problems.append(f"{where}: the MLP is not c_fc -> activation -> c_proj")
    if len(heads) > 1:
        problems.append(f"blocks differ in heads x head_dim: {sorted(heads)}")
    if len(visual.transformer.resblocks) == 0:
        problems.append("the image tower has no transformer blocks")
    if problems:
        raise UnsupportedModelError(
            "this OpenCLIP image tower uses features the fused Hydra model does not implement: "
            + "; ".join(problems)
        )


# --------------------------------------------------------------------------------------------------
# the adapter


class OpenClipAdapter(BackboneAdapter):
    """An OpenCLIP image tower with a zero-shot classifier, seen through the common interface.

    Build it with :func:`load_openclip` (a model name) or :func:`wrap_openclip` (a built model).
    """

    family = "openclip"

    def __init__(
        self,
        classifier: ZeroShotClassifier,
        name: str,
        weights: str = "random",
        model_name: str | None = None,
        templates: Sequence[str] | None = None,
    ) -> None:
        if not isinstance(classifier, ZeroShotClassifier):
            raise BackboneError(
                f"OpenClipAdapter wraps a ZeroShotClassifier, got {type(classifier).__name__}; "
                "use load_openclip or wrap_openclip"
            )
        visual = classifier.visual
        check_supported(visual)
        install_gates(visual)
        self.module = classifier.eval()
        self.name = name
        self.weights = weights
        self.model_name = model_name
        self.templates = None if templates is None else list(templates)
        self.class_names = classifier.class_names
        first = visual.transformer.resblocks[0]
        self.num_layers = len(visual.transformer.resblocks)
        self.num_heads = first.attn.num_heads
        self.head_dim = first.attn.head_dim
        self.embed_dim = visual.transformer.width
        self.output_dim = int(visual.proj.shape[1])
        self.num_classes = classifier.num_classes
        self.mlp_hidden = first.mlp.c_fc.out_features
        self.img_size = tuple(int(s) for s in visual.image_size)
        self.patch_size = tuple(int(s) for s in visual.patch_size)
        self.in_chans = visual.conv1.in_channels
        self.num_patches = visual.grid_size[0] * visual.grid_size[1]
        self.num_prefix_tokens = 1
        self.num_tokens = self.num_patches + 1

    # ---------------------------------------------------------------------------------------------
    @property
    def visual(self) -> nn.Module:
        return self.module.visual

    def _gate_targets(self) -> list[nn.Module]:
        return [block.attn.out_proj for block in self.visual.transformer.resblocks]

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        visual = self.visual
        x = visual.conv1(inputs)  # [B, D, gh, gw]
        x = x.flatten(2).transpose(1, 2)  # [B, P, D]
        cls = visual.class_embedding.to(x.dtype).view(1, 1, -1).expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + visual.positional_embedding.to(x.dtype)
        return visual.ln_pre(visual.patch_dropout(x))  # [B, N, D]

    def run_layers(self, hidden: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        for block in self.visual.transformer.resblocks[start:stop]:
            hidden = block(hidden)
        return hidden

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, N, D] -> [B, D]: the class token ('tok') or the mean of the patch tokens ('avg')."""
        return hidden[:, 0] if self.visual.pool_type == "tok" else hidden[:, 1:].mean(dim=1)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        visual = self.visual
        if visual.final_ln_after_pool:
            pooled = visual.ln_post(self.pool(hidden))
        else:
            pooled = self.pool(visual.ln_post(hidden))
        return self.module.logits(pooled @ visual.proj)

    def attention_weights(self, layer: int) -> AttentionWeights:
        attn = self.visual.transformer.resblocks[layer].attn
        H, hd, D = self.num_heads, self.head_dim, self.embed_dim
        qkv_w = attn.in_proj_weight.detach().view(3, H, hd, D)
        qkv_b = None if attn.in_proj_bias is None else attn.in_proj_bias.detach().view(3, H, hd)
        proj_b = attn.out_proj.bias
        return AttentionWeights(
            q=qkv_w[0],
            k=qkv_w[1],
            v=qkv_w[2],
            q_bias=None if qkv_b is None else qkv_b[0],
            k_bias=None if qkv_b is None else qkv_b[1],
            v_bias=None if qkv_b is None else qkv_b[2],
            proj=attn.out_proj.weight.detach().view(D, H, hd),
            proj_bias=None if proj_b is None else proj_b.detach(),
        )

    def example_inputs(self, batch_size: int = 2, seed: int = 0) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(batch_size, self.in_chans, *self.img_size, generator=generator)

    # ---------------------------------------------------------------------------------------------
    def preprocess_cfg(self) -> dict[str, Any]:
        """open_clip's preprocessing config of the model (its defaults where the model has none)."""
        from dataclasses import asdict

        from open_clip.transform import PreprocessCfg

        config = asdict(PreprocessCfg())
        config.update(getattr(self.visual, "preprocess_cfg", None) or {})
        config["size"] = self.img_size
        return config

    def data_config(self) -> dict[str, Any]:
        """Preprocessing as a timm data config, equal to open_clip's eval transform.

        open_clip's eval transform is: resize (bicubic for the released models) so the shorter
        side is the input size, center-crop, scale to [0, 1], normalise with the model's
        ``image_mean`` / ``image_std``. As a timm config that is ``crop_pct=1.0`` with
        ``crop_mode="center"`` (open_clip's ``resize_mode="shortest"``; ``"squash"`` maps to
        ``"squash"``, ``"longest"`` to ``"border"``, whose padding colour differs).
        """
        config = self.preprocess_cfg()
        resize_mode = config.get("resize_mode", "shortest")
        if resize_mode not in _CROP_MODES:
            raise UnsupportedModelError(
                f"open_clip resize_mode {resize_mode!r} has no timm equivalent "
                f"(supported: {', '.join(_CROP_MODES)})"
            )
        return {
            "input_size": (self.in_chans, *self.img_size),
            "interpolation": str(config.get("interpolation", "bicubic")),
            "mean": tuple(float(v) for v in config["mean"]),
            "std": tuple(float(v) for v in config["std"]),
            "crop_pct": 1.0,
            "crop_mode": _CROP_MODES[resize_mode],
        }

    def constructor_kwargs(self) -> dict[str, Any]:
        """JSON-able arguments that rebuild this image tower and classifier (see rebuild_openclip).

        Weights are not included: the rebuilt model has placeholder weights to load a state dict into.
        """
        from open_clip.transformer import QuickGELU

        visual = self.visual
        block = visual.transformer.resblocks[0]
        act = block.mlp[1]
        if isinstance(act, QuickGELU):
            quick_gelu, approximate = True, "none"
        elif type(act) is nn.GELU:
            quick_gelu, approximate = False, act.approximate
        else:
            raise UnsupportedModelError(
                f"cannot record how to rebuild an MLP activation {type(act).__name__} "
                "(only GELU and QuickGELU)"
            )
        preprocess = self.preprocess_cfg()
        return {
            "image_size": list(self.img_size),
            "patch_size": list(self.patch_size),
            "width": self.embed_dim,
            "layers": self.num_layers,
            "heads": self.num_heads,
            # +0.5: open_clip takes int(width * mlp_ratio), which must give mlp_hidden exactly
            "mlp_ratio": (self.mlp_hidden + 0.5) / self.embed_dim,
            "ls_init_value": 1.0 if hasattr(block.ls_1, "gamma") else None,
            "output_dim": self.output_dim,
            "pool_type": visual.pool_type,
            "final_ln_after_pool": bool(visual.final_ln_after_pool),
            "no_ln_pre": _is_identity(visual.ln_pre),
            "quick_gelu": quick_gelu,
            "gelu_approximate": approximate,
            "layer_norm_eps": float(block.ln_1.eps),
            "num_classes": self.num_classes,
            "logit_bias": self.module.logit_bias is not None,
            "preprocess_cfg": {
                k: (list(v) if isinstance(v, tuple) else v) for k, v in preprocess.items()
            },
        }

    def backbone_kwargs(self) -> dict[str, Any]:
        """What an export folder records to rebuild the model: name, classes, templates, tower."""
        return {
            "name": self.name,
            "model_name": self.model_name,
            "classes": list(self.class_names or []),
            "templates": None if self.templates is None else list(self.templates),
            "weights": self.weights,
            "vision": self.constructor_kwargs(),
        }

    # ---------------------------------------------------------------------------------------------
    def macs(
        self,
        layer_heads: Sequence[Sequence[int]] | None = None,
        embed_streams: int = 1,
        head_streams: int = 1,
    ) -> int:
        """Multiply-accumulates per image (the text side is computed once, offline: not counted).

        ``layer_heads[l]`` lists the kept-head count of every residual stream computed in layer l
        (the single model: ``[[num_heads]] * num_layers``); the MLP runs once per stream.
        ``embed_streams`` / ``head_streams``: how many patch embeddings / heads (projection to the
        joint space and the class-weight product) run.
        """
        if layer_heads is None:
            layer_heads = [[self.num_heads]] * self.num_layers
        N, D, hd = self.num_tokens, self.embed_dim, self.head_dim
        ph, pw = self.patch_size
        patch = self.num_patches * self.in_chans * ph * pw * D
        head = D * self.output_dim + self.output_dim * self.num_classes
        total = embed_streams * patch + head_streams * head
        for streams in layer_heads:
            for kept in streams:
                width = kept * hd
                total += N * D * 3 * width  # Q, K, V projections
                total += 2 * kept * N * N * hd  # scores and weighted sum
                total += N * width * D  # output projection
                total += 2 * N * D * self.mlp_hidden  # MLP
        return int(total)


# --------------------------------------------------------------------------------------------------
# building


def _hub_unreachable_reason(host: str, timeout_s: float = 3.0) -> str | None:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
        return "HF_HUB_OFFLINE is set"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return None
    except OSError as err:
        return f"{host} is unreachable ({err})"


def _check_model_name(model_name: str) -> None:
    import open_clip

    if model_name.startswith("local-dir:"):
        return
    if model_name.startswith("hf-hub:"):
        reason = _hub_unreachable_reason(HUB_HOST)
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
    import open_clip

    cfg = open_clip.get_pretrained_cfg(model_name, pretrained)
    if not cfg:
        tags = open_clip.list_pretrained_tags_by_model(model_name)
        raise CheckpointError(
            f"pretrained={pretrained!r} is neither a file nor a pretrained tag of {model_name!r} "
            f"(tags: {', '.join(tags) or 'none'}); pass checkpoint='path/to/weights' for local weights"
        )
    host = HUB_HOST if cfg.get("hf_hub") else (urlparse(cfg.get("url", "")).hostname or HUB_HOST)
    reason = _hub_unreachable_reason(host)
    if reason:
        raise CheckpointError(
            f"pretrained={pretrained!r} of {model_name!r} needs a download but {reason}; download "
            "the weights on a connected machine and pass the local file: "
            "checkpoint='path/to/open_clip_model.safetensors' (or .bin/.pt)"
        )
    return pretrained


def _tokenizer_for(model_name: str | None, clip: nn.Module) -> Callable[[list[str]], torch.Tensor]:
    import open_clip

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
    import open_clip

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
    import open_clip

    tokenizer = kwargs.pop("tokenizer", None)
    if classes is None:
        raise BackboneError(
            f"openclip:{model_name} needs the class names of the zero-shot classifier: pass "
            "classes=[...] or a text file with one name per line (--classes names.txt)"
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
        logger.warning(
            "openclip:%s: random weights (no checkpoint given); pass checkpoint=<file> for "
            "trained weights",
            model_name,
        )
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
    from open_clip.transformer import LayerNorm, QuickGELU, VisionTransformer

    kwargs = dict(kwargs)
    eps = kwargs.pop("layer_norm_eps", 1e-5)
    quick_gelu = kwargs.pop("quick_gelu", False)
    approximate = kwargs.pop("gelu_approximate", "none")
    preprocess = kwargs.pop("preprocess_cfg", None)
    for key in ("num_classes", "logit_bias"):
        kwargs.pop(key, None)
    act = QuickGELU if quick_gelu else partial(nn.GELU, approximate=approximate)
    try:
        visual = VisionTransformer(
            **{
                **kwargs,
                "image_size": tuple(kwargs["image_size"]),
                "patch_size": tuple(kwargs["patch_size"]),
            },
            act_layer=act,
            norm_layer=partial(LayerNorm, eps=eps),
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
