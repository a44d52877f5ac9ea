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
int8          0.15 x max(1, max |logit|)  5e-2       1.5e-1        >= 98%
============  ==========================  =========  ============  ===============

The table leaves FP16/BF16 logits "reported"; the bound chosen here scales with each member's
largest reference logit (5% / 10% of it, at least 0.05 / 0.1 absolute): loose enough for the
rounding of 11- and 8-bit mantissas accumulated over a ViT's layers, tight enough to catch the
silently wrong fused-attention kernels of some TensorRT releases (their errors are O(logits)).
Disagreement (steps of 1/M) is checked as its mean absolute difference, at most the argmax
tolerance (0 for fp32, 0.01 for fp16, 0.02 for bf16). An engine of precision ``best`` gets the
loosest (bf16) row.

INT8 (ONNX Runtime's quantization of the matrix products, :mod:`hydra_deploy.export.int8`): the
architecture's table leaves logits "reported" and probs/entropy "measured"; the bounds here are
0.15 x max(1, max |logit|), probs 0.05, entropies/MI 0.15, argmax >= 98%. Measured against FP32
in ONNX Runtime on tiny Hydras (M=3 ViTs with scrambled weights and trained on digits, an M=2
BERT; dynamic, and static with each calibration method; 128-297 examples, on the calibration
data and on held-out data), the worst were: member logits 71% of their bound (digits, entropy
calibration), probs 0.041 (scrambled ViT, entropy), entropies 0.072, MI 0.045; argmax agreement
on clear examples 100% in every case, 98.0-99.7% counting near-ties. To be refined on real
checkpoints by issue 27's drift benchmark; an INT8 export outside them is refused.

**One rule for argmax agreement** (export validation and ``hydra-compare`` alike): an example's
argmax is judged only where its reference top-2 margin exceeds ``TIE_MARGIN`` (2) x the error
bound (a member's logit bound; for the ensemble prediction, the probs bound): within tolerance, a
nearer tie may fall either way, so a flip there is no evidence of a wrong backend. Near-ties are
counted and reported (:meth:`BackendReport.verdict`); when nearly all member predictions are
near-ties (``UNTRAINED_SHARE``) the model looks untrained (random weights), and the verdict says
so: argmax agreement then says little, the logit and score bounds still hold. Disagreement is
compared on the examples whose members and ensemble are all clear.
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
    "int8": {"logits": 1.5e-1, "probs": 5e-2, "entropy": 1.5e-1, "argmax": 0.98},
}
#: An argmax is judged only where the reference's top-2 margin exceeds this many error bounds.
TIE_MARGIN = 2.0
#: At least this share of near-tie member predictions: the model looks untrained (random weights).
UNTRAINED_SHARE = 0.9

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
    judged: int | None = None  # agreement: the examples with a clear reference margin
    near_ties: int | None = None  # agreement: the examples left out as near-ties


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

    def near_ties(self) -> tuple[int, int]:
        """(near-tie member predictions, member predictions): those left out of argmax agreement."""
        argmax = [c for c in self.members if c.name == "argmax" and c.judged is not None]
        near = sum(c.near_ties or 0 for c in argmax)
        return near, near + sum(c.judged or 0 for c in argmax)

    def looks_untrained(self) -> bool:
        """Nearly every member prediction is a near-tie: random weights, or an untrained model."""
        near, total = self.near_ties()
        return total > 0 and near >= UNTRAINED_SHARE * total

    def verdict(self) -> str:
        """The one verdict on this backend, with the near-ties and, for a model that looks
        untrained, why its argmax agreement says little (export validation and hydra-compare
        say it in these words)."""
        if self.status == "skipped":
            return f"not compared: {self.reason}"
        precision = self.tolerance.precision
        state = "within" if self.passed else "BEYOND"
        line = f"{state} the {precision} tolerances"
        near, total = self.near_ties()
        if near:
            line += (
                f"; argmax judged on {total - near} of {total} member predictions ({near} "
                f"near-ties: top-2 logit margin within {TIE_MARGIN:g}x the logit bound)"
            )
        if self.looks_untrained():
            line += (
                "; the model looks untrained (random weights?), or these inputs are unlike its "
                "data: its classes are nearly tied, so argmax agreement says little; the logit and "
                "score bounds still hold"
            )
        if not self.passed:
            line += ": " + "; ".join(f.split(": ", 1)[-1] for f in self.failures()[:3])
        return line

    def summary(self) -> dict[str, Any]:
        """A JSON-ready digest: passed, the verdict, the worst value of each check, near-ties."""
        worst: dict[str, float] = {}
        for check in self.members + self.scores:
            value = check.value
            if check.judged == 0:
                continue  # nothing judged: every example a near-tie
            keep = min if check.kind == "agreement" else max
            worst[check.name] = keep(worst.get(check.name, value), value)
        near, total = self.near_ties()
        return _finite_json(
            {
                "passed": self.passed,
                "verdict": self.verdict(),
                "tolerance": asdict(self.tolerance) if self.tolerance else None,
                "worst": worst,
                "near_ties": near,
                "member_predictions": total,
                "looks_untrained": self.looks_untrained(),
                "failures": self.failures(),
            }
        )


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
    clear_members = np.ones(ref.shape[0], dtype=bool)
    for m in range(ref.shape[1]):
        diff = _max_abs(ref[:, m] - got[:, m])
        bound = tolerance.logit_bound(ref[:, m])
        members.append(Check("member_logits", diff, bound, diff <= bound, member=m))
        clear = clear_margin(ref[:, m], bound)
        clear_members &= clear
        members.append(
            _agreement("argmax", ref[:, m].argmax(-1), got[:, m].argmax(-1), clear, tolerance, m)
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
    clear = clear_margin(expected["probs"], tolerance.probs)
    scores.append(
        _agreement("prediction", expected["prediction"], actual["prediction"], clear, tolerance)
    )
    # disagreement moves with every flipped argmax: compared where no member nor the ensemble is
    # a near-tie (not judged when every example has one)
    rows = clear & clear_members
    changed = np.abs(expected["disagreement"][rows] - actual["disagreement"][rows].astype(float))
    flips = float(np.mean(changed)) if rows.any() else math.nan
    flips = math.inf if math.isinf(flips) or (rows.any() and not math.isfinite(flips)) else flips
    scores.append(
        Check(
            "disagreement",
            flips,
            1.0 - tolerance.argmax,
            not rows.any() or flips <= 1.0 - tolerance.argmax + 1e-9,
            kind="mean_abs_diff",
            judged=int(rows.sum()),
            near_ties=int(rows.size - rows.sum()),
        )
    )
    for name in UQ_GRAPH_OUTPUTS:  # the ensemble head inside the graph, when exported with it
        if name in outputs:
            diff = _max_abs(expected[name].astype(np.float64) - outputs[name])
            scores.append(Check(f"graph:{name}", diff, bounds[name], diff <= bounds[name]))
    return members, scores


def clear_margin(values: np.ndarray, bound: float) -> np.ndarray:
    """Per example ([N, C] -> [N] bool): whether the top-2 margin exceeds ``TIE_MARGIN`` x
    ``bound``, so that no change within ``bound`` can flip its argmax."""
    values = np.asarray(values, dtype=np.float64)
    if values.shape[-1] < 2:
        return np.ones(values.shape[0], dtype=bool)
    top2 = np.partition(values, -2, axis=-1)[..., -2:]
    return (top2[..., 1] - top2[..., 0]) > TIE_MARGIN * bound


def _agreement(
    name: str,
    expected: np.ndarray,
    actual: np.ndarray,
    clear: np.ndarray,
    tolerance: Tolerance,
    member: int | None = None,
) -> Check:
    """The share of clear examples whose argmax agrees (NaN, and passed, when none is clear)."""
    judged = int(clear.sum())
    agree = float(np.mean(expected[clear] == actual[clear])) if judged else math.nan
    return Check(
        name,
        agree,
        tolerance.argmax,
        not judged or agree >= tolerance.argmax,
        member=member,
        kind="agreement",
        judged=judged,
        near_ties=int(clear.size - judged),
    )


def _max_abs(delta: np.ndarray) -> float:
    delta = np.asarray(delta, dtype=np.float64)
    if not np.isfinite(delta).all():
        return math.inf
    return float(np.abs(delta).max())
