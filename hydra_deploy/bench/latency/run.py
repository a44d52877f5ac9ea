"""The run: build the variants, time them on every chosen backend, compare their outputs with
PyTorch eager FP32, and return the result (JSON-able).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hydra_deploy.backbones import BackboneAdapter
from hydra_deploy.bench.latency.backends import make_backend, resolve_backends
from hydra_deploy.bench.latency.config import RESULT_FORMAT, BenchConfig
from hydra_deploy.bench.latency.machine import environment, load_average, torch_threads
from hydra_deploy.bench.latency.timing import Backend, summarize, time_rounds
from hydra_deploy.bench.latency.variants import VariantSet, build_variants


@dataclass
class Progress:
    """A tqdm bar on stderr (when tqdm is installed and ``enabled``), else nothing."""

    total: int
    enabled: bool = True
    bar: Any = field(default=None, init=False)

    def __enter__(self) -> Progress:
        if self.enabled:
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self.bar = tqdm(total=self.total, unit="run", dynamic_ncols=True, file=sys.stderr)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    def describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description(text)

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(1)


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def measure_backend(
    backend: Backend,
    variants: VariantSet,
    config: BenchConfig,
    reference: Mapping[str, np.ndarray],
    progress: Progress,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(results per batch, backend info with output differences from PyTorch eager FP32)."""
    started = time.perf_counter()
    progress.describe(f"{backend.name}: preparing")
    backend.load(variants, config.batches)
    prepared_s = time.perf_counter() - started
    results: dict[str, Any] = {}
    diffs: dict[str, float] = {}
    for batch in config.batches:
        progress.describe(f"{backend.name} batch {batch}")
        inputs = variants.example_inputs(batch)
        timers = {v.name: backend.timer(v, inputs) for v in variants.variants}
        if batch == config.batches[0] and backend.name != "torch":
            diffs = {name: max_abs_diff(t.output(), reference[name]) for name, t in timers.items()}
        times = time_rounds(timers, config.rounds, config.warmup, progress.tick)
        results[str(batch)] = summarize(times, variants.variants, batch)
        del timers
        backend.release(batch)
    info = {
        **backend.info(),
        "prepare_s": round(prepared_s, 2),
        "max_abs_diff_vs_torch_fp32": diffs,
        "diff_batch": config.batches[0],
    }
    return results, info


def reference_outputs(variants: VariantSet, batch: int) -> dict[str, np.ndarray]:
    """Every variant's logits in PyTorch eager FP32 (what the other backends are compared to)."""
    inputs = variants.example_inputs(batch)
    with torch.inference_mode():
        return {v.name: v(*inputs).float().numpy() for v in variants.variants}


def run_benchmark(
    config: BenchConfig,
    factory: Callable[[int], BackboneAdapter] | None = None,
    *,
    quiet: bool = False,
    variants: VariantSet | None = None,
) -> dict[str, Any]:
    """Build the variants, time them on every chosen backend; returns the result (JSON-able).

    ``factory``: seed -> backbone adapter (default from ``config.backbone``); ``variants``: an
    already built :class:`VariantSet` (then ``factory`` is not used). Raises BenchError for an
    impossible configuration or a backend asked for that cannot run here.
    """
    started = time.perf_counter()
    backends, skipped = resolve_backends(config.backends)
    threads = config.threads or torch.get_num_threads()
    with torch_threads(threads):
        env = environment(threads)
        variants = variants or build_variants(config, factory)
        reference = reference_outputs(variants, config.batches[0])
        total = (
            len(backends)
            * len(config.batches)
            * len(variants.variants)
            * (config.warmup + config.rounds)
        )
        results: dict[str, Any] = {}
        infos: dict[str, Any] = {}
        with (
            Progress(total, enabled=not quiet) as progress,
            tempfile.TemporaryDirectory(prefix="hydra-bench-") as workdir,
        ):
            for name in backends:
                backend = make_backend(name, config, threads, Path(workdir))
                try:
                    results[name], infos[name] = measure_backend(
                        backend, variants, config, reference, progress
                    )
                finally:
                    backend.close()
                gc.collect()
    env["load_average_end"] = load_average()
    return {
        "format": RESULT_FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {**config.to_dict(), "threads": threads, "backends": backends},
        "model": variants.info,
        "variants": {v.name: v.describe() for v in variants.variants},
        "environment": env,
        "backends": infos,
        "skipped": skipped,
        "results": results,
        "wall_time_s": round(time.perf_counter() - started, 1),
    }
