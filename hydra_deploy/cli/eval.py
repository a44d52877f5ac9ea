"""hydra-eval: calibration and OOD detection of an exported Hydra ensemble, as a report folder."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from hydra_deploy.cli import common
from hydra_deploy.engines.runner import load_runner
from hydra_deploy.errors import HydraError
from hydra_deploy.evaluation.evaluate import evaluate, write_report
from hydra_deploy.labels import LABELS_HELP, with_class_names
from hydra_deploy.options import RunnerOptions, add_options
from hydra_deploy.threads import use_threads
from hydra_deploy.uncertainty.metrics import MAX_BINS

log = logging.getLogger("hydra_deploy.eval")

RAW_HELP = {
    "raw": "leave out the decisions of a calibrated export (no decisions section, and they are "
    "not checked against the model file)"
}

EXAMPLES = """\
  hydra-eval export/vit-m3 --id test.npz --ood noise=noise.npz --out reports/vit-m3
  hydra-eval export/vit-m3 --id images/test/ --ood svhn=svhn/ --ood textures=dtd/ --out rep --bins 10
  hydra-eval engines/vit-m3.fp16.engine --id test.npz --ood far=far.npz --out rep --overwrite --json
  hydra-eval export/minilm-m3 --id glosses.tsv --ood other=other.txt --out rep   # text model
  hydra-eval export/vit-m3 --id test.npz --ood noise=noise.npz --out rep --raw   # no decisions
  hydra-eval export/vit-m3 --id test/ --labels names.txt --ood noise=noise/ --out rep  # named
"""


def build_parser() -> argparse.ArgumentParser:
    p = common.parser(
        "hydra-eval",
        "Evaluate a Hydra ensemble (export folder, .onnx file or TensorRT engine) on labelled "
        "in-distribution data and one or more OOD sets. Writes REPORT_DIR/report.json and "
        "report.md (accuracy, NLL, Brier, ECE, AURC on the ID data; AUROC, AUPR and FPR95 per OOD "
        "set and score, OOD positive), reliability.png and hist_<score>.png. On an export "
        "calibrated with hydra-calibrate, the report adds its decisions beside their targets: "
        "set coverage (>= 1 - alpha), mean set size and empty sets, selective risk (<= the "
        "rule's risk) and the share answered, ECE before and after the temperature, the share of "
        "ID flagged as OOD (<= alpha_ood) and, per OOD set, the share flagged; plots "
        "risk_coverage.png and set_sizes.png (--raw: scores only). Data: a .npz with x "
        "(or the model's input names) and y (y is needed for --id only), a .npy array (OOD), an "
        "image folder (--id: one sub-folder per class, named after it), or for text models a .tsv "
        "(label<TAB>text, or a third column for sentence pairs; a label is a class name or index) "
        "or .txt (one text a line, OOD). "
        "Class names map to the model's classes through the export's class_names (an unknown "
        "name is refused); a model without class names takes the sorted names as its classes "
        "only when there are as many as it has classes.",
        EXAMPLES,
    )
    p.add_argument("model", type=Path, metavar="MODEL", help="export folder, .onnx or engine file")
    p.add_argument(
        "--id",
        dest="id_data",
        type=Path,
        required=True,
        metavar="DATA",
        help="labelled in-distribution data",
    )
    p.add_argument("--labels", type=Path, metavar="FILE", help=LABELS_HELP)
    p.add_argument(
        "--ood",
        action="append",
        required=True,
        metavar="NAME=DATA",
        help="an OOD set and its name (repeat for more)",
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="REPORT_DIR",
        help="report folder to write (refused if it exists, unless --overwrite)",
    )
    add_options(p, RunnerOptions, p, only=("batch_size", "threads"))
    p.add_argument("--bins", type=int, default=15, help="ECE / reliability bins (default 15)")
    p.add_argument(
        "--scores",
        default="msp,predictive_entropy,mutual_information",
        help="comma-separated OOD scores (default: msp,predictive_entropy,"
        "mutual_information; also expected_entropy, disagreement)",
    )
    add_options(p, RunnerOptions, p, only=("raw",), helps=RAW_HELP)
    p.add_argument("--overwrite", action="store_true", help="replace an existing REPORT_DIR")
    p.add_argument("--json", action="store_true", help="also print report.json on stdout")
    return p


def parse_ood(items: list[str]) -> dict[str, Path]:
    """``NAME=DATA`` arguments as ``{name: path}``; refuses a malformed or repeated one."""
    sets: dict[str, Path] = {}
    for item in items:
        name, eq, data = item.partition("=")
        name = name.strip()
        if not eq or not name or not data:
            raise HydraError(
                f"--ood {item!r} is malformed: expected NAME=DATA, e.g. noise=noise.npz"
            )
        if name in sets:
            raise HydraError(f"--ood names must differ: {name!r} is given twice")
        sets[name] = Path(data)
    return sets


def main_body(args: argparse.Namespace) -> int:
    runtime = common.options(RunnerOptions, args)
    use_threads(runtime.threads)
    if not 1 <= args.bins <= MAX_BINS:
        raise HydraError(
            f"--bins must be in 1..{MAX_BINS} (ECE / reliability bins), got {args.bins}"
        )
    ood = parse_ood(args.ood)
    scores = [s.strip() for s in args.scores.split(",") if s.strip()]
    common.refuse_existing(args.out, args.overwrite)
    id_data = with_class_names(args.id_data, args.labels)  # a --labels file before the model
    with load_runner(args.model, decisions=runtime.decisions) as runner:
        report, arrays = evaluate(
            runner,
            id_data,
            ood,
            batch_size=runtime.batch_size,
            bins=args.bins,
            scores=scores,
            return_scores=True,
            decisions=runtime.decisions,
        )
    report["model"] = str(args.model)
    write_report(report, arrays, args.out, overwrite=args.overwrite)
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2, allow_nan=False) + "\n")
    if not args.quiet:
        _log_summary(report, args)
    return 0


def _log_summary(report: dict, args: argparse.Namespace) -> None:
    """The report's headline numbers, one line per part."""
    c = report["id"]["classification"]
    log.info(
        "ID: accuracy %.4f, ECE %.4f (%d bins), NLL %.4f",
        c["accuracy"],
        c["ece"],
        args.bins,
        c["nll"],
    )
    for name, entry in report["ood"].items():
        parts = ", ".join(
            f"{s} AUROC {m['auroc']:.4f}"
            for s, m in entry["scores"].items()
            if m["auroc"] is not None
        )  # M = 1: no mutual information
        log.info("OOD %s: %s", name, parts)
    if report.get("decisions"):
        log.info("decisions: %s", _decisions_line(report["decisions"]))
    log.info("wrote %s", args.out)


def _decisions_line(section: dict) -> str:
    """The decisions of a report in one line: each checked number and its target."""
    ident = section["id"]
    parts = [f"ECE {ident['ece_raw']:.4f} -> {ident['ece']:.4f} (T {section['temperature']:.3g})"]
    words = {
        "coverage": ("set coverage", ">="),
        "selective_risk": ("selective risk", "<="),
        "flag_rate": ("ID flagged", "<="),
    }
    for key, check in ident["checks"].items():
        what, side = words[key]
        value = "-" if check["value"] is None else f"{check['value']:.4f}"
        parts.append(f"{what} {value} (target {side} {check['target']:.4g})")
    if "answered" in ident:
        parts.append(f"answered {ident['answered']:.4f}")
    return ", ".join(parts)


main = common.entry_point(build_parser, main_body, "hydra-eval")


if __name__ == "__main__":
    sys.exit(main())
