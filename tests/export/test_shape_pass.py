"""``Shape(start, end)`` written as ``Shape -> Slice`` (surgery.plain_shapes), on every export path.

TensorRT 8.6's ONNX parser ignores Shape's start/end (onnx-tensorrt 8.6-GA
``builtin_op_importers.cpp``, ``DEFINE_BUILTIN_OP_IMPORTER(Shape)``), and the dynamo exporter reads
the batch size (and BERT's length) with them.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers.bert import tiny_bert
from helpers.members import random_spec
from helpers.openclip import tiny_adapter
from helpers.trt_standins import parse_onnx
from helpers.vit import tiny_vit
from onnx import TensorProto, helper

from hydra_deploy.engines.onnx_support import parser_problems
from hydra_deploy.export import export_onnx
from hydra_deploy.export.surgery import SHAPE_SLICE_ATTRIBUTES, plain_shapes
from hydra_deploy.export.torch_onnx import export_module
from hydra_deploy.fusion import fuse
from hydra_deploy.options import Int8Options

STARTS = (None, 0, 1, 3, -1, -2, -4, -9, 4, 9)
ENDS = (None, 0, 1, 2, 4, -1, -3, -4, -9, 9)


def _shape_graph(rank_known: bool) -> onnx.ModelProto:
    """One Shape node per (start, end) pair over a rank-4 tensor ``x`` (its rank unknown to shape
    inference when ``x`` is a Reshape by runtime dims); some nodes unnamed, or named with ',' and
    ':'."""
    nodes, outputs = [], []
    if rank_known:
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 5, 7])]
    else:
        inputs = [
            helper.make_tensor_value_info("flat", TensorProto.FLOAT, [210]),
            helper.make_tensor_value_info("dims", TensorProto.INT64, ["rank"]),
        ]
        nodes.append(helper.make_node("Reshape", ["flat", "dims"], ["x"], name="Reshape_0"))
    for index, (start, end) in enumerate(itertools.product(STARTS, ENDS)):
        attrs = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
        name = (
            ("" if index % 7 == 0 < index else f"shape:{index},x")
            if index % 3 == 0
            else f"s{index}"
        )
        out = f"shape_{index}"
        nodes.append(helper.make_node("Shape", ["x"], [out], name=name, **attrs))
        outputs.append(helper.make_tensor_value_info(out, TensorProto.INT64, [None]))
    graph = helper.make_graph(nodes, "shapes", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _feed(rank_known: bool) -> dict[str, np.ndarray]:
    if rank_known:
        return {"x": np.zeros((2, 3, 5, 7), np.float32)}
    return {"flat": np.zeros(210, np.float32), "dims": np.array([2, 3, 5, 7], np.int64)}


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feed)


def _sliced_shapes(model: onnx.ModelProto) -> list[str]:
    """Shape nodes that still select part of the shape (an ``end``, or a non-zero ``start``)."""
    return [
        n.name
        for n in model.graph.node
        if n.op_type == "Shape"
        and any(a.name == "end" or (a.name == "start" and a.i != 0) for a in n.attribute)
    ]


@pytest.mark.parametrize("rank_known", [True, False])
def test_the_pass_equals_onnx_runtimes_shape_for_every_start_and_end(rank_known):
    """Negative, omitted and out-of-range start/end, rank known or not: the same values as ORT's
    Shape with the attributes, output names kept, every new name unique and trtexec-safe."""
    model = _shape_graph(rank_known)
    expected = _run(model, _feed(rank_known))
    outputs = [o.name for o in model.graph.output]
    changed = plain_shapes(model)
    onnx.checker.check_model(model)
    got = _run(model, _feed(rank_known))
    assert changed == sum(
        s is not None or e is not None for s, e in itertools.product(STARTS, ENDS)
    )
    for (start, end), a, b in zip(itertools.product(STARTS, ENDS), expected, got, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all(), (start, end)
    assert [o.name for o in model.graph.output] == outputs
    assert not any(a.name in SHAPE_SLICE_ATTRIBUTES for n in model.graph.node for a in n.attribute)
    names = [n.name for n in model.graph.node] + [t.name for t in model.graph.initializer]
    assert all(names) and len(set(names)) == len(names)
    assert not any("," in n or ":" in n for n in names if not n.startswith("shape:"))
    assert plain_shapes(model) == 0  # idempotent
    if rank_known:  # resolved bounds: no negative or INT64-max value left for TensorRT
        bounds = [onnx.numpy_helper.to_array(t) for t in model.graph.initializer]
        assert all(0 <= int(b[0]) <= 4 for b in bounds)


def test_the_8_6_standin_refuses_shape_with_start_or_end_and_accepts_it_after_the_pass(tmp_path):
    model = _shape_graph(rank_known=True)
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    with pytest.raises(RuntimeError, match="Shape with start/end"):
        parse_onnx(path, "8.6.2")
    parse_onnx(path, "10.3.0")  # 10.x reads start/end
    plain_shapes(model)
    onnx.save(model, str(path))
    parse_onnx(path, "8.6.2")


# --- real exports ------------------------------------------------------------------------------
def _hydra(family: str):
    backbone = {
        "vit": lambda: tiny_vit("token"),
        "bert": lambda: tiny_bert("segments"),
        "openclip": lambda: tiny_adapter("tok")[0],
    }[family]()
    return fuse(backbone, random_spec(backbone, members=3, heads_per_member=2, seed=1))


def _calibration(hydra) -> dict[str, np.ndarray]:
    made = hydra.example_inputs(32, seed=3)
    made = made if isinstance(made, tuple) else (made,)
    return {n: t.numpy() for n, t in zip(hydra.input_names, made, strict=True)}


PRECISIONS = ("fp32", "fp16", "int8-static", "int8-dynamic")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{(family, precision): (folder, info)}, each validated (ORT vs PyTorch, or INT8 vs FP32)."""
    root = tmp_path_factory.mktemp("shape_pass")
    made = {}
    for family in ("vit", "bert", "openclip"):
        hydra = _hydra(family)
        for precision in PRECISIONS:
            options: dict = {"precision": precision}
            if precision == "int8-static":
                options = {"precision": "int8", "int8": Int8Options(calib=_calibration(hydra))}
            elif precision == "int8-dynamic":
                options = {"precision": "int8", "int8": Int8Options(method="dynamic")}
            out = root / f"{family}-{precision}"
            made[family, precision] = (out, export_onnx(hydra, out, batch=(1, 2, 4), **options))
    return made


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("family", ["vit", "bert", "openclip"])
def test_every_export_has_plain_shapes_only(exports, family, precision):
    folder, info = exports[family, precision]
    model = onnx.load(str(folder / "model.onnx"))
    assert _sliced_shapes(model) == []
    assert info.graph_passes["plain_shapes"] >= (2 if family == "bert" else 1)
    validation = info.validation
    assert validation["passed"] if "passed" in validation else validation["drift_within_tolerance"]
    names = [n.name for n in model.graph.node]
    assert all(names) and len(set(names)) == len(names)
    assert not any("," in n or ":" in n for n in names)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8-static"])
@pytest.mark.parametrize("family", ["vit", "bert", "openclip"])
def test_every_standin_release_parses_every_buildable_export(exports, family, precision):
    """What TensorRT builds (FP32, FP16, static INT8) passes the table on 8.6, 10.x and 11."""
    folder, _ = exports[family, precision]
    for version in ("8.6.2", "10.3.0", "10.13.0", "11.0.0"):
        assert parser_problems(folder / "model.onnx", version) == []
        parse_onnx(folder / "model.onnx", version)


@pytest.mark.parametrize("family", ["vit", "bert", "openclip"])
def test_the_pass_leaves_onnx_runtimes_outputs_bit_identical(family, tmp_path):
    """The raw dynamo export (Shape with start/end) and the same file after the pass give the
    same bits in ONNX Runtime, at batch 1 and 3 (and BERT at another length)."""
    hydra = _hydra(family)
    path = tmp_path / "raw.onnx"
    used = export_module(
        hydra,
        hydra.example_inputs(2),
        path,
        input_names=hydra.input_names,
        output_names=["member_logits"],
        opset=17,
        max_batch=4,
        exporter="dynamo",
        dynamic_axes=getattr(hydra, "dynamic_axes", None),
    )
    assert used == "dynamo"
    raw = onnx.load(str(path))
    assert _sliced_shapes(raw)  # what the dynamo exporter writes
    passed = onnx.load(str(path))
    assert plain_shapes(passed) == len(
        [n for n in raw.graph.node if n.op_type == "Shape" and n.attribute]
    )
    assert _sliced_shapes(passed) == []
    sessions = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        for m in (raw, passed)
    ]
    cases = [hydra.example_inputs(1, seed=1), hydra.example_inputs(3, seed=2)]
    if family == "bert":
        cases.append(hydra.example_inputs(3, seed=3, seq_len=11))
    for made in cases:
        made = made if isinstance(made, tuple) else (made,)
        feed = {n: t.numpy() for n, t in zip(hydra.input_names, made, strict=True)}
        before, after = (s.run(None, feed)[0] for s in sessions)
        assert before.shape == after.shape and np.array_equal(before, after)
        with torch.no_grad():
            np.testing.assert_allclose(after, hydra(*made).numpy(), atol=1e-4, rtol=0)
