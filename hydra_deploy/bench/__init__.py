"""Latency benchmarks: Hydra against one model and a deep ensemble, and a regression guard.

- :mod:`hydra_deploy.bench.latency`: builds the variants (``single``, ``hydra``, ``hydra_trunk``,
  ``fused_deep_ensemble``, ``deep_ensemble_seq``, ``deep_ensemble_batched``), times them on every
  backend present (PyTorch eager, ONNX Runtime CPU, both also in INT8 / BF16, PyTorch CUDA
  BF16/FP16 with CUDA graphs, TensorRT) and reports medians,
  spreads, ratios to the single model and the analytic FLOPs beside them (needs torch).
- :mod:`hydra_deploy.bench.check`: baselines of those ratios and the comparison that fails on a
  regression, the claims and issue 27's INT8 targets read from a result (JSON only; no torch).

``hydra-bench`` (:mod:`hydra_deploy.cli.bench`) is the command over both. Names resolve lazily so
that ``import hydra_deploy.bench`` stays cheap.
"""

from __future__ import annotations

from hydra_deploy.errors import HydraError
from hydra_deploy.optional import lazy_attributes


class BenchError(HydraError, ValueError):
    """A benchmark setting is invalid, a backend is missing, or a baseline does not fit the run."""


_LAZY = {
    "BenchConfig": "hydra_deploy.bench.config",
    "BACKENDS": "hydra_deploy.bench.config",
    "VARIANTS": "hydra_deploy.bench.config",
    "available_backends": "hydra_deploy.bench.latency",
    "build_variants": "hydra_deploy.bench.latency",
    "run_benchmark": "hydra_deploy.bench.latency",
    "make_baseline": "hydra_deploy.bench.check",
    "load_baseline": "hydra_deploy.bench.check",
    "compare": "hydra_deploy.bench.check",
    "claims": "hydra_deploy.bench.check",
    "int8_targets": "hydra_deploy.bench.check",
}

__all__ = sorted([*_LAZY, "BenchError"])

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
