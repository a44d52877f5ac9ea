"""The regression check of a run against a baseline, with one re-measure of what regressed.

A ratio (variant time / single model time, from paired rounds) carries across machines and loads
far better than a time, but one hiccup (another job starting on a shared CI runner) can still push
a few rounds of one variant over the limit. So a failed comparison is not the verdict yet: the
backends, batches and variants that regressed are timed again, with twice the rounds, and only an
entry that regresses in both runs fails (:func:`hydra_deploy.bench.check.confirm`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, MutableMapping
from functools import partial
from typing import Any

from hydra_deploy.bench import check
from hydra_deploy.bench.config import BenchConfig
from hydra_deploy.bench.latency.run import run_benchmark

log = logging.getLogger("hydra_deploy.bench")


def remeasure_config(config: BenchConfig, report: check.CheckReport) -> BenchConfig:
    """``config`` narrowed to ``report``'s regressions (their batches and variants; their
    backends where all are FP32 backends of the run, else every backend, since a lower precision
    is timed beside its runtime's FP32 single model), with twice the rounds."""
    failed = check.failed_entries(report)
    backends = config.backends
    if backends is not None and failed["backends"] <= set(backends):
        backends = tuple(b for b in backends if b in failed["backends"])
    return dataclasses.replace(
        config,
        backends=backends,
        batches=tuple(sorted(int(b) for b in failed["batches"])),
        variants=tuple(v for v in config.variants if v in failed["variants"] or v == "single"),
        rounds=2 * config.rounds,
    )


def check_run(
    result: MutableMapping[str, Any],
    baseline: Mapping[str, Any],
    config: BenchConfig,
    tolerance: float | None = None,
    *,
    measure: Callable[[BenchConfig], dict[str, Any]] | None = None,
) -> check.CheckReport:
    """Compare ``result`` (a run of ``config``) with ``baseline``; when something regressed,
    re-measure it once (:func:`remeasure_config`) and fail only on what regresses again.

    ``measure``: config -> result, how to re-measure (default :func:`run_benchmark` without a
    progress bar). The re-measured run's results go into ``result["remeasured"]`` (with its
    config), so a saved result shows both.
    """
    report = check.compare(result, baseline, tolerance)
    if report.passed:
        return report
    again_config = remeasure_config(config, report)
    log.warning(
        "%d ratio(s) over the tolerance; timing %s again (batch %s, %d rounds) before the verdict",
        len(report.regressions),
        ", ".join(sorted({f.variant for f in report.regressions})),
        " ".join(str(b) for b in again_config.batches),
        again_config.rounds,
    )
    again = (measure or partial(run_benchmark, quiet=True))(again_config)
    result["remeasured"] = {"config": again["config"], "results": again["results"]}
    return check.confirm(report, check.compare(again, baseline, tolerance))
