"""Parity of an export across backends: PyTorch (reference), ONNX Runtime and a TensorRT engine.

``compare_export(export_dir, engine=None)`` rebuilds the fused model from the export folder in
PyTorch (float32, the reference), runs the same inputs through ONNX Runtime and, when given, a
TensorRT engine, and reports each backend against the tolerance of its precision
(:mod:`hydra_deploy.parity`: the table, the per-member and per-score checks).

ONNX Runtime's CPU kernels do not run BF16 MatMul: for BF16 exports that backend is skipped with
the reason. torch is imported only inside :func:`compare_export`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.arrays import read_array_file
from hydra_deploy.engines.inputs import pick_inputs
from hydra_deploy.errors import HydraError, RunnerError
from hydra_deploy.parity import (
    BackendReport,
    CompareReport,
    Tolerance,
    compare_outputs,
    tolerance_for,
)


def _load_inputs(
    inputs: Any, info: dict[str, Any], hydra: Any, batch: int, seed: int
) -> tuple[dict[str, np.ndarray], str]:
    """The inputs by name: given (array, .npy, .npz), or the model's own seeded example inputs
    (random pixels; random token ids with padded rows for text models)."""
    names = [spec["name"] for spec in info["inputs"]]
    if inputs is None:
        example = hydra.example_inputs(batch, seed)
        example = (example,) if not isinstance(example, (tuple, list)) else example
        arrays = {name: t.numpy() for name, t in zip(names, example, strict=True)}
        return arrays, f"the model's example inputs, seed {seed}"
    if isinstance(inputs, np.ndarray):
        if len(names) > 1:
            raise HydraError(f"the model takes {names}: pass a .npz holding each of them")
        return {names[0]: inputs.astype(np.float32, copy=False)}, "array"
    path = Path(inputs)
    if not path.exists():
        raise HydraError(f"the inputs file {str(path)!r} does not exist; check the path")
    if path.suffix.lower() != ".npz" and len(names) > 1:
        raise HydraError(f"the model takes {names}: pass a .npz holding each of them")
    loaded = read_array_file(
        path,
        what="the inputs",
        hint="give a complete .npy (np.save) or .npz (np.savez) of preprocessed arrays",
    )
    if isinstance(loaded, dict):
        picked = pick_inputs(loaded, names, str(path))
        if isinstance(picked, dict):  # a text model: int64 ids, zeros where token types are absent
            first = picked[names[0]]
            arrays = {
                n: picked[n].astype(np.int64) if n in picked else np.zeros_like(first, np.int64)
                for n in names
            }
            return arrays, str(path)
        array = picked
    else:
        array = loaded
    if array.dtype.kind != "f":
        raise HydraError(
            f"the inputs {path} are {array.dtype}, not floats"
            + (" (raw pixels?)" if array.dtype == np.uint8 else "")
            + "; give preprocessed float inputs, as hydra-run feeds the model"
        )
    if array.ndim == len(info["inputs"][0]["shape"]) - 1:
        array = array[None]
    return {names[0]: np.asarray(array, dtype=np.float32)}, str(path)


def compare_export(
    export_dir: str | os.PathLike,
    *,
    engine: str | os.PathLike | None = None,
    inputs: str | os.PathLike | np.ndarray | None = None,
    batch: int = 8,
    seed: int = 0,
    providers: Any = None,
    tolerance: Tolerance | None = None,
) -> CompareReport:
    """Compare ONNX Runtime (and ``engine``, a TensorRT engine file) with PyTorch on one batch.

    ``inputs``: a .npy/.npz file or an array of preprocessed inputs; default ``batch`` random
    normal examples (``seed``). ``tolerance`` overrides the per-precision table for every backend.
    Returns a :class:`CompareReport`; it does not raise on a mismatch (check ``report.passed``).
    A requested engine that cannot be loaded (TensorRT missing) raises RunnerError.
    """
    import torch

    from hydra_deploy.engines.runner import load_runner
    from hydra_deploy.export import load_export
    from hydra_deploy.export_folder import MODEL_FILE, read_info

    folder = Path(export_dir)
    if not folder.exists():
        raise HydraError(
            f"{str(folder)!r} does not exist; give the folder hydra-export wrote (--out DIR)"
        )
    if not folder.is_dir():
        raise HydraError(
            f"{str(folder)!r} is not an export folder; give the folder hydra-export wrote "
            "(--out DIR)"
        )
    export = read_info(folder)
    info = dict(export.record)
    if not export.onnx_path.is_file():
        raise HydraError(
            f"{str(folder)!r} is not an export folder: {MODEL_FILE} is missing; give the folder "
            "hydra-export wrote (--out DIR)"
        )
    if batch < 1:
        raise HydraError(f"batch must be at least 1, got {batch}")
    precision = export.precision
    hydra = load_export(folder, check=False).float().eval()
    x, source = _load_inputs(inputs, info, hydra, batch, seed)
    if len(next(iter(x.values()))) == 0:
        raise HydraError("the inputs are an empty batch; give at least one example")
    bad = [n for n, a in x.items() if a.dtype.kind == "f" and not np.isfinite(a).all()]
    if bad:
        raise HydraError(
            f"the inputs ({source}) hold NaN or infinite values in {bad[0]!r}; fix the data"
        )
    with torch.no_grad():
        tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in x.values()]
        reference = hydra(*tensors).numpy()
    if not np.isfinite(reference).all():
        raise HydraError("the PyTorch reference returns NaN/inf for these inputs; check the inputs")

    reports = []
    ort_report = BackendReport("onnxruntime", str(folder / "model.onnx"), precision, "skipped")
    if precision == "bf16":
        ort_report.reason = (
            "ONNX Runtime's CPU kernels do not implement BF16 MatMul/Softmax "
            "(NOT_IMPLEMENTED); build a TensorRT engine and pass --engine"
        )
    else:
        try:
            runner = load_runner(folder, providers=providers)
        except RunnerError as err:
            if "NOT_IMPLEMENTED" not in str(err):
                raise
            ort_report.reason = str(err)
        else:
            with runner:
                outputs = runner(x)
            _fill(ort_report, reference, outputs, tolerance or tolerance_for(precision))
    reports.append(ort_report)

    if engine is not None:
        with load_runner(engine, backend="tensorrt") as runner:
            engine_precision = runner.precision or precision
            trt_report = BackendReport("tensorrt", str(engine), engine_precision, "skipped")
            _fill(trt_report, reference, runner(x), tolerance or tolerance_for(engine_precision))
        reports.append(trt_report)
    count = len(next(iter(x.values())))
    return CompareReport(str(folder), precision, "pytorch fp32", count, source, reports)


def _fill(
    report: BackendReport,
    reference: np.ndarray,
    outputs: dict[str, np.ndarray],
    tolerance: Tolerance,
) -> None:
    report.status, report.tolerance = "compared", tolerance
    report.members, report.scores = compare_outputs(reference, outputs, tolerance)
