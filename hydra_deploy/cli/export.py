"""hydra-export: build a Hydra model and export it to ONNX, validated against PyTorch."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys
import time
import zipfile
from pathlib import Path

import numpy as np

from hydra_deploy import userdata
from hydra_deploy.cli import common, triton
from hydra_deploy.cli import model_options as build
from hydra_deploy.engines.trtexec import command_lines, trtexec_commands
from hydra_deploy.errors import HydraError, ParameterError, counted
from hydra_deploy.export_folder import (
    INFO_FILE,
    MODEL_FILE,
    WEIGHTS_FILE,
    ExportInfo,
    read_info,
)
from hydra_deploy.families import get_family
from hydra_deploy.optional import lazy_module
from hydra_deploy.options import (
    MIN_CALIBRATION_EXAMPLES,
    Int8Options,
    RunnerOptions,
    add_options,
    from_args,
)
from hydra_deploy.threads import use_threads

# the stages this command runs, imported when it runs them (``--help`` imports no torch)
backbones = lazy_module("hydra_deploy.backbones")
calibrate = lazy_module("hydra_deploy.evaluation.calibrate")
int8_data = lazy_module("hydra_deploy.evaluation.int8_data")
exporter = lazy_module("hydra_deploy.export.exporter")
export_load = lazy_module("hydra_deploy.export.load")

log = logging.getLogger("hydra_deploy")

EXAMPLES = """\
  hydra-export --backbone vit_b16                  # writes export/vit_b16-m3
  hydra-export --backbone vit_b16 --checkpoint vit_b16.safetensors --calib train/ \\
               --heads-per-member 4 --finetune train/ --epochs 1 --out export/vit_b16-m3
  hydra-export --backbone vit_s16 --spec spec.json --max-batch 64 --out export/vit_s16 --json
  hydra-export --from export/vit_b16-m3 --opset 18 --uq-outputs --out export/vit_b16-m3-uq
  hydra-export --backbone vit_b16 --out export/vit_b16-m3 --triton models/   # + Triton repository
  hydra-export --backbone vit_b16 --precision int8 --int8-calib calib/ --out export/vit_b16-m3-int8
"""


def build_parser() -> argparse.ArgumentParser:
    p = common.parser(
        "hydra-export",
        "Build a Hydra ensemble (as hydra-fuse does) and export it to ONNX: model.onnx with a "
        "dynamic batch and the spec in its metadata, hydra.json (spec, inputs, outputs, "
        "preprocessing, validation) and weights.safetensors. ONNX Runtime checks the file against "
        "PyTorch at the smallest, an odd middle and the largest batch before the folder appears.",
        EXAMPLES,
    )
    build.add_build_arguments(p, backbone_required=False)
    out = p.add_argument_group("export")
    out.add_argument(
        "--from",
        dest="from_dir",
        type=Path,
        metavar="EXPORT_DIR",
        help="re-export the model saved in an export folder (its hydra.json and "
        "weights.safetensors; no checkpoint needed) instead of building one",
    )
    out.add_argument(
        "--out", type=Path, help="export folder to write (default: export/<backbone>-m<members>)"
    )
    out.add_argument("--opset", type=int, default=17, help="ONNX opset (default 17)")
    out.add_argument("--min-batch", type=int, default=1)
    out.add_argument(
        "--opt-batch", type=int, help="batch TensorRT tunes for (default: 8, at most max)"
    )
    out.add_argument("--max-batch", type=int, default=32)
    out.add_argument(
        "--exporter",
        choices=("auto", "dynamo", "torchscript"),
        default="auto",
        help="torch exporter (default: dynamo when onnxscript is installed)",
    )
    out.add_argument(
        "--precision",
        choices=("fp32", "fp16", "bf16", "int8"),
        default="fp32",
        help="fp16/bf16: a strongly typed graph (weights and matmuls in that precision, "
        "LayerNorm and the ensemble head in float32, float32 inputs and outputs); int8: matmuls "
        "quantized, the rest float32 (--int8-method static: QuantizeLinear/DequantizeLinear "
        "pairs, which TensorRT builds; dynamic: ONNX Runtime only). TensorRT builds fp16, bf16 "
        "and int8 graphs with --stronglyTyped from 10.0 on (JetPack 6.1/6.2 included), 8.6 "
        "weakly typed (--fp16, --int8); the export prints each version's trtexec line "
        "(default fp32)",
    )
    out.add_argument(
        "--uq-outputs",
        action="store_true",
        help="put the ensemble head in the graph: probs, entropies, MI, msp outputs",
    )
    out.add_argument("--no-validate", action="store_true", help="skip the ONNX Runtime check")
    out.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    out.add_argument("--json", action="store_true", help="print hydra.json's contents as JSON")
    add_options(p, Int8Options)
    add_options(p, RunnerOptions, only=("threads",))
    triton.add_arguments(p, engine=False)
    return p


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def int8_options(args: argparse.Namespace) -> Int8Options | None:
    """``--precision int8``'s options from the INT8 flags (refused without it); ``--int8-calib``
    becomes the reader of that data (:func:`hydra_deploy.evaluation.int8_data.int8_calibration`),
    run on the staged FP32 export with the model's own preprocessing or tokenizer."""
    flags = {f.metadata["flag"]: f.default for f in dataclasses.fields(Int8Options)}
    given = [flag for flag, default in flags.items() if getattr(args, _dest(flag)) != default]
    if args.precision != "int8":
        if given:
            raise HydraError(f"{given[0]} is for INT8 exports: add --precision int8, or drop it")
        return None
    try:
        options = from_args(Int8Options, args)
    except ParameterError as err:
        err.args = (err.for_command(Int8Options.FLAGS),)
        raise
    if options.calib is None:
        if args.int8_method is None:
            log.info(
                "--precision int8 without --int8-calib: dynamic quantization (int8 weights, "
                "activations quantized at run time; ONNX Runtime on a CPU). For static QDQ "
                "(TensorRT, and no run-time quantization) give --int8-calib DATA"
            )
        return options
    if not Path(options.calib).exists():
        raise HydraError(
            f"--int8-calib {str(options.calib)!r} does not exist; give an image folder, a .npz of "
            "the model's inputs, or a .txt/.tsv for a text model"
        )
    int8_data.refuse_wrong_kind(options.calib, _family_to_build(args), "--int8-calib")
    _refuse_too_few(Path(options.calib))
    reader = int8_data.int8_calibration(options.calib, max_examples=options.calib_size)
    return dataclasses.replace(options, calib=reader)


def calibration_count(path: Path) -> tuple[int, str] | None:
    """How many examples ``path`` holds and what they are, read without decoding them: an image
    folder's images, a text file's lines, a ``.npz``/``.npy``'s rows (its longest array's);
    None for what is not counted here (the reader says what is wrong with it later)."""
    suffix = path.suffix.lower()
    try:
        if path.is_dir():
            return len(userdata.find_images([path], error=HydraError)), "image"
        if suffix in userdata.TEXT_FILE_SUFFIXES:
            return len(userdata.read_text_file(path, error=HydraError).texts), "text line"
        if suffix == ".npy":
            array = np.load(path, mmap_mode="r")
            return (len(array) if array.ndim else 1), "example"
        if suffix == ".npz":
            return max(_npz_rows(path), default=0), "example"
    except (OSError, ValueError, zipfile.BadZipFile):
        return None
    return None


def _npz_rows(path: Path) -> list[int]:
    """The first dimension of each array in a ``.npz``, from the headers (nothing loaded)."""
    rows = []
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            if not name.endswith(".npy"):
                continue
            with archive.open(name) as member:
                version = np.lib.format.read_magic(member)
                read = (
                    np.lib.format.read_array_header_1_0
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                shape = read(member)[0]
                rows.append(shape[0] if shape else 1)
    return rows


def _refuse_too_few(path: Path) -> None:
    """Fewer than MIN_CALIBRATION_EXAMPLES in ``--int8-calib``: refused before anything is built
    (the count the data holds; at most --int8-calib-size of them are used)."""
    counted_here = calibration_count(path)
    if counted_here is None or counted_here[0] >= MIN_CALIBRATION_EXAMPLES:
        return
    count, noun = counted_here
    raise HydraError(
        f"--int8-calib {path} holds {counted(count, noun)}; static INT8 calibration needs at "
        f"least {MIN_CALIBRATION_EXAMPLES} (a few hundred is better): add more, or quantize "
        "dynamically (--int8-method dynamic, no data needed)"
    )


def _family_to_build(args: argparse.Namespace):
    """The family ``--backbone`` builds or ``--from``'s folder holds (a vision model when the
    folder cannot be read: the re-export says why, later)."""
    if args.from_dir is None:
        return backbones.family_of_name(args.backbone)
    try:
        return get_family(read_info(args.from_dir).family or "vit")
    except HydraError:
        return get_family("vit")


def default_name(backbone: str) -> str:
    """A folder name for a backbone: ``vit_b16``, ``hf:/models/minilm`` -> ``minilm``,
    ``openclip:ViT-B-32`` -> ``openclip-ViT-B-32``."""
    prefix, sep, rest = str(backbone).partition(":")
    if sep and prefix == "hf":
        return Path(rest.rstrip("/")).name or "hf"
    if sep and prefix == "openclip":
        return "openclip-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", rest)
    return Path(str(backbone).rstrip("/")).name


def trtexec_lines(info: ExportInfo | None, out: Path) -> list[str]:
    """The trtexec lines that build an engine from the export written to ``out``: per TensorRT
    generation what ``hydra-build EXPORT_DIR --trtexec`` prints, without its blank lines (both
    come from :func:`hydra_deploy.engines.trtexec.trtexec_commands`, which reads the folder, so
    ``info`` is not needed). An export no TensorRT can build gets one line saying why."""
    results = trtexec_commands(out)
    if all(result.command is None for result in results):
        return [f"# no TensorRT can build this export: {results[0].error}"]
    return [line.replace("EXPORT_DIR", str(out)) for line in command_lines(results) if line]


def validation_line(validation: dict) -> str:
    """What validation compared and the largest differences it found; for FP16/BF16/INT8 also
    the drift from FP32 (its verdict the export says once, as it ends: parity's rule)."""
    batches = validation["batches"]
    worst = max(b["member_logits"]["max_abs_diff"] for b in batches.values())
    limit = max(b["member_logits"]["atol"] for b in batches.values())
    precision = validation.get("precision", "fp32")
    line = (
        f"validated in ONNX Runtime at batch {', '.join(batches)}: max member-logit difference "
        f"{worst:.2g} (tolerance {limit:.2g})"
    )
    if precision == "fp32":
        return line
    if precision == "int8":
        line = line.replace("in ONNX Runtime", "the fp32 graph in ONNX Runtime")
        line += " against PyTorch, before quantization"
    else:
        line = line.replace(
            "in ONNX Runtime", f"the {precision} file's float32 widening in ONNX Runtime"
        )
        line += f" against PyTorch with {precision} weights"
    drift = validation.get("drift") or {}
    moved = ", ".join(
        f"{name} {drift['worst'][name]:.2g}"
        for name in ("member_logits", "probs", "predictive_entropy", "mutual_information")
        if name in drift.get("worst", {})
    )
    where = validation.get("drift_measured_in", "")
    if drift.get("inputs"):
        where += f" on {drift['inputs']}"
    examples = drift.get("examples")
    return f"{line}\n{precision} vs fp32 (measured in {where}): max {moved} ({examples} examples)"


def main_body(args: argparse.Namespace) -> int:
    use_threads(common.options(RunnerOptions, args).threads, torch=True)  # the whole build
    int8, batch = _check_request(args)  # before the build: a wrong flag costs nothing
    # decisions the overwrite removes, unless a --from source with decisions carries or warns
    replaced_decisions = args.overwrite and _held_decisions(args.out)
    replaced_decisions &= args.from_dir is None or not _held_decisions(args.from_dir)
    started = time.perf_counter()
    hydra = (
        _rebuild(args)
        if args.from_dir is not None
        else build.build_hydra(args, progress=not args.quiet)[3]
    )
    _say_built(hydra)
    info = exporter.export_onnx(
        hydra,
        args.out,
        opset=args.opset,
        batch=batch,
        exporter=args.exporter,
        validate=not args.no_validate,
        uq_outputs=args.uq_outputs,
        precision=args.precision,
        int8=int8,
        overwrite=args.overwrite,
    )
    if args.from_dir is not None:
        _carry_decisions(args.from_dir, args.out, hydra)
    if replaced_decisions and read_info(args.out).decisions is None:
        log.warning(
            "%s held decisions (hydra-calibrate) fitted on the model this export replaced; they "
            "are removed with it: fit them again with hydra-calibrate %s --data LABELLED",
            args.out,
            args.out,
        )
    repository = triton.write(args, args.out) if args.triton is not None else None
    if args.json:
        record = dict(info.record)
        print(
            json.dumps(record if repository is None else {**record, "triton": repository}, indent=2)
        )
    elif not args.quiet:
        _report(info, args.out, time.perf_counter() - started)
    return 0


def _held_decisions(folder: Path) -> bool:
    """Whether ``folder`` is an export folder holding decisions (an unreadable one: no)."""
    try:
        info = read_info(folder, required=False) if folder.is_dir() else None
    except HydraError:
        return False
    return info is not None and info.decisions is not None


def _check_request(args: argparse.Namespace) -> tuple[Int8Options | None, tuple[int, int, int]]:
    """The flags checked before anything is built (``--out`` filled in): the INT8 options and
    the batch profile."""
    if (args.backbone is None) == (args.from_dir is None):
        raise HydraError(
            "give --backbone NAME (build a model) or --from EXPORT_DIR (re-export one)"
        )
    if args.out is None:
        if args.from_dir is not None:
            raise HydraError("--from needs --out (a new folder for the re-export)")
        args.out = Path("export") / f"{default_name(args.backbone)}-m{build.resolve_members(args)}"
    common.refuse_existing(args.out, args.overwrite)
    int8 = int8_options(args)
    triton.check_unused(args)
    if args.triton is not None:
        triton.preflight(args, args.out, with_engine=False)
        if not args.uq_outputs:
            log.info(
                "--triton: the ensemble head goes in the graph (--uq-outputs), so Triton "
                "answers the uncertainty scores itself"
            )
            args.uq_outputs = True
    opt = args.opt_batch if args.opt_batch is not None else min(8, args.max_batch)
    return int8, exporter.check_profile(args.opset, (args.min_batch, opt, args.max_batch))


def _rebuild(args: argparse.Namespace):
    """``--from``: the model saved in an export folder, its preprocessing corrected by the
    flags."""
    if args.model_arg:
        raise HydraError("--model-arg builds a backbone; --from re-exports a built model as is")
    hydra = export_load.load_export(args.from_dir, warn_preprocessing=False)  # warned once, below
    log.info("rebuilt the model saved in %s", args.from_dir)
    preprocessing = build.preprocessing_from_args(args)
    if preprocessing:  # correct the recorded preprocessing of an image export
        hydra.preprocessing = build.override_preprocessing(hydra, preprocessing)
    export_load.warn_default_preprocessing(hydra, args.from_dir)
    return hydra


def _say_built(hydra) -> None:
    spec, macs = hydra.spec, hydra.macs
    heads = ", ".join(
        f"{int(n)} of {spec.num_layers * spec.num_heads} heads"
        for n in spec.heads_per_layer().sum(1)
    )
    log.info(
        "built %d member%s (%s), %s, %.2f x the single model's MACs",
        spec.num_members,
        "s" * (spec.num_members != 1),
        heads,
        hydra.parameters_line(),
        macs["hydra"] / macs["single"],
    )


def _report(info: ExportInfo, out: Path, seconds: float) -> None:
    print(
        f"wrote {out}/{MODEL_FILE}, {INFO_FILE}, {WEIGHTS_FILE} "
        f"({seconds:.0f} s, opset {info.opset}, {info.exporter} exporter)"
    )
    if info.validation:
        print(validation_line(info.validation))
    print("build a TensorRT engine with:")
    for line in trtexec_lines(info, out):
        print("  " + line)


def _carry_decisions(source: Path, out: Path, hydra) -> None:
    """Keep the source's hydra-calibrate decisions when the re-export computes the same member
    logits (same precision and graph arithmetic), else say they must be fitted again."""
    if read_info(source).decisions is None:
        return
    example = hydra.example_inputs(4, 0)
    example = example if isinstance(example, tuple) else (example,)
    names = [tensor.name for tensor in read_info(out).input_tensors]
    inputs = {name: t.numpy() for name, t in zip(names, example, strict=False)}
    if calibrate.carry_decisions(source, out, inputs) is not None:
        log.info("kept the decisions of %s: the re-export computes the same member logits", source)
    else:
        log.warning(
            "the decisions of %s are not kept: the re-export computes other member logits (or "
            "they were fitted on another file); fit them again with hydra-calibrate %s --data "
            "LABELLED",
            source,
            out,
        )


main = common.entry_point(build_parser, main_body, "hydra-export")


if __name__ == "__main__":
    sys.exit(main())
