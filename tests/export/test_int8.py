"""INT8 exports: ONNX Runtime's quantization of the matrix products, recorded, validated, refused."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import json
import logging
import shutil

import numpy as np
import onnx
import pytest
import torch
from helpers.bert import tiny_bert
from helpers.members import random_spec
from helpers.vit import tiny_vit
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from hydra_deploy import parity
from hydra_deploy.engines.runner import load_runner
from hydra_deploy.errors import DataError, ExportError, ParameterError
from hydra_deploy.evaluation.compare import compare_export
from hydra_deploy.evaluation.int8_data import int8_calibration
from hydra_deploy.export import export_onnx, load_export
from hydra_deploy.export.int8 import (
    CALIBRATION_METHODS,
    INT8_METHODS,
    MIN_CALIBRATION_EXAMPLES,
    calibration_sha256,
    quantize_export,
)
from hydra_deploy.export_folder import ExportFolderError, Int8Record, read_info
from hydra_deploy.fusion import fuse
from hydra_deploy.options import Int8Options
from hydra_deploy.specs import HydraSpec

BATCH = (1, 4, 6)
#: the tiny ViT's inputs: 3 x 16 x 16, normalized pixels
CALIBRATION = np.random.default_rng(0).standard_normal((48, 3, 16, 16)).astype(np.float32)
#: the TINY_VIT_B16 of tests/test_docs.py: a tiny stand-in that hydra-export builds by name
TINY_ARGS = [
    *("--model-arg", "img_size=16", "--model-arg", "patch_size=8"),
    *("--model-arg", "embed_dim=48", "--model-arg", "depth=2"),
]


@pytest.fixture(scope="module")
def hydra():
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=[2, 1, 3], seed=0)
    return fuse(backbone, spec)


@pytest.fixture(scope="module")
def exports(hydra, tmp_path_factory):
    """{"static": (folder, info), "dynamic": (folder, info), "fp32": folder}; static has the
    ensemble head in the graph."""
    root = tmp_path_factory.mktemp("int8")
    static = export_onnx(
        hydra,
        root / "static",
        batch=BATCH,
        exporter="torchscript",
        uq_outputs=True,
        precision="int8",
        int8=Int8Options(calib={"pixel_values": CALIBRATION}),
    )
    dynamic = export_onnx(hydra, root / "dynamic", batch=BATCH, precision="int8")
    export_onnx(hydra, root / "fp32", batch=BATCH, exporter="torchscript", validate=False)
    return {
        "static": (root / "static", static),
        "dynamic": (root / "dynamic", dynamic),
        "fp32": root / "fp32",
    }


def ops(folder) -> dict[str, int]:
    model = onnx.load(str(folder / "model.onnx"))
    found: dict[str, int] = {}
    for node in model.graph.node:
        found[node.op_type] = found.get(node.op_type, 0) + 1
    return found


def producers(folder) -> tuple[onnx.ModelProto, dict[str, onnx.NodeProto]]:
    model = onnx.load(str(folder / "model.onnx"))
    return model, {out: node for node in model.graph.node for out in node.output}


def weight_matmuls(folder) -> int:
    model = onnx.load(str(folder / "model.onnx"))
    weights = {t.name for t in model.graph.initializer}
    return sum(
        n.op_type in ("MatMul", "Gemm") and any(i in weights for i in n.input)
        for n in model.graph.node
    )


def test_the_contract_names():
    assert INT8_METHODS == ("dynamic", "static")
    assert CALIBRATION_METHODS == ("minmax", "entropy", "percentile")
    assert MIN_CALIBRATION_EXAMPLES == 32


# --- what the graphs hold -------------------------------------------------------------------------
def test_static_graph_is_qdq_on_every_weight_product_and_float_elsewhere(exports):
    folder, info = exports["static"]
    model, made_by = producers(folder)
    found = ops(folder)
    assert found["QuantizeLinear"] > 0 and found["DequantizeLinear"] > found["QuantizeLinear"]
    quantized = [
        n
        for n in model.graph.node
        if n.op_type == "MatMul"
        and sum(getattr(made_by.get(i), "op_type", "") == "DequantizeLinear" for i in n.input) == 2
    ]
    # every product with a weight takes int8 weights and activations; none is left with a float one
    assert len(quantized) == weight_matmuls(exports["fp32"]) and weight_matmuls(folder) == 0
    assert info.int8.quantized_ops == {"MatMul": len(quantized)}
    assert info.int8.integer_ops == {
        "QuantizeLinear": found["QuantizeLinear"],
        "DequantizeLinear": found["DequantizeLinear"],
    }
    # weights per output channel, symmetric: int8 weights with a zero point of 0 and a scale vector
    weights = {t.name: t for t in model.graph.initializer}
    for node in quantized:
        dq = made_by[node.input[1]]
        scale = onnx.numpy_helper.to_array(weights[dq.input[1]])
        zero = onnx.numpy_helper.to_array(weights[dq.input[2]]) if len(dq.input) > 2 else 0
        assert weights[dq.input[0]].data_type == onnx.TensorProto.INT8
        assert scale.ndim == 1 and scale.size > 1 and not np.any(zero)
    # LayerNorm, the attention's Softmax and its two activation products, the head: float
    float_ops = {"LayerNormalization", "Softmax", "Conv", "LogSoftmax", "ReduceSum", "TopK"}
    for node in model.graph.node:
        if node.op_type in float_ops or (node.op_type == "MatMul" and node not in quantized):
            assert all(
                getattr(made_by.get(i), "op_type", "") != "DequantizeLinear" for i in node.input
            ), node.name
    kept = info.int8.kept_float
    assert kept["LayerNormalization"]["nodes"] == found["LayerNormalization"] == 7
    assert kept["Softmax"]["nodes"] == 3 and kept["attention MatMul"]["nodes"] == 6
    assert kept["ensemble head"]["nodes"] > 5 and kept["Conv"]["nodes"] == 1
    assert all(entry["why"] for entry in kept.values())


def test_onnx_runtime_runs_every_static_product_as_an_integer_kernel(exports, tmp_path):
    """The member products multiply 2-D activations: ONNX Runtime would fuse each with its bias
    Add into a float Gemm over dequantized weights (slower than FP32) unless the bias is kept
    apart; its optimized graph must hold one integer product per quantized one."""
    import onnxruntime as ort

    folder, info = exports["static"]
    quantized = info.int8.quantized_ops["MatMul"]
    assert 0 < info.int8.bias_kept_apart < quantized  # the trunk's products are 3-D
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))
    made_by = {out: n for n in optimized.graph.node for out in n.output}
    found = collections.Counter(n.op_type for n in optimized.graph.node)
    assert found["MatMulIntegerToFloat"] == quantized
    for node in optimized.graph.node:
        if node.op_type in ("Gemm", "MatMul"):
            assert all(
                getattr(made_by.get(i), "op_type", "") != "DequantizeLinear" for i in node.input
            ), node.name


def test_dynamic_graph_quantizes_weights_and_activations_at_run_time(exports):
    folder, info = exports["dynamic"]
    found = ops(folder)
    assert found["MatMulInteger"] == weight_matmuls(exports["fp32"]) > 0
    assert found["DynamicQuantizeLinear"] > 0 and "QuantizeLinear" not in found
    assert found["LayerNormalization"] == 7 and found["Softmax"] == 3
    record = info.int8.to_dict()
    assert record["method"] == "dynamic" and record["quantized_ops"] == {
        "MatMul": found["MatMulInteger"]
    }
    assert (record["calibration_method"], record["num_calibration"]) == (None, 0)
    assert record["calibration_sha256"] is None and "run time" in record["activations"]


def test_dynamic_weights_get_one_scale_per_output_channel(exports):
    """ORT's default (one scale per weight tensor) moved a fine-tuned MiniLM's accuracy by up
    to 4 points. Here each MatMulInteger's weight zero point and the weight scale it is multiplied
    back with have one entry per output channel, and every output channel that is not all zero (the
    fused graph has some) reaches +-127 (symmetric MinMax per channel; per tensor only the largest
    would)."""
    from onnx import numpy_helper

    folder, info = exports["dynamic"]
    assert info.int8.weights == "int8, symmetric, per output channel"
    model = onnx.load(str(folder / "model.onnx"))
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    by_name = {n.name: n for n in model.graph.node}
    integer = [n for n in model.graph.node if n.op_type == "MatMulInteger"]
    assert integer
    for node in integer:
        weight, zero_point = arrays[node.input[1]], arrays[node.input[3]]
        channels = weight.shape[-1]
        assert weight.dtype == np.int8 and zero_point.shape == (channels,)
        assert not zero_point.any()  # symmetric
        scales = [arrays[i] for i in by_name[f"{node.name}_scales_mul"].input if i in arrays]
        assert [s.shape for s in scales] == [(channels,)]
        reach = np.abs(weight.astype(np.int32)).max(axis=0)
        assert (reach[reach > 0] == 127).all() and (reach > 0).sum() > 1


def test_metadata_and_record_say_int8(exports):
    for method in ("static", "dynamic"):
        folder, info = exports[method]
        model = onnx.load(str(folder / "model.onnx"))
        metadata = {p.key: p.value for p in model.metadata_props}
        assert metadata["hydra_precision"] == "int8" and "hydra_spec" in metadata
        assert info.precision == "int8" and info.strongly_typed is False
        assert {tensor.dtype for tensor in info.output_tensors} == {"float32"}


# --- hydra.json -----------------------------------------------------------------------------------
def test_the_int8_record_round_trips(exports):
    folder, _ = exports["static"]
    checked = read_info(folder)
    assert checked.precision == "int8" and isinstance(checked.int8, Int8Record)
    record = checked.int8
    assert (record.method, record.calibration_method) == ("static", "minmax")
    assert record.num_calibration == len(CALIBRATION)
    assert record.calibration_sha256 == calibration_sha256({"pixel_values": CALIBRATION})
    assert record.to_dict() == json.loads((folder / "hydra.json").read_text())["int8"]
    assert Int8Record.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    assert read_info(exports["fp32"]).int8 is None


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda r: {k: v for k, v in r.items() if k != "int8"}, "no 'int8' entry"),
        (lambda r: {**r, "precision": "fp32"}, "an 'int8' entry"),
        (lambda r: {**r, "int8": {**r["int8"], "method": "int4"}}, "malformed method"),
        (lambda r: {**r, "int8": {**r["int8"], "calibration_sha256": None}}, "calibration_sha256"),
        (lambda r: {**r, "int8": {**r["int8"], "quantized_ops": {}}}, "quantized_ops"),
        (lambda r: {**r, "int8": {**r["int8"], "quantized_ops": {"MatMul": "9"}}}, "quantized_ops"),
        (lambda r: {**r, "int8": {**r["int8"], "kept_float": {"Conv": 1}}}, "kept_float"),
        (lambda r: {**r, "int8": "static"}, "malformed record"),
    ],
)
def test_a_damaged_int8_record_is_refused(exports, tmp_path, damage, expected):
    folder, _ = exports["static"]
    record = json.loads((folder / "hydra.json").read_text())
    (tmp_path / "hydra.json").write_text(json.dumps(damage(record)))
    with pytest.raises(ExportFolderError, match=expected) as caught:
        read_info(tmp_path)
    assert "re-export" in str(caught.value)


# --- running it -----------------------------------------------------------------------------------
def test_both_methods_run_in_onnx_runtime_within_the_int8_tolerances(exports, hydra):
    x = CALIBRATION[:6]
    with torch.no_grad():
        reference = hydra(torch.from_numpy(x)).numpy()
    for method in ("static", "dynamic"):
        folder, info = exports[method]
        with load_runner(folder) as runner:
            assert runner.precision == "int8"
            outputs = runner(x)
        assert outputs["member_logits"].shape == reference.shape
        members, scores = parity.compare_outputs(reference, outputs, parity.tolerance_for("int8"))
        assert all(c.passed for c in members + scores), method
        assert np.abs(outputs["member_logits"] - reference).max() > 0  # it is quantized
        drift = info.validation["drift"]
        assert drift["passed"] and drift["examples"] > 0 and "within the int8" in drift["verdict"]
    assert exports["static"][1].validation["drift"]["examples"] == len(CALIBRATION)
    assert "calibration" in exports["static"][1].validation["drift"]["inputs"]
    assert "example inputs" in exports["dynamic"][1].validation["drift"]["inputs"]


def test_hydra_compare_judges_an_int8_export_by_the_int8_tolerances(exports, tmp_path):
    folder, _ = exports["static"]
    np.save(tmp_path / "inputs.npy", CALIBRATION[:16])
    report = compare_export(folder, inputs=tmp_path / "inputs.npy")
    (ort,) = report.backends
    assert report.precision == "int8" and ort.tolerance == parity.TOLERANCES["int8"]
    assert report.passed, report.failures()


def test_reload_checks_an_int8_folder_and_reexports_it(exports, hydra, tmp_path):
    folder, _ = exports["dynamic"]
    rebuilt = load_export(folder)  # the int8 file within the int8 tolerances of the weights
    x = torch.from_numpy(CALIBRATION[:2])
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x), hydra(x), atol=1e-5, rtol=0)
    # weights from another model are refused
    other = fuse(tiny_vit("token", seed=1), hydra.spec)
    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    weights = {k: v.contiguous() for k, v in other.state_dict().items()}
    save_file(weights, moved / "weights.safetensors")
    with pytest.raises(ExportError, match="int8 tolerances"):
        load_export(moved)


def static_export(hydra, folder):
    """A static INT8 export of ``hydra`` (MinMax on CALIBRATION) to ``folder``."""
    return export_onnx(
        hydra,
        folder,
        batch=BATCH,
        exporter="torchscript",
        precision="int8",
        int8=Int8Options(calib=CALIBRATION),
    )


def test_validation_refuses_an_int8_file_beyond_tight_tolerances(hydra, tmp_path, monkeypatch):
    tiny = parity.Tolerance("int8", 1e-6, False, 1e-7, 1e-7, 1.0)
    monkeypatch.setitem(parity.TOLERANCES, "int8", tiny)
    with pytest.raises(ExportError, match="beyond the int8 tolerances from FP32 on the calib"):
        static_export(hydra, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []  # nothing half-written


# --- calibration a batch at a time ----------------------------------------------------------------
def _initializers(path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


def test_batched_minmax_gives_the_ranges_of_onnx_runtimes_all_at_once_calibration(
    exports, tmp_path
):
    """The MinMax ranges calibrated a batch at a time are ONNX Runtime's, computed over every
    batch's activations held at once (its calibrator without a stride), value for value."""
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import create_calibrator

    from hydra_deploy.export import int8

    fp32 = exports["fp32"] / "model.onnx"
    model = onnx.load(str(fp32))
    excluded, _ = int8._float_nodes(model)
    chosen = [n.name for n in int8._weight_products(model) if n.name not in excluded]
    feeds = int8._check_calibration(model, {"pixel_values": CALIBRATION})
    batches = int8._calibration_batches(model, feeds)
    plan = int8._Plan("static", feeds, chosen, excluded, "minmax")
    ours = int8._calibrate_minmax(model, batches, plan, len(CALIBRATION))
    assert len(model.graph.node) == len(onnx.load(str(fp32)).graph.node)  # left as it was
    calibrator = create_calibrator(
        fp32,
        list(int8.QUANTIZED_OP_TYPES),
        augmented_model_path=str(tmp_path / "augmented.onnx"),
        calibrate_method=CalibrationMethod.MinMax,
    )
    calibrator.collect_data(int8._feed_reader(batches))  # every batch, then one reduction
    theirs = calibrator.compute_data()
    assert ours and set(ours) <= set(theirs.keys())
    for name, (low, high) in ours.items():
        expected_low, expected_high = theirs[name].range_value
        assert low.dtype == expected_low.dtype and low.shape == expected_low.shape, name
        np.testing.assert_array_equal(low, expected_low)
        np.testing.assert_array_equal(high, expected_high)
    # the FP32 outputs kept for validation, one entry per batch
    assert [len(b["pixel_values"]) for b, _ in plan.fp32_runs] == [
        len(b["pixel_values"]) for b in batches
    ]
    assert set(plan.fp32_runs[0][1]) == {o.name for o in model.graph.output}


def test_the_quantized_file_is_the_one_onnx_runtimes_calibrator_gives(
    exports, tmp_path, monkeypatch
):
    """Every scale, zero point and int8 weight of the static file equals what ONNX Runtime's own
    calibration (through quantize_static's data reader) gives."""
    from hydra_deploy.export import int8

    fp32 = exports["fp32"] / "model.onnx"
    calibration = {"pixel_values": CALIBRATION}
    quantize_export(fp32, tmp_path / "ours.onnx", method="static", calibration=calibration)
    monkeypatch.setattr(int8, "_takes_a_cache", lambda: False)
    quantize_export(fp32, tmp_path / "ort.onnx", method="static", calibration=calibration)
    ours, theirs = _initializers(tmp_path / "ours.onnx"), _initializers(tmp_path / "ort.onnx")
    assert set(ours) == set(theirs)
    for name, value in ours.items():
        np.testing.assert_array_equal(value, theirs[name], err_msg=name)


def test_static_int8_validation_reuses_the_calibration_runs(hydra, tmp_path, monkeypatch):
    """The FP32 file is run once, while calibrating: validation compares the INT8 file with those
    outputs instead of running it again."""
    from hydra_deploy.export import validate

    opened = []
    real = validate._session
    monkeypatch.setattr(
        validate, "_session", lambda path, **kw: opened.append(path) or real(path, **kw)
    )
    info = static_export(hydra, tmp_path / "out")
    int8_files = [p for p in opened if p.name == "model.onnx"]
    fp32_files = [p for p in opened if p.name.endswith(".fp32")]
    assert len(int8_files) >= 1 and fp32_files == []
    assert info.validation["drift"]["examples"] == len(CALIBRATION)


@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_each_calibration_method_is_recorded(hydra, tmp_path, method):
    info = export_onnx(
        hydra,
        tmp_path / method,
        batch=BATCH,
        exporter="torchscript",
        precision="int8",
        int8=Int8Options(calib=CALIBRATION, calib_method=method),
    )
    assert info.int8.calibration_method == method and info.validation["drift"]["passed"]


def test_the_calibration_size_caps_a_seeded_subset(hydra, tmp_path):
    info = export_onnx(
        hydra,
        tmp_path / "capped",
        batch=BATCH,
        exporter="torchscript",
        precision="int8",
        validate=False,
        int8=Int8Options(calib=CALIBRATION, calib_size=40),
    )
    assert info.int8.num_calibration == 40 and info.validation is None


# --- a text model, its data read through the reader of hydra-export --int8-calib ------------------
def test_a_text_model_calibrates_on_a_text_file(tmp_path):
    from helpers.bert import word_tokenizer
    from helpers.text_data import FILLER, KEYWORDS

    words = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        *FILLER,
        *(w for ws in KEYWORDS.values() for w in ws),
    ]
    word_tokenizer(words, tmp_path / "tok")
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(words[4:], size=int(rng.integers(2, 9)))) for _ in range(40)]
    (tmp_path / "calib.txt").write_text("\n".join(lines) + "\n")
    backbone = tiny_bert("segments")
    hydra = fuse(backbone, random_spec(backbone, members=2, heads_per_member=2, seed=0))
    hydra.tokenizer_dir = str(tmp_path / "tok")
    info = export_onnx(
        hydra,
        tmp_path / "text-int8",
        batch=(1, 2, 8),
        exporter="torchscript",
        precision="int8",
        int8=Int8Options(calib=int8_calibration(tmp_path / "calib.txt")),
    )
    assert info.int8.num_calibration == 40 and info.int8.method == "static"
    assert info.validation["drift"]["passed"] and info.int8.quantized_ops["MatMul"] > 0
    with load_runner(tmp_path / "text-int8") as runner:
        tokens = runner.text_encoder()(["the cat", "a dog and a tree"])
        assert runner(tokens)["member_logits"].shape == (2, 2, 5)
    # an image folder is no data for it, and text none for an image model
    (tmp_path / "images" / "a").mkdir(parents=True)
    with pytest.raises(DataError, match=r"is an image folder, but the model is a bert \(text\)"):
        int8_calibration(tmp_path / "images")(tmp_path / "text-int8")


# --- errors ---------------------------------------------------------------------------------------
def test_library_errors(hydra, tmp_path):
    with pytest.raises(
        ExportError, match="holds 10 examples; static calibration needs at least 32"
    ):
        export_onnx(
            hydra,
            tmp_path / "few",
            exporter="torchscript",
            validate=False,
            precision="int8",
            int8=Int8Options(calib=CALIBRATION[:10]),
        )
    with pytest.raises(ParameterError, match=r"static INT8 calibrates .* give calib"):
        Int8Options(method="static")
    with pytest.raises(ParameterError, match="dynamic INT8 takes none"):
        Int8Options(method="dynamic", calib=CALIBRATION)
    with pytest.raises(ParameterError, match="calib_method"):
        Int8Options(calib_method="entropy")
    with pytest.raises(ExportError, match="INT8 options are for an INT8 export"):
        export_onnx(hydra, tmp_path / "x", int8=Int8Options())
    with pytest.raises(ExportError, match=r"does not read data files.*int8_calibration"):
        export_onnx(
            hydra,
            tmp_path / "y",
            exporter="torchscript",
            validate=False,
            precision="int8",
            int8=Int8Options(calib="calib/"),
        )
    assert list(tmp_path.iterdir()) == []


def test_an_einsum_graph_cannot_be_quantized_and_says_which_operator(tmp_path):
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=2, seed=0)
    einsum = fuse(backbone, spec, lowering="einsum")
    with pytest.raises(ExportError, match=r"are Einsum nodes .*the einsum lowering.*lowering"):
        export_onnx(einsum, tmp_path / "e", exporter="torchscript", precision="int8")
    assert list(tmp_path.iterdir()) == []


def _bmm_int8_export(out, options: Int8Options) -> dict:
    """A 3-member Hydra of the ``bmm`` lowering ([M, in, out] weights) exported in INT8."""
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=2, seed=0)
    return export_onnx(
        fuse(backbone, spec, lowering="bmm"),
        out,
        batch=BATCH,
        exporter="torchscript",
        precision="int8",
        int8=options,
    )


def test_the_bmm_lowering_quantizes_its_batched_weights_per_tensor(tmp_path):
    """ONNX Runtime's integer MatMul refuses per-channel scales on [M, in, out] weights (measured:
    "b zero point is not valid" at run time): those get one scale, and the file runs."""
    info = _bmm_int8_export(tmp_path / "bmm", Int8Options(calib=CALIBRATION))
    assert info.validation["drift"]["passed"] and "one scale per tensor" in info.int8.weights
    model, _ = producers(tmp_path / "bmm")
    weights = {t.name: t for t in model.graph.initializer}
    scales = [
        (len(weights[n.input[0]].dims), len(weights[n.input[1]].dims))
        for n in model.graph.node
        if n.op_type == "DequantizeLinear" and n.input[0] in weights
    ]
    assert (3, 0) in scales and (2, 1) in scales  # batched: one scale; 2-D (MLP): per channel


def test_a_dynamic_bmm_export_is_per_tensor_throughout_and_runs(tmp_path):
    """The dynamic quantizer chooses per channel or per tensor for the whole graph: with the
    bmm lowering's batched weights it is per tensor, the record says why, and the file runs."""
    from onnx import numpy_helper

    info = _bmm_int8_export(tmp_path / "bmm", Int8Options())
    assert info.validation["drift"]["passed"]
    assert info.int8.weights.startswith("int8, symmetric, one scale per tensor (the bmm")
    model = onnx.load(str(tmp_path / "bmm" / "model.onnx"))
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    points = [arrays[n.input[3]] for n in model.graph.node if n.op_type == "MatMulInteger"]
    assert points and all(p.size == 1 for p in points)


def test_a_graph_without_weight_products_cannot_be_quantized(tmp_path):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("member_logits", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["member_logits"])], "g", [x], [y])
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx"
    )
    with pytest.raises(ExportError, match=r"no MatMul or Gemm with a weight .*Relu"):
        quantize_export(tmp_path / "m.onnx", tmp_path / "q.onnx", method="dynamic")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_products_sharing_one_bias_are_all_kept_apart_and_unchanged(tmp_path):
    """Exporters share equal constants (Hydra members copied from one model have equal biases):
    two 2-D products adding one bias initializer get one widened copy and stay exact."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((8, 6)).astype(np.float32), f"w{i}")
        for i in range(2)
    ]
    bias = numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "shared.bias")
    nodes = []
    for i in range(2):
        nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"p{i}"], name=f"mm{i}"))
        nodes.append(helper.make_node("Add", [f"p{i}", "shared.bias"], [f"a{i}"], name=f"add{i}"))
    nodes.append(helper.make_node("Add", ["a0", "a1"], ["member_logits"], name="sum"))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", 8])],
        [helper.make_tensor_value_info("member_logits", TensorProto.FLOAT, ["rows", 6])],
        [*weights, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "m.onnx")
    calibration = {"x": rng.standard_normal((40, 8)).astype(np.float32)}
    record = quantize_export(
        tmp_path / "m.onnx", tmp_path / "q.onnx", method="static", calibration=calibration
    )
    assert record["bias_kept_apart"] == 2 and record["quantized_ops"] == {"MatMul": 2}
    quantized = onnx.load(str(tmp_path / "q.onnx"))
    assert sum(t.name.startswith("shared.bias_1x1") for t in quantized.graph.initializer) == 1
    feed = {"x": calibration["x"][:5]}
    ours = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])
    exact = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got, want = ours.run(None, feed)[0], exact.run(None, feed)[0]
    assert got.shape == want.shape == (5, 6)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def invoke(*argv: str) -> tuple[int, str, str]:
    from hydra_deploy.cli.export import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def tiny_export(tmp_path, *extra: str) -> tuple[int, str, str]:
    return invoke(
        *("--backbone", "vit_b16", *TINY_ARGS, "--members", "2", "--heads-per-member", "4"),
        *("--max-batch", "4", "--exporter", "torchscript", "--out", str(tmp_path / "out")),
        *extra,
    )


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--int8-calib", "calib.npz"], "--int8-calib is for INT8 exports: add --precision int8"),
        (["--int8-method", "dynamic"], "--int8-method is for INT8 exports"),
        (["--precision", "int8", "--int8-method", "static"], "give --int8-calib (a few hundred"),
        (
            ["--precision", "int8", "--int8-calib-method", "entropy"],
            "--int8-calib-method calibrates static INT8",
        ),
        (["--precision", "int8", "--int8-calib", "missing/"], "'missing' does not exist"),
        (
            ["--precision", "int8", "--int8-calib-size", "8"],
            "--int8-calib-size must be an int >= 32",
        ),
    ],
)
def test_cli_refuses_wrong_int8_flags_before_building(tmp_path, flags, expected):
    code, _, err = tiny_export(tmp_path, *flags)
    assert code == 1 and err.count("\n") == 1 and expected in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_cli_refuses_calibration_data_of_the_wrong_kind_before_building(tmp_path, monkeypatch):
    from hydra_deploy.export import exporter

    def never(*args, **kwargs):
        raise AssertionError("exported before the calibration data was checked")

    monkeypatch.setattr(exporter, "export_onnx", never)  # what hydra-export calls
    (tmp_path / "calib.tsv").write_text("0\tthe cat\n" * 40)
    code, _, err = tiny_export(
        tmp_path, "--precision", "int8", "--int8-calib", str(tmp_path / "calib.tsv")
    )
    assert code == 1 and err.count("\n") == 1, err
    assert "--int8-calib" in err and "is text, but the model is a vit model" in err
    assert not (tmp_path / "out").exists()


def test_the_family_of_a_backbone_name_is_known_before_building():
    from hydra_deploy.backbones import family_of_name

    assert family_of_name("vit_b16").name == "vit"
    assert family_of_name("hf:/models/minilm").text
    assert family_of_name("openclip:ViT-B-32").name == "openclip"


def test_cli_exports_static_int8_and_refuses_the_wrong_data(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hydra_deploy")
    np.savez(tmp_path / "calib.npz", x=CALIBRATION[:40], y=np.zeros(40, np.int64))
    code, stdout, err = tiny_export(
        tmp_path, "--precision", "int8", "--int8-calib", str(tmp_path / "calib.npz")
    )
    assert code == 0, err
    info = json.loads((tmp_path / "out" / "hydra.json").read_text())
    assert info["precision"] == "int8" and info["int8"]["method"] == "static"
    assert info["int8"]["num_calibration"] == 40
    assert "int8 vs fp32 (measured in onnxruntime (int8 file) on the calibration data)" in stdout
    verdicts = [r for r in caplog.records if "tolerances" in r.getMessage()]
    assert len(verdicts) == 1 and "within the int8 tolerances" in caplog.text  # said once
    # text data for an image model: one line that says what it takes
    (tmp_path / "calib.tsv").write_text("0\tthe cat\n" * 40)
    code, _, err = tiny_export(
        tmp_path, "--precision", "int8", "--int8-calib", str(tmp_path / "calib.tsv"), "--overwrite"
    )
    assert code == 1 and err.count("\n") == 1, err
    assert "is text, but the model is a vit model" in err and "image folder" in err
    assert json.loads((tmp_path / "out" / "hydra.json").read_text()) == info  # left as it was
    # too few examples
    np.savez(tmp_path / "few.npz", x=CALIBRATION[:5])
    code, _, err = tiny_export(
        tmp_path, "--precision", "int8", "--int8-calib", str(tmp_path / "few.npz"), "--overwrite"
    )
    assert code == 1 and err.count("\n") == 1, err
    assert f"--int8-calib {tmp_path / 'few.npz'} holds 5 examples" in err
    assert "needs at least 32" in err and "--int8-method dynamic" in err


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda p: np.savez(p / "few.npz", x=CALIBRATION[:20], y=np.zeros(20)), "20 examples"),
        (lambda p: np.save(p / "few.npy", CALIBRATION[:1]), "1 example;"),
        (lambda p: (p / "few.txt").write_text("a cat\n\nthe dog\n"), "2 text lines"),
        (lambda p: _images(p / "few", 3), "3 images"),
    ],
)
def test_cli_refuses_too_few_calibration_examples_before_building(
    tmp_path, monkeypatch, make, said
):
    from hydra_deploy.export import exporter

    def never(*args, **kwargs):
        raise AssertionError("exported before the calibration count was checked")

    monkeypatch.setattr(exporter, "export_onnx", never)
    make(tmp_path)
    data = next(p for p in tmp_path.iterdir() if p.name.startswith("few"))
    if data.suffix == ".txt":  # a text file for an image model is refused for its kind first
        from hydra_deploy.cli.export import calibration_count

        assert calibration_count(data) == (2, "text line")
        return
    code, _, err = tiny_export(tmp_path, "--precision", "int8", "--int8-calib", str(data))
    assert code == 1 and err.count("\n") == 1, err
    assert f"--int8-calib {data} holds {said}" in err and "needs at least 32" in err
    assert "--int8-method dynamic" in err and not (tmp_path / "out").exists()


def test_the_calibration_count_reads_no_pixels(tmp_path):
    from hydra_deploy.cli.export import calibration_count

    _images(tmp_path / "calib", 40)
    np.savez(tmp_path / "x.npz", x=CALIBRATION, y=np.zeros(len(CALIBRATION)))
    assert calibration_count(tmp_path / "calib") == (40, "image")
    assert calibration_count(tmp_path / "x.npz") == (len(CALIBRATION), "example")
    assert calibration_count(tmp_path / "missing.csv") is None


def _images(folder, count: int) -> None:
    from PIL import Image

    for i in range(count):
        (folder / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(folder / f"c{i % 2}" / f"{i}.png")


def test_cli_int8_without_data_is_dynamic_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hydra_deploy")
    code, _, err = tiny_export(tmp_path, "--precision", "int8", "--no-validate")
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "hydra.json").read_text())["int8"]["method"] == "dynamic"
    assert "without --int8-calib: dynamic quantization" in caplog.text


# --- a property -----------------------------------------------------------------------------------
@settings(max_examples=10)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.5, 1.5))
def test_int8_keeps_every_clear_argmax(exports, hydra, seed, scale):
    """On inputs like the calibration data, every member argmax with a clear FP32 margin (beyond
    twice the INT8 logit bound) survives static INT8."""
    x = (np.random.default_rng(seed).standard_normal((8, 3, 16, 16)) * scale).astype(np.float32)
    with torch.no_grad():
        reference = hydra(torch.from_numpy(x)).numpy()
    folder, _ = exports["static"]
    with load_runner(folder) as runner:
        got = runner(x)["member_logits"]
    tolerance = parity.tolerance_for("int8")
    for m in range(reference.shape[1]):
        clear = parity.clear_margin(reference[:, m], tolerance.logit_bound(reference[:, m]))
        assert (reference[clear, m].argmax(-1) == got[clear, m].argmax(-1)).all()


def test_options_are_frozen_and_resolve_their_method():
    assert Int8Options().method == "dynamic" and Int8Options(calib=CALIBRATION).method == "static"
    assert Int8Options(calib=CALIBRATION).calib_method == "minmax"
    with pytest.raises(dataclasses.FrozenInstanceError):
        Int8Options().method = "static"  # type: ignore[misc]


# --- calibration batches --------------------------------------------------------------------------
def _text_graph(sequence: str | int = "sequence"):
    from onnx import TensorProto, helper

    inputs = [
        helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", sequence])
        for name in ("input_ids", "attention_mask")
    ]
    out = helper.make_tensor_value_info("y", TensorProto.INT64, ["batch", sequence])
    node = helper.make_node("Add", ["input_ids", "attention_mask"], ["y"])
    return helper.make_model(helper.make_graph([node], "g", inputs, [out]))


def _right_padded(lengths, width=12):
    mask = (np.arange(width) < np.asarray(lengths)[:, None]).astype(np.int64)
    ids = (np.arange(len(lengths))[:, None] + 1) * 100 * mask + np.arange(width) * mask
    return {"input_ids": ids, "attention_mask": mask}


@given(st.lists(st.integers(1, 12), min_size=1, max_size=40))
@settings(max_examples=40, deadline=None)
def test_text_calibration_batches_group_by_length_and_cut_padding(lengths):
    """Each example appears once, whole (its tokens), in a batch cut to its longest example:
    the ranges are calibrated on tokens, not on padding columns no example of the batch uses."""
    from hydra_deploy.export.int8 import CALIBRATION_BATCH, _calibration_batches

    feeds = _right_padded(lengths)
    batches = _calibration_batches(_text_graph(), feeds)
    assert all(len(b["input_ids"]) <= CALIBRATION_BATCH for b in batches)
    seen = []
    for b in batches:
        assert b["input_ids"].shape == b["attention_mask"].shape
        assert b["attention_mask"][:, -1].any()  # no column that no example uses
        for ids, mask in zip(b["input_ids"], b["attention_mask"], strict=True):
            seen.append(tuple(ids[mask == 1]))
    want = [
        tuple(i[m == 1]) for i, m in zip(feeds["input_ids"], feeds["attention_mask"], strict=True)
    ]
    assert sorted(seen) == sorted(want)
    widths = [b["input_ids"].shape[1] for b in batches]
    assert widths == sorted(widths)  # grouped by length


def test_calibration_batches_keep_left_padding_fixed_shapes_and_images_as_given():
    from hydra_deploy.export.int8 import CALIBRATION_BATCH, _calibration_batches

    right = _right_padded([3, 9, 2, 5, 12, 1, 7, 4, 8, 6])
    left = {k: v[:, ::-1].copy() for k, v in right.items()}  # left-padded: not cut, not reordered
    for graph, feeds in ((_text_graph(), left), (_text_graph(12), right)):
        batches = _calibration_batches(graph, feeds)
        np.testing.assert_array_equal(
            np.concatenate([b["input_ids"] for b in batches]), feeds["input_ids"]
        )
    images = {"pixel_values": CALIBRATION}
    batches = _calibration_batches(_text_graph(), images)
    assert len(batches) == -(-len(CALIBRATION) // CALIBRATION_BATCH)
    np.testing.assert_array_equal(np.concatenate([b["pixel_values"] for b in batches]), CALIBRATION)
