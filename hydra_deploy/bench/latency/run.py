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
from hydra_deploy.bench.config import RESULT_FORMAT, BenchConfig
from hydra_deploy.bench.latency.backends import make_backend, resolve_backends, resolve_precisions
from hydra_deploy.bench.latency.machine import environment, load_average, torch_threads
from hydra_deploy.bench.latency.timing import Backend, paired_key, summarize, time_rounds
from hydra_deploy.bench.latency.variants import Variant, VariantSet, build_variants
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


def _prepare(
    backend: Backend,
    variants: VariantSet,
    config: BenchConfig,
    progress: Progress,
    skipped: dict[str, str] | None,
    required: bool,
) -> float | None:
    """Load ``backend``; seconds taken, or None when it could not be (named in ``skipped``)."""
    started = time.perf_counter()
    progress.describe(f"{backend.name}: preparing")
    try:
        backend.load(variants, config.batches)
    except HydraError as err:
        if required or skipped is None:
            raise
        skipped[backend.name] = f"could not be prepared: {err}"
        log.warning("%s skipped: %s", backend.name, err)
        progress.tick(len(config.batches) * len(variants.variants) * _runs(config))
        return None
    return time.perf_counter() - started


def _time_group(
    group: Sequence[tuple[Backend, Sequence[Variant]]],
    variants: VariantSet,
    config: BenchConfig,
    reference: Mapping[str, np.ndarray],
    progress: Progress,
) -> tuple[dict[str, dict[int, dict[str, list[float]]]], dict[str, dict[str, float]]]:
    """Per batch, paired rounds timing every (backend, variant) of ``group`` once in a rotating
    order, the first backend's single model around each (its runs around its own variants kept
    under ``paired_key("single", variant)``).
    Returns ({backend: {batch: {variant: seconds per round}}}, {backend: {variant: max |diff|
    from PyTorch eager FP32 at the first batch}})."""
    times: dict[str, dict[int, dict[str, list[float]]]] = {b.name: {} for b, _ in group}
    diffs: dict[str, dict[str, float]] = {b.name: {} for b, _ in group}
    for batch in config.batches:
        progress.describe(" + ".join(b.name for b, _ in group) + f" batch {batch}")
        inputs = variants.example_inputs(batch)
        timers = {f"{b.name}/{v.name}": b.timer(v, inputs) for b, chosen in group for v in chosen}
        if batch == config.batches[0]:
            for b, chosen in group:
                if b.name != "torch":
                    diffs[b.name] = {
                        v.name: max_abs_diff(
                            timers[f"{b.name}/{v.name}"].output(), reference[v.name]
                        )
                        for v in chosen
                    }
        reference = f"{group[0][0].name}/single"
        measured = time_rounds(timers, config.rounds, config.warmup, progress.tick, reference)
        for b, chosen in group:
            times[b.name][batch] = {v.name: measured[f"{b.name}/{v.name}"] for v in chosen}
            if b is group[0][0]:  # the reference's runs around each of its own variants
                times[b.name][batch].update(
                    {
                        paired_key("single", v.name): measured[paired_key(reference, key)]
                        for v in chosen
                        if (key := f"{b.name}/{v.name}") != reference
                    }
                )
        del timers
        for b, _ in group:
            b.release(batch)
    return times, diffs


def _rows_and_info(
    backend: Backend,
    first: Backend,
    measured: tuple[dict[str, Any], dict[str, float]],
    variants: VariantSet,
    config: BenchConfig,
    progress: Progress,
    prepare_s: float | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rows per batch and info of ``backend`` from its group's times and logit differences
    (``measured``); when ``first`` is FP32, the group holds its single model's times, which every
    row's ``ratio_vs_fp32_single`` is taken against. Profiles the INT8 graphs when asked."""
    group_times, diffs = measured
    fp32 = first.precision == "fp32"
    times: dict[int, dict[str, list[float]]] = group_times[backend.name]
    rows_by_batch: dict[str, Any] = {}
    for batch, own in times.items():
        rows = summarize(own, variants.variants, batch)
        if fp32 and backend is first:
            for row in rows.values():
                row["ratio_vs_fp32_single"] = row["ratio_vs_single"]
        elif fp32:
            reference_single = group_times[first.name][batch]["single"]
            for name, row in rows.items():
                row["ratio_vs_fp32_single"] = statistics.median(
                    t / s for t, s in zip(own[name], reference_single, strict=True)
                )
        rows_by_batch[str(batch)] = rows
    if config.int8_profile_runs:
        progress.describe(f"{backend.name}: profiling")
        backend.profile(variants, profile_batch(config.batches), config.int8_profile_runs)
    info = {
        **backend.info(),
        "prepare_s": round(prepare_s or 0.0, 2),
        "max_abs_diff_vs_torch_fp32": diffs,
        "diff_batch": config.batches[0],
    }
    if fp32 and backend is not first:
        info["timed_with"] = first.name
        info["fp32_reference"] = (
            f"{first.name}'s single model, timed in the same rounds (its other variants "
            "released before)"
        )
    return rows_by_batch, info


def measure_backends(
    backends: Sequence[Backend],
    variants: VariantSet,
    config: BenchConfig,
    reference: Mapping[str, np.ndarray],
    progress: Progress,
    skipped: dict[str, str] | None = None,
) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Time the backends of one runtime. Returns {backend: (results per batch, info)}.

    The first backend's variants are timed together (per batch, rounds in a rotating order).
    When it is FP32 (``torch``, ``ort``), each later backend (a lower precision of the same
    runtime) is then timed in its own rounds beside the FP32 *single* model only, the FP32
    backend's other variants released first (ONNX Runtime sessions of five ViT-B/16 variants in
    three precisions at once did not fit in 24 GB); every row gets ``ratio_vs_fp32_single``:
    the median over rounds of (its time / the FP32 single model's time in the same round). The
    FP32 rows' equals their ``ratio_vs_single``. ``skipped``: where a backend after the first
    that cannot be prepared (an INT8 quantization refused) is named with the reason, instead of
    ending the run.
    """
    first, lower = backends[0], list(backends[1:])
    fp32 = first.precision == "fp32"
    prepared = {first.name: _prepare(first, variants, config, progress, skipped, True)}
    if not fp32:  # no FP32 reference in this runtime: all together, as one group
        for backend in lower:
            prepared[backend.name] = _prepare(backend, variants, config, progress, skipped, False)
        lower = [b for b in lower if prepared[b.name] is not None]
        groups = [[(b, variants.variants) for b in (first, *lower)]]
    else:
        groups = [[(first, variants.variants)]]
    results: dict[str, dict[str, Any]] = {}
    infos: dict[str, dict[str, Any]] = {}
    single = next(v for v in variants.variants if v.name == "single")

    def record(backend: Backend, group_times: dict[str, Any], diffs: dict[str, float]) -> None:
        results[backend.name], infos[backend.name] = _rows_and_info(
            backend,
            first,
            (group_times, diffs),
            variants,
            config,
            progress,
            prepared[backend.name],
        )

    for group in groups:
        group_times, group_diffs = _time_group(group, variants, config, reference, progress)
        for backend, _ in group:
            record(backend, group_times, group_diffs[backend.name])
    if fp32 and lower:
        first.keep_only({"single"})
        gc.collect()
        for backend in lower:
            prepared[backend.name] = _prepare(backend, variants, config, progress, skipped, False)
            if prepared[backend.name] is None:
                continue
            try:
                group = [(first, [single]), (backend, variants.variants)]
                group_times, group_diffs = _time_group(group, variants, config, reference, progress)
                record(backend, group_times, group_diffs[backend.name])
            finally:
                backend.close()
                gc.collect()
    return {name: (results[name], infos[name]) for name in results}


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
        per_variant = len(config.batches) * (config.warmup + config.rounds)
        # every variant on every backend, and the FP32 single model again beside each lower one
        total = per_variant * ((len(backends) + len(lower)) * len(variants.variants) + len(lower))
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
