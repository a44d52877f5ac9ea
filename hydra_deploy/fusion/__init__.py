"""Fusion: grouped layers, fused multi-head attention, the HydraModel and ``fuse``."""

from hydra_deploy.fusion.grouped import LOWERINGS, GroupedLinear, grouped_linear
from hydra_deploy.fusion.model import HydraModel, fuse

__all__ = ["LOWERINGS", "GroupedLinear", "HydraModel", "fuse", "grouped_linear"]
