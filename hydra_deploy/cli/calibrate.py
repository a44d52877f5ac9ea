"""hydra-calibrate: fit an export's decisions on labelled data and store them in it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hydra_deploy.cli import common
from hydra_deploy.errors import HydraError, ParameterError
from hydra_deploy.export_folder import INFO_FILE, MODEL_FILE

EXAMPLES = """\
  hydra-calibrate export/vit_b16-m3 --data calib/          # LAC sets at 90%, OOD flag at 5%
  hydra-calibrate export/vit_b16-m3 --data calib.npz --alpha 0.05 --risk 0.02 --delta 0.1
  hydra-calibrate export/vit_b16-m3 --data calib/ --sets aps --class-conditional --overwrite
  hydra-calibrate export/vit_b16-m3 --data calib/ --ood-alpha 0.01 --ood-score mutual_information \\
      --ood-check textures=dtd/ --in-graph --overwrite        # decisions as graph outputs too
  hydra-calibrate export/minilm-m3 --data glosses.tsv --risk 0.05   # a text model
  hydra-calibrate export/vit_b16-m3 --data calib/ --engine export/vit_b16-m3/model.fp16.engine
"""

#: library parameter -> the flag that sets it (errors name flags)
FLAGS = {
    "alpha": "--alpha",
    "sets": "--sets",
    "risk": "--risk",
    "delta": "--delta",
    "accept_score": "--accept-score",
    "ood_alpha": "--ood-alpha",
    "ood_score": "--ood-score",
    "holdout": "--holdout",
    "class_names": "the export's class_names",
}


#: why --in-graph does not go with --engine (the library says the same: store_decisions)
IN_GRAPH_ENGINE = (
    "--in-graph rewrites model.onnx, so no engine built from the new file is the engine the "
    "decisions were fitted on: drop --engine to fit them in ONNX Runtime (an engine built from "
    "the new file then applies them with --allow-decisions-mismatch), or drop --in-graph"
)


def build_parser() -> argparse.ArgumentParser:
    from hydra_deploy.decisions import DECISION_SCORES, SET_METHODS

    p = common.parser(
        "hydra-calibrate",
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
        "text models).",
        EXAMPLES,
    )
    p.add_argument("model", type=Path, metavar="EXPORT", help="export folder (hydra-export --out)")
    p.add_argument("--data", type=Path, required=True, metavar="LABELLED", help="labelled ID data")
    p.add_argument(
        "--alpha",
        type=float,
        default=0.1,
        help="prediction sets hold the true class with probability >= 1 - alpha (default 0.1)",
    )
    p.add_argument(
        "--sets",
        choices=(*SET_METHODS, "none"),
        default="lac",
        help="prediction-set method (default lac: the smallest sets, may be empty; aps/raps "
        "always hold the top class); none: no sets",
    )
    p.add_argument(
        "--class-conditional",
        action="store_true",
        help="one threshold per class: coverage >= 1 - alpha within every class (needs enough "
        "examples of each)",
    )
    p.add_argument(
        "--risk",
        type=float,
        metavar="R",
        help="fit answer-or-abstain: the largest share answered whose error rate is <= R "
        "(with probability >= 1 - delta); default: no abstention rule",
    )
    p.add_argument(
        "--delta",
        type=float,
        default=0.1,
        help="the probability that the --risk guarantee fails (default 0.1)",
    )
    p.add_argument(
        "--accept-score",
        choices=DECISION_SCORES,
        default="msp",
        help="what answer-or-abstain thresholds (default msp, the calibrated confidence)",
    )
    p.add_argument(
        "--ood-alpha",
        type=float,
        default=0.05,
        help="the OOD flag flags at most this share of ID inputs (default 0.05; 0: no flag)",
    )
    p.add_argument(
        "--ood-score",
        choices=DECISION_SCORES,
        default="msp",
        help="what the OOD flag thresholds (default msp: a low calibrated confidence)",
    )
    p.add_argument(
        "--ood-check",
        action="append",
        default=[],
        metavar="NAME=DATA",
        help="an OOD set to report the flag rate on (repeat for more; it chooses nothing)",
    )
    p.add_argument(
        "--holdout",
        type=float,
        default=0.5,
        metavar="F",
        help="share of the data the thresholds are fitted on; the rest fits the temperature "
        "(default 0.5)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the split, >= 0 (default 0)")
    p.add_argument(
        "--in-graph",
        action="store_true",
        help="also add the decisions to model.onnx as outputs (calibrated_probs, prediction_set, "
        "accept, ood_flag), for TensorRT, Triton and Jetson deployments without Python",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        metavar="N",
        help="examples per forward pass (default: the model's max batch, else 32)",
    )
    p.add_argument(
        "--providers", help="ONNX Runtime providers, comma-separated (cpu,cuda,tensorrt)"
    )
    p.add_argument(
        "--engine",
        type=Path,
        metavar="FILE",
        help="fit on a TensorRT engine's outputs instead of ONNX Runtime's (an engine hydra-build "
        "made from this export's model.onnx: its JSON sidecar names the file); the record names "
        "the engine, and only that engine applies it",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace decisions the export already holds"
    )
    p.add_argument("--json", action="store_true", help="print the record and the table as JSON")
    return p


def main_body(args: argparse.Namespace) -> int:
    from hydra_deploy.cli.eval import parse_ood
    from hydra_deploy.engines.runner import load_runner
    from hydra_deploy.evaluation.calibrate import (
        calibrate,
        describe_parts,
        quantile_part_note,
        store_decisions,
    )
    from hydra_deploy.export_folder import read_info

    if args.batch_size is not None and args.batch_size < 1:
        raise HydraError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.seed < 0:
        raise HydraError(f"--seed must be at least 0, got {args.seed}")
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
    if args.class_conditional and args.sets == "none":
        raise HydraError("--class-conditional needs prediction sets; drop --sets none")
    ood_checks = parse_ood(args.ood_check) if args.ood_check else {}
    providers = args.providers.split(",") if args.providers else None
    if args.engine is not None and providers is not None:
        raise HydraError("--providers are ONNX Runtime's; an --engine runs in TensorRT")
    target, backend = (args.model, None) if args.engine is None else (args.engine, "tensorrt")
    try:
        with load_runner(target, backend, providers, decisions=False) as runner:
            calibration = calibrate(
                runner,
                args.data,
                alpha=None if args.sets == "none" else args.alpha,
                sets="lac" if args.sets == "none" else args.sets,
                class_conditional=args.class_conditional,
                risk=args.risk,
                delta=args.delta,
                accept_score=args.accept_score,
                ood_alpha=None if args.ood_alpha == 0 else args.ood_alpha,
                ood_score=args.ood_score,
                holdout=args.holdout,
                seed=args.seed,
                ood=ood_checks,
                batch_size=args.batch_size,
            )
    except ParameterError as err:
        err.args = (err.for_command(FLAGS),)
        raise
    info = store_decisions(args.model, calibration.record, in_graph=args.in_graph)
    assert info.decisions is not None
    if args.json:
        sys.stdout.write(
            json.dumps(
                {
                    "export": str(args.model),
                    "decisions": info.decisions.to_dict(),
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
        print(f"wrote the decisions to {args.model}/{where}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hydra-calibrate``; returns the exit code."""
    args = build_parser().parse_args(argv)
    return common.run(main_body, args)


if __name__ == "__main__":
    sys.exit(main())
