"""Fusion: grouped layers, fused multi-head attention, the HydraModel and ``fuse``."""

from hydra_deploy.fusion.grouped import DEFAULT_LOWERING, LOWERINGS, GroupedLinear, grouped_linear
from hydra_deploy.fusion.model import HydraModel, fuse

__all__ = ["DEFAULT_LOWERING", "LOWERINGS", "GroupedLinear", "HydraModel", "fuse", "grouped_linear"]
