"""The fused Hydra ViT: M timm ViT members (head-pruned, maybe fine-tuned) in one network."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from hydra_deploy.backbones import BackboneAdapter
from hydra_deploy.errors import FusionError
from hydra_deploy.export_folder import DEFAULTED
from hydra_deploy.fusion.grouped import GroupedLinear
from hydra_deploy.fusion.layers import all_equal, stream_norm, token_mean
from hydra_deploy.fusion.model import HydraModel
from hydra_deploy.optional import lazy_module

timm = lazy_module("timm", purpose="the vit family (timm Vision Transformers)", error=FusionError)


class VitEmbedding(nn.Module):
    """Patch embedding, prefix tokens and position embedding of a timm ViT (inference semantics)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.patch_embed = copy.deepcopy(model.patch_embed)
        self.cls_token = _copy_param(model.cls_token)
        self.reg_token = _copy_param(model.reg_token)
        self.pos_embed = _copy_param(model.pos_embed)
        self.no_embed_class = bool(model.no_embed_class)
        self.norm_pre = copy.deepcopy(model.norm_pre)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixel_values)  # [B, P, D]
        prefix = [
            t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.reg_token) if t is not None
        ]
        if self.pos_embed is None:
            x = torch.cat([*prefix, x], dim=1)
        elif self.no_embed_class:  # position embedding covers the patches only
            x = torch.cat([*prefix, x + self.pos_embed], dim=1)
        else:
            x = torch.cat([*prefix, x], dim=1) + self.pos_embed
        return self.norm_pre(x)  # [B, N, D]


def _copy_param(param: torch.Tensor | None) -> nn.Parameter | None:
    return None if param is None else nn.Parameter(param.detach().clone())


def _embedding_tensors(model: nn.Module) -> list[torch.Tensor | None]:
    tensors = [model.cls_token, model.reg_token, model.pos_embed]
    tensors += list(model.patch_embed.parameters()) + list(model.norm_pre.parameters())
    return tensors


class HydraViT(HydraModel):
    """Fused Hydra ViT. forward(pixel_values [B, C, H, W]) -> member logits [B, M, C]."""

    family = "vit"

    def _fuse(self, members: Sequence[BackboneAdapter], shared_trunk: bool) -> None:
        M, lowering = self.num_members, self.lowering
        models = [member.module for member in members]
        first = models[0]
        self.input_size = (members[0].in_chans, *members[0].img_size)
        self.input_names = ("pixel_values",)
        self.preprocessing = members[0].data_config()
        if members[0].preprocessing_defaulted:  # hydra.json says so; a re-export warns again
            self.preprocessing[DEFAULTED] = list(members[0].preprocessing_defaulted)
        self.backbone_kwargs = members[0].constructor_kwargs()

        # embeddings shared when every member has the same weights; a shared trunk while all
        # members' layers are identical, then M streams
        embed_shared = self._fuse_embeddings(models, _embedding_tensors, VitEmbedding)
        stack = self._fuse_layers(members, shared_trunk and embed_shared)

        # final norms, pooling and classifier
        self.norm = stream_norm([model.norm for model in models])
        self.fc_norm = stream_norm([model.fc_norm for model in models])
        self.global_pool = first.global_pool
        self.num_prefix_tokens = first.num_prefix_tokens
        self.pool_include_prefix = bool(getattr(first, "pool_include_prefix", False))
        head_w = [model.head.weight for model in models]
        head_b = [model.head.bias for model in models]
        if all_equal(head_w) and all_equal(head_b):
            self.head = copy.deepcopy(first.head)
            head_kind = "shared"
        else:
            stacked_b = None if head_b[0] is None else torch.stack([b.detach() for b in head_b])
            weight = torch.stack([w.detach() for w in head_w]).transpose(1, 2)
            self.head = GroupedLinear.from_weights(weight, stacked_b, lowering)
            head_kind = "per-member"
        final_per_stream = [getattr(n, "per_stream", False) for n in (self.norm, self.fc_norm)]
        self.final_shared = head_kind == "shared" and not any(final_per_stream)
        final_streams = M if (self.blocks or not self.final_shared) else 1

        self.merge = {
            **stack.merge(embed_shared, (self.norm, self.fc_norm)),
            "classifier": head_kind,
        }
        self._count_macs(members[0], stack, embed_shared, final_streams)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        M = self.num_members
        self.check_pixel_values(pixel_values)
        x = self.encode(pixel_values)  # [S, B, N, D]
        x = self.norm(x)
        S, B, N, D = x.shape
        if self.global_pool == "avg":
            tokens = x if self.pool_include_prefix else x[:, :, self.num_prefix_tokens :]
            pooled = token_mean(tokens, dim=2)  # [S, B, D]
        else:
            pooled = timm.layers.global_pool_nlc(
                x.reshape(S * B, N, D),
                pool_type=self.global_pool,
                num_prefix_tokens=self.num_prefix_tokens,
                reduce_include_prefix=self.pool_include_prefix,
            ).view(S, B, D)
        logits = self.head(self.fc_norm(pooled))  # [S, B, C]
        if S != M:
            logits = logits.expand(M, -1, -1)
        return logits.transpose(0, 1)  # [B, M, C]
