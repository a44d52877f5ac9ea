"""INT8 export folders for the engine tests, made from an FP32 export folder with ONNX Runtime's own
quantization tools (what ``hydra-export --precision int8`` uses), so the graphs are the real thing:

- ``"static"``: QuantizeLinear/DequantizeLinear pairs around the matrix products, symmetric signed
  INT8 activations and per-channel weights (zero points 0): what TensorRT's explicit quantization
  takes.
- ``"dynamic"``: ``quantize_dynamic`` (DynamicQuantizeLinear, MatMulInteger), which TensorRT's ONNX
  parser cannot import.
- ``"asymmetric"``: Q/DQ pairs with ONNX Runtime's default asymmetric activations (non-zero int8
  zero points), and ``"uint8"``: uint8 activations; TensorRT refuses both.

Only ``model.onnx``, hydra.json's ``precision``, ``onnx_sha256`` and ``int8`` record (which
``read_info`` requires of an INT8 export; the engine code decides from the graph, not from it)
change.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from hydra_deploy.export_folder import file_sha256

KINDS = ("static", "dynamic", "asymmetric", "uint8")


class _RandomInputs:
    """A CalibrationDataReader: a few batches of standard-normal inputs of the export's shapes."""

    def __init__(self, inputs: list[dict], batches: int = 3, batch: int = 2, seed: int = 0):
        rng = np.random.default_rng(seed)
        self._feeds = iter(
            [
                {
                    spec["name"]: rng.standard_normal(
                        [batch, *(d for d in spec["shape"][1:])]
                    ).astype(np.float32)
                    for spec in inputs
                }
                for _ in range(batches)
            ]
        )

    def get_next(self):
        return next(self._feeds, None)


def quantized_folder(fp32_folder: Path, out: Path, kind: str = "static") -> Path:
    """A copy of the FP32 export folder ``fp32_folder`` at ``out`` with an INT8 ``model.onnx``."""
    from onnxruntime.quantization import (
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    shutil.copytree(fp32_folder, out)
    info = json.loads((out / "hydra.json").read_text())
    source, model = fp32_folder / "model.onnx", out / "model.onnx"
    if kind == "dynamic":
        quantize_dynamic(source, model, weight_type=QuantType.QInt8)
    else:
        quantize_static(
            source,
            model,
            _RandomInputs(info["inputs"]),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=["MatMul"],
            per_channel=True,
            activation_type=QuantType.QUInt8 if kind == "uint8" else QuantType.QInt8,
            weight_type=QuantType.QInt8,
            extra_options={  # hydra_deploy.export.int8's static options, but the zero points
                "ActivationSymmetric": kind == "static",
                "WeightSymmetric": True,
                "MatMulConstBOnly": True,
                "QDQOpTypePerChannelSupportToAxis": {"MatMul": -1},
                "DedicatedQDQPair": True,
            },
        )
    info["precision"] = "int8"
    info["onnx_sha256"] = file_sha256(model)
    info["int8"] = int8_record(model, "dynamic" if kind == "dynamic" else "static")
    (out / "hydra.json").write_text(json.dumps(info, indent=2))
    return out


def int8_record(model: Path, method: str) -> dict:
    """A well-formed ``int8`` entry of hydra.json for ``model`` (see ``Int8Record``)."""
    from collections import Counter

    import onnx

    ops = Counter(n.op_type for n in onnx.load(str(model), load_external_data=False).graph.node)
    integer = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger")
    static = method == "static"
    return {
        "method": method,
        "calibration_method": "minmax" if static else None,
        "num_calibration": 6 if static else 0,
        "calibration_sha256": "0" * 64 if static else None,
        "quantized_ops": {"MatMul": ops["MatMul"] or ops["MatMulInteger"]},
        "integer_ops": {op: ops[op] for op in integer if ops[op]},
        "kept_float": {},
    }
