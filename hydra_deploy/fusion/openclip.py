"""The fused Hydra OpenCLIP: M head-pruned image towers in one network, one shared text classifier.

Layout as in :mod:`hydra_deploy.fusion.vit`: residual streams [S, B, N, D], a shared trunk of
leading layers where every member is identical, then one stream per member. After the last layer
each stream is pooled (class token or mean of the patch tokens), normalised by ``ln_post`` and
projected into the joint image-text space (``ln_post`` / ``proj`` shared or per member); its
normalised features meet the zero-shot class weights that every member shares:

    member_logits[:, m] = logit_scale.exp() * normalize(features_m) @ class_weights.T (+ bias)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hydra_deploy.backbones.base import BackboneAdapter
from hydra_deploy.backbones.openclip.zero_shot import zero_shot_logits
from hydra_deploy.fusion.grouped import GroupedLinear
from hydra_deploy.fusion.layers import all_equal, stream_norm, token_mean
from hydra_deploy.fusion.model import HydraModel


class OpenClipEmbedding(nn.Module):
    """conv1 patchify, class token, position embedding and ln_pre of an open_clip image tower."""

    def __init__(self, visual: nn.Module) -> None:
        super().__init__()
        conv = visual.conv1
        self.conv1 = nn.Conv2d(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            conv.stride,
            bias=conv.bias is not None,
        )
        self.conv1.load_state_dict(conv.state_dict())
        self.class_embedding = nn.Parameter(visual.class_embedding.detach().clone())  # [D]
        self.positional_embedding = nn.Parameter(visual.positional_embedding.detach().clone())
        self.ln_pre = stream_norm([visual.ln_pre])

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.conv1(pixel_values)  # [B, D, gh, gw]
        x = x.flatten(2).transpose(1, 2)  # [B, P, D]
        cls = self.class_embedding.view(1, 1, -1).expand(x.shape[0], -1, -1)  # [B, 1, D]
        x = torch.cat([cls, x], dim=1) + self.positional_embedding  # [B, N, D]
        return self.ln_pre(x)


class SharedProjection(nn.Module):
    """The projection into the joint space when every member has the same one: [S, B, D] @ [D, E]."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())  # [D, E]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def _embedding_tensors(visual: nn.Module) -> list[torch.Tensor | None]:
    tensors = [visual.class_embedding, visual.positional_embedding]
    return tensors + list(visual.conv1.parameters()) + list(visual.ln_pre.parameters())


class HydraOpenClip(HydraModel):
    """Fused Hydra OpenCLIP. forward(pixel_values [B, 3, H, W]) -> member logits [B, M, C]."""

    family = "openclip"

    def _fuse(self, members: Sequence[BackboneAdapter], shared_trunk: bool) -> None:
        M, lowering = self.num_members, self.lowering
        visuals = [member.module.visual for member in members]
        first, classifier = members[0], members[0].module
        self.input_size = (first.in_chans, *first.img_size)
        self.input_names = ("pixel_values",)
        self.preprocessing = first.data_config()
        self.class_names = None if first.class_names is None else list(first.class_names)
        self.backbone_kwargs = first.backbone_kwargs()

        # embeddings shared when every member has the same weights; a shared trunk while all
        # members' layers are identical, then M streams
        embed_shared = self._fuse_embeddings(visuals, _embedding_tensors, OpenClipEmbedding)
        stack = self._fuse_layers(members, shared_trunk and embed_shared)

        # pooling, ln_post and the projection into the joint space
        self.pool_type = visuals[0].pool_type
        self.final_ln_after_pool = bool(visuals[0].final_ln_after_pool)
        self.ln_post = stream_norm([visual.ln_post for visual in visuals])
        projections = [visual.proj for visual in visuals]
        if all_equal(projections):
            self.proj = SharedProjection(projections[0])
            proj_kind = "shared"
        else:
            stacked = torch.stack([p.detach() for p in projections])  # [M, D, E]
            self.proj = GroupedLinear.from_weights(stacked, None, lowering)
            proj_kind = "per-member"
        # the zero-shot classifier: shared by every member (check_same_architecture)
        self.register_buffer("class_weights", classifier.class_weights.detach().clone())
        self.register_buffer("logit_scale", classifier.logit_scale.detach().clone())
        bias = classifier.logit_bias
        self.register_buffer("logit_bias", None if bias is None else bias.detach().clone())

        ln_post_per_stream = bool(getattr(self.ln_post, "per_stream", False))
        self.final_shared = proj_kind == "shared" and not ln_post_per_stream
        final_streams = M if (self.blocks or not self.final_shared) else 1
        self.merge = {
            **stack.merge(embed_shared, (self.ln_post,)),
            "projection": proj_kind,
            "classifier": "shared (zero-shot text embeddings)",
        }
        self._count_macs(first, stack, embed_shared, final_streams)

    def _pooled(self, x: torch.Tensor) -> torch.Tensor:
        """[S, B, N, D] -> [S, B, D], ln_post included (it is per token, so the class token can be
        taken first and normalised alone: the same numbers as open_clip's normalise-then-take)."""
        if self.pool_type == "tok":
            return self.ln_post(x[:, :, 0])
        if self.final_ln_after_pool:
            return self.ln_post(token_mean(x[:, :, 1:], dim=2))
        return token_mean(self.ln_post(x)[:, :, 1:], dim=2)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        M = self.num_members
        self.check_pixel_values(pixel_values)
        x = self.encode(pixel_values)  # [S, B, N, D]
        features = self.proj(self._pooled(x))  # [S, B, E]
        logits = zero_shot_logits(features, self.class_weights, self.logit_scale, self.logit_bias)
        if logits.shape[0] != M:
            logits = logits.expand(M, -1, -1)  # [M, B, C]
        return logits.transpose(0, 1)  # [B, M, C]
