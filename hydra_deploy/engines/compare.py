"""Parity of an export across backends: PyTorch (reference), ONNX Runtime and a TensorRT engine.

``compare_export(export_dir, engine=None)`` rebuilds the fused model from the export folder in
PyTorch (float32, the reference), runs the same inputs through ONNX Runtime and, when given, a
TensorRT engine, and reports per member (member-logit max abs difference, argmax agreement) and per
uncertainty score (probs, msp, entropies, mutual information, disagreement, prediction, each from
:func:`~hydra_deploy.uncertainty.ensemble_scores`; and the graph's own score outputs when it has
them) the difference against a tolerance that fits the backend's precision (``TOLERANCES``, the
table in ARCHITECTURE.md):

============  ==========================  =========  ============  ===============
precision     member logits (max abs)     probs      entropy, MI   argmax agreement
============  ==========================  =========  ============  ===============
fp32          1e-4                        1e-5       1e-4          100%
fp16          0.05 x max(1, max |logit|)  2e-2       5e-2          >= 99%
bf16 / best   0.10 x max(1, max |logit|)  5e-2       1e-1          >= 98%
============  ==========================  =========  ============  ===============

The table leaves FP16/BF16 logits "reported"; the bound chosen here scales with each member's
largest reference logit (5% / 10% of it, at least 0.05 / 0.1 absolute): loose enough for the
rounding of 11- and 8-bit mantissas accumulated over a ViT's layers, tight enough to catch the
silently wrong fused-attention kernels of some TensorRT releases (their errors are O(logits)).
Disagreement (steps of 1/M) is checked as its mean absolute difference, at most the argmax
tolerance (0 for fp32, 0.01 for fp16, 0.02 for bf16). An engine of precision ``best`` gets the
loosest (bf16) row.

ONNX Runtime's CPU kernels do not run BF16 MatMul: for BF16 exports that backend is skipped with
the reason. torch is imported only inside :func:`compare_export`.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.arrays import read_array_file
from hydra_deploy.errors import HydraError, RunnerError
from hydra_deploy.uncertainty.tolerances import PRECISION_TOLERANCES

UQ_GRAPH_OUTPUTS = ("probs", "predictive_entropy", "expected_entropy", "mutual_information", "msp")


@dataclass(frozen=True)
class Tolerance:
    """Bounds a backend must meet against the PyTorch float32 reference."""

    precision: str
    logits: float  # max abs member-logit difference (times max(1, max |logit|) when relative)
    logits_relative: bool
    probs: float  # probs and msp, max abs
    entropy: float  # predictive / expected entropy and mutual information, max abs
    argmax: float  # minimum fraction of examples whose argmax agrees

    def logit_bound(self, reference: np.ndarray) -> float:
        if not self.logits_relative:
            return self.logits
        return self.logits * max(1.0, float(np.abs(reference).max()))


TOLERANCES = {
    name: Tolerance(
        name, row["logits"], name != "fp32", row["probs"], row["entropy"], row["argmax"]
    )
    for name, row in PRECISION_TOLERANCES.items()
}
TOLERANCES["best"] = TOLERANCES["bf16"]  # TensorRT may pick any precision it has


def tolerance_for(precision: str | None) -> Tolerance:
    """The tolerance row of a precision (fp32 when unknown)."""
    key = (precision or "fp32").lower()
    if key not in TOLERANCES:
        raise HydraError(f"no tolerances for precision {precision!r}; known: {sorted(TOLERANCES)}")
    return TOLERANCES[key]


@dataclass
class Check:
    """One compared quantity: its difference, the bound it must meet, and whether it did."""

    name: str
    value: float
    bound: float
    passed: bool
    member: int | None = None
    kind: str = "max_abs_diff"  # or "agreement" (value must be >= bound), "mean_abs_diff"


@dataclass
class BackendReport:
    """How one backend compares with the reference (or why it was skipped)."""

    backend: str
    path: str
    precision: str | None
    status: str  # "compared" | "skipped"
    reason: str | None = None
    tolerance: Tolerance | None = None
    members: list[Check] = field(default_factory=list)
    scores: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == "skipped" or all(c.passed for c in self.members + self.scores)

    def failures(self) -> list[str]:
        lines = []
        for check in self.members + self.scores:
            if check.passed:
                continue
            where = f"member {check.member} " if check.member is not None else ""
            relation = ">=" if check.kind == "agreement" else "<="
            lines.append(
                f"{self.backend}: {where}{check.name} {check.kind} {_fmt(check.value)} "
                f"(needs {relation} {_fmt(check.bound)}, {self.tolerance.precision} tolerance)"
            )
        return lines


@dataclass
class CompareReport:
    """The whole comparison; ``passed`` is False when any compared backend misses a tolerance."""

    export_dir: str
    precision: str
    reference: str
    batch: int
    inputs: str
    backends: list[BackendReport]

    @property
    def passed(self) -> bool:
        return all(b.passed for b in self.backends)

    def failures(self) -> list[str]:
        return [line for b in self.backends for line in b.failures()]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite differences become the strings 'nan' / 'inf')."""
        data = asdict(self)
        for backend, report in zip(data["backends"], self.backends, strict=True):
            backend["passed"] = report.passed
        data["passed"] = self.passed
        data["failures"] = self.failures()
        return _finite_json(data)


def _fmt(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else str(value)


def _finite_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def compare_outputs(
    reference_logits: np.ndarray, outputs: dict[str, np.ndarray], tolerance: Tolerance
) -> tuple[list[Check], list[Check]]:
    """Per-member and per-score checks of a backend's outputs against reference member logits."""
    from hydra_deploy.uncertainty import ensemble_scores

    ref = np.asarray(reference_logits, dtype=np.float64)
    got = np.asarray(outputs["member_logits"], dtype=np.float64)
    if got.shape != ref.shape:
        raise HydraError(
            f"member_logits has shape {got.shape}, the reference {ref.shape}: the engine and the "
            "export describe different models; rebuild the engine from this export"
        )
    members = []
    for m in range(ref.shape[1]):
        diff = _max_abs(ref[:, m] - got[:, m])
        bound = tolerance.logit_bound(ref[:, m])
        members.append(Check("member_logits", diff, bound, diff <= bound, member=m))
        agree = float(np.mean(ref[:, m].argmax(-1) == got[:, m].argmax(-1)))
        members.append(Check("argmax", agree, tolerance.argmax, agree >= tolerance.argmax,
                             member=m, kind="agreement"))  # fmt: skip
    expected = ensemble_scores(ref)
    actual = ensemble_scores(got, allow_nonfinite=True)
    bounds = {"probs": tolerance.probs, "msp": tolerance.probs,
              "predictive_entropy": tolerance.entropy, "expected_entropy": tolerance.entropy,
              "mutual_information": tolerance.entropy}  # fmt: skip
    scores = []
    for name, bound in bounds.items():
        diff = _max_abs(expected[name].astype(np.float64) - actual[name])
        scores.append(Check(name, diff, bound, diff <= bound))
    agree = float(np.mean(expected["prediction"] == actual["prediction"]))
    scores.append(Check("prediction", agree, tolerance.argmax, agree >= tolerance.argmax,
                        kind="agreement"))  # fmt: skip
    flips = float(np.mean(np.abs(expected["disagreement"] - actual["disagreement"].astype(np.float64))))  # fmt: skip
    flips = flips if math.isfinite(flips) else math.inf
    scores.append(Check("disagreement", flips, 1.0 - tolerance.argmax,
                        flips <= 1.0 - tolerance.argmax + 1e-9, kind="mean_abs_diff"))  # fmt: skip
    for name in UQ_GRAPH_OUTPUTS:  # the ensemble head inside the graph, when exported with it
        if name in outputs:
            diff = _max_abs(expected[name].astype(np.float64) - outputs[name])
            scores.append(Check(f"graph:{name}", diff, bounds[name], diff <= bounds[name]))
    return members, scores


def _max_abs(delta: np.ndarray) -> float:
    delta = np.asarray(delta, dtype=np.float64)
    if not np.isfinite(delta).all():
        return math.inf
    return float(np.abs(delta).max())


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
        path, what="the inputs",
        hint="give a complete .npy (np.save) or .npz (np.savez) of preprocessed arrays",
    )  # fmt: skip
    if isinstance(loaded, dict):
        if len(names) > 1:
            missing = [n for n in names if n not in loaded and n != "token_type_ids"]
            if missing:
                raise HydraError(f"{path} holds {list(loaded)}; it needs {names}")
            arrays = {n: loaded[n].astype(np.int64) if n in loaded else
                      np.zeros_like(loaded[names[0]], dtype=np.int64) for n in names}  # fmt: skip
            return arrays, str(path)
        key = names[0] if names[0] in loaded else "x"
        if key not in loaded:
            raise HydraError(f"{path} holds {list(loaded)}; name the array 'x' or {names[0]!r}")
        array = loaded[key]
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

    from hydra_deploy.engines.runner import _read_json, load_runner
    from hydra_deploy.export import load_export

    folder = Path(export_dir)
    if not folder.exists():
        raise HydraError(
            f"{str(folder)!r} does not exist; give the folder hydra-export wrote (--out DIR)"
        )
    info = _read_json(folder / "hydra.json")
    if info is None or not (folder / "model.onnx").is_file():
        raise HydraError(
            f"{str(folder)!r} is not an export folder (hydra.json and model.onnx); give the "
            "folder hydra-export wrote (--out DIR)"
        )
    if batch < 1:
        raise HydraError(f"batch must be at least 1, got {batch}")
    precision = str(info.get("precision") or "fp32")
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
        ort_report.reason = ("ONNX Runtime's CPU kernels do not implement BF16 MatMul/Softmax "
                             "(NOT_IMPLEMENTED); build a TensorRT engine and pass --engine")  # fmt: skip
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


def _fill(report: BackendReport, reference: np.ndarray, outputs: dict[str, np.ndarray],
          tolerance: Tolerance) -> None:  # fmt: skip
    report.status, report.tolerance = "compared", tolerance
    report.members, report.scores = compare_outputs(reference, outputs, tolerance)
