"""Latency report: Hydra against one model and a deep ensemble (the README's table).

A thin script over ``hydra-bench`` (:mod:`hydra_deploy.cli.bench`, :mod:`hydra_deploy.bench`) with
the report's defaults: ViT-B/16, M=3 members keeping 4 heads each, batches 1 2 4 8 16, PyTorch
eager and ONNX Runtime on the CPU, 5 rounds. It writes

- ``benchmarks/results/latency.json``: every time, ratio, FLOPs ratio and the environment;
- ``benchmarks/results/latency.md``: the table, the command that reproduces it and the claims;
- ``benchmarks/results/latency.png``: latency against batch size per backend and variant;

and prints the claims of issue 8 per backend and batch: ``hydra gap <= 1.10`` at batch 8 (latency
ratio at most 1.10 x the FLOPs ratio), ``hydra < deep ensemble`` and ``hydra_trunk < hydra``.
With ``--strict`` the exit status is 1 when a claim on ONNX Runtime fails. Every hydra-bench option
works here too (``--check``, ``--write-baseline``, ``--backend``, ...).

Run it from the repository root::

    .venv/bin/python benchmarks/latency.py --overwrite
    .venv/bin/python benchmarks/latency.py --backbone vit_s16 --batch 1 8 --rounds 3 --overwrite
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra_deploy.atomic import atomic_write_text
from hydra_deploy.bench.check import claims
from hydra_deploy.bench.latency import markdown_report
from hydra_deploy.cli import bench, common

RESULTS = Path("benchmarks/results")
DEFAULTS = {
    "backbone": "vit_b16",
    "batch": [1, 2, 4, 8, 16],
    "backend": ["torch", "ort"],
    "rounds": 5,
    "out": RESULTS / "latency.json",
    "plot": RESULTS / "latency.png",
}
PROG = ".venv/bin/python benchmarks/latency.py"


def build_parser():
    parser = bench.build_parser(prog=PROG, **DEFAULTS)
    report = parser.add_argument_group("report")
    report.add_argument(
        "--md",
        type=Path,
        default=RESULTS / "latency.md",
        help=f"Markdown report (default {RESULTS / 'latency.md'})",
    )
    report.add_argument(
        "--max-gap",
        type=float,
        default=1.10,
        help="largest accepted hydra latency/FLOPs gap (default 1.10)",
    )
    report.add_argument(
        "--gap-batch", type=int, default=8, help="batch size of the gap claim (default 8)"
    )
    report.add_argument(
        "--strict", action="store_true", help="exit 1 when a claim on ONNX Runtime fails"
    )
    return parser


def body(args) -> int:
    common.refuse_existing(args.md, args.overwrite)
    config, result, baseline = bench.measure(args)
    found = claims(result, max_gap=args.max_gap, gap_batch=args.gap_batch)
    result["claims"] = found
    for claim in found:
        verdict = "PASS" if claim["passed"] else "FAIL"
        print(
            f"{claim['backend']} batch {claim['batch']}: {claim['claim']}: {verdict} "
            f"({claim['detail']})",
            file=sys.stderr if args.json else sys.stdout,
        )
    code = bench.finish(args, config, result, baseline)
    command = (
        bench.command_for(
            config, result["config"]["threads"], result["config"]["backends"], prog=PROG
        )
        + " --overwrite"
    )
    atomic_write_text(args.md, markdown_report(result, found, command))
    if not args.quiet:
        print(f"wrote {args.md}", file=sys.stderr)
    failed = [c for c in found if c["backend"] == "ort" and not c["passed"]]
    return code or (1 if args.strict and failed else 0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return common.run(body, args)


if __name__ == "__main__":
    sys.exit(main())
