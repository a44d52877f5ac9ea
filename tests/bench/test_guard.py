"""The latency regression guard on a busy machine: paired rounds, the re-measure of a failed
comparison, and (marked ``latency``, CI's own step) the committed quick check loaded and unloaded,
with a real regression (one variant doing its work twice) failing either way."""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.bench import tiny_config, tiny_factory

from hydra_deploy.bench import check
from hydra_deploy.bench import latency as bench
from hydra_deploy.bench.latency import guard, run
from hydra_deploy.cli import bench as cli

ROOT = Path(__file__).resolve().parents[2]
CPU_QUICK = ROOT / "benchmarks" / "baselines" / "cpu_quick.json"


# --------------------------------------------------------------------------------------------------
# paired rounds


def test_paired_rounds_time_the_reference_around_every_other_timer():
    calls: list[str] = []
    clock = iter(range(1, 1000))

    def timer(name):
        return lambda: calls.append(name) or float(next(clock))

    timers = {name: timer(name) for name in ("s", "a", "b")}
    times = bench.time_rounds(timers, rounds=2, warmup=1, reference="s")
    assert calls[:3] == ["s", "a", "b"]  # warm-up as before
    assert calls[3:] == ["s", "a", "s", "b", "s", "s", "b", "s", "a", "s"]  # rotated, sandwiched
    # round 0: s=4 a=5 s=6 b=7 s=8; round 1: s=9 b=10 s=11 a=12 s=13
    assert times["a"] == [5.0, 12.0] and times["b"] == [7.0, 10.0]
    assert times[bench.paired_key("s", "a")] == [5.0, 12.0]  # (4 + 6) / 2, (11 + 13) / 2
    assert times[bench.paired_key("s", "b")] == [7.0, 10.0]  # (6 + 8) / 2, (9 + 11) / 2
    assert times["s"] == [6.0, 11.0]  # the median of the round's reference runs


def test_summarize_divides_by_the_paired_single_runs_where_given():
    variants = [
        bench.Variant("single", [], 100, 1.0, 1, False),
        bench.Variant("hydra", [], 250, 2.5, 1, True),
    ]
    # the machine slowed down 4x while hydra ran in rounds 1 and 2: the rounds' median single
    # (1.0) missed it, the single runs around hydra's (4.0) did not
    times = {"single": [1.0, 1.0, 1.0], "hydra": [2.0, 8.0, 8.0]}
    assert bench.summarize(times, variants, batch=1)["hydra"]["ratio_vs_single"] == 8.0
    times[bench.paired_key("single", "hydra")] = [1.0, 4.0, 4.0]
    rows = bench.summarize(times, variants, batch=1)
    assert rows["hydra"]["ratio_vs_single"] == 2.0 and rows["hydra"]["ratio_q3"] == 2.0
    assert rows["single"]["ratio_vs_single"] == 1.0


def test_a_run_pairs_every_variant_with_the_single_model():
    config = tiny_config(backends=("torch",), batches=(1,), rounds=3)
    variants = bench.build_variants(config, tiny_factory)
    result = bench.run_benchmark(config, quiet=True, variants=variants)
    rows = result["results"]["torch"]["1"]
    assert rows["single"]["ratio_vs_single"] == 1.0
    for row in rows.values():
        assert len(row["times_ms"]) == 3
        assert row["ratio_vs_fp32_single"] == row["ratio_vs_single"]
        assert row["ratio_q1"] <= row["ratio_vs_single"] <= row["ratio_q3"]


# --------------------------------------------------------------------------------------------------
# the re-measure of a failed comparison


def finding(variant: str, ratio: float, backend: str = "torch", batch: str = "4") -> check.Finding:
    return check.Finding(backend, batch, variant, ratio, 2.0)


def test_confirm_keeps_only_what_regresses_twice():
    first = check.CheckReport(
        0.5,
        regressions=[finding("hydra", 3.5), finding("hydra_trunk", 3.2), finding("x", 3.1)],
        within=[finding("deep_ensemble_seq", 2.1)],
        notes=["a note"],
    )
    again = check.CheckReport(
        0.5,
        regressions=[finding("hydra", 3.6)],
        within=[finding("hydra_trunk", 2.2)],
        not_checked=["torch batch 1 hydra"],
    )
    report = check.confirm(first, again)
    assert not report.passed
    assert [f.variant for f in report.regressions] == ["hydra", "x"]  # x: not measured again
    assert report.regressions[0].ratio == 3.6  # the re-measured ratio
    assert [f.variant for f in report.within] == ["deep_ensemble_seq", "hydra_trunk"]
    assert report.notes == ["a note"] and report.not_checked == []
    assert report.remeasured == [
        "torch batch 4 hydra: ratio 3.500, then 3.600 (baseline 2.000, limit 3.000): a "
        "regression again",
        "torch batch 4 hydra_trunk: ratio 3.200, then 2.200 (baseline 2.000, limit 3.000): passed",
        "torch batch 4 x: ratio 3.100, not measured again",
    ]
    lines = report.lines()
    assert "re-measured: torch batch 4 hydra_trunk: ratio 3.200, then 2.200" in "\n".join(lines)
    assert lines[-1].startswith("check FAILED: 2 regressions")
    assert report.to_dict()["remeasured"] == report.remeasured
    passed = check.confirm(
        check.CheckReport(0.5, regressions=[finding("hydra", 3.5)]),
        check.CheckReport(0.5, improvements=[finding("hydra", 0.9)]),
    )
    assert passed.passed and [f.ratio for f in passed.improvements] == [0.9]


def test_remeasure_times_only_what_regressed_with_twice_the_rounds():
    config = tiny_config(backends=("torch", "ort"), batches=(1, 3), rounds=3)
    report = check.CheckReport(
        0.5,
        regressions=[finding("hydra", 3.5, "ort", "3"), finding("hydra_trunk", 3.5, "ort", "3")],
    )
    again = guard.remeasure_config(config, report)
    assert again.backends == ("ort",) and again.batches == (3,) and again.rounds == 6
    assert again.variants == ("single", "hydra", "hydra_trunk")
    int8 = check.CheckReport(0.5, regressions=[finding("hydra", 3.5, "ort-int8-static", "1")])
    assert guard.remeasure_config(config, int8).backends == ("torch", "ort")  # beside FP32


class Repeated(bench.Timer):
    """A timer doing its variant's work ``times`` times per run (a real regression: the work of
    the model, in its runtime, under whatever load the machine carries, not a sleep)."""

    def __init__(self, inner: bench.Timer, times: int) -> None:
        self.inner, self.times = inner, times

    def __call__(self) -> float:
        return sum(self.inner() for _ in range(self.times))

    def output(self):
        return self.inner.output()


def slowed_hydra(monkeypatch, times: int = 2) -> None:
    """The test hook for a regression: every backend's ``hydra`` timer does its work ``times``
    times, every other variant's is as built."""
    make_backend = run.make_backend

    def make_slowed(*args, **kwargs):
        backend = make_backend(*args, **kwargs)
        make_timer = backend.timer

        def timer(variant, inputs):
            made = make_timer(variant, inputs)
            return Repeated(made, times) if variant.name == "hydra" else made

        backend.timer = timer
        return backend

    monkeypatch.setattr(run, "make_backend", make_slowed)


def test_a_regression_that_passes_on_remeasure_passes_and_one_that_does_not_fails(monkeypatch):
    config = tiny_config(backends=("torch",), batches=(1,), rounds=3, variants=("hydra",))

    def measure(again):
        return bench.run_benchmark(again, tiny_factory, quiet=True)

    result = measure(config)
    baseline = check.make_baseline(result, tolerance=0.5)
    ratio = result["results"]["torch"]["1"]["hydra"]["ratio_vs_single"]
    # a tiny model's ratio is mostly noise: factors of 100 between the claims and the runs
    # a baseline claiming hydra was once 100x faster: every run regresses against it
    baseline["ratios"]["torch"]["1"]["hydra"] = ratio / 100
    report = guard.check_run(result, baseline, config, measure=measure)
    assert not report.passed and len(report.remeasured) == 1
    assert result["remeasured"]["config"]["rounds"] == 6
    assert "a regression again" in report.remeasured[0]
    # the first run's ratio inflated 100x by a hiccup, the re-measure within 10x: passes
    baseline.update(tolerance=9.0)
    baseline["ratios"]["torch"]["1"]["hydra"] = ratio
    hiccup = {**result, "results": {"torch": {"1": {"hydra": {"ratio_vs_single": ratio * 100}}}}}
    report = guard.check_run(hiccup, baseline, config, measure=measure)
    assert report.passed, report.lines()
    assert report.remeasured[0].endswith(": passed")


# --------------------------------------------------------------------------------------------------
# the committed quick check (what CI runs), on a busy machine and with a real regression


@contextlib.contextmanager
def busy_cores(count: int | None = None) -> Iterator[list[subprocess.Popen]]:
    """``count`` (default: every core) processes spinning in a busy loop, stopped on exit."""
    count = count or os.cpu_count() or 2
    spin = [sys.executable, "-c", "while True: pass"]
    procs = [subprocess.Popen(spin) for _ in range(count)]
    try:
        time.sleep(0.5)
        assert all(p.poll() is None for p in procs), "a busy-loop process did not start"
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=30)


def quick_check(capsys, out: Path, *extra: str) -> tuple[int, str]:
    """The committed baseline's own command with --check (and ``extra`` flags), the result with
    its check in ``out`` (the ratios of each run, for the record); (exit code, stderr)."""
    baseline = check.load_baseline(CPU_QUICK)
    argv = shlex.split(baseline["command"])
    assert argv[0] == "hydra-bench"
    code = cli.main([*argv[1:], *extra, "--check", str(CPU_QUICK), "--quiet", "--out", str(out)])
    return code, capsys.readouterr().err


@pytest.mark.latency
def test_quick_check_passes_on_a_machine_busy_on_every_core(capsys, tmp_path):
    with busy_cores() as procs:
        code, err = quick_check(capsys, tmp_path / "busy.json")
        assert all(p.poll() is None for p in procs), "the load stopped before the check ended"
    assert code == 0, f"latency check failed under load against {CPU_QUICK.name}:\n{err}"


@pytest.mark.latency
@pytest.mark.parametrize("loaded", [False, True], ids=["idle", "busy"])
def test_quick_check_fails_when_hydra_does_twice_the_work(capsys, monkeypatch, tmp_path, loaded):
    slowed_hydra(monkeypatch)
    with busy_cores() if loaded else contextlib.nullcontext():
        # hydra alone (the other variants: the test above)
        code, err = quick_check(capsys, tmp_path / "slowed.json", "--variants", "hydra")
    assert code == 1, "hydra at twice the work passed the latency check"
    regressed = [line for line in err.splitlines() if line.startswith("REGRESSION")]
    assert regressed and all(" hydra: " in line for line in regressed), err
