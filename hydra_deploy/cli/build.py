"""hydra-build: a TensorRT engine from an export folder, or the trtexec commands that build one."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hydra_deploy.cli import common, triton
from hydra_deploy.engines.build_options import EngineBuildOptions
from hydra_deploy.engines.build_source import load_source
from hydra_deploy.engines.tensorrt import build_engine
from hydra_deploy.engines.trtexec import command_lines, trtexec_commands
from hydra_deploy.errors import EngineError
from hydra_deploy.export_folder import EngineInfo, read_engine_info
from hydra_deploy.options import add_options, from_args

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
    add_options(p, EngineBuildOptions)
    p.add_argument("--overwrite", action="store_true", help="rebuild an existing engine")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    recipes = p.add_argument_group("trtexec command lines instead of a build")
    recipes.add_argument(
        "--trtexec", action="store_true", help="print the trtexec command lines, build nothing"
    )
    recipes.add_argument(
        "--trt",
        choices=("8.6", "10", "10.12", "11"),
        help="with --trtexec: the TensorRT on the target (8.6: JetPack 6.0's 8.6.2; 10 = 10.0-10.11, "
        "e.g. JetPack 6.1/6.2's 10.3); "
        "default: one command per generation",
    )
    recipes.add_argument(
        "--gpu-tag", help="with --trtexec: a tag for the file names, e.g. orin-sm87 (default: none)"
    )
    triton.add_arguments(p, engine=True)
    return p


def _trtexec(args: argparse.Namespace, build: EngineBuildOptions) -> int:
    results = trtexec_commands(
        load_source(args.export_dir),
        generations=[args.trt] if args.trt else None,
        options=build,
        gpu=args.gpu_tag,
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


def _check_flags(args: argparse.Namespace, build: EngineBuildOptions) -> None:
    """Refuse flags that would do nothing with the others given."""
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
    if args.triton is not None and args.trtexec:
        raise EngineError(
            "--triton needs an engine and --trtexec builds none here: run the trtexec line on "
            "the target, then hydra-build EXPORT_DIR --triton REPO --engine FILE"
        )
    building = build.given_flags()
    if args.triton is not None and args.engine is not None and building:
        raise EngineError(
            f"--engine adds an engine already built, so {', '.join(building)} (settings of "
            "a build) would do nothing: drop them, or drop --engine to build one"
        )


def _report(args: argparse.Namespace, engine: Path, engine_info: EngineInfo, repository) -> None:
    """Say what was built: the sidecar as JSON (``--json``), else one line."""
    if args.json:
        extra = {} if repository is None else {"triton": repository}
        sidecar = dict(engine_info.record)
        print(json.dumps({"engine_path": str(engine), **sidecar, **extra}, indent=2))
    elif not args.quiet:
        low, opt, high = engine_info.batch_profile or ("?", "?", "?")
        print(
            f"wrote {engine} ({engine_info.precision}, "
            f"{'strongly' if engine_info.strongly_typed else 'weakly'} typed, batch "
            f"{low}/{opt}/{high}, {engine_info.gpu_name}, "
            f"TensorRT {engine_info.tensorrt_version}) and {engine_info.path.name}"
        )


def main_body(args: argparse.Namespace) -> int:
    """Parse-free body: build the engine (or print trtexec lines) for ``args``."""
    build = from_args(EngineBuildOptions, args)
    _check_flags(args, build)
    if args.triton is not None:
        triton.preflight(args, args.export_dir, with_engine=True)
        if args.engine is not None:
            result = triton.write(args, args.export_dir, engine=args.engine)
            if args.json:
                print(json.dumps({"triton": result}, indent=2))
            return 0
    if args.trtexec:
        return _trtexec(args, build)
    engine = build_engine(args.export_dir, build, overwrite=args.overwrite)
    engine_info = read_engine_info(engine, required=True)
    repository = triton.write(args, args.export_dir, engine=engine) if args.triton else None
    _report(args, engine, engine_info, repository)
    return 0


main = common.entry_point(build_parser, main_body, "hydra-build")


if __name__ == "__main__":
    sys.exit(main())
