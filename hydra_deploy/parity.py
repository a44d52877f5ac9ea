"""Parity: how far a backend or a precision may move a model's outputs, and the comparison itself.

The one home of the tolerances (``PRECISION_TOLERANCES``, ``TOLERANCES``) and of the output
comparison (:func:`compare_outputs`), read by export validation
(:mod:`hydra_deploy.export.validate`) and by backend parity
(:func:`hydra_deploy.evaluation.compare.compare_export`). numpy only (edge-safe).

A backend's outputs are compared with reference member logits per member (member-logit max abs
difference, argmax agreement) and per uncertainty score (probs, msp, entropies, mutual
information, disagreement, prediction, each from :func:`~hydra_deploy.uncertainty.ensemble_scores`;
and the graph's own score outputs when it has them), against a tolerance that fits the backend's
precision (``TOLERANCES``):

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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from hydra_deploy.errors import HydraError
from hydra_deploy.uncertainty.scores import GRAPH_SCORES

#: How far each precision may move member outputs and scores from FP32 (one table for all
#: checks): probs/msp and entropies/MI as max absolute differences, the fraction of examples whose
#: argmax must agree, and the member-logit bound (relative to the logits below fp32).
PRECISION_TOLERANCES: dict[str, dict[str, float]] = {
    "fp32": {"logits": 1e-4, "probs": 1e-5, "entropy": 1e-4, "argmax": 1.0},
    "fp16": {"logits": 5e-2, "probs": 2e-2, "entropy": 5e-2, "argmax": 0.99},
    "bf16": {"logits": 1e-1, "probs": 5e-2, "entropy": 1e-1, "argmax": 0.98},
}

UQ_GRAPH_OUTPUTS = GRAPH_SCORES


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
        members.append(
            Check(
                "argmax",
                agree,
                tolerance.argmax,
                agree >= tolerance.argmax,
                member=m,
                kind="agreement",
            )
        )
    expected = ensemble_scores(ref)
    actual = ensemble_scores(got, allow_nonfinite=True)
    bounds = {
        "probs": tolerance.probs,
        "msp": tolerance.probs,
        "predictive_entropy": tolerance.entropy,
        "expected_entropy": tolerance.entropy,
        "mutual_information": tolerance.entropy,
    }
    scores = []
    for name, bound in bounds.items():
        diff = _max_abs(expected[name].astype(np.float64) - actual[name])
        scores.append(Check(name, diff, bound, diff <= bound))
    agree = float(np.mean(expected["prediction"] == actual["prediction"]))
    scores.append(
        Check("prediction", agree, tolerance.argmax, agree >= tolerance.argmax, kind="agreement")
    )
    flips = float(
        np.mean(np.abs(expected["disagreement"] - actual["disagreement"].astype(np.float64)))
    )
    flips = flips if math.isfinite(flips) else math.inf
    scores.append(
        Check(
            "disagreement",
            flips,
            1.0 - tolerance.argmax,
            flips <= 1.0 - tolerance.argmax + 1e-9,
            kind="mean_abs_diff",
        )
    )
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
