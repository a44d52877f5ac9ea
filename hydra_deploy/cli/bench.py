"""hydra-bench: latency of Hydra against one model and a deep ensemble, and the regression check."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Any, TextIO

from hydra_deploy.cli import common
from hydra_deploy.cli.model_options import DEFAULT_LOWERING, LOWERINGS

log = logging.getLogger("hydra_deploy.bench")

EXAMPLES = """\
  hydra-bench --backbone vit_s16 --members 3 --heads-per-member 4 --batch 1 8 --backend torch ort --rounds 10 --out results.json
  hydra-bench --backbone vit_b16 --batch 1 2 4 8 16 --backend torch ort --plot latency.png --out latency.json
  hydra-bench --backbone minilm --seq-len 128 --batch 1 8 --backend ort
  hydra-bench --backbone vit_b16 --batch 1 8 64 --backend torch-cuda-bf16      # GPU, CUDA graphs
  hydra-bench --backbone vit_b16 --batch 1 8 16 --backend torch ort --precision fp32 int8-dynamic int8-static bf16
  hydra-bench --backbone vit_s16 ... --write-baseline benchmarks/baselines/mine.json --tolerance 0.3
  hydra-bench --backbone vit_s16 ... --check benchmarks/baselines/mine.json    # exit 1 on a regression
"""

PRECISION_HELP = (
    "precisions on the CPU, timed in the same rounds as the FP32 variants and reported against "
    "the single FP32 model: fp32 (always), int8-dynamic and int8-static (ONNX Runtime; needs "
    "--backend ort), bf16 (PyTorch under CPU autocast; needs --backend torch and a CPU with "
    "BF16 instructions, else listed as skipped with the reason); int8 = both INT8 methods, all = "
    "every one; space- or comma-separated (default fp32)"
)

BACKEND_HELP = (
    "backends to measure: torch (eager CPU), ort (ONNX Runtime CPU), torch-cuda-bf16, "
    "torch-cuda-fp16 (CUDA graphs), tensorrt (FP16 engines); default (or auto): every one "
    "present, the others listed as skipped with the reason"
)


def build_parser(prog: str = "hydra-bench", **defaults: Any) -> argparse.ArgumentParser:
    """The command's arguments; ``defaults`` override them (benchmarks/latency.py's defaults)."""
    p = common.parser(
        prog,
        "Time the single model, Hydra, Hydra with a shared trunk and the deep ensemble (members "
        "one after another, and fused into one batched network) on every backend present. Prints "
        "a table (median, spread, ratio to the single model, FLOPs ratio, gap = ratio / FLOPs "
        "ratio, MACs per example, achieved GMAC/s); --out writes JSON with the environment, --plot "
        "a PNG of latency against batch size. --check compares the ratios with a baseline and "
        "exits 1 when one got worse than the tolerance allows. Weights are random: latency does "
        "not depend on them.",
        EXAMPLES,
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--backbone",
        required="backbone" not in defaults,
        help="vit_s16, vit_b16 (or another alias / timm ViT name), minilm (the "
        "MiniLM BERT), or hf:<folder> of a BERT model",
    )
    model.add_argument(
        "--members", "-m", type=int, default=3, help="M, ensemble members (default 3)"
    )
    model.add_argument(
        "--heads-per-member",
        "-k",
        type=int,
        default=4,
        help="heads each member keeps per layer (default 4)",
    )
    model.add_argument(
        "--trunk-layers",
        type=int,
        help="leading layers hydra_trunk shares (default: half the layers)",
    )
    model.add_argument("--seq-len", type=int, default=128, help="text models: tokens (default 128)")
    model.add_argument(
        "--classes", type=int, help="classifier size (default: timm's 1000; minilm: 2, random)"
    )
    model.add_argument(
        "--img-size", type=int, help="timm ViTs: input resolution (default: the model's)"
    )

    timing = p.add_argument_group("timing")
    timing.add_argument(
        "--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (default 1 8)"
    )
    timing.add_argument("--backend", nargs="+", metavar="NAME", help=BACKEND_HELP)
    timing.add_argument(
        "--precision", nargs="+", metavar="NAME", default=["fp32"], help=PRECISION_HELP
    )
    timing.add_argument(
        "--int8-calibration-examples",
        type=int,
        help="int8-static: random inputs it is calibrated on (default and least 32; fine for "
        "latency, not for accuracy)",
    )
    timing.add_argument(
        "--int8-profile-runs",
        type=int,
        help="INT8: ONNX Runtime profiled runs of the single, hydra and fused_deep_ensemble "
        "graphs, to show what stays in float (default 3; 0: no profile)",
    )
    timing.add_argument(
        "--variants",
        nargs="+",
        metavar="NAME",
        help="variants to time (default: all; single is always timed)",
    )
    timing.add_argument("--rounds", type=int, default=10, help="timed rounds (default 10)")
    timing.add_argument(
        "--warmup", type=int, default=2, help="untimed runs of each variant first (default 2)"
    )
    timing.add_argument(
        "--threads", type=int, help="CPU threads for torch and ONNX Runtime (default: torch's)"
    )
    timing.add_argument(
        "--exporter",
        default="auto",
        choices=("auto", "dynamo", "torchscript"),
        help="torch -> ONNX exporter for ort/tensorrt (default auto)",
    )
    timing.add_argument(
        "--cuda-replays", type=int, default=10, help="CUDA-graph replays per timed run (default 10)"
    )
    timing.add_argument(
        "--ort-spinning",
        action="store_true",
        help="let ONNX Runtime's idle threads spin (its default; off here)",
    )
    timing.add_argument(
        "--lowering",
        default=DEFAULT_LOWERING,
        choices=LOWERINGS,
        help="how the fused variants' grouped projections run and export "
        f"(default {DEFAULT_LOWERING}; bmm: one batched MatMul)",
    )
    timing.add_argument("--seed", type=int, default=0, help="seed of weights, specs and inputs")

    output = p.add_argument_group("output and regression check")
    output.add_argument("--out", type=Path, metavar="FILE", help="write the result as JSON")
    output.add_argument(
        "--plot",
        type=Path,
        metavar="PNG",
        help="write a plot of latency against batch size (needs matplotlib)",
    )
    output.add_argument("--overwrite", action="store_true", help="replace existing output files")
    output.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    output.add_argument(
        "--check",
        type=Path,
        metavar="BASELINE",
        help="compare the ratios with a baseline file; exit 1 on a regression",
    )
    output.add_argument(
        "--tolerance",
        type=float,
        help="relative worsening of a ratio allowed by --check (default: the "
        "baseline's, else 0.15); also the one --write-baseline records",
    )
    output.add_argument(
        "--write-baseline",
        type=Path,
        metavar="PATH",
        help="write this run's ratios as a baseline file",
    )
    output.add_argument("--note", help="--write-baseline: why its tolerance is what it is")
    p.set_defaults(**defaults)
    return p


def config_from_args(args: argparse.Namespace):
    """The :class:`BenchConfig` of the arguments (BenchError for an impossible one)."""
    from hydra_deploy.bench.latency import VARIANTS, BenchConfig

    int8 = {
        "int8_calibration_examples": args.int8_calibration_examples,
        "int8_profile_runs": args.int8_profile_runs,
    }
    return BenchConfig(
        backbone=args.backbone,
        members=args.members,
        heads_per_member=args.heads_per_member,
        batches=tuple(args.batch),
        backends=None if args.backend in (None, ["auto"]) else tuple(args.backend),
        variants=tuple(args.variants) if args.variants else VARIANTS,
        trunk_layers=args.trunk_layers,
        rounds=args.rounds,
        warmup=args.warmup,
        threads=args.threads,
        seq_len=args.seq_len,
        classes=args.classes,
        img_size=args.img_size,
        exporter=args.exporter,
        cuda_replays=args.cuda_replays,
        ort_spinning=args.ort_spinning,
        seed=args.seed,
        lowering=args.lowering,
        precisions=tuple(args.precision),
        **{key: value for key, value in int8.items() if value is not None},  # else BenchConfig's
    )


def command_for(config, threads: int, backends: list[str], prog: str = "hydra-bench") -> str:
    """The command line that repeats a run's measurement (written into baselines); ``prog``
    starts it as given (not quoted)."""
    from hydra_deploy.bench.latency import VARIANTS, is_text_backbone

    argv = [
        "--backbone",
        config.backbone,
        "--members",
        config.members,
        "--heads-per-member",
        config.heads_per_member,
        "--batch",
        *config.batches,
        "--backend",
        *backends,
        "--rounds",
        config.rounds,
        "--warmup",
        config.warmup,
        "--threads",
        threads,
        "--seed",
        config.seed,
    ]
    optional = {
        "--trunk-layers": config.trunk_layers,
        "--classes": config.classes,
        "--img-size": config.img_size,
    }
    argv += [x for flag, value in optional.items() if value is not None for x in (flag, value)]
    if is_text_backbone(config.backbone):
        argv += ["--seq-len", config.seq_len]
    if config.variants != VARIANTS:
        argv += ["--variants", *config.variants]
    if config.exporter != "auto":
        argv += ["--exporter", config.exporter]
    if config.ort_spinning:
        argv.append("--ort-spinning")
    if config.lowering != DEFAULT_LOWERING:
        argv += ["--lowering", config.lowering]
    if config.precisions != ("fp32",):
        argv += ["--precision", *config.precisions]
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    if "int8-static" in config.precisions and (
        config.int8_calibration_examples != defaults["int8_calibration_examples"]
    ):
        argv += ["--int8-calibration-examples", config.int8_calibration_examples]
    if any(p.startswith("int8") for p in config.precisions) and (
        config.int8_profile_runs != defaults["int8_profile_runs"]
    ):
        argv += ["--int8-profile-runs", config.int8_profile_runs]
    return f"{prog} {shlex.join(str(a) for a in argv)}"


def pre_run_settings(config) -> dict[str, Any]:
    """What a baseline must match, as far as it is known before the model is built."""
    from hydra_deploy.bench.latency import is_text_backbone

    text = is_text_backbone(config.backbone)
    return {
        "backbone": config.backbone,
        "members": config.members,
        "heads_per_member": config.heads_per_member,
        "trunk_layers": config.trunk_layers,
        "img_size": config.img_size,
        "seq_len": config.seq_len if text else None,
        "classes": config.classes,
    }


def prepare(args: argparse.Namespace):
    """Check everything that can be checked before measuring; returns (config, baseline)."""
    from hydra_deploy.bench import check
    from hydra_deploy.bench.latency import require_matplotlib

    config = config_from_args(args)
    for path in (args.out, args.plot, args.write_baseline):
        if path is not None:
            common.refuse_existing(path, args.overwrite)
    if args.plot is not None:
        require_matplotlib()
    if args.tolerance is not None:
        check.check_tolerance(args.tolerance)
    baseline = None
    if args.check is not None:
        baseline = check.load_baseline(args.check)
        check.refuse_mismatch(baseline, pre_run_settings(config))
    return config, baseline


def print_report(result: dict[str, Any], file: TextIO = sys.stdout) -> None:
    from hydra_deploy.bench.latency import TABLE_HEADER, describe_run, table_rows

    print(describe_run(result), file=file)
    print(common.print_table(table_rows(result), TABLE_HEADER), file=file)
    for name, reason in result["skipped"].items():
        print(f"skipped {name}: {reason}", file=file)
    for name, info in result["backends"].items():
        diffs = info.get("max_abs_diff_vs_torch_fp32") or {}
        if diffs:
            worst = max(diffs, key=diffs.get)
            print(
                f"{name}: largest logit difference from PyTorch FP32 {diffs[worst]:.2g} "
                f"({worst}, batch {info['diff_batch']})",
                file=file,
            )


def finish(args: argparse.Namespace, config, result: dict[str, Any], baseline) -> int:
    """Baseline check, then the files asked for; returns the exit code."""
    from hydra_deploy.atomic import atomic_write_json
    from hydra_deploy.bench import check
    from hydra_deploy.bench.latency import plot_latency

    code = 0
    if baseline is not None:
        report = check.compare(result, baseline, args.tolerance)
        result["check"] = {"baseline": str(args.check), **report.to_dict()}
        for line in report.lines():
            if line.startswith("REGRESSION"):
                print(line, file=sys.stderr)
            elif not args.quiet:
                print(line, file=sys.stderr if args.json else sys.stdout)
        code = 0 if report.passed else common.EXIT_ERROR
    if args.write_baseline is not None:
        command = command_for(config, result["config"]["threads"], result["config"]["backends"])
        tolerance = args.tolerance if args.tolerance is not None else check.DEFAULT_TOLERANCE
        check.write_baseline(
            args.write_baseline,
            check.make_baseline(
                result, tolerance=tolerance, tolerance_note=args.note, command=command
            ),
        )
        log.info("wrote baseline %s", args.write_baseline)
    if args.out is not None:
        atomic_write_json(args.out, result)
        log.info("wrote %s", args.out)
    if args.plot is not None:
        plot_latency(result, args.plot)
        log.info("wrote %s", args.plot)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2, allow_nan=False) + "\n")
    return code


def measure(args: argparse.Namespace):
    """Validate, then run the benchmark; returns (config, result, baseline)."""
    from hydra_deploy.bench.latency import run_benchmark

    config, baseline = prepare(args)
    result = run_benchmark(config, quiet=args.quiet)
    if not args.quiet:  # with --json, stdout holds the JSON alone
        print_report(result, file=sys.stderr if args.json else sys.stdout)
    return config, result, baseline


def main_body(args: argparse.Namespace) -> int:
    config, result, baseline = measure(args)
    return finish(args, config, result, baseline)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hydra-bench``; returns the exit code."""
    args = build_parser().parse_args(argv)
    return common.run(main_body, args)


if __name__ == "__main__":
    sys.exit(main())
