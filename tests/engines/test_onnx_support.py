"""The table of what TensorRT's ONNX parser takes (engines/onnx_support.py), its checks, the
stand-in parser that enforces it, and static INT8's float Gemm bias."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers.trt_standins import parse_onnx
from onnx import TensorProto, helper, numpy_helper

from hydra_deploy.engines.onnx_support import (
    COVERED_OPS,
    SUPPORT,
    TOPK_MAX_K,
    parser_problems,
    table_markdown,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "tensorrt.md"
RELEASES = ("8.6.2", "10.1.0", "10.3.0", "11.0.0")


def _model(nodes, inputs, outputs, initializers=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _float(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _int64(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def _refused_on(model) -> dict[str, bool]:
    return {v: bool(parser_problems(model, v)) for v in RELEASES}


def test_the_table_covers_every_decision_operator():
    from hydra_deploy.export.decision_graph import DECISION_OPS

    assert set(DECISION_OPS) <= COVERED_OPS
    assert all(r.trt86 in ("yes", "restricted", "no") for r in SUPPORT)


def test_docs_hold_the_table_as_the_code_has_it():
    assert table_markdown() in DOCS.read_text()


def test_shape_with_start_or_end_is_mis_read_on_8_6_only():
    for attrs in ({"start": 0, "end": 1}, {"start": 1}, {"end": -1}):
        model = _model(
            [helper.make_node("Shape", ["x"], ["s"], name="Shape_0", **attrs)],
            [_float("x", ["batch", 3])],
            [helper.make_tensor_value_info("s", TensorProto.INT64, None)],
        )
        assert _refused_on(model) == {
            "8.6.2": True,
            "10.1.0": False,
            "10.3.0": False,
            "11.0.0": False,
        }
        assert "mis-read" in parser_problems(model, "8.6")[0]
    plain = _model(
        [helper.make_node("Shape", ["x"], ["s"], name="Shape_0", start=0)],
        [_float("x", ["batch", 3])],
        [helper.make_tensor_value_info("s", TensorProto.INT64, None)],
    )
    assert not any(_refused_on(plain).values())  # start=0 alone: the whole shape


def _dequantize(kind: int, values, zero=None) -> onnx.ModelProto:
    """A DequantizeLinear over an initializer of ONNX type ``kind`` (zero point of the same)."""
    dtype = helper.tensor_dtype_to_np_dtype(kind)
    inits = [
        numpy_helper.from_array(np.asarray(values, dtype=dtype), "q"),
        numpy_helper.from_array(np.float32(0.5), "scale"),
    ]
    if zero is not None:
        inits.append(numpy_helper.from_array(np.asarray(zero, dtype=dtype), "zp"))
    inputs = ["q", "scale", "zp"][: len(inits)]
    node = helper.make_node("DequantizeLinear", inputs, ["y"], name="dq")
    return _model([node], [], [_float("y", [3])], inits)


def test_a_dequantize_over_int32_is_refused_everywhere_and_int8_is_not():
    int32 = _dequantize(TensorProto.INT32, [1, -2, 3], zero=0)
    assert all(_refused_on(int32).values())
    assert "ONNX type 6" in parser_problems(int32, "10.3")[0]
    assert not any(_refused_on(_dequantize(TensorProto.INT8, [1, -2, 3], zero=0)).values())
    nonzero = _dequantize(TensorProto.INT8, [1, -2, 3], zero=1)
    assert all(_refused_on(nonzero).values())
    uint8 = _dequantize(TensorProto.UINT8, [1, 2, 3], zero=0)
    assert all(_refused_on(uint8).values())


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        pytest.param(
            lambda: _model(
                [helper.make_node("Cast", ["x"], ["y"], name="c", to=TensorProto.BFLOAT16)],
                [_float("x", [2])],
                [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2])],
            ),
            {"8.6.2": True, "10.1.0": False, "10.3.0": False, "11.0.0": False},
            id="bf16-cast",
        ),
        pytest.param(
            lambda: _model(
                [helper.make_node("TopK", ["x", "k"], ["v", "i"], name="t", axis=-1)],
                [_float("x", ["batch", TOPK_MAX_K + 1])],
                [_float("v", None), helper.make_tensor_value_info("i", TensorProto.INT64, None)],
                [_int64("k", [TOPK_MAX_K + 1])],
            ),
            dict.fromkeys(RELEASES, True),
            id="topk-k-too-large",
        ),
        pytest.param(
            lambda: _model(
                [helper.make_node("Squeeze", ["x"], ["y"], name="s")],
                [_float("x", ["batch", 1])],
                [_float("y", None)],
            ),
            dict.fromkeys(RELEASES, True),
            id="squeeze-no-axes-dynamic",
        ),
        pytest.param(
            lambda: _model(
                [helper.make_node("ReduceSum", ["x", "axes"], ["y"], name="r")],
                [
                    _float("x", [2, 3]),
                    helper.make_tensor_value_info("axes", TensorProto.INT64, [1]),
                ],
                [_float("y", None)],
            ),
            dict.fromkeys(RELEASES, True),
            id="reducesum-axes-tensor",
        ),
        pytest.param(
            lambda: _model(
                [helper.make_node("Slice", ["x", "b", "e", "axes"], ["y"], name="s")],
                [
                    _float("x", [4, 3]),
                    helper.make_tensor_value_info("axes", TensorProto.INT64, [1]),
                ],
                [_float("y", None)],
                [_int64("b", [0]), _int64("e", [2])],
            ),
            {"8.6.2": True, "10.1.0": True, "10.3.0": False, "11.0.0": False},
            id="slice-axes-tensor",
        ),
        pytest.param(
            lambda: _model(
                [
                    helper.make_node(
                        "ScatterElements", ["x", "i", "x"], ["y"], name="s", axis=1, reduction="add"
                    )
                ],
                [
                    _float("x", [2, 3]),
                    helper.make_tensor_value_info("i", TensorProto.INT64, [2, 3]),
                ],
                [_float("y", None)],
                opset=18,
            ),
            {"8.6.2": True, "10.1.0": False, "10.3.0": False, "11.0.0": False},
            id="scatter-reduction",
        ),
        pytest.param(
            lambda: _model(
                [
                    helper.make_node(
                        "LayerNormalization", ["x", "w"], ["y", "mean", "inv"], name="ln"
                    )
                ],
                [_float("x", [2, 3])],
                [_float("y", None), _float("mean", None), _float("inv", None)],
                [numpy_helper.from_array(np.ones(3, np.float32), "w")],
            ),
            dict.fromkeys(RELEASES, True),
            id="layernorm-three-outputs",
        ),
        pytest.param(
            lambda: _model(
                [helper.make_node("MatMulInteger", ["a", "b"], ["y"], name="m")],
                [helper.make_tensor_value_info("a", TensorProto.UINT8, [2, 3])],
                [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
                [numpy_helper.from_array(np.ones((3, 2), np.int8), "b")],
            ),
            dict.fromkeys(RELEASES, True),
            id="ort-integer-op",
        ),
    ],
)
def test_each_restriction_is_found_on_the_releases_it_applies_to(make, expected):
    assert _refused_on(make()) == expected


def test_the_standins_parser_refuses_what_the_table_refuses(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(_dequantize(TensorProto.INT32, [1, -2, 3], zero=0), str(path))
    for version in RELEASES:
        with pytest.raises(RuntimeError, match=re.escape("DequantizeLinear over a tensor")):
            parse_onnx(path, version)
    onnx.save(_dequantize(TensorProto.INT8, [1, -2, 3], zero=0), str(path))
    for version in RELEASES:
        assert parse_onnx(path, version).num_layers == 1


# --- static INT8 keeps a Gemm's bias in float -------------------------------------------------------
def _gemm_graph(path: Path) -> None:
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    model = _model(
        [helper.make_node("Gemm", ["x", "w", "b"], ["member_logits"], name="Gemm_0")],
        [_float("x", ["batch", 8])],
        [_float("member_logits", ["batch", 4])],
        [weight, bias],
    )
    onnx.save(model, str(path))


def _int32_dequantizers(path: Path) -> list[str]:
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    types = {t.name: t.data_type for t in model.graph.initializer}
    types.update((v.name, v.type.tensor_type.elem_type) for v in model.graph.value_info)
    return [
        n.name
        for n in model.graph.node
        if n.op_type == "DequantizeLinear" and types.get(n.input[0]) == TensorProto.INT32
    ]


def test_static_int8_leaves_a_gemm_bias_in_float(tmp_path):
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    from hydra_deploy.export.int8 import _feed_reader, quantize_export

    source = tmp_path / "fp32.onnx"
    _gemm_graph(source)
    x = np.random.default_rng(1).standard_normal((40, 8)).astype(np.float32)
    record = quantize_export(source, tmp_path / "int8.onnx", method="static", calibration={"x": x})
    assert record["quantized_ops"] == {"Gemm": 1}
    assert _int32_dequantizers(tmp_path / "int8.onnx") == []
    for version in RELEASES:
        assert parser_problems(tmp_path / "int8.onnx", version) == []
        parse_onnx(tmp_path / "int8.onnx", version)
    # ONNX Runtime's default (QuantizeBias on) writes the INT32 bias TensorRT refuses
    default = tmp_path / "default.onnx"
    quantize_static(
        str(source),
        str(default),
        _feed_reader([{"x": x[:8]}]),
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
    )
    assert _int32_dequantizers(default)
    for version in RELEASES:
        assert any("ONNX type 6" in p for p in parser_problems(default, version))
        with pytest.raises(RuntimeError, match="Failed to parse ONNX model"):
            parse_onnx(default, version)
