"""Specs and members for fusing any family: random specs (a hypothesis strategy, and a seeded one
over a backbone's own geometry) and "fine-tuned" copies of a backbone."""

from __future__ import annotations

import copy

import torch
from hypothesis import strategies as st

from hydra_deploy.backbones import load_backbone
from hydra_deploy.specs import HydraSpec


@st.composite
def specs(draw, backbone, max_members: int = 5) -> HydraSpec:
    """Random valid specs: 1..5 members, unequal and empty head subsets, sometimes a shared prefix."""
    L, H = backbone.num_layers, backbone.num_heads
    members = draw(st.integers(1, max_members))
    layer_heads = st.lists(st.integers(0, H - 1), unique=True, max_size=H).map(sorted)
    heads = [[draw(layer_heads) for _ in range(L)] for _ in range(members)]
    shared = draw(st.integers(0, L))
    for member in heads[1:]:
        member[:shared] = heads[0][:shared]
    return HydraSpec(backbone.name, L, H, backbone.head_dim, [{"heads": h} for h in heads])


def random_spec(backbone, **kwargs) -> HydraSpec:
    """``HydraSpec.random`` over the backbone's own name, layers, heads and head width; the keyword
    arguments (members=, heads_per_member=, shared_layers=, seed=, ...) go to it unchanged."""
    return HydraSpec.random(
        backbone.name, backbone.num_layers, backbone.num_heads, backbone.head_dim, **kwargs
    )


def perturbed_members(backbone, count: int, seed: int, scale: float = 0.05) -> list:
    """``count`` "fine-tuned" copies of the backbone: every weight moved a little, differently."""
    members = []
    for index in range(count):
        module = copy.deepcopy(backbone.module)
        generator = torch.Generator().manual_seed(seed * 101 + index)
        with torch.no_grad():
            for param in module.parameters():
                param.add_(scale * torch.randn(param.shape, generator=generator))
        members.append(load_backbone(module))
    return members
