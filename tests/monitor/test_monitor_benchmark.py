"""benchmarks/monitor.py on the stored digits logits, at a tiny size: it runs, its numbers mean what
its report says (a first alarm index, delays counted from the switch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import monitor as bench  # noqa: E402


def test_first_alarms_and_delays_are_counted_from_the_switch():
    pvalues = np.full((3, 8), 0.5)
    pvalues[1, 5:] = 1e-4  # the jumper's -1 bettor grows ~1.5x per step: an alarm some steps on
    pvalues[2, :] = 1e-6
    first = bench.first_alarms(pvalues, "mixture", alpha=0.05)
    assert first[0] == -1 and first[1] >= 5 and 0 <= first[2] < 5
    summary = bench._delay_summary(np.array([-1, 99, 100, 104]), horizon=10)
    assert summary["before_switch"] == 0.25  # the alarm at index 99 came before the switch at 100
    assert summary["no_alarm"] == 1 / 3 and summary["median"] == 5.0


def test_the_benchmark_runs_on_the_stored_logits(tmp_path):
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "monitor.py"),
        "--task",
        "digits",
        "--seeds",
        "0",
        "--rows",
        "single",
        "--null-streams",
        "20",
        "--delay-streams",
        "5",
        "--null-steps",
        "200",
        "--synthetic-streams",
        "20",
        "--horizon",
        "50",
        "--out",
        str(tmp_path),
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    results = json.loads((tmp_path / "results.json").read_text())
    row = results["rows"]["single"]["0"]
    assert set(row["false_alarms"]) == {"jumper", "mixture"}
    assert set(row["delays"]) == {"shift", "ood 0.05", "ood 0.2", "ood 1"}
    assert 0.0 <= row["estimate_error"] <= 1.0
    assert "## False alarms" in (tmp_path / "report.md").read_text()
