"""The latency benchmark on a tiny ViT: M = 2 members of K = 2 heads, a few short rounds."""

from __future__ import annotations

from helpers.vit import tiny_vit
from hydra_deploy.bench import latency as bench

M, K = 2, 2
HAS_ORT = bench.backend_status()["ort"] is None


def tiny_factory(seed: int):
    return tiny_vit("token", seed)


def tiny_config(**changes) -> bench.BenchConfig:
    settings = dict(
        backbone="tiny_vit",
        members=M,
        heads_per_member=K,
        batches=(1, 3),
        backends=("torch", "ort") if HAS_ORT else ("torch",),
        rounds=3,
        warmup=1,
        threads=1,
        exporter="torchscript",
    )
    return bench.BenchConfig(**{**settings, **changes})
