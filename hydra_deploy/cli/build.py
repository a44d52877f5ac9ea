"""hydra-build: a TensorRT engine from an export folder, or the trtexec commands that build one."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hydra_deploy.cli import common, triton
from hydra_deploy.export_folder import read_engine_info

EXAMPLES = """\
  hydra-build export/vit_b16-m3                          # FP16 engine beside model.onnx
  hydra-build export/vit_b16-m3 --precision best --max-batch 64 --out engines/
  hydra-build export/vit_b16-m3 --trtexec                # trtexec lines for every TensorRT
  hydra-build export/vit_b16-m3 --trtexec --trt 10 --precision fp16   # JetPack 6.1/6.2 (TensorRT 10.3)
  hydra-build export/vit_b16-m3-fp16 --trtexec --trt 10.12            # strongly typed export
  hydra-build export/vit_b16-m3-uq --triton models/      # engine + Triton repository (ONNX, plan)
  hydra-build export/vit_b16-m3-uq --triton models/ --engine model.plan   # a trtexec-built engine
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of hydra-build."""
    p = common.parser(
        "hydra-build",
        "Build a TensorRT engine from a hydra-export folder through the TensorRT / Polygraphy API: "
        "a dynamic-batch optimization profile, strongly typed for exports that carry their "
        "precision (hydra-export --precision fp16|bf16|int8), weakly typed --fp16/--bf16 with "
        "LayerNorm kept in FP32 for FP32 exports on TensorRT before 10.12. The engine is named "
        "by model hash, precision, GPU and TensorRT version; a JSON sidecar and the timing cache "
        "sit beside it. With --trtexec, print the equivalent trtexec command lines instead (no "
        "TensorRT needed here; run them on the target, e.g. a Jetson).",
        EXAMPLES,
    )
    p.add_argument("export_dir", type=Path, metavar="EXPORT_DIR", help="folder hydra-export wrote")
    p.add_argument(
        "--precision",
        choices=("fp16", "bf16", "fp32", "best"),
        help="engine precision (default: the export's own precision, else fp16); best = bf16 "
        "where the GPU (SM >= 80) and TensorRT (>= 10) support it, else fp16. An INT8 export "
        "(hydra-export --precision int8 --int8-method static: QuantizeLinear/DequantizeLinear "
        "pairs) builds in INT8 by default",
    )
    p.add_argument(
        "--trtexec", action="store_true", help="print the trtexec command lines, build nothing"
    )
    p.add_argument(
        "--trt",
        choices=("8.6", "10", "10.12", "11"),
        help="with --trtexec: the TensorRT on the target (8.6: JetPack 6.0's 8.6.2; 10 = 10.0-10.11, "
        "e.g. JetPack 6.1/6.2's 10.3); "
        "default: one command per generation",
    )
    p.add_argument(
        "--gpu-tag", help="with --trtexec: a tag for the file names, e.g. orin-sm87 (default: none)"
    )
    p.add_argument("--out", type=Path, help="folder for the engine (default: EXPORT_DIR)")
    p.add_argument("--min-batch", type=int, help="profile minimum batch (default: the export's)")
    p.add_argument("--opt-batch", type=int, help="batch TensorRT tunes for (default: the export's)")
    p.add_argument("--max-batch", type=int, help="profile maximum batch (default: the export's)")
    p.add_argument(
        "--timing-cache",
        type=Path,
        help="timing cache to reuse and update (default: timing.<gpu>.trt<version>.cache beside "
        "the engine)",
    )
    typing = p.add_mutually_exclusive_group()
    typing.add_argument(
        "--strongly-typed",
        dest="strongly_typed",
        action="store_const",
        const=True,
        help="force a strongly typed network (precision from the graph)",
    )
    typing.add_argument(
        "--weakly-typed",
        dest="strongly_typed",
        action="store_const",
        const=False,
        help="force weak typing (--fp16/--bf16 flags; deprecated since TensorRT 10.12)",
    )
    p.add_argument("--overwrite", action="store_true", help="rebuild an existing engine")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    triton.add_arguments(p, engine=True)
    return p


def _trtexec(args: argparse.Namespace) -> int:
    from hydra_deploy.engines.build_source import load_source
    from hydra_deploy.engines.trtexec import command_lines, trtexec_commands
    from hydra_deploy.errors import EngineError

    results = trtexec_commands(
        load_source(args.export_dir),
        generations=[args.trt] if args.trt else None,
        precision=args.precision,
        out=args.out,
        gpu=args.gpu_tag,
        timing_cache=args.timing_cache,
        min_batch=args.min_batch,
        opt_batch=args.opt_batch,
        max_batch=args.max_batch,
        strongly_typed=args.strongly_typed,
    )
    if args.json:
        commands = [result.record() for result in results]
        print(json.dumps({"export": str(args.export_dir), "commands": commands}, indent=2))
        return 0
    if all(r.command is None for r in results):
        raise EngineError("no TensorRT generation can build this export: " + str(results[0].error))
    for line in command_lines(results, headers=not args.trt):
        print(line)
    if not args.quiet:
        print(
            "# then check fused attention: the layer info (--exportLayerInfo file) should list "
            "one fused MHA kernel per layer rather than MatMul, Softmax, MatMul",
            file=sys.stderr,
        )
    return 0


def main_body(args: argparse.Namespace) -> int:
    """Parse-free body: build the engine (or print trtexec lines) for ``args``."""
    from hydra_deploy.errors import EngineError

    if args.trt and not args.trtexec:
        raise EngineError(
            "--trt picks the TensorRT of a trtexec command; add --trtexec (a Python build uses "
            "the installed TensorRT)"
        )
    if args.gpu_tag and not args.trtexec:
        raise EngineError(
            "--gpu-tag names trtexec outputs; a Python build tags files with the detected GPU"
        )
    triton.check_unused(args)
    if args.triton is not None:
        if args.trtexec:
            raise EngineError(
                "--triton needs an engine and --trtexec builds none here: run the trtexec line on "
                "the target, then hydra-build EXPORT_DIR --triton REPO --engine FILE"
            )
        if args.engine is not None:
            building = [
                flag
                for flag, value in (
                    ("--precision", args.precision),
                    ("--out", args.out),
                    ("--min-batch", args.min_batch),
                    ("--opt-batch", args.opt_batch),
                    ("--max-batch", args.max_batch),
                    ("--timing-cache", args.timing_cache),
                    ("--strongly-typed/--weakly-typed", args.strongly_typed),
                )
                if value is not None
            ]
            if building:
                raise EngineError(
                    f"--engine adds an engine already built, so {', '.join(building)} (settings of "
                    "a build) would do nothing: drop them, or drop --engine to build one"
                )
        triton.preflight(args, args.export_dir, with_engine=True)
        if args.engine is not None:
            result = triton.write(args, args.export_dir, engine=args.engine)
            if args.json:
                print(json.dumps({"triton": result}, indent=2))
            return 0
    if args.trtexec:
        return _trtexec(args)

    from hydra_deploy.engines.tensorrt import build_engine

    engine = build_engine(
        args.export_dir,
        precision=args.precision,
        min_batch=args.min_batch,
        opt_batch=args.opt_batch,
        max_batch=args.max_batch,
        timing_cache=args.timing_cache,
        strongly_typed=args.strongly_typed,
        out=args.out,
        overwrite=args.overwrite,
    )
    engine_info = read_engine_info(engine, required=True)
    sidecar_path, sidecar = engine_info.path, dict(engine_info.record)
    repository = triton.write(args, args.export_dir, engine=engine) if args.triton else None
    if args.json:
        extra = {} if repository is None else {"triton": repository}
        print(json.dumps({"engine_path": str(engine), **sidecar, **extra}, indent=2))
    elif not args.quiet:
        low, opt, high = engine_info.batch_profile or ("?", "?", "?")
        print(
            f"wrote {engine} ({engine_info.precision}, "
            f"{'strongly' if engine_info.strongly_typed else 'weakly'} typed, batch "
            f"{low}/{opt}/{high}, {engine_info.gpu_name}, "
            f"TensorRT {engine_info.tensorrt_version}) and {sidecar_path.name}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hydra-build`` console script."""
    args = build_parser().parse_args(argv)
    return common.run(main_body, args)


if __name__ == "__main__":
    sys.exit(main())
