"""How far each precision may move member outputs and scores from FP32 (one table for all checks).

ARCHITECTURE.md's table: probs/msp and entropies/MI as max absolute differences, and the fraction
of examples whose argmax must agree. Member logits are "reported" there; the bound used by the
parity checks scales with the logits (``logits`` x max(1, max |logit|)). Export validation
(:mod:`hydra_deploy.export.validate`) and backend parity (:mod:`hydra_deploy.engines.compare`)
both read this table. numpy-free, torch-free.
"""

from __future__ import annotations

PRECISION_TOLERANCES: dict[str, dict[str, float]] = {
    "fp32": {"logits": 1e-4, "probs": 1e-5, "entropy": 1e-4, "argmax": 1.0},
    "fp16": {"logits": 5e-2, "probs": 2e-2, "entropy": 5e-2, "argmax": 0.99},
    "bf16": {"logits": 1e-1, "probs": 5e-2, "entropy": 1e-1, "argmax": 0.98},
}
