"""Check an exported file against PyTorch in ONNX Runtime, at several batch sizes.

FP32 files are compared with the model itself. A FP16/BF16 file is checked in two ways:

- *the file computes what it should*: its exact float32 widening (same graph and casts, its own
  rounded weights and constants, :func:`hydra_deploy.export.precision.upcast_model`) runs in ONNX
  Runtime against the model computing in float32 with the same rounded weights
  (:func:`~hydra_deploy.export.precision.reference_model` with ``compute="fp32"``), to a tight
  tolerance; a wrong cast, a weight converted twice or a lost node fails here;
- *what the precision costs* (``drift_vs_fp32`` per batch, and one verdict over all of them in
  ``drift``): the file itself in ONNX Runtime (FP16) or, where ORT's CPU kernels cannot run it
  (BF16 MatMul/Expand/Softmax: NOT_IMPLEMENTED), PyTorch computing in BF16 under the same policy,
  against the FP32 model, judged by :mod:`hydra_deploy.parity`'s rule (the one ``hydra-compare``
  uses: argmax agreement on the examples without a near-tie), recorded with its verdict
  (``drift.verdict``; the exporter says it once, a warning beyond the tolerances: the export is
  what was asked for, the drift is the model's).

An INT8 file (:mod:`hydra_deploy.export.int8`) computes approximately by design, so it has no
exact twin: :func:`validate_int8` runs it and the FP32 file it was quantized from in ONNX Runtime
on the same inputs (the calibration data of a static file, the model's example inputs of a dynamic
one) and refuses what falls outside parity's INT8 tolerances.

(PyTorch's FP16 kernels on a CPU are ~10x slower than FP32 ones, so FP16 is never the reference.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hydra_deploy.errors import ExportError
from hydra_deploy.export.precision import (
    check_precision,
    compute_types,
    reference_model,
    upcast_model,
)
from hydra_deploy.optional import lazy_module
from hydra_deploy.parity import (
    PRECISION_TOLERANCES,
    BackendReport,
    compare_outputs,
    tolerance_for,
)
from hydra_deploy.threads import ort_threads

onnx = lazy_module("onnx", purpose="validating exported models", error=ExportError)
ort = lazy_module("onnxruntime", purpose="validating exported models", error=ExportError)

logger = logging.getLogger("hydra_deploy")

DEFAULT_ATOL = {
    "member_logits": 1e-4,
    "probs": 1e-5,
    "msp": 1e-5,
    "predictive_entropy": 1e-4,
    "expected_entropy": 1e-4,
    "mutual_information": 1e-4,
}

# the float32 widening of a low-precision file vs float32 compute with the same rounded weights:
# (absolute, relative to the reference's largest magnitude); they differ by the few constants the
# file rounds besides weights (GELU's sqrt 2, the attention scale)
WIDENED_TOLERANCE = {
    "member_logits": (1e-3, 1e-3),
    "probs": (1e-4, 0),
    "msp": (1e-4, 0),
    "predictive_entropy": (5e-4, 0),
    "expected_entropy": (5e-4, 0),
    "mutual_information": (5e-4, 0),
}

# how far a precision may move the scores from FP32, as benchmarks/precision_drift.py reads it
# (hydra_deploy.parity's table; the export's verdict is parity's compare_outputs)
DRIFT_TOLERANCE = {
    precision: {
        "probs": row["probs"],
        "msp": row["probs"],
        "predictive_entropy": row["entropy"],
        "expected_entropy": row["entropy"],
        "mutual_information": row["entropy"],
        "argmax_agreement": row["argmax"],
    }
    for precision, row in PRECISION_TOLERANCES.items()
    if precision != "fp32"
}


def validation_batches(batch: Sequence[int]) -> list[int]:
    """The profile's minimum, the smallest odd size between, and its maximum (ascending, unique).

    An odd size catches graphs that specialised on the traced (even) batch; the smallest keeps
    the check cheap on a CPU.
    """
    low, _, high = batch
    middle = low + 1 if (low + 1) % 2 else low + 2
    return sorted({low, high} | ({middle} if middle < high else set()))


def _session(model_or_path):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if ort_threads():  # the command's --threads
        options.intra_op_num_threads = ort_threads()
    source = (
        model_or_path
        if isinstance(model_or_path, (str, Path))
        else model_or_path.SerializeToString()
    )
    return ort.InferenceSession(
        str(source) if isinstance(source, Path) else source,
        options,
        providers=["CPUExecutionProvider"],
    )


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def _low_precision_plan(path: Path, model: torch.nn.Module, precision: str):
    """(widened session, its reference, drift session or None, drift reference or None)."""

    proto = onnx.load(str(path))
    fp32_ops = [
        op for op, types in compute_types(proto).items() if op == "Conv" and "float" in types
    ]
    widened = _session(upcast_model(proto))
    reference = reference_model(model, precision, compute="fp32", fp32_ops=fp32_ops)
    try:
        return widened, reference, _session(path), None
    except Exception as err:  # onnxruntime raises its own NotImplemented/Fail types
        if "NOT_IMPLEMENTED" not in str(err):
            raise ExportError(f"ONNX Runtime cannot load the {precision} file: {err}") from err
        logger.debug(
            "ONNX Runtime has no CPU kernel for a %s op (%s); its drift is measured in PyTorch",
            precision,
            str(err).split(":")[-1].strip(),
        )
    return widened, reference, None, reference_model(model, precision, fp32_ops=fp32_ops)


def validate_onnx(
    path: str | Path,
    model: torch.nn.Module,
    example_inputs: Any,
    batches: Sequence[int],
    *,
    atol: dict[str, float] | None = None,
    precision: str = "fp32",
    seed: int = 0,
    sequence_lengths: Sequence[int] = (),
) -> dict[str, Any]:
    """Run ``path`` in ONNX Runtime (CPU) and ``model`` in PyTorch at each batch size; compare.

    ``example_inputs(batch, seed)`` makes the inputs; ``sequence_lengths`` (text models) adds one
    case per length at the middle batch size, made by ``example_inputs(batch, seed, seq_len=n)``
    and reported under ``"<batch>x<n>"``. ``precision`` is the file's (``model`` is
    the FP32 module it was exported from). Returns a report (per batch and output: max abs
    difference and its tolerance, argmax agreement; for FP16/BF16 also ``drift_vs_fp32``); raises
    ExportError naming the worst output, its difference and the member where it occurs when a
    difference exceeds its tolerance.
    """
    path = Path(path)
    if precision == "int8":
        raise ExportError(
            "an INT8 file has no exact float twin: check it with validate_int8 (against the FP32 "
            "file it was quantized from) or check_int8_against_model"
        )
    plan = _Plan.of(path, model, check_precision(precision))
    report: dict[str, Any] = {
        "runtime": f"onnxruntime {ort.__version__} CPU",
        "precision": precision,
        "checked": plan.checked,
        "batches": {},
    }
    if precision != "fp32":
        report["drift_measured_in"] = (
            f"onnxruntime ({precision} file)" if plan.drift_session else f"PyTorch in {precision}"
        )
    cases = [(batch, None) for batch in batches]
    cases += [(batches[len(batches) // 2], n) for n in sequence_lengths]
    drifted: list[tuple[dict, dict]] = []  # (low-precision outputs, fp32 outputs) per case
    for batch, length in cases:
        made = (
            example_inputs(batch, seed + batch)
            if length is None
            else example_inputs(batch, seed + batch, seq_len=length)
        )
        entry, drift = plan.compare(_as_tuple(made), batch, atol)
        if drift is not None:
            drifted.append(drift)
        report["batches"][str(batch) if length is None else f"{batch}x{length}"] = entry
    report["passed"] = True
    if precision != "fp32":
        judged = judge_drift(
            [low for low, _ in drifted],
            [fp32 for _, fp32 in drifted],
            precision,
            where=report["drift_measured_in"],
        )
        report["drift"] = {"examples": _rows(drifted), **judged.summary()}
        report["drift_within_tolerance"] = judged.passed
    return report


@dataclass
class _Plan:
    """What :func:`validate_onnx` runs: the file's session and the PyTorch module it must equal
    (for FP16/BF16 the widened file and the reference under the same policy), and where the
    precision's drift from FP32 is measured (the file itself, else PyTorch in that precision)."""

    model: torch.nn.Module  # the FP32 module
    precision: str
    session: Any
    reference: torch.nn.Module
    drift_session: Any = None
    drift_model: torch.nn.Module | None = None

    @classmethod
    def of(cls, path: Path, model: torch.nn.Module, precision: str) -> _Plan:
        if precision == "fp32":
            return cls(model, precision, _session(path), model)
        return cls(model, precision, *_low_precision_plan(path, model, precision))

    @property
    def checked(self) -> str:
        return "onnxruntime" if self.precision == "fp32" else "float32 widening in onnxruntime"

    def compare(
        self, x: tuple[torch.Tensor, ...], batch: int, atol: dict[str, float] | None
    ) -> tuple[dict[str, Any], tuple[dict, dict] | None]:
        """One case: each output against the reference, and (FP16/BF16) the low-precision and
        FP32 outputs whose drift is judged over every case."""
        input_names = [i.name for i in self.session.get_inputs()]
        output_names = [o.name for o in self.session.get_outputs()]
        feed = {name: t.numpy() for name, t in zip(input_names, x, strict=True)}
        with torch.inference_mode():
            expected = dict(zip(output_names, _as_tuple(self.reference(*x)), strict=True))
        got = dict(zip(output_names, self.session.run(None, feed), strict=True))
        entry = {
            name: _compare(
                name, got[name], expected[name].float().numpy(), batch, self.precision, atol
            )
            for name in output_names
        }
        if self.precision == "fp32":
            return entry, None
        with torch.inference_mode():
            fp32 = dict(zip(output_names, _as_tuple(self.model(*x)), strict=True))
            if self.drift_session is not None:
                low = dict(zip(output_names, self.drift_session.run(None, feed), strict=True))
            else:
                low = {
                    k: v.numpy()
                    for k, v in zip(output_names, _as_tuple(self.drift_model(*x)), strict=True)
                }
        fp32 = {k: v.float().numpy() for k, v in fp32.items()}
        entry["drift_vs_fp32"] = _drift(low, fp32)
        return entry, (low, fp32)


def _rows(drifted: Sequence[tuple[dict, dict]]) -> int:
    return sum(len(fp32["member_logits"]) for _, fp32 in drifted)


def judge_drift(
    low: Sequence[Mapping[str, np.ndarray]],
    fp32: Sequence[Mapping[str, np.ndarray]],
    precision: str,
    *,
    where: str,
) -> BackendReport:
    """One verdict on a precision's outputs (``low``, one mapping per batch) against the FP32
    model's (``fp32``), by :func:`hydra_deploy.parity.compare_outputs` with the precision's
    tolerances: the rule ``hydra-compare`` applies."""
    reference = np.concatenate([np.asarray(f["member_logits"]) for f in fp32])
    names = set.intersection(*(set(o) for o in low))
    outputs = {name: np.concatenate([np.asarray(o[name]) for o in low]) for name in names}
    tolerance = tolerance_for(precision)
    report = BackendReport(where, where, precision, "compared", tolerance=tolerance)
    report.members, report.scores = compare_outputs(reference, outputs, tolerance)
    return report


def _tolerance(name: str, reference: np.ndarray, precision: str, atol: dict | None) -> float:
    if atol and name in atol:
        return float(atol[name])
    if precision == "fp32":
        return DEFAULT_ATOL.get(name, 1e-4)
    absolute, relative = WIDENED_TOLERANCE.get(name, (1e-3, 1e-3))
    scale = float(np.abs(reference).max()) if reference.size else 0.0
    return absolute + relative * scale


def _compare(name, got, reference, batch, precision, atol) -> dict[str, Any]:
    if got.shape != reference.shape:
        raise ExportError(
            f"output {name} has shape {list(got.shape)} in ONNX Runtime but "
            f"{list(reference.shape)} in PyTorch at batch {batch}"
        )
    diff = np.abs(got.astype(np.float64) - reference)
    worst = float(diff.max()) if diff.size else 0.0
    entry: dict[str, Any] = {
        "max_abs_diff": worst,
        "atol": _tolerance(name, reference, precision, atol),
    }
    if name == "member_logits":
        entry["argmax_agreement"] = float((got.argmax(-1) == reference.argmax(-1)).mean())
    if worst > entry["atol"]:
        where = np.unravel_index(int(diff.argmax()), diff.shape)
        member = f", member {where[1]}" if name == "member_logits" else ""
        what = "ONNX Runtime" if precision == "fp32" else f"the {precision} file (widened)"
        against = "PyTorch" if precision == "fp32" else f"PyTorch with {precision} weights"
        raise ExportError(
            f"{what} differs from {against} at batch {batch}: output {name} max abs "
            f"difference {worst:.3g} > {entry['atol']:.2g} (at example {where[0]}{member}); the "
            "export is wrong, try the other exporter"
        )
    return entry


def _drift(low: Mapping[str, np.ndarray], fp32: Mapping[str, np.ndarray]) -> dict[str, float]:
    """One batch's measurements: each output's max abs difference and the raw member argmax
    agreement (the verdict, over every batch, is :func:`judge_drift`'s)."""
    drift: dict[str, float] = {}
    for name, value in low.items():
        reference = np.asarray(fp32[name], dtype=np.float64)
        worst = float(np.abs(value.astype(np.float64) - reference).max()) if value.size else 0.0
        drift[name] = worst
    logits = low.get("member_logits")
    if logits is not None:
        agreement = float((logits.argmax(-1) == fp32["member_logits"].argmax(-1)).mean())
        drift["argmax_agreement"] = agreement
    return drift


# --- INT8 ------------------------------------------------------------------------------------------
def feed_batches(feeds: Mapping[str, np.ndarray], size: int) -> list[dict[str, np.ndarray]]:
    """Named arrays cut into batches of ``size`` rows (the last may be shorter)."""
    count = len(next(iter(feeds.values())))
    return [
        {name: np.ascontiguousarray(a[start : start + size]) for name, a in feeds.items()}
        for start in range(0, count, size)
    ]


def validate_int8(
    int8_path: str | Path,
    fp32_path: str | Path,
    feeds: Sequence[Mapping[str, np.ndarray]],
    *,
    inputs: str,
) -> dict[str, Any]:
    """Run the INT8 file and the FP32 file it was quantized from in ONNX Runtime (CPU) on
    ``feeds`` (batches of named inputs; ``inputs`` says what they are) and judge the INT8 outputs
    by parity's INT8 tolerances. Returns ``{"measured_in", "inputs", "examples", ...summary}``;
    raises ExportError with the failures when a tolerance is missed."""
    fp32_session = _session(Path(fp32_path))
    try:
        int8_session = _session(Path(int8_path))
        names = [o.name for o in int8_session.get_outputs()]
        low = [dict(zip(names, int8_session.run(None, dict(f)), strict=True)) for f in feeds]
    except Exception as err:  # onnxruntime's own error types; the message names the node
        raise ExportError(
            f"ONNX Runtime cannot run the INT8 file ({str(err).strip()[:400]}); export fp32 or "
            "fp16 instead, or with the default loop lowering"
        ) from err
    fp32 = [dict(zip(names, fp32_session.run(None, dict(f)), strict=True)) for f in feeds]
    judged = judge_drift(low, fp32, "int8", where="onnxruntime (int8 file)")
    examples = _rows(list(zip(low, fp32, strict=True)))
    summary = {
        "measured_in": "onnxruntime, the int8 file against the fp32 file it was quantized from",
        "inputs": inputs,
        "examples": examples,
        **judged.summary(),
    }
    if not judged.passed:
        raise ExportError(
            f"the INT8 file moves the outputs beyond the int8 tolerances from FP32 on {inputs} "
            f"({examples} examples): {'; '.join(judged.failures()[:3])}; try another "
            "calibration method or more representative calibration data, or export fp16"
        )
    return summary


def check_int8_against_model(
    path: str | Path, model: torch.nn.Module, example_inputs: Callable[..., Any], batch: int = 16
) -> BackendReport:
    """The INT8 file against the FP32 PyTorch model on ``batch`` example inputs, judged by parity's
    INT8 tolerances (reload's check that an INT8 folder's weights and file belong together)."""
    session = _session(Path(path))
    input_names = [i.name for i in session.get_inputs()]
    output_names = [o.name for o in session.get_outputs()]
    x = _as_tuple(example_inputs(batch, 0))
    feed = {name: t.numpy() for name, t in zip(input_names, x, strict=True)}
    with torch.inference_mode():
        expected = dict(zip(output_names, _as_tuple(model(*x)), strict=True))
    low = dict(zip(output_names, session.run(None, feed), strict=True))
    fp32 = {k: v.float().numpy() for k, v in expected.items()}
    return judge_drift([low], [fp32], "int8", where="onnxruntime (int8 file)")
