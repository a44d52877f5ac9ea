"""Distributed batch scoring: an export folder run over many images or text lines with Ray Data.

``score_dataset(export_dir, inputs, out)`` (:mod:`hydra_deploy.distributed.ray_score`, the library
side of ``hydra-score-dataset``) scores every input in a pool of Ray actors, one ONNX Runtime
session each, and writes one Parquet part per shard of inputs, resumable after a crash.

Runtime code here imports numpy, ray, pyarrow and the runners only (never torch); ray and pyarrow
are imported when scoring starts, so importing this package needs neither.
"""

from __future__ import annotations

from hydra_deploy.distributed.ray_score import (
    DEFAULT_SHARD_SIZE,
    MANIFEST,
    HydraScorer,
    ScoreReport,
    score_dataset,
)

__all__ = ["DEFAULT_SHARD_SIZE", "MANIFEST", "HydraScorer", "ScoreReport", "score_dataset"]
