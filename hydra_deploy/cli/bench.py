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

from hydra_deploy.atomic import atomic_write_json
from hydra_deploy.bench import check
from hydra_deploy.bench.config import BenchConfig, is_text_backbone
from hydra_deploy.cli import common
from hydra_deploy.optional import lazy_module
from hydra_deploy.options import add_options, command_line, from_args

# the measurement builds torch models: imported when a run starts, so --help stays fast
latency = lazy_module("hydra_deploy.bench.latency", purpose="hydra-bench")

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

DESCRIPTION = (
    "Time the single model, Hydra, Hydra with a shared trunk and the deep ensemble (members "
    "one after another, and fused into one batched network) on every backend present. Prints "
    "a table (median, spread, ratio to the single model, FLOPs ratio, gap = ratio / FLOPs "
    "ratio, MACs per example, achieved GMAC/s); --out writes JSON with the environment, --plot "
    "a PNG of latency against batch size. --check compares the ratios with a baseline and "
    "exits 1 when one got worse than the tolerance allows. Weights are random: latency does "
    "not depend on them."
)


def build_parser(prog: str = "hydra-bench", **defaults: Any) -> argparse.ArgumentParser:
    """The command's arguments: :class:`BenchConfig`'s flags and the outputs; ``defaults``
    override them by argparse name (benchmarks/latency.py's defaults)."""
    p = common.parser(prog, DESCRIPTION, EXAMPLES)
    add_options(p, BenchConfig, defaults=defaults)
    _add_output_arguments(p)
    p.set_defaults(**defaults)
    return p


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    """Where the result goes, and the regression check against a baseline."""
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


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The :class:`BenchConfig` of the arguments (BenchError for an impossible one)."""
    return from_args(BenchConfig, args)


def command_for(
    config: BenchConfig, threads: int, backends: list[str], prog: str = "hydra-bench"
) -> str:
    """The command line that repeats a run's measurement (written into baselines): ``config``'s
    flags with the threads and backends the run used; ``prog`` starts it as given (not quoted)."""
    measured = dataclasses.replace(config, threads=threads, backends=tuple(backends))
    return f"{prog} {shlex.join(command_line(measured))}"


def pre_run_settings(config: BenchConfig) -> dict[str, Any]:
    """What a baseline must match, as far as it is known before the model is built."""
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
    config = config_from_args(args)
    for path in (args.out, args.plot, args.write_baseline):
        if path is not None:
            common.refuse_existing(path, args.overwrite)
    if args.plot is not None:
        latency.require_matplotlib()
    if args.tolerance is not None:
        check.check_tolerance(args.tolerance)
    baseline = None
    if args.check is not None:
        baseline = check.load_baseline(args.check)
        check.refuse_mismatch(baseline, pre_run_settings(config))
    return config, baseline


def print_report(result: dict[str, Any], file: TextIO = sys.stdout) -> None:
    print(latency.describe_run(result), file=file)
    print(common.print_table(latency.table_rows(result), latency.TABLE_HEADER), file=file)
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
    code = 0
    if baseline is not None:
        # a regression is timed again before the verdict (a busy machine's hiccup does not fail)
        report = latency.check_run(
            result,
            baseline,
            config,
            args.tolerance,
            measure=lambda c: latency.run_benchmark(c, quiet=args.quiet),
        )
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
        latency.plot_latency(result, args.plot)
        log.info("wrote %s", args.plot)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2, allow_nan=False) + "\n")
    return code


def measure(args: argparse.Namespace):
    """Validate, then run the benchmark; returns (config, result, baseline)."""
    config, baseline = prepare(args)
    result = latency.run_benchmark(config, quiet=args.quiet)
    if not args.quiet:  # with --json, stdout holds the JSON alone
        print_report(result, file=sys.stderr if args.json else sys.stdout)
    return config, result, baseline


def main_body(args: argparse.Namespace) -> int:
    config, result, baseline = measure(args)
    return finish(args, config, result, baseline)


main = common.entry_point(build_parser, main_body, "hydra-bench")


if __name__ == "__main__":
    sys.exit(main())
