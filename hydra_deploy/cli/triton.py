"""The --triton options that hydra-export and hydra-build share (a Triton model repository)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from hydra_deploy.cli import common
from hydra_deploy.errors import ServeError
from hydra_deploy.options import BatchingOptions, add_options
from hydra_deploy.serve.triton_repo import (
    check_name,
    default_model_name,
    plan_repository,
    refuse_existing_models,
    write_triton_repository,
)

logger = logging.getLogger("hydra_deploy")

#: the repository's flags: BatchingOptions' under --triton-, with a repository's own defaults
PREFIX = "triton-"
BATCHING = ("model_name", "preferred_batch", "queue_delay_us", "instances")
DEFAULTS = {"queue_delay_us": 100}
HELPS = {
    "model_name": "model name in the repository (default: the export folder's name; the "
    "engine's is NAME-trt)",
    "preferred_batch": "dynamic batcher's preferred batch sizes (default: the profile's opt and "
    "max)",
    "instances": "model instances per device (default 1)",
}


def add_arguments(p: argparse.ArgumentParser, *, engine: bool) -> None:
    """``--triton REPO`` and its settings; ``engine``: also ``--engine FILE`` (hydra-build)."""
    g = p.add_argument_group("Triton model repository")
    g.add_argument(
        "--triton",
        type=Path,
        metavar="REPO",
        help="also add the model to this Triton model repository (made when absent): the ONNX "
        "model (onnxruntime_onnx)"
        + (" and the engine (tensorrt_plan)" if engine else "")
        + ", each with a config.pbtxt (dynamic batching, instance group), and a README on "
        "starting Triton on it",
    )
    add_options(p, BatchingOptions, g, prefix=PREFIX, only=BATCHING, defaults=DEFAULTS, helps=HELPS)
    g.add_argument(
        "--triton-device",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="the ONNX model's instance kind (default auto: GPU where Triton has one); "
        "a TensorRT plan always runs on the GPU",
    )
    if engine:
        g.add_argument(
            "--engine",
            type=Path,
            metavar="FILE",
            help="with --triton: add this engine (built by trtexec or an earlier "
            "hydra-build) instead of building one",
        )


def batching(args: argparse.Namespace) -> BatchingOptions:
    """The repository's batching settings (checked: errors name the --triton-* flags)."""
    return common.options(BatchingOptions, args, prefix=PREFIX)


def options(args: argparse.Namespace) -> dict[str, Any]:
    """``write_triton_repository``'s (and ``plan_repository``'s) settings."""
    chosen = batching(args)
    return {name: getattr(chosen, name) for name in BATCHING} | {"kind": args.triton_device}


def check_unused(args: argparse.Namespace) -> None:
    """Refuse --triton-* settings given without --triton."""
    if args.triton is not None:
        return
    given = [
        f"--{k.replace('_', '-')}"
        for k in ("triton_name", "triton_preferred_batch")
        if getattr(args, k) is not None
    ]
    given += ["--engine"] if getattr(args, "engine", None) is not None else []
    if given:
        verb = "sets" if len(given) == 1 else "set"
        raise ServeError(f"{', '.join(given)} {verb} up a Triton repository; add --triton REPO")


def preflight(args: argparse.Namespace, export_name: Path, with_engine: bool) -> list[str]:
    """Check the names and the repository before any export or build; returns the model names."""
    name = check_name(batching(args).model_name or default_model_name(export_name))
    names = [name] + ([check_name(f"{name}-trt")] if with_engine else [])
    refuse_existing_models(args.triton, names, args.overwrite)
    if with_engine:  # the export exists already: check it holds what Triton needs, before a build
        plan_repository(export_name, **options(args))
    return names


def write(args: argparse.Namespace, export_dir: Path, engine: Path | None = None) -> dict:
    """Write the repository entries and say where they went."""
    result = write_triton_repository(
        export_dir, args.triton, engine=engine, overwrite=args.overwrite, **options(args)
    )
    for model in result["models"]:
        logger.info(
            "wrote Triton model %s (%s, max batch %d, preferred %s) in %s",
            model["name"],
            model["platform"],
            model["max_batch_size"],
            model["preferred_batch_size"],
            result["repository"],
        )
    logger.info("start Triton on it: see %s", Path(result["repository"]) / "README.md")
    return result
