"""hydra-monitor: replay a stored stream through the export's monitor (alarms, rates, a plot).

The stream is what a run stored, in its order: hydra-run's JSON (``--monitor`` stores the score
the monitor consumed; without it the score is computed where the record allows) or
hydra-score-dataset's Parquet output (with ``--member-logits``, exactly what a live monitor sees).
Replaying hydra-run --monitor's JSON with the same settings gives the live run's numbers.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.cli import common
from hydra_deploy.cli.run import write_output
from hydra_deploy.errors import DataError
from hydra_deploy.export_folder import read_info
from hydra_deploy.monitor import Monitor, no_reference, replay, stream_columns, summary_lines
from hydra_deploy.optional import lazy_module
from hydra_deploy.options import MonitorOptions, add_options
from hydra_deploy.uncertainty import plots

parquet = lazy_module(
    "pyarrow.parquet", purpose="reading hydra-score-dataset's Parquet output", error=DataError
)

log = logging.getLogger("hydra_deploy")

#: the monitor settings hydra-monitor takes (a replay starts a new stream: no --monitor-state)
MONITOR_OPTIONS = ("alpha", "rule", "window")

EXAMPLES = """\
  hydra-monitor watched.json --model export/digits-m3       # of hydra-run --monitor --json FILE
  hydra-monitor watched.json --model export/digits-m3 --monitor-rule mixture --plot watch.png
  hydra-monitor scores.parquet --model export/digits-m3 --json monitor.json   # score-dataset's
"""

DESCRIPTION = (
    "Replay a stored stream of model outputs, in its order, through the drift monitor of an "
    "export that hydra-calibrate fitted (its decisions hold the monitor's reference): print "
    "the alarm points (input index, martingale), each rate against what calibration expects "
    "and the label-free estimates (accuracy, set coverage); --json writes them with the "
    "per-input p-values and martingale, --plot draws the martingale path, the rates and the "
    "estimated accuracy over time. SCORES: hydra-run's JSON (--monitor stores the monitored "
    "score; without it the score is computed from the calibrated confidence where the record "
    "monitors msp) or hydra-score-dataset's Parquet output folder (run with --member-logits)."
)


def build_parser() -> argparse.ArgumentParser:
    p = common.parser("hydra-monitor", DESCRIPTION, EXAMPLES)
    p.add_argument(
        "scores",
        type=Path,
        metavar="SCORES",
        help="hydra-run's JSON file, or hydra-score-dataset's Parquet folder (or one part file)",
    )
    p.add_argument(
        "--model",
        type=Path,
        required=True,
        metavar="EXPORT",
        help="the export folder the stream was scored with (its decisions hold the reference)",
    )
    p.add_argument(
        "--json", type=Path, metavar="FILE", help="write the summary and per-input values as JSON"
    )
    p.add_argument(
        "--plot",
        type=Path,
        metavar="FILE",
        help="draw the martingale, the rates and the estimated accuracy over time as a PNG "
        "(needs matplotlib: pip install 'hydra-deploy[eval]')",
    )
    p.add_argument("--overwrite", action="store_true", help="replace existing --json/--plot files")
    add_options(p, MonitorOptions, only=MONITOR_OPTIONS)
    return p


def _json_rows(path: Path) -> list[dict[str, Any]]:
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"cannot read {path} as JSON ({err})") from None
    if not isinstance(report, dict) or not isinstance(report.get("results"), list):
        raise DataError(f"{path} is not hydra-run's JSON (no 'results' list): run hydra-run --json")
    return report["results"]


def _parquet_rows(path: Path) -> list[dict[str, Any]]:
    parts = sorted(path.glob("part-*.parquet")) if path.is_dir() else [path]
    if not parts:
        raise DataError(f"{path} holds no part-*.parquet files: is it hydra-score-dataset's OUT?")
    rows = [row for part in parts for row in parquet.read_table(part).to_pylist()]
    kept = [row for row in rows if not row.get("unreadable")]
    if len(kept) < len(rows):
        log.info("left out %d unreadable row(s) of %s", len(rows) - len(kept), path)
    return kept


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The stored stream's rows, in order, from hydra-run's JSON or hydra-score-dataset's Parquet."""
    if not path.exists():
        raise DataError(f"{str(path)!r} does not exist")
    if path.is_dir() or path.suffix.lower() == ".parquet":
        return _parquet_rows(path)
    return _json_rows(path)


def plot(out: dict[str, np.ndarray], monitor: Monitor, path: Path) -> None:
    """The martingale path (log scale, the alarm line, the alarms), the rates and the estimated
    accuracy over the inputs, one panel each, as a PNG."""
    steps = np.arange(out["martingale"].size)
    fig, (drift, rates, accuracy) = plots._pyplot().subplots(3, 1, figsize=(8, 9), sharex=True)
    drift.semilogy(steps, out["martingale"], label="martingale")
    drift.axhline(monitor.drift.threshold, color="red", linestyle="--", label="alarm at 1/alpha")
    alarms = np.flatnonzero(out["alarm"])
    drift.plot(alarms, out["martingale"][alarms], "rv", label="alarm")
    drift.set_ylabel("martingale")
    drift.legend(loc="upper left")
    for name, watch in monitor.rates.items():
        (line,) = rates.plot(steps, out[f"rate_{name}"], label=name)
        rates.axhline(watch.expected, color=line.get_color(), linestyle=":")
    rates.set_ylabel(f"rate (last {monitor.window}; dotted: expected)")
    if monitor.rates:
        rates.legend(loc="upper left")
    if "accuracy" in out:
        accuracy.plot(steps, out["accuracy"])
    accuracy.set_ylabel("estimated accuracy")
    accuracy.set_xlabel("input")
    fig.tight_layout()
    plots._save(fig, path)


def _report(args: argparse.Namespace, monitor: Monitor, out: dict[str, np.ndarray]) -> str:
    per_input = {key: out[key].tolist() for key in ("pvalue", "martingale", "alarm")}
    report = {
        "scores": str(args.scores),
        "model": str(args.model),
        "monitor": monitor.summary(),
        "per_input": per_input,
    }
    return json.dumps(report, indent=2, allow_nan=False) + "\n"


def main_body(args: argparse.Namespace) -> int:
    watch = common.options(MonitorOptions, args)
    for target in (args.json, args.plot):
        if target is not None and str(target) != "-":
            common.refuse_existing(target, args.overwrite)
    record = read_info(args.model).decisions
    if record is None or record.monitor is None:
        raise no_reference(args.model)
    monitor = Monitor.from_record(record, **watch.settings())
    out = replay(monitor, stream_columns(read_rows(args.scores), monitor))
    if args.json is not None:
        write_output(args.json, _report(args, monitor, out))
    if args.plot is not None:
        plot(out, monitor, args.plot)
    if not args.quiet and str(args.json) != "-":
        print("\n".join(summary_lines(monitor.summary())))
    return 0


main = common.entry_point(build_parser, main_body, "hydra-monitor")


if __name__ == "__main__":
    sys.exit(main())
