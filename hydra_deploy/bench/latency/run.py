"""The run: build the variants, time them on every chosen backend (a CPU runtime's lower
precisions in the same rounds as its FP32 variants), compare their outputs with PyTorch eager
FP32, and return the result (JSON-able).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hydra_deploy.backbones import BackboneAdapter
from hydra_deploy.bench.latency.backends import make_backend, resolve_backends, resolve_precisions
from hydra_deploy.bench.latency.config import RESULT_FORMAT, BenchConfig
from hydra_deploy.bench.latency.machine import environment, load_average, torch_threads
from hydra_deploy.bench.latency.timing import Backend, summarize, time_rounds
from hydra_deploy.bench.latency.variants import VariantSet, build_variants
from hydra_deploy.errors import HydraError

log = logging.getLogger("hydra_deploy.bench")


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

    def tick(self, runs: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(runs)


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
    return measure_backends([backend], variants, config, reference, progress)[backend.name]


def _runs(config: BenchConfig) -> int:
    return config.warmup + config.rounds


def profile_batch(batches: Sequence[int]) -> int:
    """The batch the INT8 graphs are profiled at: 8 when measured, else the largest."""
    return 8 if 8 in batches else max(batches)


def measure_backends(
    backends: Sequence[Backend],
    variants: VariantSet,
    config: BenchConfig,
    reference: Mapping[str, np.ndarray],
    progress: Progress,
    skipped: dict[str, str] | None = None,
) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Time the backends of one runtime together: per batch, every round times every (backend,
    variant) once in a rotating order. Returns {backend: (results per batch, info)}.

    When the first backend is FP32 (``torch``, ``ort``), every row also gets
    ``ratio_vs_fp32_single``: the median over rounds of (its time / that backend's single-model
    time in the same round); the FP32 rows' equals their ``ratio_vs_single``. ``skipped``: where
    a backend after the first that cannot be prepared (an INT8 quantization refused) is named
    with the reason, instead of ending the run.
    """
    prepared: dict[str, float] = {}
    loaded: list[Backend] = []
    for index, backend in enumerate(backends):
        started = time.perf_counter()
        progress.describe(f"{backend.name}: preparing")
        try:
            backend.load(variants, config.batches)
        except HydraError as err:
            if index == 0 or skipped is None:
                raise
            skipped[backend.name] = f"could not be prepared: {err}"
            log.warning("%s skipped: %s", backend.name, err)
            progress.tick(len(config.batches) * len(variants.variants) * _runs(config))
            continue
        prepared[backend.name] = time.perf_counter() - started
        loaded.append(backend)
    backends = loaded
    fp32 = backends[0].name if backends[0].precision == "fp32" else None
    results: dict[str, dict[str, Any]] = {b.name: {} for b in backends}
    diffs: dict[str, dict[str, float]] = {b.name: {} for b in backends}
    for batch in config.batches:
        progress.describe(" + ".join(b.name for b in backends) + f" batch {batch}")
        inputs = variants.example_inputs(batch)
        timers = {
            f"{b.name}/{v.name}": b.timer(v, inputs) for b in backends for v in variants.variants
        }
        if batch == config.batches[0]:
            for b in backends:
                if b.name != "torch":
                    diffs[b.name] = {
                        v.name: max_abs_diff(
                            timers[f"{b.name}/{v.name}"].output(), reference[v.name]
                        )
                        for v in variants.variants
                    }
        times = time_rounds(timers, config.rounds, config.warmup, progress.tick)
        for b in backends:
            own = {v.name: times[f"{b.name}/{v.name}"] for v in variants.variants}
            rows = summarize(own, variants.variants, batch)
            if fp32 is not None:
                single = times[f"{fp32}/single"]
                for name, row in rows.items():
                    row["ratio_vs_fp32_single"] = statistics.median(
                        t / s for t, s in zip(own[name], single, strict=True)
                    )
            results[b.name][str(batch)] = rows
        del timers
        for b in backends:
            b.release(batch)
    out: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for b in backends:
        if config.int8_profile_runs:
            progress.describe(f"{b.name}: profiling")
            b.profile(variants, profile_batch(config.batches), config.int8_profile_runs)
        info = {
            **b.info(),
            "prepare_s": round(prepared[b.name], 2),
            "max_abs_diff_vs_torch_fp32": diffs[b.name],
            "diff_batch": config.batches[0],
        }
        if fp32 is not None and b.name != fp32:
            info["timed_with"] = fp32
        out[b.name] = (results[b.name], info)
    return out


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
    lower, not_measured = resolve_precisions(config, backends)
    skipped = {**skipped, **not_measured}
    threads = config.threads or torch.get_num_threads()
    with torch_threads(threads):
        env = environment(threads)
        variants = variants or build_variants(config, factory)
        reference = reference_outputs(variants, config.batches[0])
        total = (
            (len(backends) + len(lower))
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
                group = [make_backend(name, config, threads, Path(workdir))]
                group += [
                    make_backend(low.backend, config, threads, Path(workdir), fp32=group[0])
                    for low in lower
                    if low.runtime == name
                ]
                try:
                    measured = measure_backends(
                        group, variants, config, reference, progress, skipped
                    )
                finally:
                    for backend in group:
                        backend.close()
                for backend_name, (rows, info) in measured.items():
                    results[backend_name], infos[backend_name] = rows, info
                del group
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
