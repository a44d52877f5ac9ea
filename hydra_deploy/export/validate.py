"""Check an exported file against PyTorch in ONNX Runtime, at several batch sizes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hydra_deploy.errors import ExportError

DEFAULT_ATOL = {
    "member_logits": 1e-4, "probs": 1e-5, "msp": 1e-5,
    "predictive_entropy": 1e-4, "expected_entropy": 1e-4, "mutual_information": 1e-4,
}  # fmt: skip


def validation_batches(batch: Sequence[int]) -> list[int]:
    """The profile's minimum, the smallest odd size between, and its maximum (ascending, unique).

    An odd size catches graphs that specialised on the traced (even) batch; the smallest keeps
    the check cheap on a CPU.
    """
    low, _, high = batch
    middle = low + 1 if (low + 1) % 2 else low + 2
    return sorted({low, high} | ({middle} if middle < high else set()))


def validate_onnx(
    path: str | Path,
    model: torch.nn.Module,
    example_inputs: Any,
    batches: Sequence[int],
    *,
    atol: dict[str, float] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Run ``path`` in ONNX Runtime (CPU) and ``model`` in PyTorch at each batch size; compare.

    ``example_inputs(batch, seed)`` makes the inputs. Returns a report (per batch and output: max
    abs difference, argmax agreement); raises ExportError naming the worst output, its difference
    and the member where it occurs when a difference exceeds its tolerance.
    """
    import onnxruntime as ort

    tolerances = {**DEFAULT_ATOL, **(atol or {})}
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name
    output_names = [o.name for o in session.get_outputs()]
    report: dict[str, Any] = {"runtime": f"onnxruntime {ort.__version__} CPU", "batches": {}}
    for batch in batches:
        x = example_inputs(batch, seed + batch)
        with torch.inference_mode():
            expected = model(x)
        if isinstance(expected, torch.Tensor):
            expected = (expected,)
        expected = dict(zip(output_names, expected, strict=True))
        got = dict(zip(output_names, session.run(None, {input_name: x.numpy()}), strict=True))
        entry = {}
        for name in output_names:
            reference = expected[name].float().numpy()
            if got[name].shape != reference.shape:
                raise ExportError(
                    f"output {name} has shape {list(got[name].shape)} in ONNX Runtime but "
                    f"{list(reference.shape)} in PyTorch at batch {batch}"
                )
            diff = np.abs(got[name].astype(np.float64) - reference)
            worst = float(diff.max()) if diff.size else 0.0
            entry[name] = {"max_abs_diff": worst, "atol": tolerances.get(name, 1e-4)}
            if name == "member_logits":
                entry[name]["argmax_agreement"] = float(
                    (got[name].argmax(-1) == reference.argmax(-1)).mean()
                )
            if worst > entry[name]["atol"]:
                where = np.unravel_index(int(diff.argmax()), diff.shape)
                member = f", member {where[1]}" if name == "member_logits" else ""
                raise ExportError(
                    f"ONNX Runtime differs from PyTorch at batch {batch}: output {name} max abs "
                    f"difference {worst:.3g} > {entry[name]['atol']:.0e} (at example {where[0]}"
                    f"{member}); the export is wrong, try the other exporter"
                )
        report["batches"][str(batch)] = entry
    report["passed"] = True
    return report
