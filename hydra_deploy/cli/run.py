"""hydra-run: uncertainty scores for images, text lines or arrays, from an export or an engine.

The command parses flags and lays the results out (a table, JSON or CSV); reading the INPUT
arguments and scoring them is :func:`hydra_deploy.engines.sources.score_inputs`.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import sys
from pathlib import Path
from typing import Any

from hydra_deploy.atomic import atomic_write_text
from hydra_deploy.cli import common
from hydra_deploy.engines.preprocess import IMAGE_SUFFIXES
from hydra_deploy.engines.runner import BACKENDS, load_runner
from hydra_deploy.engines.sources import score_inputs
from hydra_deploy.errors import HydraError, counted
from hydra_deploy.monitor import Monitor, no_reference, summary_lines
from hydra_deploy.options import MonitorOptions, RunnerOptions, add_options, command_line
from hydra_deploy.uncertainty import SCALAR_SCORES

#: the runtime options hydra-run takes
RUNNER_OPTIONS = (
    "providers",
    "batch_size",
    "threads",
    "raw",
    "skip_unreadable",
    "allow_decisions_mismatch",
)

log = logging.getLogger("hydra_deploy")

EXAMPLES = """\
  hydra-run export/vit_b16-m3 images/                    # every image under images/, a table
  hydra-run export/vit_b16-m3 cat.jpg dog.png --top-k 3
  hydra-run export/vit_b16-m3 images/ --json scores.json --batch-size 16
  hydra-run engines/vit_b16-m3.fp16.engine batch.npy --csv scores.csv --overwrite
  hydra-run export/vit_b16-m3/model.onnx arrays.npz --providers cpu --json -   # JSON on stdout
  hydra-run export/minilm-m3 glosses.txt --text "a domesticated carnivorous mammal"   # BERT
  hydra-run export/vit_b16-m3 images/ --raw       # scores only, even if hydra-calibrate ran
  hydra-run export/vit_b16-m3 stream/ --monitor --json watched.json   # drift alarm, rates
  hydra-run export/vit_b16-m3 today/ --monitor --monitor-state monitor.json   # one stream, many runs
"""


DESCRIPTION = (
    "Run a Hydra ensemble (export folder, .onnx file or TensorRT engine) on images or "
    "preprocessed arrays and report, per input, the ensemble prediction and its uncertainty "
    "scores (msp, predictive and expected entropy, mutual information, disagreement). "
    f"Images ({', '.join(IMAGE_SUFFIXES)}; folders are searched recursively, sorted) are "
    "preprocessed as timm's eval transform from the export's hydra.json; .npy/.npz arrays "
    "(npz key 'x' or the model's input name) are taken as already preprocessed. An export "
    "calibrated with hydra-calibrate also gives, per input, the calibrated confidence, the "
    "prediction set, answer or abstain, and the OOD flag (--raw: scores only)."
)


def build_parser() -> argparse.ArgumentParser:
    p = common.parser("hydra-run", DESCRIPTION, EXAMPLES)
    p.add_argument("model", type=Path, metavar="MODEL", help="export folder, .onnx or engine file")
    p.add_argument(
        "inputs",
        type=Path,
        nargs="*",
        metavar="INPUT",
        help="image files or folders, .npy/.npz arrays, or (text models) .txt files "
        "with one input per line and .tsv files (label<TAB>text, or label<TAB>text<TAB>second "
        "text for sentence pairs; the labels are not read)",
    )
    p.add_argument(
        "--text",
        action="append",
        metavar="TEXT",
        help="a text to classify (text models; repeat for more)",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument(
        "--json", type=Path, metavar="FILE", help="write the results as JSON ('-': stdout)"
    )
    out.add_argument(
        "--csv", type=Path, metavar="FILE", help="write the results as CSV ('-': stdout)"
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=1,
        metavar="K",
        help="also report the K most probable classes (default 1: the prediction only)",
    )
    p.add_argument(
        "--backend",
        choices=tuple(BACKENDS),
        help="default: TensorRT for engine files, ONNX Runtime otherwise",
    )
    add_options(p, RunnerOptions, p, only=RUNNER_OPTIONS)
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json/--csv file")
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="run inputs holding NaN/inf and pass non-finite logits through (prediction "
        "-1, scores null in JSON, empty in CSV) instead of refusing them",
    )
    add_options(p, MonitorOptions)
    return p


def _fmt(value: float | None) -> str:
    """A score in the printed table: 4 decimals, ``nan`` for a non-finite one."""
    return "nan" if value is None else f"{value:.4f}"


_DECISION_COLUMNS = {  # field -> (column, how a value is shown)
    "confidence": ("confidence", _fmt),
    "prediction_set": ("prediction set", lambda v: "{" + ", ".join(map(str, v)) + "}"),
    "accept": ("decision", lambda v: "answer" if v else "abstain"),
    "ood_flag": ("OOD", lambda v: "flagged" if v else "-"),
}


def _table(results: list[dict[str, Any]]) -> str:
    """The printed table: the prediction, the decisions the export holds, then the scores."""
    decided = [f for f in _DECISION_COLUMNS if f in results[0]]
    scores = [s for s in SCALAR_SCORES if s != "expected_entropy"]
    truth = ["true class"] if "true_name" in results[0] else []
    header = ["input", *truth, "prediction", *(_DECISION_COLUMNS[f][0] for f in decided), *scores]
    rows = [
        [
            r["input"],
            *([r["true_name"] if r["true_name"] is not None else "-"] if truth else []),
            r["predicted_name"] if r["predicted_name"] is not None else r["prediction"],
            *(_DECISION_COLUMNS[f][1](r[f]) for f in decided),
            *(_fmt(r[s]) for s in scores),
        ]
        for r in results
    ]
    return common.print_table(rows, header)


def _top_k_line(result: dict[str, Any]) -> str:
    """One input's K most probable classes (by label where the export names them)."""
    return f"{result['input']}: " + ", ".join(
        f"{e['label'] if e['label'] is not None else e['class']} {_fmt(e['prob'])}"
        for e in result["top_k"]
    )


def _csv_text(results: list[dict[str, Any]]) -> str:
    rows = []
    for result in results:
        row = {k: v for k, v in result.items() if k != "top_k"}
        if "prediction_set" in row:  # one CSV cell: the classes joined by '|'
            row["prediction_set"] = "|".join(map(str, row["prediction_set"]))
        for rank, entry in enumerate(result.get("top_k", []), start=1):
            row[f"top{rank}_class"] = entry["class"]
            row[f"top{rank}_label"] = entry["label"]
            row[f"top{rank}_prob"] = entry["prob"]
        rows.append(row)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def write_output(path: Path, text: str) -> None:
    """``text`` to the file ``path`` (atomically, its folder made), or stdout for ``-``."""
    if str(path) == "-":
        sys.stdout.write(text)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    except OSError as err:
        raise HydraError(f"cannot write {path}: {err}") from err


def _check_monitoring(watch: MonitorOptions, args: argparse.Namespace) -> None:
    """Refuse monitor flags without --monitor, and --monitor with what it cannot watch."""
    if not watch.monitor:
        given = [flag for flag in command_line(watch) if flag.startswith("--")]
        if given:
            raise HydraError(f"{', '.join(given)} set the monitor: add --monitor")
        return
    if args.raw:
        raise HydraError("--monitor watches the export's decisions: leave out --raw")
    if args.allow_nonfinite:
        raise HydraError(
            "--monitor cannot watch non-finite scores: leave out --allow-nonfinite (or run the "
            "inputs holding NaN/inf without --monitor)"
        )


def _start_monitor(runner: Any, model: Path, watch: MonitorOptions) -> Monitor:
    """A monitor of the export's decisions record: resumed from --monitor-state when the file
    exists (its settings must be the ones given), else new."""
    record = runner.decisions
    if record is None or record.monitor is None:
        raise no_reference(model)
    if watch.state is None or not watch.state.exists():
        return Monitor.from_record(record, **watch.settings())
    monitor = Monitor.load(watch.state, record)
    held = {
        "alpha": monitor.drift.alpha,
        "rule": monitor.drift.bettor.name,
        "window": monitor.window,
    }
    default = MonitorOptions().settings()
    for name, value in watch.settings().items():
        if value != default[name] and value != held[name]:  # a flag given that the state differs on
            raise HydraError(
                f"the monitor state {watch.state} was kept with --monitor-{name} {held[name]}, "
                f"not {value}: leave out --monitor-{name}, or give a new --monitor-state file"
            )
    return monitor


def _said_monitor(monitor: Monitor) -> None:
    """The monitor's summary in words, on stderr (stdout holds the results)."""
    print("monitor: " + "\n  ".join(summary_lines(monitor.summary())), file=sys.stderr)


def main_body(args: argparse.Namespace) -> int:
    runtime = common.options(RunnerOptions, args)
    watch = common.options(MonitorOptions, args)
    _check_monitoring(watch, args)
    if args.top_k < 1:
        raise HydraError(f"--top-k must be at least 1, got {args.top_k}")
    target = args.json or args.csv
    if target is not None and str(target) != "-":
        common.refuse_existing(target, args.overwrite)
    skipped: list[dict[str, str]] | None = [] if runtime.skip_unreadable else None
    with load_runner(args.model, backend=args.backend, **runtime.load_kwargs()) as runner:
        monitor = _start_monitor(runner, args.model, watch) if watch.monitor else None
        results = score_inputs(
            runner,
            args.inputs,
            runtime.batch_size,
            args.top_k,
            args.text,
            allow_nonfinite=args.allow_nonfinite,
            decisions=runtime.decisions,
            skipped=skipped,
            monitor=monitor,
        )
        if runtime.decisions and runner.decisions is None:  # said once, after a run that worked
            log.info(
                "%s holds no decisions (fit them with hydra-calibrate): scores only", args.model
            )
        meta = {
            "model": str(args.model),
            "backend": runner.backend,
            "providers": list(runner.providers),
            "precision": runner.precision,
        }
    if args.json is not None:
        report = {**meta, "count": len(results), "results": results}
        if skipped is not None:  # the files --skip-unreadable left out, with the reason
            report["skipped"] = skipped
        if monitor is not None:
            report["monitor"] = monitor.summary()
        write_output(args.json, json.dumps(report, indent=2, allow_nan=False) + "\n")
    elif args.csv is not None:
        write_output(args.csv, _csv_text(results))
    if target is None:
        if not args.quiet:
            print(_table(results))
            if args.top_k > 1:
                print("\n".join(_top_k_line(r) for r in results))
    elif not args.quiet and str(target) != "-":
        print(
            f"wrote {counted(len(results), 'result')} to {target} ({meta['backend']}, "
            f"{', '.join(meta['providers'])})"
        )
    if monitor is not None:
        if watch.state is not None:
            monitor.save(watch.state)
        if not args.quiet:
            _said_monitor(monitor)
    return 0


main = common.entry_point(build_parser, main_body, "hydra-run")


if __name__ == "__main__":
    sys.exit(main())
