"""Triton model repositories: configs parse with Triton's own ModelConfig protobuf and match the
ONNX file (names, types, shapes, batch), the model answers the shapes the config declares, writes
are all-or-nothing, and hydra-export/hydra-build --triton refuse what Triton could not load."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import numpy as np
import onnx
import pytest
from helpers.bert import tiny_bert
from helpers.vit import tiny_vit

from hydra_deploy.cli import build as build_cli
from hydra_deploy.cli import export as export_cli
from hydra_deploy.engines import load_runner
from hydra_deploy.errors import ServeError
from hydra_deploy.export import export_onnx
from hydra_deploy.fusion import fuse
from hydra_deploy.serve import triton_repo
from hydra_deploy.serve.triton_repo import parse_config, write_triton_repository
from hydra_deploy.specs import HydraSpec

model_config_pb2 = pytest.importorskip(
    "tritonclient.grpc.model_config_pb2", reason="tritonclient (the [serve] extra) is not installed"
)
CLASSES = ["ant", "bee", "cat", "dog", "eel"]
ONNX_TO_TRITON = {
    onnx.TensorProto.FLOAT: model_config_pb2.TYPE_FP32,
    onnx.TensorProto.INT64: model_config_pb2.TYPE_INT64,
}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{"vit": a vision export with the ensemble head, "bert": a text one, "plain": no head}."""
    root = tmp_path_factory.mktemp("triton")
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=2, seed=1)
    hydra = fuse(backbone, spec)
    export_onnx(
        hydra, root / "vit", batch=(1, 2, 4), class_names=CLASSES, validate=False, uq_outputs=True
    )
    export_onnx(hydra, root / "plain", batch=(1, 2, 4), validate=False)
    text = tiny_bert("segments")
    text_spec = HydraSpec.random(
        text.name,
        text.num_layers,
        text.num_heads,
        text.head_dim,
        members=2,
        heads_per_member=2,
        seed=0,
    )
    export_onnx(
        fuse(text, text_spec), root / "bert", batch=(1, 3, 6), validate=False, uq_outputs=True
    )
    return {"vit": root / "vit", "bert": root / "bert", "plain": root / "plain"}


def load_config(folder):
    return parse_config((folder / "config.pbtxt").read_text(encoding="utf-8"))


def onnx_dims(value_info) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def assert_matches_onnx(config, onnx_path, max_batch):
    """Every graph input and output is declared, in order, with its type and per-example shape."""
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    assert config.max_batch_size == max_batch
    for declared, actual in [(config.input, graph.input), (config.output, graph.output)]:
        assert [t.name for t in declared] == [v.name for v in actual]
        for tensor, value in zip(declared, actual, strict=True):
            assert tensor.data_type == ONNX_TO_TRITON[value.type.tensor_type.elem_type]
            shape = onnx_dims(value)
            assert isinstance(shape[0], str), "the batch axis is dynamic"  # Triton adds it
            expected = [-1 if isinstance(d, str) else d for d in shape[1:]]
            if expected:
                assert list(tensor.dims) == expected and not tensor.HasField("reshape")
            else:  # [batch] in the model: dims [1] reshaped to a scalar per example
                assert list(tensor.dims) == [1]
                assert tensor.HasField("reshape") and list(tensor.reshape.shape) == []


@pytest.mark.parametrize("family", ["vit", "bert"])
def test_onnx_config_parses_and_matches_the_model(exports, family, tmp_path):
    result = write_triton_repository(exports[family], tmp_path / "repo")
    folder = tmp_path / "repo" / family
    assert [m["name"] for m in result["models"]] == [family]
    config = load_config(folder)
    info = json.loads((exports[family] / "hydra.json").read_text())
    profile = info["batch_profile"]
    assert config.name == family and config.platform == "onnxruntime_onnx"
    assert_matches_onnx(config, folder / "1" / "model.onnx", max_batch=profile["max"])
    names = [t.name for t in config.output]
    assert names[0] == "member_logits" and {"probs", "msp", "mutual_information"} <= set(names)
    assert list(config.dynamic_batching.preferred_batch_size) == [profile["opt"], profile["max"]]
    assert config.dynamic_batching.max_queue_delay_microseconds == 100
    [group] = config.instance_group
    assert (group.count, group.kind) == (1, model_config_pb2.ModelInstanceGroup.KIND_AUTO)
    assert config.default_model_filename == "model.onnx"
    assert (folder / "1" / "model.onnx").read_bytes() == (
        exports[family] / "model.onnx"
    ).read_bytes()
    assert json.loads((folder / "hydra.json").read_text()) == info
    readme = (tmp_path / "repo" / "README.md").read_text()
    assert f"`{family}`" in readme and "--model-repository" in readme


def test_labels_give_triton_classification_on_probs(exports, tmp_path):
    write_triton_repository(exports["vit"], tmp_path / "repo")
    config = load_config(tmp_path / "repo" / "vit")
    labelled = {t.name: t.label_filename for t in config.output if t.label_filename}
    assert labelled == {"probs": "labels.txt"}
    assert (tmp_path / "repo" / "vit" / "labels.txt").read_text().splitlines() == CLASSES


@pytest.mark.parametrize("family", ["vit", "bert"])
def test_the_model_answers_the_shapes_its_config_declares(exports, family, tmp_path):
    """Run the repository's model.onnx at Triton's max batch: each output is [batch] + dims (or
    [batch] for the reshaped scalars), as Triton will check."""
    write_triton_repository(exports[family], tmp_path / "repo")
    folder = tmp_path / "repo" / family
    config = load_config(folder)
    runner = load_runner(folder / "1" / "model.onnx")
    batch, rng = config.max_batch_size, np.random.default_rng(0)
    if family == "vit":
        feed = rng.standard_normal((batch, *config.input[0].dims)).astype(np.float32)
    else:
        feed = {t.name: rng.integers(0, 12, (batch, 7)) for t in config.input}
        feed["attention_mask"] = np.ones((batch, 7), np.int64)
        feed["token_type_ids"] = np.zeros((batch, 7), np.int64)
    outputs = runner(feed)
    for tensor in config.output:
        per_example = (
            list(tensor.reshape.shape) if tensor.HasField("reshape") else list(tensor.dims)
        )
        assert list(outputs[tensor.name].shape) == [batch, *per_example], tensor.name


def fake_engine(export_dir, folder, profile, sha=None):
    """An engine file and the sidecar hydra-build writes beside it (TensorRT is not needed to
    write a repository; Triton deserializes the plan)."""
    info = json.loads((export_dir / "hydra.json").read_text())
    folder.mkdir(parents=True, exist_ok=True)
    engine = folder / "model.abc.fp16.h200-sm90.trt10.13.engine"
    engine.write_bytes(b"not really a TensorRT plan" * 10)
    sidecar = {
        "format": "hydra-engine/1",
        "engine": engine.name,
        "precision": "fp16",
        "gpu": {"name": "NVIDIA H200", "compute_capability": "9.0"},
        "tensorrt_version": "10.13.0.35",
        "batch_profile": profile,
        "inputs": info["inputs"],
        "outputs": info["outputs"],
        "onnx_sha256": sha or info["onnx_sha256"],
    }
    engine.with_suffix(".json").write_text(json.dumps(sidecar))
    return engine


def test_engine_becomes_a_tensorrt_plan_model(exports, tmp_path):
    engine = fake_engine(exports["vit"], tmp_path / "eng", {"min": 1, "opt": 3, "max": 3})
    result = write_triton_repository(exports["vit"], tmp_path / "repo", engine=engine)
    assert [(m["name"], m["platform"]) for m in result["models"]] == [
        ("vit", "onnxruntime_onnx"),
        ("vit-trt", "tensorrt_plan"),
    ]
    folder = tmp_path / "repo" / "vit-trt"
    config = load_config(folder)
    assert config.platform == "tensorrt_plan" and config.default_model_filename == "model.plan"
    assert_matches_onnx(config, exports["vit"] / "model.onnx", max_batch=3)  # the engine's max
    assert list(config.dynamic_batching.preferred_batch_size) == [3]
    assert [g.kind for g in config.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_GPU]
    assert (folder / "1" / "model.plan").read_bytes() == engine.read_bytes()
    assert json.loads((folder / "engine.json").read_text())["tensorrt_version"] == "10.13.0.35"
    readme = (tmp_path / "repo" / "README.md").read_text()
    assert "`vit-trt` | TensorRT plan; built for NVIDIA H200 with TensorRT 10.13.0.35" in readme


def test_engine_without_sidecar_uses_the_export_profile(exports, tmp_path):
    engine = tmp_path / "trtexec.plan"
    engine.write_bytes(b"plan")
    write_triton_repository(exports["vit"], tmp_path / "repo", engine=engine)
    assert load_config(tmp_path / "repo" / "vit-trt").max_batch_size == 4


# Issue 18, finding 6: TensorRT 8.6 has no INT64; Triton's TensorRT backend refuses a config whose
# data_type differs from the engine's, so the plan's config takes the engine's dtypes.
@pytest.mark.parametrize("version, ids", [("8.6.1.6", "TYPE_INT32"), ("10.3.0.30", "TYPE_INT64")])
def test_a_text_engine_config_declares_the_engines_dtypes(
    exports, tmp_path, monkeypatch, version, ids
):
    import sys

    from helpers import trt_standins

    from hydra_deploy.engines.tensorrt import GpuInfo, execute_plan, plan_build

    monkeypatch.setitem(sys.modules, "tensorrt", trt_standins.tensorrt_module(version))
    monkeypatch.setitem(
        sys.modules, "polygraphy.backend.trt", trt_standins.polygraphy_module(version)
    )
    plan = plan_build(
        exports["bert"],
        precision="fp16",
        trt_version=version,
        gpu=GpuInfo("Orin (nvgpu)", 8, 7),
        out=tmp_path / "eng",
    )
    execute_plan(plan)
    write_triton_repository(exports["bert"], tmp_path / "repo", engine=plan.engine_path)
    name = lambda t: model_config_pb2.DataType.Name(t.data_type)  # noqa: E731
    onnx_model, trt_model = (load_config(tmp_path / "repo" / n) for n in ("bert", "bert-trt"))
    assert {name(t) for t in onnx_model.input} == {"TYPE_INT64"}  # what the ONNX file takes
    assert {name(t) for t in trt_model.input} == {ids}  # what the engine takes
    assert [name(t) for t in trt_model.output] == [name(t) for t in onnx_model.output]


def test_a_trtexec_86_engine_without_sidecar_takes_int32(exports, tmp_path):
    engine = tmp_path / "model.abc.fp16.orin-sm87.trt8.6.engine"
    engine.write_bytes(b"plan")
    write_triton_repository(exports["bert"], tmp_path / "repo", engine=engine)
    config = load_config(tmp_path / "repo" / "bert-trt")
    assert {model_config_pb2.DataType.Name(t.data_type) for t in config.input} == {"TYPE_INT32"}


def test_settings_reach_the_config(exports, tmp_path):
    write_triton_repository(
        exports["vit"],
        tmp_path / "repo",
        model_name="hydra.v2",
        max_batch=3,
        preferred_batch=[3, 1],
        queue_delay_us=2500,
        instances=2,
        kind="cpu",
    )
    config = load_config(tmp_path / "repo" / "hydra.v2")
    assert config.name == "hydra.v2" and config.max_batch_size == 3
    assert list(config.dynamic_batching.preferred_batch_size) == [1, 3]
    assert config.dynamic_batching.max_queue_delay_microseconds == 2500
    assert [(g.count, g.kind) for g in config.instance_group] == [
        (2, model_config_pb2.ModelInstanceGroup.KIND_CPU)
    ]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_batch=5), "above the export's profile maximum 4"),
        (dict(max_batch=0), "max batch must be an integer >= 1"),
        (dict(preferred_batch=[2, 8]), "must be between 1 and the max batch 4"),
        (dict(instances=0), "instances must be an integer >= 1"),
        (dict(queue_delay_us=-1), "queue delay (microseconds) must be an integer >= 0"),
        (dict(kind="tpu"), "unknown instance kind 'tpu'"),
        (dict(model_name="my model"), "is not usable: use letters"),
        (dict(model_name="../up"), "is not usable"),
    ],
)
def test_impossible_settings_are_refused_before_writing(exports, tmp_path, kwargs, message):
    with pytest.raises(ServeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        write_triton_repository(exports["vit"], tmp_path / "repo", **kwargs)
    assert not (tmp_path / "repo").exists()


def test_export_without_the_ensemble_head_is_refused(exports, tmp_path):
    with pytest.raises(ServeError, match=r"no uncertainty outputs in its graph.*--uq-outputs"):
        write_triton_repository(exports["plain"], tmp_path / "repo")


def test_engine_of_another_onnx_is_refused(exports, tmp_path):
    engine = fake_engine(
        exports["vit"], tmp_path / "eng", {"min": 1, "opt": 2, "max": 4}, sha="0" * 64
    )
    with pytest.raises(ServeError, match="built from another ONNX file"):
        write_triton_repository(exports["vit"], tmp_path / "repo", engine=engine)
    assert not (tmp_path / "repo").exists()


def test_existing_models_are_refused_then_replaced_and_others_kept(exports, tmp_path):
    repo = tmp_path / "repo"
    write_triton_repository(exports["vit"], repo)
    (repo / "other").mkdir()
    (repo / "other" / "config.pbtxt").write_text('name: "other"\n')
    with pytest.raises(ServeError, match=r"already holds model.*vit; pass --overwrite"):
        write_triton_repository(exports["vit"], repo)
    write_triton_repository(exports["vit"], repo, overwrite=True, preferred_batch=[4])
    assert list(load_config(repo / "vit").dynamic_batching.preferred_batch_size) == [4]
    assert (repo / "other" / "config.pbtxt").read_text() == 'name: "other"\n'
    assert sorted(p.name for p in repo.iterdir()) == ["README.md", "other", "vit"]


def test_a_failed_write_leaves_no_model_and_keeps_the_old_one(exports, tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    write_triton_repository(exports["vit"], repo)
    before = (repo / "vit" / "config.pbtxt").read_text()
    engine = fake_engine(exports["vit"], tmp_path / "eng", {"min": 1, "opt": 2, "max": 4})
    real_copy = shutil.copy2

    def failing_copy(src, dst, *args, **kwargs):
        if str(dst).endswith("model.plan"):
            raise OSError(28, "No space left on device")
        return real_copy(src, dst, *args, **kwargs)

    monkeypatch.setattr(triton_repo.shutil, "copy2", failing_copy)
    with pytest.raises(ServeError, match=r"cannot write the Triton repository.*No space left"):
        write_triton_repository(
            exports["vit"], repo, engine=engine, overwrite=True, preferred_batch=[1]
        )
    assert sorted(p.name for p in repo.iterdir()) == ["README.md", "vit"]  # no -trt, no staging
    # the ONNX model was replaced whole before the plan failed: still a complete model folder
    assert load_config(repo / "vit").name == "vit" and (repo / "vit" / "1" / "model.onnx").is_file()
    assert before != (repo / "vit" / "config.pbtxt").read_text()


def test_generated_text_that_does_not_parse_is_never_written(exports, tmp_path, monkeypatch):
    monkeypatch.setattr(triton_repo.TritonModel, "pbtxt", lambda self: "name: [oops\n")
    with pytest.raises(ServeError, match="does not parse"):
        write_triton_repository(exports["vit"], tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


# --- the commands -----------------------------------------------------------------------------------------
def invoke(main, *argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def test_hydra_export_triton_adds_the_ensemble_head(exports, tmp_path):
    """--triton on an export without --uq-outputs: the new graph computes the scores."""
    out, repo = tmp_path / "reexport", tmp_path / "repo"
    code, stdout, err = invoke(
        export_cli.main,
        "--from",
        exports["plain"],
        "--out",
        out,
        "--no-validate",
        "--triton",
        repo,
        "--triton-name",
        "m3",
        "--triton-instances",
        "2",
        "--json",
    )
    assert code == 0, err
    reported = json.loads(stdout)
    assert reported["uq_outputs"] is True
    assert [m["name"] for m in reported["triton"]["models"]] == ["m3"]
    config = load_config(repo / "m3")
    assert_matches_onnx(config, out / "model.onnx", max_batch=32)  # hydra-export's default
    assert "mutual_information" in [t.name for t in config.output]
    assert config.instance_group[0].count == 2


def test_hydra_export_triton_refuses_before_exporting(exports, tmp_path):
    repo = tmp_path / "repo"
    write_triton_repository(exports["vit"], repo, model_name="taken")
    code, _, err = invoke(
        export_cli.main,
        "--from",
        exports["vit"],
        "--out",
        tmp_path / "new",
        "--no-validate",
        "--triton",
        repo,
        "--triton-name",
        "taken",
    )
    assert code == 1 and "already holds model(s) taken; pass --overwrite" in err
    assert not (tmp_path / "new").exists()  # refused before the export started
    code, _, err = invoke(
        export_cli.main, "--from", exports["vit"], "--out", tmp_path / "new", "--triton-name", "x"
    )
    assert code == 1 and "--triton-name set(s) up a Triton repository; add --triton REPO" in err
    code, _, err = invoke(
        export_cli.main,
        "--from",
        exports["vit"],
        "--out",
        tmp_path / "new",
        "--triton",
        repo,
        "--triton-instances",
        "0",
    )
    assert code == 1 and "--triton-instances must be an integer >= 1" in err
    assert not (tmp_path / "new").exists()


def test_hydra_build_triton_with_a_prebuilt_engine(exports, tmp_path):
    engine = fake_engine(exports["vit"], tmp_path / "eng", {"min": 1, "opt": 2, "max": 4})
    repo = tmp_path / "repo"
    code, stdout, err = invoke(
        build_cli.main, exports["vit"], "--triton", repo, "--engine", engine, "--json"
    )
    assert code == 0, err
    assert [m["platform"] for m in json.loads(stdout)["triton"]["models"]] == [
        "onnxruntime_onnx",
        "tensorrt_plan",
    ]
    assert load_config(repo / "vit-trt").platform == "tensorrt_plan"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--trtexec"], "--triton needs an engine and --trtexec builds none here"),
        (["--engine", "missing.plan"], "engine 'missing.plan' does not exist"),
        (
            ["--engine", "x.plan", "--precision", "fp16", "--max-batch", "8"],
            "--engine adds an engine already built, so --precision, --max-batch (settings of a build) "
            "would do nothing",
        ),
    ],
)
def test_hydra_build_triton_refusals(exports, tmp_path, extra, message):
    code, _, err = invoke(build_cli.main, exports["vit"], "--triton", tmp_path / "repo", *extra)
    assert code == 1 and message in err, err
    assert not (tmp_path / "repo").exists()


def test_hydra_build_refuses_engine_without_triton_and_exports_without_the_head(exports, tmp_path):
    code, _, err = invoke(build_cli.main, exports["vit"], "--engine", tmp_path / "x.plan")
    assert code == 1 and "--engine set(s) up a Triton repository; add --triton REPO" in err
    code, _, err = invoke(build_cli.main, exports["plain"], "--triton", tmp_path / "repo")
    assert code == 1 and "no uncertainty outputs in its graph" in err
