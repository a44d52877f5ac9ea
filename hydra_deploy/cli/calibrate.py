"""hydra-calibrate: fit an export's decisions on labelled data and store them in it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hydra_deploy.cli import common
from hydra_deploy.cli.eval import parse_ood
from hydra_deploy.decisions import describe_split
from hydra_deploy.engines.runner import load_runner
from hydra_deploy.errors import HydraError
from hydra_deploy.evaluation.calibrate import (
    Calibration,
    calibrate,
    describe_parts,
    quantile_part_note,
    store_decisions,
)
from hydra_deploy.export_folder import INFO_FILE, MODEL_FILE, ExportInfo, read_info
from hydra_deploy.labels import LABELS_HELP, with_class_names
from hydra_deploy.options import CalibrationOptions, RunnerOptions, add_options
from hydra_deploy.threads import use_threads

EXAMPLES = """\
  hydra-calibrate export/vit_b16-m3 --data calib/          # LAC sets at 90%, OOD flag at 5%
  hydra-calibrate export/vit_b16-m3 --data calib.npz --alpha 0.05 --risk 0.02 --delta 0.1
  hydra-calibrate export/vit_b16-m3 --data calib/ --sets aps --class-conditional --overwrite
  hydra-calibrate export/vit_b16-m3 --data calib/ --ood-alpha 0.01 --ood-score mutual_information \\
      --ood-check textures=dtd/ --in-graph --overwrite        # decisions as graph outputs too
  hydra-calibrate export/minilm-m3 --data glosses.tsv --risk 0.05   # a text model
  hydra-calibrate export/vit_b16-m3 --data calib/ --labels names.txt   # sub-folders named by class
  hydra-calibrate export/vit_b16-m3 --data calib/ --engine export/vit_b16-m3/model.fp16.engine
"""

#: library parameter -> how the command names it where no flag sets it (errors name flags)
FLAGS = {"class_names": "the export's class_names"}


#: why --in-graph does not go with --engine (the library says the same: store_decisions)
IN_GRAPH_ENGINE = (
    "--in-graph rewrites model.onnx, so no engine built from the new file is the engine the "
    "decisions were fitted on: drop --engine to fit them in ONNX Runtime (an engine built from "
    "the new file then applies them with --allow-decisions-mismatch), or drop --in-graph"
)


DESCRIPTION = (
    "Uncertainty calibration of an export (not TensorRT's INT8 calibration): fit, on labelled "
    "in-distribution data, a temperature for calibrated probabilities, conformal prediction "
    "sets that hold the true class with probability >= 1 - alpha, an answer-or-abstain "
    "threshold whose selective error rate exceeds --risk with probability <= --delta, and an "
    "OOD flag that flags at most --ood-alpha of in-distribution inputs. The guarantees are "
    "marginal over data exchangeable with the calibration data; none holds under "
    "distribution shift. The record goes into the export's hydra.json (atomically), where "
    "hydra-run, hydra-serve, Triton repositories and hydra-score-dataset apply it; "
    "--in-graph also adds the decisions to model.onnx as outputs. Data: what hydra-eval --id "
    "reads (a .npz with x and y, an image folder with one sub-folder per class, a .tsv for "
    "text models)."
)

#: this command's wording of the runtime options it takes
RUNNER_HELP = {
    "engine": "fit on a TensorRT engine's outputs instead of ONNX Runtime's (an engine hydra-build "
    "made from this export's model.onnx: its JSON sidecar names the file); the record names "
    "the engine, and only that engine applies it",
}


def build_parser() -> argparse.ArgumentParser:
    p = common.parser("hydra-calibrate", DESCRIPTION, EXAMPLES)
    p.add_argument("model", type=Path, metavar="EXPORT", help="export folder (hydra-export --out)")
    p.add_argument("--data", type=Path, required=True, metavar="LABELLED", help="labelled ID data")
    p.add_argument("--labels", type=Path, metavar="FILE", help=LABELS_HELP)
    add_options(p, CalibrationOptions, p)
    p.add_argument(
        "--ood-check",
        action="append",
        default=[],
        metavar="NAME=DATA",
        help="an OOD set to report the flag rate on (repeat for more; it chooses nothing)",
    )
    p.add_argument(
        "--in-graph",
        action="store_true",
        help="also add the decisions to model.onnx as outputs (calibrated_probs, prediction_set, "
        "accept, ood_flag), for TensorRT, Triton and Jetson deployments without Python",
    )
    add_options(p, RunnerOptions, p, only=("batch_size", "providers", "engine"), helps=RUNNER_HELP)
    add_options(p, RunnerOptions, p, only=("threads",))
    p.add_argument(
        "--overwrite", action="store_true", help="replace decisions the export already holds"
    )
    p.add_argument("--json", action="store_true", help="print the record and the table as JSON")
    return p


def check_target(args: argparse.Namespace) -> None:
    """Refuse what cannot be fitted before the model is run: --in-graph with --engine, a path
    that is no export folder, decisions the folder holds already (without --overwrite)."""
    if args.engine is not None and args.in_graph:
        raise HydraError(IN_GRAPH_ENGINE)
    if not args.model.is_dir():
        raise HydraError(
            f"{str(args.model)!r} is not an export folder; hydra-calibrate stores the decisions "
            "in the folder's hydra.json: give the folder hydra-export wrote"
        )
    if read_info(args.model).decisions is not None and not args.overwrite:
        raise HydraError(
            f"{args.model} already holds decisions; pass --overwrite to fit them again"
        )


def fit(args: argparse.Namespace) -> Calibration:
    """Run the export (or --engine) on --data and fit the decisions."""
    runtime = common.options(RunnerOptions, args)
    fitting = common.options(CalibrationOptions, args)
    data = with_class_names(args.data, args.labels)  # a --labels file is read before the model
    use_threads(runtime.threads)
    check_target(args)
    ood_checks = parse_ood(args.ood_check) if args.ood_check else {}
    target, backend = (args.model, None) if runtime.engine is None else (runtime.engine, "tensorrt")
    with (
        load_runner(target, backend, runtime.providers, decisions=False) as runner,
        common.flags_named(FLAGS),
    ):
        return calibrate(runner, data, fitting, ood=ood_checks, batch_size=runtime.batch_size)


def _shown_record(record: dict) -> dict:
    """The record as --json prints it: the monitor reference's values left in hydra.json (their
    count and hash shown)."""
    if "monitor" in record:
        record["monitor"] = {k: v for k, v in record["monitor"].items() if k != "values"}
    return record


def report(args: argparse.Namespace, calibration: Calibration, info: ExportInfo) -> None:
    """The record and the table (--json), or the table and where the decisions went."""
    assert info.decisions is not None
    if args.json:
        sys.stdout.write(
            json.dumps(
                {
                    "export": str(args.model),
                    "decisions": _shown_record(info.decisions.to_dict()),
                    "parts": calibration.parts,
                    "ood": calibration.ood,
                },
                indent=2,
                allow_nan=False,
            )
            + "\n"
        )
    elif not args.quiet:
        rows = describe_parts(calibration)
        print(common.print_table(rows, ["", "temperature part", "quantile part"]))
        print(quantile_part_note())
        for name, measured in calibration.ood.items():
            flag = measured.get("flag_rate")
            print(f"OOD set {name}: {'-' if flag is None else f'{100 * flag:.1f}%'} flagged")
        where = f"{INFO_FILE} and {MODEL_FILE}" if args.in_graph else INFO_FILE
        fitted = describe_split(info.decisions.n_temperature, info.decisions.n_quantile)
        print(f"wrote the decisions, fitted on {fitted}, to {args.model}/{where}")


def main_body(args: argparse.Namespace) -> int:
    calibration = fit(args)
    report(
        args, calibration, store_decisions(args.model, calibration.record, in_graph=args.in_graph)
    )
    return 0


main = common.entry_point(build_parser, main_body, "hydra-calibrate")

if __name__ == "__main__":
    sys.exit(main())
