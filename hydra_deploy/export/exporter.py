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

from hydra_deploy.atomic import staging_dir
from hydra_deploy.errors import ExportError, spelled
from hydra_deploy.export.heads import UQ_OUTPUTS, WithEnsembleHead
from hydra_deploy.export.int8 import calibration_rows, quantize_export
from hydra_deploy.export.precision import check_precision, compute_types
from hydra_deploy.export.surgery import DEFAULT_PASSES, run_passes
from hydra_deploy.export.torch_onnx import export_module
from hydra_deploy.export.validate import validate_int8, validate_onnx, validation_batches
from hydra_deploy.export_folder import (
    FORMAT,
    GRAPH_PRECISIONS,
    MODEL_FILE,
    WEIGHTS_FILE,
    file_sha256,
    write_info,
)
from hydra_deploy.options import Int8Options

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
) -> dict[str, Any]:
    """Export ``hydra`` to ``out_dir`` and return the contents of its ``hydra.json``.

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
    import onnx
    from safetensors.torch import save_file

    from hydra_deploy import __version__

    out = Path(out_dir)
    batch = _check_arguments(hydra, out, opset, batch, overwrite)
    int8 = _check_int8(precision, int8)
    graph_precision = "fp32" if precision == "int8" else check_precision(precision)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(out.parent, out.name)
    try:
        started = time.perf_counter()
        model_path = staging / MODEL_FILE
        example = hydra.example_inputs(max(2, batch[1]))
        graph_module = WithEnsembleHead(hydra) if uq_outputs else hydra
        output_names = ["member_logits", *(UQ_OUTPUTS if uq_outputs else ())]
        used = export_module(
            graph_module,
            example,
            model_path,
            input_names=hydra.input_names,
            output_names=output_names,
            opset=opset,
            max_batch=batch[2],
            exporter=exporter,
            dynamic_axes=getattr(hydra, "dynamic_axes", None),
        )
        logger.info("exported with the %s exporter in %.1f s", used, time.perf_counter() - started)

        surgery = run_passes(model_path, passes, precision=graph_precision)
        logger.info(
            "graph passes: %s",
            ", ".join(f"{k} {v}" for k, v in surgery.items() if k != "precision"),
        )
        if graph_precision != "fp32":
            converted = surgery["precision"]
            logger.info(
                "%s graph: %d nodes in %s, %d kept in float32 (LayerNorm, ensemble head%s), "
                "%d casts",
                precision,
                converted["low_precision_nodes"],
                precision,
                converted["fp32_nodes"],
                "".join(f", {op}" for op in converted["fp32_for_lack_of_kernels"]),
                converted["casts"],
            )
        model = onnx.load(str(model_path))
        _set_metadata(model, hydra.spec.to_json(indent=None), __version__, graph_precision)
        onnx.save(model, str(model_path))
        onnx.checker.check_model(str(model_path), full_check=True)
        einsums = [n.name for n in model.graph.node if n.op_type == "Einsum"]
        if einsums:
            logger.warning(
                "the graph holds %d Einsum node(s) (lowering=einsum?); TensorRT and "
                "ONNX Runtime run MatMul faster",
                len(einsums),
            )

        validation = None
        if validate:
            started = time.perf_counter()
            validation = validate_onnx(
                model_path,
                graph_module,
                hydra.example_inputs,
                validation_batches(batch),
                atol=atol,
                precision=graph_precision,
                sequence_lengths=_sequence_lengths(hydra),
            )
            validation["seconds"] = round(time.perf_counter() - started, 2)
            logger.debug(
                "validated in ONNX Runtime at batch %s (max member-logit difference %.2g)",
                ", ".join(validation["batches"]),
                max(b["member_logits"]["max_abs_diff"] for b in validation["batches"].values()),
            )

        save_file(
            {k: v.contiguous() for k, v in hydra.state_dict().items()}, str(staging / WEIGHTS_FILE)
        )
        if class_names is None:  # zero-shot models and BERT classifiers (id2label) know theirs
            class_names = getattr(hydra, "class_names", None)
        info = _export_info(hydra, model, model_path, opset, batch, used, validation, class_names)
        tokenizer = _copy_tokenizer(hydra, staging)
        if tokenizer is not None:
            info["tokenizer"] = tokenizer
        info["precision"] = graph_precision
        info["strongly_typed"] = graph_precision != "fp32"
        info["graph_passes"] = {k: v for k, v in surgery.items() if k != "precision"}
        if graph_precision != "fp32":
            info["precision_report"] = {
                **surgery["precision"],
                "compute_types": compute_types(model),
            }
        info["uq_outputs"] = bool(uq_outputs)
        info["package_version"] = __version__
        if int8 is not None:
            write_info(staging, info)  # the staged FP32 export: what a calibration reader runs
            info = _to_int8(staging, hydra, info, int8, batch, validate, __version__)
        drift = (info["validation"] or {}).get("drift")
        if drift:  # the precision's verdict, said once
            say = logger.info if drift["passed"] else logger.warning
            say("%s vs fp32 on %d examples: %s", precision, drift["examples"], drift["verdict"])
        write_info(staging, info)
        folder_mode = staging.stat().st_mode & 0o777  # the umask's, set by staging_dir
        for path in staging.rglob("*"):  # ordinary file modes (safetensors writes 0600)
            path.chmod(folder_mode if path.is_dir() else folder_mode & 0o666)
        _move_into_place(staging, out, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return info


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
    info: dict[str, Any],
    int8: Int8Options,
    batch: Sequence[int],
    validate: bool,
    version: str,
) -> dict[str, Any]:
    """Quantize the staged, validated FP32 ``model.onnx`` in place, validate it against the FP32
    file on the calibration data (static) or the example inputs (dynamic), and return hydra.json's
    record of the INT8 export."""
    import onnx

    model_path = staging / MODEL_FILE
    dtypes = {entry["name"]: entry["dtype"] for entry in info["inputs"]}
    calibration = _calibration_inputs(int8.calib, staging, dtypes, int8.calib_size)
    fp32_path = staging / f".{MODEL_FILE}.fp32"
    os.replace(model_path, fp32_path)
    started = time.perf_counter()
    record = quantize_export(
        fp32_path,
        model_path,
        method=int8.method,
        calibration=calibration,
        calibrate_method=int8.calib_method or "minmax",
    )
    logger.info(
        "int8 (%s): quantized %s in %.1f s; kept in float: %s",
        int8.method,
        ", ".join(f"{n} {op}" for op, n in record["quantized_ops"].items()),
        time.perf_counter() - started,
        ", ".join(f"{v['nodes']} {op}" for op, v in record["kept_float"].items()),
    )
    validation = info.get("validation")
    if validate:
        if calibration is not None:
            feeds = _chunks(calibration, batch[2])
            inputs = "the calibration data"
        else:
            feeds = _example_feeds(hydra, batch)
            inputs = "the model's example inputs (random)"
        validation = {
            **(validation or {}),
            "precision": "int8",
            "checked": "onnxruntime (the fp32 graph, before quantization)",
            "drift_measured_in": "onnxruntime (int8 file)",
            "drift": validate_int8(model_path, fp32_path, feeds, inputs=inputs),
            "drift_within_tolerance": True,
        }
    fp32_path.unlink()
    model = onnx.load(str(model_path))
    _set_metadata(model, hydra.spec.to_json(indent=None), version, "int8")
    onnx.save(model, str(model_path))
    onnx.checker.check_model(str(model_path), full_check=True)
    return {
        **info,
        "inputs": [tensor_info(v) for v in model.graph.input],
        "outputs": [tensor_info(v) for v in model.graph.output],
        "onnx_sha256": file_sha256(model_path),
        "validation": validation,
        "precision": "int8",
        "strongly_typed": False,
        "int8": record,
    }


def _chunks(arrays: Mapping[str, np.ndarray], size: int) -> list[dict[str, np.ndarray]]:
    count = len(next(iter(arrays.values())))
    return [
        {name: np.ascontiguousarray(a[start : start + size]) for name, a in arrays.items()}
        for start in range(0, count, size)
    ]


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


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
)


def _copy_tokenizer(hydra, staging: Path) -> dict[str, Any] | None:
    """Copy a text model's tokenizer files into ``<export>/tokenizer``; its hydra.json entry."""
    source = getattr(hydra, "tokenizer_dir", None)
    if source is None:
        return None
    source = Path(source)
    files = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if "tokenizer.json" not in files:
        logger.warning(
            "%s has no tokenizer.json (a fast tokenizer); the export cannot tokenize "
            "text: give hydra-run token ids in a .npz",
            source,
        )
        return None
    (staging / "tokenizer").mkdir()
    for name in files:
        shutil.copyfile(source / name, staging / "tokenizer" / name)
    config = getattr(hydra, "backbone_config", None) or {}
    limit = config.get("max_position_embeddings", 512)
    try:
        wanted = json.loads((source / "tokenizer_config.json").read_text()).get("model_max_length")
    except (OSError, ValueError):
        wanted = None
    max_length = min(int(wanted), limit) if isinstance(wanted, (int, float)) else limit
    return {
        "dir": "tokenizer",
        "files": files,
        "max_length": max_length,
        "vocab_size": config.get("vocab_size"),
    }


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
    from hydra_deploy.fusion import HydraModel

    if not isinstance(hydra, HydraModel):
        raise ExportError(
            f"export_onnx expects a HydraModel (from fuse), got {type(hydra).__name__}"
        )
    batch = check_profile(opset, batch)
    if out.exists() and not overwrite:
        raise ExportError(f"{str(out)!r} exists; pass overwrite=True (--overwrite) to replace it")
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


def tensor_info(value) -> dict[str, Any]:
    """hydra.json's entry of a graph input or output: name, shape (dim names or sizes), dtype."""
    import onnx

    dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name
    return {"name": value.name, "shape": dims, "dtype": dtype}


def _export_info(hydra, model, path: Path, opset, batch, exporter, validation, class_names):
    digest = file_sha256(path)
    return {
        "format": FORMAT,
        "family": hydra.family,
        "backbone": hydra.spec.backbone,
        "spec": hydra.spec.to_dict(),
        "merge": hydra.merge,
        "macs_per_example": hydra.macs,
        "parameters": hydra.num_parameters(),
        "inputs": [tensor_info(v) for v in model.graph.input],
        "outputs": [tensor_info(v) for v in model.graph.output],
        "batch_profile": {"min": batch[0], "opt": batch[1], "max": batch[2]},
        "preprocessing": _jsonable(getattr(hydra, "preprocessing", None)),
        "backbone_kwargs": getattr(hydra, "backbone_kwargs", None),
        "backbone_config": getattr(hydra, "backbone_config", None),
        "class_names": list(class_names) if class_names is not None else None,
        "opset": opset,
        "exporter": exporter,
        "onnx_sha256": digest,
        "weights": WEIGHTS_FILE,
        "validation": validation,
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


def _move_into_place(staging: Path, out: Path, overwrite: bool) -> None:
    if out.exists():
        if not overwrite:  # appeared while exporting
            raise ExportError(f"{str(out)!r} appeared during the export; pass overwrite=True")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(staging, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, out)
