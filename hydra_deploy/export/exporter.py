"""export_onnx: a HydraModel -> an export folder (model.onnx, hydra.json, weights.safetensors)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hydra_deploy
from hydra_deploy.atomic import staging_dir
from hydra_deploy.errors import ExportError, spelled
from hydra_deploy.export.heads import UQ_OUTPUTS, WithEnsembleHead
from hydra_deploy.export.int8 import calibration_rows, quantize_export
from hydra_deploy.export.precision import check_precision, compute_types
from hydra_deploy.export.surgery import DEFAULT_PASSES, run_passes
from hydra_deploy.export.torch_onnx import export_module
from hydra_deploy.export.validate import (
    feed_batches,
    validate_int8,
    validate_onnx,
    validation_batches,
)
from hydra_deploy.export_folder import (
    GRAPH_PRECISIONS,
    MODEL_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_DIR,
    TOKENIZER_FILE,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    ExportInfo,
    Int8Record,
    MergeRecord,
    Preprocessing,
    TensorInfo,
    TokenizerEntry,
    file_sha256,
    read_info,
    write_info,
)
from hydra_deploy.fusion import HydraModel
from hydra_deploy.optional import lazy_module
from hydra_deploy.options import Int8Options

onnx = lazy_module("onnx", purpose="exporting models to ONNX", error=ExportError)
safetensors_torch = lazy_module(
    "safetensors.torch", purpose="saving the fused weights", error=ExportError
)

logger = logging.getLogger("hydra_deploy")

SPEC_KEY = "hydra_spec"
MIN_OPSET, MAX_OPSET = 17, 21
VALIDATION_SEQUENCE_LENGTHS = (5, 23)  # odd, one short and one longer than the traced length


def export_onnx(
    hydra: torch.nn.Module,
    out_dir: str | os.PathLike,
    *,
    opset: int = 17,
    batch: Sequence[int] = (1, 8, 32),
    exporter: str = "auto",
    validate: bool = True,
    atol: dict[str, float] | None = None,
    class_names: Sequence[str] | None = None,
    passes: Sequence[str] = DEFAULT_PASSES,
    uq_outputs: bool = False,
    precision: str = "fp32",
    int8: Int8Options | None = None,
    overwrite: bool = False,
) -> ExportInfo:
    """Export ``hydra`` to ``out_dir`` and return its ``hydra.json``, checked
    (:class:`~hydra_deploy.export_folder.ExportInfo`, as :func:`~hydra_deploy.export_folder.read_info`
    reads it; ``.record`` is the JSON object).

    ``batch`` is the (min, opt, max) batch profile; validation runs ONNX Runtime at the minimum,
    an odd size between and the maximum against PyTorch (``atol`` per output, 1e-4 for member
    logits) and fails the export on a mismatch. The folder is written under a temporary name and
    renamed into place: an interrupted export leaves nothing behind a valid-looking name. An
    existing ``out_dir`` is refused unless ``overwrite``. ``passes``: the graph-surgery passes run
    on the exported file (see :mod:`hydra_deploy.export.surgery`). ``uq_outputs`` adds the
    ensemble head to the graph: outputs ``probs``, ``predictive_entropy``, ``expected_entropy``,
    ``mutual_information`` and ``msp`` beside ``member_logits``, in float32. ``precision``
    ``"fp16"``/``"bf16"`` writes a strongly typed graph (see :mod:`hydra_deploy.export.precision`:
    weights and matmuls in that precision, LayerNorm and the ensemble head in float32, explicit
    casts, float32 inputs and outputs); validation then compares it with PyTorch under the same
    policy and records its drift from FP32, judged by :mod:`hydra_deploy.parity` (said once: a
    warning beyond the tolerances). ``precision="int8"`` exports FP32, validates it, then
    quantizes its matrix products as ``int8`` says (:class:`~hydra_deploy.options.Int8Options`:
    ``dynamic`` weights only, the default without data; ``static`` QDQ calibrated on
    ``int8.calib``: arrays by input name, or a reader of the staged FP32 folder such as
    :func:`hydra_deploy.evaluation.int8_data.int8_calibration`) with
    :func:`hydra_deploy.export.int8.quantize_export`, records how in ``hydra.json``'s ``int8``,
    and refuses a file that moves the outputs beyond parity's INT8 tolerances from FP32 (on the
    calibration data, or the example inputs of a dynamic file).
    """
    out = Path(out_dir)
    batch = _check_arguments(hydra, out, opset, batch, overwrite)
    int8 = _check_int8(precision, int8)
    graph_precision = "fp32" if precision == "int8" else check_precision(precision)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(out.parent, out.name)
    try:
        graph_module = WithEnsembleHead(hydra) if uq_outputs else hydra
        model_path = staging / MODEL_FILE
        model, used, surgery = _write_graph(
            hydra, graph_module, model_path, opset, batch, exporter, passes, graph_precision
        )
        validation = None
        if validate:
            validation = _validate(hydra, graph_module, model_path, batch, atol, graph_precision)
        info = _stage_record(
            hydra,
            staging,
            model,
            exporter=used,
            surgery=surgery,
            validation=validation,
            class_names=class_names,
            opset=opset,
            batch=batch,
            precision=graph_precision,
            uq_outputs=uq_outputs,
        )
        if int8 is not None:
            write_info(staging, info)  # the staged FP32 export: what a calibration reader runs
            info = _to_int8(staging, hydra, info, int8, batch, validate)
        _say_drift(precision, info.validation)
        write_info(staging, info)
        _ordinary_modes(staging)
        _move_into_place(staging, out, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return read_info(out)


def _stage_record(
    hydra,
    staging: Path,
    model,
    *,
    exporter: str,
    surgery: Mapping[str, Any],
    validation: Mapping[str, Any] | None,
    class_names: Sequence[str] | None,
    opset: int,
    batch: tuple[int, int, int],
    precision: str,
    uq_outputs: bool,
) -> ExportInfo:
    """Write the weights (and a text model's tokenizer) beside the staged ``model.onnx``; the
    folder's record."""
    safetensors_torch.save_file(
        {k: v.contiguous() for k, v in hydra.state_dict().items()}, str(staging / WEIGHTS_FILE)
    )
    if class_names is None:  # zero-shot models and BERT classifiers (id2label) know theirs
        class_names = getattr(hydra, "class_names", None)
    return ExportInfo.new(
        staging,
        **_model_entries(hydra, class_names),
        inputs=[tensor_info(v) for v in model.graph.input],
        outputs=[tensor_info(v) for v in model.graph.output],
        batch_profile=batch,
        opset=opset,
        exporter=exporter,
        onnx_sha256=file_sha256(staging / MODEL_FILE),
        validation=validation,
        tokenizer=_copy_tokenizer(hydra, staging),
        precision=precision,
        graph_passes={k: v for k, v in surgery.items() if k != "precision"},
        precision_report=None
        if precision == "fp32"
        else {**surgery["precision"], "compute_types": compute_types(model)},
        uq_outputs=uq_outputs,
        package_version=hydra_deploy.__version__,
    )


def _write_graph(
    hydra,
    graph_module: torch.nn.Module,
    model_path: Path,
    opset: int,
    batch: tuple[int, int, int],
    exporter: str,
    passes: Sequence[str],
    precision: str,
) -> tuple[Any, str, dict[str, Any]]:
    """Export ``graph_module`` to ``model_path``, run the graph passes, stamp the metadata and
    check the file: (the ONNX model, the exporter used, what the passes did)."""
    started = time.perf_counter()
    used = export_module(
        graph_module,
        hydra.example_inputs(max(2, batch[1])),
        model_path,
        input_names=hydra.input_names,
        output_names=["member_logits", *(UQ_OUTPUTS if graph_module is not hydra else ())],
        opset=opset,
        max_batch=batch[2],
        exporter=exporter,
        dynamic_axes=getattr(hydra, "dynamic_axes", None),
    )
    logger.info("exported with the %s exporter in %.1f s", used, time.perf_counter() - started)
    surgery = run_passes(model_path, passes, precision=precision)
    logger.info(
        "graph passes: %s", ", ".join(f"{k} {v}" for k, v in surgery.items() if k != "precision")
    )
    if precision != "fp32":
        converted = surgery["precision"]
        logger.info(
            "%s graph: %d nodes in %s, %d kept in float32 (LayerNorm, ensemble head%s), %d casts",
            precision,
            converted["low_precision_nodes"],
            precision,
            converted["fp32_nodes"],
            "".join(f", {op}" for op in converted["fp32_for_lack_of_kernels"]),
            converted["casts"],
        )
    model = _stamp(model_path, hydra, precision)
    einsums = [n.name for n in model.graph.node if n.op_type == "Einsum"]
    if einsums:
        logger.warning(
            "the graph holds %d Einsum node(s) (lowering=einsum?); TensorRT and "
            "ONNX Runtime run MatMul faster",
            len(einsums),
        )
    return model, used, surgery


def _stamp(model_path: Path, hydra, precision: str):
    """Write the spec, the package version and the precision into the file's metadata; check
    the file (ONNX's full check) and return it loaded."""
    model = onnx.load(str(model_path))
    _set_metadata(model, hydra.spec.to_json(indent=None), hydra_deploy.__version__, precision)
    onnx.save(model, str(model_path))
    onnx.checker.check_model(str(model_path), full_check=True)
    return model


def _validate(
    hydra,
    graph_module: torch.nn.Module,
    model_path: Path,
    batch: tuple[int, int, int],
    atol: dict[str, float] | None,
    precision: str,
) -> dict[str, Any]:
    """The file against PyTorch in ONNX Runtime (:func:`validate_onnx`), timed."""
    started = time.perf_counter()
    validation = validate_onnx(
        model_path,
        graph_module,
        hydra.example_inputs,
        validation_batches(batch),
        atol=atol,
        precision=precision,
        sequence_lengths=_sequence_lengths(hydra),
    )
    validation["seconds"] = round(time.perf_counter() - started, 2)
    logger.debug(
        "validated in ONNX Runtime at batch %s (max member-logit difference %.2g)",
        ", ".join(validation["batches"]),
        max(b["member_logits"]["max_abs_diff"] for b in validation["batches"].values()),
    )
    return validation


def _say_drift(precision: str, validation: Mapping[str, Any] | None) -> None:
    """The precision's verdict on its drift from FP32, said once."""
    drift = (validation or {}).get("drift")
    if drift:
        say = logger.info if drift["passed"] else logger.warning
        say("%s vs fp32 on %d examples: %s", precision, drift["examples"], drift["verdict"])


def _ordinary_modes(staging: Path) -> None:
    """The staged files get the folder's mode (the umask's, set by staging_dir), not the 0600
    safetensors writes."""
    folder_mode = staging.stat().st_mode & 0o777
    for path in staging.rglob("*"):
        path.chmod(folder_mode if path.is_dir() else folder_mode & 0o666)


def _check_int8(precision: str, int8: Int8Options | None) -> Int8Options | None:
    if precision not in GRAPH_PRECISIONS:
        raise ExportError(f"unknown precision {precision!r}; choose one of {GRAPH_PRECISIONS}")
    if precision != "int8":
        if int8 is not None:
            raise ExportError(
                "INT8 options are for an INT8 export: "
                + spelled("pass precision='int8'", "add --precision int8")
            )
        return None
    if int8 is not None and not isinstance(int8, Int8Options):
        raise ExportError(f"int8 must be an Int8Options, got {type(int8).__name__}")
    return int8 or Int8Options()


def _calibration_inputs(
    calib: Any, staging: Path, dtypes: Mapping[str, str], size: int
) -> dict[str, np.ndarray] | None:
    """The calibration inputs by name (at most ``size`` rows, each as its graph input's dtype):
    arrays as given, or what a reader of the staged FP32 folder returns."""
    if calib is None:
        return None
    if isinstance(calib, (str, os.PathLike)):
        raise ExportError(
            f"export_onnx does not read data files: give the calibration inputs as arrays, or "
            f"read {str(calib)!r} with int8_calibration({str(calib)!r}) from "
            "hydra_deploy.evaluation.int8_data (what hydra-export --int8-calib does)"
        )
    arrays = calib(staging) if callable(calib) else calib
    if not isinstance(arrays, Mapping):
        arrays = {next(iter(dtypes)): arrays}
    arrays = {name: np.asarray(value, dtype=dtypes.get(name)) for name, value in arrays.items()}
    count = len(next(iter(arrays.values()))) if arrays else 0
    rows = calibration_rows(count, size)
    return {name: value[rows] for name, value in arrays.items()}


def _to_int8(
    staging: Path,
    hydra,
    info: ExportInfo,
    int8: Int8Options,
    batch: Sequence[int],
    validate: bool,
) -> ExportInfo:
    """Quantize the staged, validated FP32 ``model.onnx`` in place, validate it against the FP32
    file on the calibration data (static) or the example inputs (dynamic), and return the record
    of the INT8 export."""
    model_path = staging / MODEL_FILE
    dtypes = {tensor.name: tensor.dtype for tensor in info.input_tensors}
    calibration = _calibration_inputs(int8.calib, staging, dtypes, int8.calib_size)
    fp32_path = staging / f".{MODEL_FILE}.fp32"
    os.replace(model_path, fp32_path)
    started = time.perf_counter()
    fp32_runs: list = []  # the FP32 file's outputs while calibrating, for the validation
    record = quantize_export(
        fp32_path,
        model_path,
        method=int8.method,
        calibration=calibration,
        calibrate_method=int8.calib_method or "minmax",
        fp32_runs=fp32_runs,
    )
    done = Int8Record.from_dict(record, "the quantizer's record")
    logger.info(
        "int8 (%s): quantized %s in %.1f s; kept in float: %s",
        int8.method,
        ", ".join(f"{n} {op}" for op, n in done.quantized_ops.items()),
        time.perf_counter() - started,
        ", ".join(f"{v['nodes']} {op}" for op, v in done.kept_float.items()),
    )
    validation = info.validation
    if validate:
        validation = _int8_validation(
            hydra, model_path, fp32_path, calibration, batch, validation, fp32_runs
        )
    fp32_path.unlink()
    model = _stamp(model_path, hydra, "int8")
    return info.replace(
        inputs=[tensor_info(v) for v in model.graph.input],
        outputs=[tensor_info(v) for v in model.graph.output],
        onnx_sha256=file_sha256(model_path),
        validation=validation,
        precision="int8",
        int8=record,  # as the quantizer wrote it (Int8Record checks it)
    )


def _int8_validation(
    hydra,
    model_path: Path,
    fp32_path: Path,
    calibration: Mapping[str, np.ndarray] | None,
    batch: Sequence[int],
    validation: Mapping[str, Any] | None,
    fp32_runs: Sequence[tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]]] = (),
) -> dict[str, Any]:
    """The FP32 graph's validation, with the INT8 file's drift from it (on the calibration
    data, else the model's example inputs). ``fp32_runs``: (batch, the FP32 file's outputs) from
    the calibration, whose batches are then the ones checked (the FP32 file is not run again)."""
    fp32_outputs = None
    if fp32_runs:
        feeds = [dict(inputs) for inputs, _ in fp32_runs]
        fp32_outputs = [outputs for _, outputs in fp32_runs]
        inputs = "the calibration data"
    elif calibration is not None:
        feeds = feed_batches(calibration, batch[2])
        inputs = "the calibration data"
    else:
        feeds = _example_feeds(hydra, batch)
        inputs = "the model's example inputs (random)"
    drift = validate_int8(model_path, fp32_path, feeds, inputs=inputs, fp32_outputs=fp32_outputs)
    return {
        **(validation or {}),
        "precision": "int8",
        "checked": "onnxruntime (the fp32 graph, before quantization)",
        "drift_measured_in": "onnxruntime (int8 file)",
        "drift": drift,
        "drift_within_tolerance": True,
    }


def _example_feeds(hydra, batch: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """The model's seeded example inputs at the validation batches (and lengths, for text)."""
    cases = [hydra.example_inputs(b, b) for b in validation_batches(batch)]
    middle = validation_batches(batch)[len(validation_batches(batch)) // 2]
    cases += [hydra.example_inputs(middle, middle, seq_len=n) for n in _sequence_lengths(hydra)]
    feeds = []
    for made in cases:
        made = made if isinstance(made, tuple) else (made,)
        feeds.append({n: t.numpy() for n, t in zip(hydra.input_names, made, strict=True)})
    return feeds


def _copy_tokenizer(hydra, staging: Path) -> TokenizerEntry | None:
    """Copy a text model's tokenizer files into ``<export>/tokenizer``; its hydra.json entry."""
    source = getattr(hydra, "tokenizer_dir", None)
    if source is None:
        return None
    source = Path(source)
    files = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if TOKENIZER_FILE not in files:
        logger.warning(
            "%s has no %s (a fast tokenizer); the export cannot tokenize "
            "text: give hydra-run token ids in a .npz",
            source,
            TOKENIZER_FILE,
        )
        return None
    (staging / TOKENIZER_DIR).mkdir()
    for name in files:
        shutil.copyfile(source / name, staging / TOKENIZER_DIR / name)
    config = getattr(hydra, "backbone_config", None) or {}
    limit = config.get("max_position_embeddings", 512)
    try:
        settings = json.loads((source / TOKENIZER_CONFIG_FILE).read_text())
        wanted = settings.get("model_max_length")
    except (OSError, ValueError):
        wanted = None
    max_length = min(int(wanted), limit) if isinstance(wanted, (int, float)) else limit
    return TokenizerEntry(
        dir=TOKENIZER_DIR,
        files=tuple(files),
        max_length=max_length,
        vocab_size=config.get("vocab_size"),
    )


def _sequence_lengths(hydra) -> tuple[int, ...]:
    """Text models (a dynamic ``sequence`` axis) are also validated at a short and a long length."""
    axes = getattr(hydra, "dynamic_axes", None) or {}
    if not any("sequence" in a.values() for a in axes.values()):
        return ()
    return VALIDATION_SEQUENCE_LENGTHS


def check_profile(opset: int, batch: Sequence[int]) -> tuple[int, int, int]:
    """Validate the opset and the (min, opt, max) batch profile; returns the profile as ints."""
    if not MIN_OPSET <= int(opset) <= MAX_OPSET:
        raise ExportError(
            f"opset {opset} is not supported; use {MIN_OPSET}..{MAX_OPSET} (17 "
            "parses on TensorRT 8.6 and JetPack 6)"
        )
    batch = tuple(int(b) for b in batch)
    if len(batch) != 3 or not 1 <= batch[0] <= batch[1] <= batch[2]:
        raise ExportError(f"batch must be (min, opt, max) with 1 <= min <= opt <= max, got {batch}")
    return batch


def _check_arguments(hydra, out: Path, opset: int, batch: Sequence[int], overwrite: bool):
    if not isinstance(hydra, HydraModel):
        raise ExportError(
            f"export_onnx expects a HydraModel (from fuse), got {type(hydra).__name__}"
        )
    batch = check_profile(opset, batch)
    if out.exists() and not overwrite:
        raise ExportError(
            f"{str(out)!r} exists; "
            + spelled("pass overwrite=True", "pass --overwrite")
            + " to replace it"
        )
    if out.exists() and not out.is_dir():
        raise ExportError(f"{str(out)!r} is a file, not an export folder")
    return batch


def _set_metadata(model, spec_json: str, version: str, precision: str = "fp32") -> None:
    entries = {SPEC_KEY: spec_json, "hydra_deploy_version": version, "hydra_precision": precision}
    for key, value in entries.items():
        existing = [p for p in model.metadata_props if p.key == key]
        prop = existing[0] if existing else model.metadata_props.add()
        prop.key, prop.value = key, value
    model.producer_name = "hydra-deploy"


def tensor_info(value) -> TensorInfo:
    """hydra.json's entry of a graph input or output: name, shape (dim names or sizes), dtype."""
    dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name
    return TensorInfo(value.name, tuple(dims), dtype)


def _model_entries(hydra, class_names: Sequence[str] | None) -> dict[str, Any]:
    """The record's entries that describe the fused model (not its graph)."""
    preprocessing = getattr(hydra, "preprocessing", None)
    return {
        "family": hydra.family,
        "backbone": hydra.spec.backbone,
        "spec": hydra.spec.to_dict(),
        "merge": MergeRecord.from_dict(hydra.merge, "the fused model's merge report"),
        "macs_per_example": hydra.macs,
        "parameters": hydra.num_parameters(),
        "preprocessing": None
        if preprocessing is None
        else Preprocessing.from_dict(preprocessing, "the model's preprocessing"),
        "backbone_kwargs": getattr(hydra, "backbone_kwargs", None),
        "backbone_config": getattr(hydra, "backbone_config", None),
        "class_names": list(class_names) if class_names is not None else None,
    }


def _move_into_place(staging: Path, out: Path, overwrite: bool) -> None:
    if out.exists():
        if not overwrite:  # appeared while exporting
            raise ExportError(
                f"{str(out)!r} appeared during the export; "
                + spelled("pass overwrite=True", "pass --overwrite")
            )
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(staging, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, out)
