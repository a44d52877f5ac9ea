"""Engines and runners: TensorRT builds (TensorRT / Polygraphy API), trtexec recipes, and one
runner interface over ONNX Runtime sessions and TensorRT engines.

Edge-runtime code: importing this package (and the runners) needs numpy only; torch is never
imported here. Names resolve lazily so ``import hydra_deploy.engines`` stays cheap.
"""

from __future__ import annotations

from hydra_deploy.optional import lazy_attributes

_LAZY = {
    "BACKENDS": "hydra_deploy.engines.runner",
    "build_engine": "hydra_deploy.engines.tensorrt",
    "trtexec_command": "hydra_deploy.engines.trtexec",
    "load_runner": "hydra_deploy.engines.runner",
    "register_backend": "hydra_deploy.engines.backends",
    "score_inputs": "hydra_deploy.engines.sources",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
