"""FP16/BF16 graphs: strongly typed as intended, checked against PyTorch, their drift measured."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
import torch
from helpers.members import perturbed_members, specs
from helpers.vit import tiny_vit
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_deploy.errors import ExportError
from hydra_deploy.export import export_onnx, load_export, validate_onnx
from hydra_deploy.export.heads import UQ_OUTPUTS, WithEnsembleHead
from hydra_deploy.export.precision import (
    attention_casts,
    compute_types,
    reference_model,
    to_low_precision,
    upcast_model,
)
from hydra_deploy.fusion import fuse
from hydra_deploy.fusion.layers import StreamLayerNorm
from hydra_deploy.specs import HydraSpec

LOW = {"fp16": "float16", "bf16": "bfloat16"}
HEAD_OPS = ("LogSoftmax", "Exp", "ReduceSum", "Log", "TopK", "Clip", "Neg", "Sub")


@pytest.fixture(scope="module")
def hydra():
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=[2, 1, 3], seed=0)
    return fuse(backbone, spec)


@pytest.fixture(
    scope="module", params=[(p, e) for p in ("fp16", "bf16") for e in ("dynamo", "torchscript")]
)
def low_export(request, hydra, tmp_path_factory):
    precision, exporter = request.param
    out = tmp_path_factory.mktemp(f"{precision}-{exporter}") / "export"
    info = export_onnx(
        hydra,
        out,
        exporter=exporter,
        batch=(1, 4, 6),
        precision=precision,
        uq_outputs=exporter == "dynamo",
    )
    return precision, out, info


def session(model_or_path):
    source = model_or_path if isinstance(model_or_path, str) else model_or_path.SerializeToString()
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"])


def test_types_are_as_intended(low_export):
    precision, out, info = low_export
    model = onnx.load(str(out / "model.onnx"))
    types = compute_types(model)
    low = LOW[precision]
    # per layer: Q/K/V and output projections one per member (the loop lowering: 3 + 3), scores,
    # weighted sums, the shared MLP's two; then the head: 3 x 10 + 1
    assert types["MatMul"] == {low: 31}
    assert types["Softmax"] == {low: 3}  # the attention's, one per layer
    assert types["LayerNormalization"] == {"float": 7}  # 2 per block + the final norm
    assert set(types["Erf"]) == {low} and set(types["Add"]) == {low}
    # patch embedding: BF16 Conv only exists from opset 22, so it stays float32 there
    assert types["Conv"] == ({"float": 1} if precision == "bf16" else {low: 1})
    for op in HEAD_OPS:  # the ensemble head computes in float32
        assert set(types.get(op, {"float": 0})) == {"float"}, op
    assert attention_casts(model) == 0  # nothing between MatMul -> Softmax -> MatMul
    for value in [*model.graph.input, *model.graph.output]:
        assert value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT, value.name
    metadata = {p.key: p.value for p in model.metadata_props}
    assert metadata["hydra_precision"] == precision and "hydra_spec" in metadata
    assert info.precision == precision and info.strongly_typed
    report = info.precision_report
    assert report["casts"] > 0 and report["compute_types"] == types
    assert ("Conv" in report["fp32_for_lack_of_kernels"]) == (precision == "bf16")
    assert info.record["outputs"][0]["dtype"] == "float32"
    assert not any(n.op_type == "Einsum" for n in model.graph.node)


def test_weights_are_stored_once_in_the_low_precision(low_export):
    precision, out, _ = low_export
    model = onnx.load(str(out / "model.onnx"))
    elem = {"fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}[precision]
    big = [t for t in model.graph.initializer if int(np.prod(t.dims)) >= 64]
    low = [t for t in big if t.data_type == elem]
    float32 = [t.name for t in big if t.data_type == onnx.TensorProto.FLOAT]
    assert len(low) >= 6  # the grouped QKV/projections and MLPs
    conv_inputs = {name for n in model.graph.node if n.op_type == "Conv" for name in n.input}
    assert set(float32) == (conv_inputs & set(float32) if precision == "bf16" else set())
    assert len(float32) == (1 if precision == "bf16" else 0)  # only the patch embedding's kernel
    # a low-precision file is about half the float32 one
    fp32_bytes = sum(4 * int(np.prod(t.dims)) for t in big)
    stored = sum(len(t.raw_data) for t in big)
    assert stored < 0.7 * fp32_bytes


def test_validation_report(low_export):
    precision, _, info = low_export
    validation = info.validation
    assert validation["passed"] and validation["precision"] == precision
    assert validation["checked"] == "float32 widening in onnxruntime"
    assert list(validation["batches"]) == ["1", "3", "6"]
    for entry in validation["batches"].values():
        assert entry["member_logits"]["max_abs_diff"] <= entry["member_logits"]["atol"]
        drift = entry["drift_vs_fp32"]
        assert 0 < drift["member_logits"] < 0.5  # it does move, a little
        assert drift["argmax_agreement"] >= 0.9
    measured_in = "onnxruntime (fp16 file)" if precision == "fp16" else "PyTorch in bf16"
    assert validation["drift_measured_in"] == measured_in


def test_onnxruntime_runs_fp16_and_says_why_not_bf16(low_export, hydra):
    """ORT's CPU kernels run the FP16 file; BF16 ones they refuse (NOT_IMPLEMENTED)."""
    precision, out, info = low_export
    x = hydra.example_inputs(5, seed=3)
    module = WithEnsembleHead(hydra) if info.uq_outputs else hydra
    with torch.no_grad():
        fp32 = module(x)
    fp32 = fp32 if isinstance(fp32, tuple) else (fp32,)
    try:
        got = session(str(out / "model.onnx")).run(None, {"pixel_values": x.numpy()})
    except Exception as err:  # onnxruntime's own exception types
        assert precision == "bf16" and "NOT_IMPLEMENTED" in str(err), err
        got = None
    if got is not None:  # FP16 (or BF16 on an onnxruntime with the kernels): close to FP32
        names = ["member_logits", *(UQ_OUTPUTS if info.uq_outputs else ())]
        limits = {
            "member_logits": 0.1,
            "probs": 2e-2,
            "msp": 2e-2,
            "predictive_entropy": 5e-2,
            "expected_entropy": 5e-2,
            "mutual_information": 5e-2,
        }
        for name, a, b in zip(names, got, fp32, strict=True):
            assert np.abs(a - b.numpy()).max() <= limits[name], name
    # the widened file runs everywhere and equals float32 compute with the rounded weights
    widened = session(upcast_model(onnx.load(str(out / "model.onnx"))))
    reference = reference_model(
        module, precision, compute="fp32", fp32_ops=["Conv"] if precision == "bf16" else []
    )
    with torch.no_grad():
        expected = reference(x)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for a, b in zip(widened.run(None, {"pixel_values": x.numpy()}), expected, strict=True):
        np.testing.assert_allclose(a, b.numpy(), atol=2e-3, rtol=0)


def test_validation_catches_a_wrong_low_precision_file(low_export, hydra, tmp_path):
    precision, out, info = low_export
    model = onnx.load(str(out / "model.onnx"))
    graph = gs.import_onnx(model)
    weights = [
        t for t in graph.tensors().values() if isinstance(t, gs.Constant) and t.values.ndim == 3
    ]
    weights[0].values = (weights[0].values.astype(np.float32) * 1.05).astype(
        weights[0].values.dtype
    )
    onnx.save(gs.export_onnx(graph), str(tmp_path / "wrong.onnx"))
    module = WithEnsembleHead(hydra) if info.uq_outputs else hydra
    with pytest.raises(ExportError, match=rf"the {precision} file \(widened\) differs"):
        validate_onnx(
            tmp_path / "wrong.onnx", module, hydra.example_inputs, [2], precision=precision
        )


def test_load_export_rebuilds_a_low_precision_folder(low_export, hydra):
    _, out, _ = low_export
    rebuilt = load_export(out)  # checks the rebuilt model against the folder's file
    x = hydra.example_inputs(2, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), hydra(x), atol=1e-5, rtol=0)


def test_an_untrained_fp16_export_gets_one_verdict_with_the_reason(tmp_path, caplog):
    """Random weights: nearly tied classes, whose argmax FP16 may flip within tolerance. The
    export says its verdict once, that the model looks untrained, and hydra-compare agrees."""
    import logging

    import timm
    from helpers.vit import TINY_VIT

    from hydra_deploy.backbones import load_backbone
    from hydra_deploy.evaluation.compare import compare_export

    torch.manual_seed(0)
    config = {**TINY_VIT["token"], "num_classes": 1000}  # as ViT-B's head
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **config)
    backbone = load_backbone(model.eval())  # timm's init, not scrambled: logits nearly tied
    hydra = fuse(backbone, HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=2))
    caplog.set_level(logging.INFO, logger="hydra_deploy")
    info = export_onnx(hydra, tmp_path / "fp16", batch=(1, 4, 32), precision="fp16")
    verdicts = [r for r in caplog.records if "fp16 tolerances" in r.getMessage()]
    assert len(verdicts) == 1, [r.getMessage() for r in verdicts]  # said once
    drift = info.validation["drift"]
    assert drift["passed"] and drift["looks_untrained"] and drift["examples"] == 36
    assert "within the fp16 tolerances" in verdicts[0].getMessage()
    assert "the model looks untrained (random weights?)" in verdicts[0].getMessage()
    assert verdicts[0].levelno == logging.INFO
    (ort,) = compare_export(tmp_path / "fp16", batch=32).backends
    assert ort.passed and ort.looks_untrained()  # the same rule, the same verdict


# --- the pass on hand-made graphs ----------------------------------------------------------------
def small_graph(opset: int = 17):
    """input -> Conv -> LayerNorm -> MatMul -> Softmax -> MatMul -> member_logits -> Softmax(head)."""
    rng = np.random.default_rng(0)
    x = gs.Variable("pixel_values", np.float32, [1, 2, 4, 4])
    conv_w = gs.Constant("conv_w", rng.standard_normal((4, 2, 2, 2)).astype(np.float32))
    conv = gs.Variable("conv", np.float32)
    flat = gs.Variable("flat", np.float32)
    shape = gs.Constant("shape", np.array([1, 4, 4], np.int64))
    perm = gs.Variable("tokens", np.float32)
    ln_scale = gs.Constant("ln_scale", np.full(4, 1.5, np.float32))
    ln_bias = gs.Constant("ln_bias", np.full(4, 0.1, np.float32))
    normed = gs.Variable("normed", np.float32)
    w = gs.Constant("w", rng.standard_normal((4, 4)).astype(np.float32))
    scores, attn = gs.Variable("scores", np.float32), gs.Variable("attn", np.float32)
    logits = gs.Variable("member_logits", np.float32, [1, 4, 4])
    probs = gs.Variable("probs", np.float32, [1, 4, 4])
    to_float = gs.Variable("steps", np.float32)
    step = gs.Variable("step_shape", np.int64)
    nodes = [
        gs.Node("Conv", "conv", {"strides": [2, 2]}, [x, conv_w], [conv]),
        gs.Node("Reshape", "reshape", {}, [conv, shape], [flat]),
        gs.Node("Transpose", "transpose", {"perm": [0, 2, 1]}, [flat], [perm]),
        gs.Node("LayerNormalization", "ln", {"axis": -1}, [perm, ln_scale, ln_bias], [normed]),
        gs.Node("MatMul", "qk", {}, [normed, w], [scores]),
        gs.Node("Softmax", "attn_softmax", {"axis": -1}, [scores], [attn]),
        gs.Node("MatMul", "av", {}, [attn, normed], [logits]),
        gs.Node("Softmax", "head_softmax", {"axis": -1}, [logits], [probs]),
        gs.Node("Shape", "shape_of", {}, [attn], [step]),
        gs.Node("Cast", "cast_steps", {"to": onnx.TensorProto.FLOAT}, [step], [to_float]),
    ]
    out_sum = gs.Variable("steps_total", np.float32, [3])
    nodes.append(
        gs.Node(
            "Mul",
            "scale_steps",
            {},
            [to_float, gs.Constant("two", np.array([2.0], np.float32))],
            [out_sum],
        )
    )
    return gs.Graph(nodes=nodes, inputs=[x], outputs=[logits, probs, out_sum], opset=opset)


def run_graph(graph, x):
    model = gs.export_onnx(graph.copy())
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model, full_check=True)
    return model, session(model).run(None, {"pixel_values": x})


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_pass_on_a_small_graph(precision):
    graph = small_graph()
    x = np.random.default_rng(1).standard_normal((1, 2, 4, 4)).astype(np.float32)
    _, expected = run_graph(graph, x)
    report = to_low_precision(graph, precision)
    model = gs.export_onnx(graph)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model, full_check=True)
    types = compute_types(model)
    low = LOW[precision]
    assert types["MatMul"] == {low: 2} and types["Softmax"] == {low: 1, "float": 1}
    assert types["LayerNormalization"] == {"float": 1}
    assert types["Conv"] == ({"float": 1} if precision == "bf16" else {low: 1})
    assert types["Mul"] == {low: 1}  # the retargeted Cast feeds it the low type
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    cast_to = {n.name: n.attribute[0].i for n in casts}
    assert cast_to["cast_steps"] == {"fp16": 10, "bf16": 16}[precision]  # retargeted, not added
    assert attention_casts(model) == 0
    # LayerNorm's scale/bias keep float32; the matmul weight is converted
    init = {t.name: t.data_type for t in model.graph.initializer}
    assert init["ln_scale"] == init["ln_bias"] == onnx.TensorProto.FLOAT
    assert init["w_" + precision] == {"fp16": 10, "bf16": 16}[precision] and "w" not in init
    assert report["constants"] >= 2 and report["casts"] >= 3
    assert [o.type.tensor_type.elem_type for o in model.graph.output] == [1, 1, 1]
    widened = session(upcast_model(model)).run(None, {"pixel_values": x})
    for got, want in zip(widened, expected, strict=True):
        np.testing.assert_allclose(got, want, atol=0.05 * max(1.0, np.abs(want).max()), rtol=0)
    if precision == "fp16":  # ORT runs FP16 itself
        for got, want in zip(session(model).run(None, {"pixel_values": x}), expected, strict=True):
            np.testing.assert_allclose(got, want, atol=0.05 * max(1.0, np.abs(want).max()), rtol=0)


def test_pass_at_fp32_changes_nothing_and_refuses_unknown_precisions(tmp_path, hydra):
    graph = small_graph()
    before = [n.op for n in graph.nodes]
    assert to_low_precision(graph, "fp32")["low_precision_nodes"] == 0
    assert [n.op for n in graph.nodes] == before
    with pytest.raises(ExportError, match="unknown precision 'int4'"):
        export_onnx(hydra, tmp_path / "x", exporter="torchscript", precision="int4")
    assert list(tmp_path.iterdir()) == []


def test_reference_model_follows_the_policy(hydra):
    reference = reference_model(hydra, "bf16")
    dtypes = {}
    for name, param in reference.named_parameters():
        dtypes[name] = param.dtype
    norms = [n for n, m in reference.named_modules() if isinstance(m, StreamLayerNorm)]
    assert norms
    for name, dtype in dtypes.items():
        in_norm = any(name.startswith(n + ".") for n in norms)
        assert dtype == (torch.float32 if in_norm else torch.bfloat16), name
    assert next(hydra.parameters()).dtype == torch.float32  # the original is untouched
    out = reference(hydra.example_inputs(2))
    assert out.dtype == torch.float32 and out.shape == (2, 3, 5)


@settings(max_examples=6)
@given(data=st.data(), precision=st.sampled_from(["fp16", "bf16"]))
def test_low_precision_export_is_right_for_random_specs(
    tiny_vits, data, precision, tmp_path_factory
):
    """Property: any spec and merge exports to a file whose widening equals the rounded model."""
    config = data.draw(st.sampled_from(sorted(tiny_vits)))
    backbone = tiny_vits[config]
    spec = data.draw(specs(backbone, max_members=3))
    merge = data.draw(st.sampled_from(["average", "grouped"]))
    members = perturbed_members(backbone, spec.num_members, 2) if merge == "grouped" else backbone
    hydra = fuse(members, spec, merge)
    out = tmp_path_factory.mktemp("lowprop") / "export"
    info = export_onnx(hydra, out, exporter="torchscript", batch=(1, 2, 3), precision=precision)
    assert info.validation["passed"]  # widened file == PyTorch with rounded weights
    model = onnx.load(str(out / "model.onnx"))
    assert attention_casts(model) == 0
    assert set(compute_types(model)["LayerNormalization"]) == {"float"}


def test_cli_precision_and_grouped_linear(tmp_path):
    from hydra_deploy.cli.export import main

    out = tmp_path / "bf16"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(
            [
                "--backbone",
                "vit_ti16",
                "--members",
                "2",
                "--max-batch",
                "2",
                "--opt-batch",
                "2",
                "--exporter",
                "torchscript",
                "--precision",
                "bf16",
                "--grouped-linear",
                "loop",
                "--out",
                str(out),
            ]
        )
    assert code == 0, stderr.getvalue()
    text = stdout.getvalue()
    assert "bf16 file's float32 widening in ONNX Runtime at batch 1, 2" in text
    assert "bf16 vs fp32 (measured in PyTorch in bf16): max member_logits" in text
    assert "--stronglyTyped" in text and "--fp16" not in text
    info = json.loads((out / "hydra.json").read_text())
    assert info["precision"] == "bf16" and info["strongly_typed"]
