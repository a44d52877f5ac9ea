"""load_runner: ONNX Runtime runner end to end, input checks, batch splitting, providers, TensorRT."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import shutil
import subprocess
import sys
import types
from typing import ClassVar

import numpy as np
import onnx
import pytest
import torch
from helpers.trt_standins import TrtRunner as _StandInTrtRunner
from helpers.vit import tiny_hydra
from onnx import TensorProto, helper

from hydra_deploy.engines import load_runner, tensorrt_runner
from hydra_deploy.engines import runner as runner_module
from hydra_deploy.errors import RunnerError
from hydra_deploy.export import export_onnx
from hydra_deploy.uncertainty import ensemble_scores

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


@pytest.fixture(scope="module")
def hydra():
    return tiny_hydra()


@pytest.fixture(scope="module")
def export_dir(hydra, tmp_path_factory):
    out = tmp_path_factory.mktemp("runner") / "export"
    export_onnx(hydra, out, batch=(1, 2, 4), uq_outputs=True, validate=False)
    return out


@pytest.fixture(scope="module")
def runner(export_dir):
    with load_runner(export_dir) as r:
        yield r


def inputs(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, 16, 16)).astype(np.float32)


def test_export_folder_runs_and_equals_pytorch(runner, hydra, export_dir):
    assert runner.backend == "onnxruntime" and runner.providers == ("CPUExecutionProvider",)
    assert runner.path == export_dir / "model.onnx"
    assert runner.input_names == ("pixel_values",)
    assert runner.inputs[0].shape == ("batch", 3, 16, 16) and runner.inputs[0].dtype == "float32"
    assert runner.output_names[0] == "member_logits" and "mutual_information" in runner.output_names
    assert (runner.min_batch, runner.max_batch) == (1, 4)  # hydra.json's batch_profile
    assert runner.spec == hydra.spec.to_dict() and runner.precision == "fp32"
    assert runner.preprocessing["input_size"] == [3, 16, 16]
    x = inputs(3)
    outputs = runner(x)
    with torch.no_grad():
        expected = hydra(torch.from_numpy(x)).numpy()
    assert outputs["member_logits"].shape == (3, 3, 5)
    np.testing.assert_allclose(outputs["member_logits"], expected, atol=1e-4)
    scores = ensemble_scores(outputs["member_logits"])  # the graph's head equals the numpy scores
    for name in ("probs", "msp", "predictive_entropy", "expected_entropy", "mutual_information"):
        np.testing.assert_allclose(outputs[name], scores[name], atol=1e-5, err_msg=name)


def test_onnx_path_reads_the_hydra_json_beside_it(runner, export_dir):
    other = load_runner(export_dir / "model.onnx", backend="ort", providers=["cpu"])
    assert other.info == runner.info and other.max_batch == 4
    x = inputs(2, seed=1)
    np.testing.assert_array_equal(other(x)["member_logits"], runner(x)["member_logits"])


def test_hydra_json_of_another_file_is_ignored(export_dir, tmp_path, caplog):
    shutil.copy(export_dir / "model.onnx", tmp_path / "model.onnx")
    info = json.loads((export_dir / "hydra.json").read_text())
    info["onnx_sha256"] = "0" * 64
    (tmp_path / "hydra.json").write_text(json.dumps(info))
    caplog.set_level(logging.WARNING, logger="hydra_deploy")
    other = load_runner(tmp_path / "model.onnx")
    assert other.info is None and other.max_batch is None
    assert "describes another ONNX file" in caplog.text


def _copy_export(export_dir, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(export_dir, folder)
    return folder, json.loads((folder / "hydra.json").read_text())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda info: info["spec"]["members"].pop(), "hydra.json says 2 members"),
        (lambda info: info.update(class_names=["a", "b"]), "hydra.json says 2 classes"),
        (lambda info: info.update(spec=[1, 2]), "the spec in hydra.json is malformed"),
        (
            lambda info: info.update(class_names="cat"),
            "class_names in .*hydra.json is not a list of",
        ),
    ],
    ids=["member-count", "class-count", "malformed-spec", "class-names-not-a-list"],
)
def test_metadata_that_disagrees_with_the_graph_is_refused(export_dir, tmp_path, edit, message):
    folder, info = _copy_export(export_dir, tmp_path)
    edit(info)
    (folder / "hydra.json").write_text(json.dumps(info))
    with pytest.raises(RunnerError, match=message) as caught:
        load_runner(folder)
    assert "re-export" in str(caught.value)


def test_hydra_json_of_a_future_format_or_not_an_object_is_refused(export_dir, tmp_path):
    folder, info = _copy_export(export_dir, tmp_path)
    (folder / "hydra.json").write_text(json.dumps({**info, "format": "hydra-export/9"}))
    with pytest.raises(
        RunnerError, match="has format 'hydra-export/9'; this version reads 'hydra-export/1'"
    ):
        load_runner(folder)
    (folder / "hydra.json").write_text("[1, 2]")
    with pytest.raises(RunnerError, match="holds list, not a JSON object; restore it or re-export"):
        load_runner(folder / "model.onnx")


def test_a_truncated_onnx_file_says_to_re_export(export_dir, tmp_path):
    data = (export_dir / "model.onnx").read_bytes()
    (tmp_path / "model.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        RunnerError, match=r"ONNX Runtime cannot load .*re-export it with hydra-export"
    ):
        load_runner(tmp_path / "model.onnx")


def test_onnx_metadata_that_disagrees_with_the_graph_is_refused(export_dir, tmp_path):
    model = onnx.load(str(export_dir / "model.onnx"))
    prop = next(p for p in model.metadata_props if p.key == "hydra_spec")
    spec = json.loads(prop.value)
    spec["members"] = spec["members"][:2]
    prop.value = json.dumps(spec)
    onnx.save(
        model, str(tmp_path / "model.onnx")
    )  # no hydra.json beside it: the file's own metadata
    with pytest.raises(
        RunnerError, match="the file's hydra_spec metadata says 2 members, but the graph"
    ):
        load_runner(tmp_path / "model.onnx")
    prop.value = "{not json"
    onnx.save(model, str(tmp_path / "model.onnx"))
    with pytest.raises(RunnerError, match="hydra_spec metadata is not JSON"):
        load_runner(tmp_path / "model.onnx")


def test_big_batches_are_split_and_equal_one_pass(runner, export_dir):
    x = inputs(11, seed=2)
    split = runner(x)  # max batch 4: chunks of 4, 4, 3
    one_by_one = runner(x, batch_size=1)
    unlimited = load_runner(export_dir / "model.onnx")
    unlimited.max_batch = None  # ONNX Runtime itself takes any batch: one pass as the reference
    whole = unlimited(x)
    for name, value in whole.items():
        assert split[name].shape == value.shape
        np.testing.assert_allclose(split[name], value, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(one_by_one[name], value, atol=1e-6, err_msg=name)
    with pytest.raises(RunnerError, match="batch_size 5 exceeds the model's maximum batch 4"):
        runner(x, batch_size=5)
    with pytest.raises(RunnerError, match="batch_size must be at least 1"):
        runner(x, batch_size=0)


@pytest.mark.parametrize(
    "value, message",
    [
        (np.zeros((0, 3, 16, 16), np.float32), r"'pixel_values' is an empty batch"),
        (
            np.zeros((3, 16, 16), np.float32),
            r"must have 4 dimensions .* got shape \(3, 16, 16\) \(add the batch axis",
        ),
        (
            np.zeros((2, 3, 16, 8), np.float32),
            r"must have size 16 on axis 3 .* got shape \(2, 3, 16, 8\)",
        ),
        (np.zeros((2, 1, 16, 16), np.float32), r"must have size 3 on axis 1"),
        (np.zeros((2, 3, 16, 16), np.uint8), r"must be float32, got uint8 \(raw pixels\?"),
        (np.zeros((2, 3, 16, 16), bool), r"must be float32, got bool"),
        (np.full((2, 3, 16, 16), np.nan, np.float32), r"NaN or infinite values in 2 of 2 example"),
        (
            {"x": np.zeros((1, 3, 16, 16), np.float32)},
            r"missing \['pixel_values'\]; unexpected \['x'\]; the model takes \['pixel_values'\]",
        ),
        (
            {"pixel_values": np.zeros((1, 3, 16, 16), np.float32), "extra": 1},
            r"unexpected \['extra'\]",
        ),
    ],
    ids=["empty", "rank", "fixed-dim", "channels", "uint8", "bool", "nan", "names", "extra"],
)
def test_inputs_are_checked_before_the_call(runner, value, message):
    with pytest.raises(RunnerError, match=message):
        runner(value)


def test_float64_is_cast_and_nonfinite_allowed_on_request(runner):
    x = inputs(2, seed=3)
    np.testing.assert_array_equal(
        runner(x.astype(np.float64))["member_logits"], runner(x)["member_logits"]
    )
    x[1, 0, 0, 0] = np.inf
    with pytest.raises(RunnerError, match="1 of 2 example"):
        runner(x)
    assert runner(x, allow_nonfinite=True)["member_logits"].shape == (2, 3, 5)


def test_providers(export_dir):
    import onnxruntime as ort

    available = ort.get_available_providers()
    default = runner_module.resolve_providers(None, available)
    assert "TensorrtExecutionProvider" not in default and default[-1] == "CPUExecutionProvider"
    assert runner_module.resolve_providers(["cpu", ("CPU", {"a": "1"})], available) == [
        "CPUExecutionProvider",
        ("CPUExecutionProvider", {"a": "1"}),
    ]
    with pytest.raises(
        RunnerError, match=r"provider 'nope' is not available.*available: .*CPUExecutionProvider"
    ):
        load_runner(export_dir, providers=["nope"])
    if "CUDAExecutionProvider" not in available:
        with pytest.raises(RunnerError, match=r"provider 'cuda' is not available.*onnxruntime-gpu"):
            load_runner(export_dir, providers="cuda")
    with pytest.raises(RunnerError, match="providers are ONNX Runtime's"):
        load_runner(_fake_engine_file(export_dir.parent), providers=["cpu"])


def _stand_in_engine(folder, sidecar: dict, name: str = "vit.fp16.engine"):
    """An engine file the stand-in TensorRT deserializes, with its JSON sidecar."""
    path = folder / name
    path.write_bytes(b"serialized")
    path.with_suffix(".json").write_text(json.dumps(sidecar))
    return path


def _fake_engine_file(folder):
    path = folder / "fake.engine"
    path.write_bytes(b"not an engine")
    return path


def test_paths_and_backends_are_checked(export_dir, tmp_path):
    with pytest.raises(RunnerError, match="does not exist; give an export folder"):
        load_runner(tmp_path / "missing")
    with pytest.raises(RunnerError, match=r"not an export folder: model.onnx is missing"):
        load_runner(tmp_path)
    with pytest.raises(RunnerError, match="build a TensorRT engine from it first"):
        load_runner(export_dir / "model.onnx", backend="tensorrt")
    with pytest.raises(RunnerError, match=r"needs one engine file in .*found none"):
        load_runner(export_dir, backend="tensorrt")
    with pytest.raises(RunnerError, match="unknown backend 'openvino'"):
        load_runner(export_dir, backend="openvino")
    (tmp_path / "model.pt").write_bytes(b"")
    with pytest.raises(RunnerError, match="cannot tell how to run"):
        load_runner(tmp_path / "model.pt")
    with pytest.raises(RunnerError, match=r"ONNX Runtime runs the .onnx file"):
        load_runner(_fake_engine_file(tmp_path), backend="onnxruntime")


@pytest.mark.skipif(
    HAS_TENSORRT, reason="TensorRT is installed: the missing-TensorRT error cannot show"
)
def test_engine_without_tensorrt_says_what_to_do(tmp_path):
    with pytest.raises(
        RunnerError, match=r"TensorRT is not installed .*hydra-deploy\[trt\].*ONNX Runtime"
    ):
        load_runner(_fake_engine_file(tmp_path))


def test_bf16_file_is_refused_with_the_reason(tmp_path):
    """ONNX Runtime's CPU kernels lack BF16 MatMul: the error says so and what to do."""
    weight = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.eye(4, dtype=np.float32).ravel())
    nodes = [
        helper.make_node("Cast", ["pixel_values"], ["xb"], to=TensorProto.BFLOAT16),
        helper.make_node("Cast", ["w"], ["wb"], to=TensorProto.BFLOAT16),
        helper.make_node("MatMul", ["xb", "wb"], ["yb"]),
        helper.make_node("Cast", ["yb"], ["member_logits"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes,
        "bf16",
        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("member_logits", TensorProto.FLOAT, ["batch", 4])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, tmp_path / "model.onnx")
    (tmp_path / "hydra.json").write_text(
        json.dumps({"format": "hydra-export/1", "precision": "bf16"})
    )
    with pytest.raises(RunnerError, match=r"do not implement BF16 MatMul.*hydra-build"):
        load_runner(tmp_path)


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A three-input int64 graph (as a BERT export): member_logits = float(ids + mask + types)."""
    ids, mask, types = ("input_ids", "attention_mask", "token_type_ids")
    nodes = [
        helper.make_node("Add", [ids, mask], ["s"]),
        helper.make_node("Add", ["s", types], ["t"]),
        helper.make_node("Cast", ["t"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["f", "axes"], ["member_logits"]),
    ]
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    graph = helper.make_graph(
        nodes,
        "text",
        [
            helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"])
            for n in (ids, mask, types)
        ],
        [helper.make_tensor_value_info("member_logits", TensorProto.FLOAT, ["batch", 1, "seq"])],
        [axes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    path = tmp_path_factory.mktemp("text") / "text.onnx"
    onnx.save(model, path)
    return load_runner(path)


def test_text_inputs_are_cast_and_token_type_ids_default_to_zeros(text_model):
    ids = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32)
    mask = np.ones((2, 3), dtype=np.int64)
    out = text_model({"input_ids": ids, "attention_mask": mask})["member_logits"]
    np.testing.assert_array_equal(out[:, 0], ids + 1)
    with pytest.raises(RunnerError, match=r"missing \['attention_mask'\]"):
        text_model({"input_ids": ids})
    with pytest.raises(
        RunnerError, match="must be int64, got float64 \\(token ids must be integers\\)"
    ):
        text_model({"input_ids": ids * 1.0, "attention_mask": mask})
    with pytest.raises(RunnerError, match="'attention_mask' has batch 1 but 'input_ids' has 2"):
        text_model({"input_ids": ids, "attention_mask": mask[:1]})
    with pytest.raises(RunnerError, match=r"takes 3 inputs .* pass a dict"):
        text_model(ids)


# --- the TensorRT backend's own logic, on a stand-in for TensorRT that runs ONNX Runtime ---------
class _FakeEngine:
    def __init__(self, session, profile):
        self.session, self.profile = session, profile
        self.names = [a.name for a in session.get_inputs()] + [
            a.name for a in session.get_outputs()
        ]
        self.num_io_tensors = len(self.names)

    def get_tensor_name(self, index):
        return self.names[index]

    def get_tensor_mode(self, name):
        inputs = [a.name for a in self.session.get_inputs()]
        return "INPUT" if name in inputs else "OUTPUT"

    def get_tensor_shape(self, name):
        arg = [a for a in self.session.get_inputs() + self.session.get_outputs() if a.name == name]
        return [d if isinstance(d, int) else -1 for d in arg[0].shape]

    def get_tensor_dtype(self, name):
        from helpers import trt_standins

        return trt_standins.DataType.FLOAT  # a tensorrt.DataType member, as the real engine's

    def get_tensor_profile_shape(self, name, index):
        return [(b, 3, 16, 16) for b in self.profile]


class _FakeTrtRunner(_StandInTrtRunner):
    """The stand-in TrtRunner over an ORT session, checking each batch against the profile."""

    calls: ClassVar[list[int]] = []

    def infer(self, feed, check_inputs=True):
        batch = len(feed["pixel_values"])
        low, _, high = (p[0] for p in self.engine.get_tensor_profile_shape("pixel_values", 0))
        assert low <= batch <= high, f"batch {batch} outside the profile {low}..{high}"
        _FakeTrtRunner.calls.append(batch)
        names = [o.name for o in self.engine.session.get_outputs()]
        return dict(zip(names, self.engine.session.run(None, feed), strict=True))


@pytest.fixture
def fake_tensorrt(monkeypatch, runner):
    def runtime(logger):
        engine = _FakeEngine(runner.session, profile=(2, 2, 4))
        return types.SimpleNamespace(deserialize_cuda_engine=lambda data: engine)

    from helpers import trt_standins

    fake = trt_standins.tensorrt_module("10.13.0.35")  # nptype, DataType, TensorIOMode, Logger
    fake.Runtime = runtime
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    monkeypatch.setattr(tensorrt_runner, "_trt_runner_class", lambda: _FakeTrtRunner)
    _FakeTrtRunner.calls = []
    return fake


def test_engine_runner_reads_its_profile_pads_and_splits(fake_tensorrt, runner, export_dir):
    engine_path = _stand_in_engine(export_dir.parent, {"precision": "fp16", "export_dir": "export"})
    engine = load_runner(engine_path)
    assert engine.backend == "tensorrt" and (engine.min_batch, engine.max_batch) == (2, 4)
    assert engine.inputs[0].shape == (None, 3, 16, 16) and engine.precision == "fp16"
    assert engine.info["spec"] == runner.spec  # hydra.json found through the sidecar
    x = inputs(7, seed=4)
    outputs = engine(x)  # 4, then 3; and a single example padded up to the minimum of 2
    one = engine(x[:1])
    assert _FakeTrtRunner.calls == [4, 3, 2]
    np.testing.assert_allclose(outputs["member_logits"], runner(x)["member_logits"], atol=1e-6)
    np.testing.assert_allclose(one["member_logits"], outputs["member_logits"][:1], atol=1e-6)
    engine.close()
    assert not engine._trt_runner.is_active


SIDECAR = {
    "tensorrt_version": "10.13.0.35",
    "gpu": {"name": "NVIDIA H200", "compute_capability": "9.0"},
}


@pytest.mark.parametrize(
    ("version", "capability", "message"),
    [
        ("10.13.0.35", "9.0", None),
        ("10.13.0.1", "9.0", None),  # the build number does not matter
        (None, None, None),  # nothing known here: TensorRT itself decides
        ("10.3.0", "9.0", "built for TensorRT 10.13.0.35 (this machine has 10.3.0)"),
        ("10.13.0.35", "8.7", "NVIDIA H200 of compute capability 9.0 (this GPU has 8.7)"),
    ],
)
def test_engine_target_mismatch_reads_the_sidecar(version, capability, message):
    found = runner_module.engine_target_mismatch(SIDECAR, version, capability)
    if message is None:
        assert found is None
    else:
        assert message in found and "rebuild it here with hydra-build EXPORT_DIR" in found
    assert runner_module.engine_target_mismatch({"precision": "fp16"}, "8.6.1", "8.7") is None
    assert runner_module.engine_target_mismatch(None, "8.6.1", "8.7") is None


def test_an_engine_for_another_tensorrt_is_refused_before_loading(
    fake_tensorrt, export_dir, monkeypatch
):
    fake_tensorrt.__version__ = "10.3.0"
    monkeypatch.setattr(tensorrt_runner, "_compute_capability_here", lambda: "8.7")
    engine_path = _stand_in_engine(export_dir.parent, SIDECAR, "other.engine")
    with pytest.raises(RunnerError) as caught:
        load_runner(engine_path)
    text = str(caught.value)
    assert (
        "TensorRT 10.13.0.35 (this machine has 10.3.0) and NVIDIA H200 of compute capability 9.0 (this GPU has 8.7)"
        in text
    )
    assert "rebuild it here with hydra-build" in text


@pytest.mark.skipif(
    not HAS_TENSORRT,
    reason="TensorRT is not installed: pip install 'hydra-deploy[trt]' on an NVIDIA GPU",
)
def test_real_tensorrt_engine_equals_onnx_runtime(runner, export_dir, tmp_path):  # pragma: no cover
    from polygraphy.backend.trt import (
        CreateConfig,
        EngineFromNetwork,
        NetworkFromOnnxPath,
        Profile,
        SaveEngine,
    )

    profile = Profile().add(
        "pixel_values", min=(1, 3, 16, 16), opt=(2, 3, 16, 16), max=(4, 3, 16, 16)
    )
    build = EngineFromNetwork(
        NetworkFromOnnxPath(str(export_dir / "model.onnx")), config=CreateConfig(profiles=[profile])
    )
    SaveEngine(build, str(tmp_path / "model.engine"))()
    with load_runner(tmp_path / "model.engine") as engine:
        x = inputs(6, seed=5)
        np.testing.assert_allclose(
            engine(x)["member_logits"], runner(x)["member_logits"], atol=1e-3
        )


def test_runner_imports_without_torch():
    code = (
        "import sys, hydra_deploy.engines.runner, hydra_deploy.engines.preprocess, "
        "hydra_deploy.uncertainty; from hydra_deploy.engines import load_runner; "
        "print(' '.join(sorted(sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    modules = set(result.stdout.split())
    assert "hydra_deploy.engines.runner" in modules
    assert not {"torch", "timm", "transformers", "onnxruntime", "tensorrt", "PIL"} & modules


def test_an_engine_applies_decisions_fitted_on_its_model_onnx(
    fake_tensorrt, runner, export_dir, tmp_path, caplog
):
    """An engine's decisions hold when its sidecar names the model.onnx they were fitted on;
    hydra-calibrate --engine fits them on the engine's own outputs."""
    from hydra_deploy.cli.calibrate import main as calibrate_main
    from hydra_deploy.export_folder import file_sha256, read_info

    folder = tmp_path / "export"
    shutil.copytree(export_dir, folder)
    sha = file_sha256(folder / "model.onnx")
    engine_path = _stand_in_engine(folder, {"precision": "fp16", "onnx_sha256": sha})
    sidecar = engine_path.with_suffix(".json")
    x = inputs(400, seed=9)
    predicted = runner(x)["member_logits"].mean(axis=1).argmax(axis=1)
    y = np.where(np.random.default_rng(0).random(400) < 0.9, predicted, 0)
    np.savez(tmp_path / "calib.npz", x=x, y=y)
    code = calibrate_main(
        [
            str(folder),
            "--data",
            str(tmp_path / "calib.npz"),
            "--engine",
            str(engine_path),
            "--quiet",
        ]
    )
    assert code == 0
    record = read_info(folder).decisions
    assert record is not None and record.onnx_sha256 == sha
    assert (record.backend, record.precision) == ("tensorrt", "fp16")
    assert record.engine_sha256 == file_sha256(engine_path)
    with load_runner(engine_path) as engine:
        assert engine.decisions == record
    # ONNX Runtime refuses the engine's record: the refit command has no --engine
    with pytest.raises(RunnerError) as caught:
        load_runner(folder)
    text = str(caught.value)
    assert "fitted on the outputs of a TensorRT engine in fp16 (sha256" in text
    assert "not on ONNX Runtime outputs of the fp32 model.onnx" in text
    assert f"hydra-calibrate {folder} --data LABELLED --overwrite" in text
    assert "allow_decisions_mismatch=True" in text
    # another engine file (another build of the same model.onnx) refuses it too
    engine_path.write_bytes(b"serialized again")
    with pytest.raises(RunnerError, match=r"the engine file of sha256 .*, this one is") as caught:
        load_runner(engine_path)
    assert f"--engine {engine_path} --overwrite" in str(caught.value)
    with caplog.at_level(logging.WARNING, logger="hydra_deploy"):
        with load_runner(engine_path, allow_decisions_mismatch=True) as engine:
            assert engine.decisions == record
        with load_runner(folder, allow_decisions_mismatch=True) as runner_:
            assert runner_.decisions == record
    warned = [r.getMessage() for r in caplog.records if "as asked" in r.getMessage()]
    assert len(warned) == 2
    assert "are not guaranteed for these" in warned[1] and "set coverage >= 0.9" in warned[1]
    caplog.clear()
    engine_path.write_bytes(b"serialized")
    sidecar.write_text(json.dumps({"precision": "fp16", "onnx_sha256": "f" * 64}))
    with pytest.raises(RunnerError, match=r"fitted on another model\.onnx"):
        load_runner(engine_path)
    sidecar.write_text(json.dumps({"precision": "fp16"}))  # trtexec-built: cannot tell
    with (
        caplog.at_level(logging.WARNING, logger="hydra_deploy"),
        load_runner(engine_path) as engine,
    ):
        assert engine.decisions is None
    assert "decisions" in caplog.text and "hydra-build" in caplog.text


def _calibrated_copy(export_dir, tmp_path):
    """A copy of the export with decisions fitted in ONNX Runtime (FP32) in its hydra.json."""
    from helpers.decisions import calibrate_export

    folder = tmp_path / "export"
    shutil.copytree(export_dir, folder)
    record = calibrate_export(folder, count=400, risk=None).record
    return folder, record


def test_an_fp16_engine_refuses_a_record_fitted_on_fp32_onnx_runtime_unless_asked(
    fake_tensorrt, export_dir, tmp_path, caplog
):
    """The guarantees hold for the numbers they were fitted on: an FP16 engine built from the
    same model.onnx gives other numbers, so it refuses the record with the command that fits it
    on the engine, unless asked to apply it (then a warning says what is no longer covered)."""
    from hydra_deploy.cli.run import main as run_main
    from hydra_deploy.export_folder import file_sha256

    folder, record = _calibrated_copy(export_dir, tmp_path)
    engine_path = _stand_in_engine(
        folder, {"precision": "fp16", "onnx_sha256": file_sha256(folder / "model.onnx")}
    )
    with load_runner(folder) as runner:  # ONNX Runtime, as fitted
        assert runner.decisions == record
    with pytest.raises(RunnerError) as caught:
        load_runner(engine_path)
    text = str(caught.value)
    assert "fitted on ONNX Runtime outputs of the fp32 model.onnx" in text
    assert "not on the outputs of a TensorRT engine in fp16 (" in text
    assert "backend onnxruntime, this runner is tensorrt" in text
    assert "precision fp32, this runner computes in fp16" in text
    assert f"hydra-calibrate {folder} --data LABELLED --engine {engine_path} --overwrite" in text
    with load_runner(engine_path, decisions=False) as engine:  # raw scores still run
        assert engine.decisions is None
    caplog.set_level(logging.WARNING, logger="hydra_deploy")
    with load_runner(engine_path, allow_decisions_mismatch=True) as engine:
        assert engine.decisions == record
    (warning,) = [r.getMessage() for r in caplog.records if "as asked" in r.getMessage()]
    assert "fitted on ONNX Runtime outputs of the fp32 model.onnx" in warning
    assert "the set coverage >= 0.9 and the OOD false-alarm rate <= 0.05" in warning
    assert "are not guaranteed for these" in warning

    # hydra-run: one line that names the flag; with it, the decisions and the warning
    np.savez(tmp_path / "x.npz", x=inputs(3, seed=2))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_main([str(engine_path), str(tmp_path / "x.npz"), "--json", "-"])
    assert code == 1 and "\n" not in err.getvalue().strip()
    assert "--allow-decisions-mismatch" in err.getvalue()
    assert f"--engine {engine_path} --overwrite" in err.getvalue()
    out, err = io.StringIO(), io.StringIO()
    caplog.clear()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        argv = [str(engine_path), str(tmp_path / "x.npz"), "--json", "-"]
        code = run_main([*argv, "--allow-decisions-mismatch"])
    assert code == 0, err.getvalue()
    assert "confidence" in json.loads(out.getvalue())["results"][0]
    (warning,) = [r.getMessage() for r in caplog.records if "as asked" in r.getMessage()]
    assert "(--allow-decisions-mismatch)" in warning and "not guaranteed for these" in warning


def test_the_folders_model_onnx_refuses_decisions_fitted_on_another_file(
    export_dir, tmp_path, caplog
):
    """load_runner(folder / "model.onnx") refuses the decisions as loading the folder does when
    model.onnx is no longer the file they were fitted on (before: it ran without them)."""
    folder, _ = _calibrated_copy(export_dir, tmp_path)
    model = onnx.load(str(folder / "model.onnx"))
    onnx.helper.set_model_props(model, {"edited": "by hand"})
    onnx.save(model, str(folder / "model.onnx"))
    for target in (folder, folder / "model.onnx"):
        with pytest.raises(RunnerError, match=r"fitted on another model\.onnx .*hydra-calibrate"):
            load_runner(target)
    caplog.set_level(logging.WARNING, logger="hydra_deploy")
    with load_runner(folder / "model.onnx", decisions=False) as runner:  # raw scores: as before
        assert runner.decisions is None and runner.info is None
    assert "describes another ONNX file" in caplog.text
