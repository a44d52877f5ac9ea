"""hydra-deploy: Hydra Ensembles of head-pruned Transformers, fused into one network.

The top-level package stays cheap to import: public names are resolved lazily, so the edge runtime
(runners, uncertainty scores) never pulls in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hydra_deploy.optional import lazy_attributes

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "HydraError": "hydra_deploy.errors",
    "HydraSpec": "hydra_deploy.specs",
    "MemberSpec": "hydra_deploy.specs",
    "load_backbone": "hydra_deploy.backbones",
    "fuse": "hydra_deploy.fusion",
    "HydraModel": "hydra_deploy.fusion",
    "GroupedLinear": "hydra_deploy.fusion",
    "export_onnx": "hydra_deploy.export",
    "head_importance": "hydra_deploy.pruning",
    "finetune_members": "hydra_deploy.pruning",
    "select_members": "hydra_deploy.pruning",
    "load_data": "hydra_deploy.pruning",
    "load_export": "hydra_deploy.export",
    "build_engine": "hydra_deploy.engines.tensorrt",
    "load_runner": "hydra_deploy.engines.runner",
    "ensemble_scores": "hydra_deploy.uncertainty",
}

__all__ = [
    "GroupedLinear",
    "HydraError",
    "HydraModel",
    "HydraSpec",
    "MemberSpec",
    "__version__",
    "build_engine",
    "ensemble_scores",
    "export_onnx",
    "finetune_members",
    "fuse",
    "head_importance",
    "load_backbone",
    "load_data",
    "load_export",
    "load_runner",
    "select_members",
]

if TYPE_CHECKING:  # pragma: no cover
    from hydra_deploy.backbones import load_backbone
    from hydra_deploy.engines.runner import load_runner
    from hydra_deploy.engines.tensorrt import build_engine
    from hydra_deploy.errors import HydraError
    from hydra_deploy.export import export_onnx, load_export
    from hydra_deploy.fusion import GroupedLinear, HydraModel, fuse
    from hydra_deploy.pruning import finetune_members, head_importance, load_data, select_members
    from hydra_deploy.specs import HydraSpec, MemberSpec
    from hydra_deploy.uncertainty import ensemble_scores

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
