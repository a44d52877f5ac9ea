"""The timing protocol: a :class:`Timer` per variant and batch, made by a :class:`Backend`.

Warm-up runs, then rounds in a rotating order (paired rounds: the single model timed around
every variant); the summary per variant (median, spread, ratio to
the single model, FLOPs ratio and gap).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hydra_deploy.bench.latency.variants import Variant, VariantSet


class Timer:
    """One variant on one batch, ready to run: ``timer()`` runs it once and returns seconds;
    ``output()`` returns its logits as float32 numpy ([B, C] single, [B, M, C] otherwise).
    By default both call ``run()`` (host-side runtimes); device timers override them."""

    def run(self) -> np.ndarray:
        raise NotImplementedError

    def __call__(self) -> float:
        start = time.perf_counter()
        self.run()
        return time.perf_counter() - start

    def output(self) -> np.ndarray:
        return self.run().astype(np.float32)


def rotated(names: Sequence[str], shift: int) -> list[str]:
    shift %= len(names)
    return [*names[shift:], *names[:shift]]


#: Separates a timer's name from its reference's in the key of the reference's paired times.
PAIRED = "~"


def paired_key(reference: str, name: str) -> str:
    """The key under which :func:`time_rounds` returns ``reference``'s times paired with ``name``."""
    return f"{reference}{PAIRED}{name}"


def time_rounds(
    timers: Mapping[str, Callable[[], float]],
    rounds: int,
    warmup: int,
    tick: Callable[[], None] = lambda: None,
    reference: str | None = None,
) -> dict[str, list[float]]:
    """Warm-up runs of every timer, then ``rounds`` rounds timing each once in a rotating order.

    Returns every timer's times in seconds, one per round (index r = round r for all timers).

    ``reference`` (a timer's name): paired rounds. Each round times the reference before every
    other timer and once after the last (R a R b R c R, the others in the rotating order), so
    each timer runs between two reference runs and whatever load the machine carries then hits
    both. The reference's own entry is then the median of its runs in each round, and
    ``paired_key(reference, name)`` holds, per round, the mean of the two reference runs around
    ``name``: the time to divide ``name``'s by.
    """
    names = list(timers)
    for name in names:
        for _ in range(warmup):
            timers[name]()
            tick()
    times: dict[str, list[float]] = {name: [] for name in names}
    others = [name for name in names if name != reference]
    for round_index in range(rounds):
        gc.collect()
        if reference is None:
            for name in rotated(names, round_index):
                times[name].append(float(timers[name]()))
                tick()
            continue
        around = [float(timers[reference]())]
        for name in rotated(others, round_index):
            times[name].append(float(timers[name]()))
            around.append(float(timers[reference]()))
            times.setdefault(paired_key(reference, name), []).append((around[-2] + around[-1]) / 2)
            tick()
        times[reference].append(statistics.median(around))
        tick()
    return times


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def summarize(
    times: Mapping[str, Sequence[float]], variants: Sequence[Variant], batch: int
) -> dict[str, dict[str, Any]]:
    """Per variant: median and spread (ms), ratio to ``single`` (median of per-round ratios; of
    the single model's runs around the variant's where ``times`` holds them, see
    :func:`time_rounds`), FLOPs ratio, gap = ratio / FLOPs ratio, MACs per example and achieved GMAC/s."""
    rows: dict[str, dict[str, Any]] = {}
    for variant in variants:
        seconds = times[variant.name]
        ms = [1000.0 * s for s in seconds]
        single = times.get(paired_key("single", variant.name), times["single"])
        ratios = [t / s for t, s in zip(seconds, single, strict=True)]
        ratio = statistics.median(ratios)
        median_ms = statistics.median(ms)
        q1, q3 = quartiles(ms)
        r1, r3 = quartiles(ratios)
        rows[variant.name] = {
            "median_ms": median_ms,
            "q1_ms": q1,
            "q3_ms": q3,
            "min_ms": min(ms),
            "max_ms": max(ms),
            "ratio_vs_single": ratio,
            "ratio_q1": r1,
            "ratio_q3": r3,
            "flops_ratio": variant.flops_ratio,
            "gap": ratio / variant.flops_ratio,
            "macs_per_example": variant.macs_per_example,
            "gmacs_per_s": variant.macs_per_example * batch / (median_ms / 1000.0) / 1e9,
            "times_ms": ms,
        }
    return rows


class Backend:
    """Prepares variants for one runtime: ``load`` once (export, compile), then ``timer`` per
    variant and batch. ``info()`` says how it ran (threads, precision, timing method)."""

    name = ""
    precision = "fp32"

    def load(self, variants: VariantSet, batches: Sequence[int]) -> None:
        self.variants = variants

    def timer(self, variant: Variant, inputs: tuple[torch.Tensor, ...]) -> Timer:
        raise NotImplementedError

    def keep_only(self, names: set[str]) -> None:
        """Free what the variants not in ``names`` hold (their sessions); those are not timed
        again."""

    def release(self, batch: int) -> None:
        """Free what the timers of ``batch`` held (CUDA graphs)."""

    def profile(self, variants: VariantSet, batch: int, runs: int) -> dict[str, Any] | None:
        """A profile of where the time goes, kept for ``info()`` (INT8 ONNX Runtime); None."""
        return None

    def info(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Free sessions, engines and device memory."""
