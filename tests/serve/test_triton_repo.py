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
    onnx.TensorProto.BOOL: model_config_pb2.TYPE_BOOL,
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
    assert code == 1 and "already holds model taken; pass --overwrite to replace it" in err
    assert not (tmp_path / "new").exists()  # refused before the export started
    code, _, err = invoke(
        export_cli.main, "--from", exports["vit"], "--out", tmp_path / "new", "--triton-name", "x"
    )
    assert code == 1 and "--triton-name sets up a Triton repository; add --triton REPO" in err
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
    assert code == 1 and "--engine sets up a Triton repository; add --triton REPO" in err
    code, _, err = invoke(build_cli.main, exports["plain"], "--triton", tmp_path / "repo")
    assert code == 1 and "no uncertainty outputs in its graph" in err


# --- decisions (hydra-calibrate) -----------------------------------------------------------------------
DECISION_TYPES = {
    "calibrated_probs": ("TYPE_FP32", [5]),
    "prediction_set": ("TYPE_BOOL", [5]),
    "accept": ("TYPE_BOOL", [1]),
    "ood_flag": ("TYPE_BOOL", [1]),
}


@pytest.fixture(scope="module")
def calibrated(exports, tmp_path_factory):
    """The vit export (scores in the graph) with decisions in hydra.json only: (folder, record)."""
    from helpers.decisions import calibrate_export

    folder = tmp_path_factory.mktemp("calibrated") / "vit"
    shutil.copytree(exports["vit"], folder)
    return folder, calibrate_export(folder).record


def types_of(config) -> dict[str, tuple[str, list[int]]]:
    return {
        t.name: (model_config_pb2.DataType.Name(t.data_type), list(t.dims)) for t in config.output
    }


def with_graph_outputs(folder, target, change=None):
    """A copy of ``folder`` whose hydra.json says its decisions are in the graph and lists the
    outputs ``hydra-calibrate --in-graph`` adds (model.onnx is left as it is: Triton is not run)."""
    shutil.copytree(folder, target)
    info = json.loads((target / "hydra.json").read_text())
    batch = info["outputs"][0]["shape"][0]
    info["outputs"] += [
        {"name": "calibrated_probs", "shape": [batch, 5], "dtype": "float32"},
        {"name": "prediction_set", "shape": [batch, 5], "dtype": "bool"},
        {"name": "accept", "shape": [batch], "dtype": "bool"},
        {"name": "ood_flag", "shape": [batch], "dtype": "bool"},
    ]
    info["decisions"]["in_graph"] = True
    if change is not None:
        change(info)
    (target / "hydra.json").write_text(json.dumps(info))
    return target


def test_decisions_in_hydra_json_only_are_not_served_and_the_repository_says_so(
    calibrated, tmp_path, caplog
):
    folder, _ = calibrated
    with caplog.at_level("WARNING", logger="hydra_deploy"):
        write_triton_repository(folder, tmp_path / "repo")
    text = (tmp_path / "repo" / "vit" / "config.pbtxt").read_text()
    assert text.startswith("# the decisions in hydra.json (hydra-calibrate) are not computed")
    assert "--in-graph" in text.split("\nname:")[0]
    config = load_config(tmp_path / "repo" / "vit")  # the comment parses
    assert not set(DECISION_TYPES) & {t.name for t in config.output}
    assert any("--in-graph" in r.getMessage() for r in caplog.records)
    readme = (tmp_path / "repo" / "README.md").read_text()
    assert "| in hydra.json only: not served (see Decisions) |" in readme
    assert "## Decisions" in readme and "--in-graph --overwrite" in readme


def test_decision_outputs_listed_in_hydra_json_become_typed_outputs(calibrated, tmp_path):
    folder, _ = calibrated
    export = with_graph_outputs(folder, tmp_path / "vit")
    write_triton_repository(export, tmp_path / "repo")
    model = tmp_path / "repo" / "vit"
    text = (model / "config.pbtxt").read_text()
    assert not text.startswith("#")
    config = load_config(model)
    types = types_of(config)
    for name, expected in DECISION_TYPES.items():
        assert types[name] == expected, name
    by_name = {t.name: t for t in config.output}
    for name in ("accept", "ood_flag"):  # [batch] in the model: a scalar per example
        assert list(by_name[name].reshape.shape) == [] and by_name[name].HasField("reshape")
    labelled = {t.name: t.label_filename for t in config.output if t.label_filename}
    assert labelled == {"probs": "labels.txt", "calibrated_probs": "labels.txt"}
    readme = (tmp_path / "repo" / "README.md").read_text()
    assert "`calibrated_probs`, `prediction_set`, `accept`, `ood_flag` |" in readme


def test_in_graph_decisions_that_do_not_match_are_refused(calibrated, tmp_path):
    folder, _ = calibrated

    def drop_accept(info):
        info["outputs"] = [o for o in info["outputs"] if o["name"] != "accept"]

    def stale(info):
        info["decisions"]["onnx_sha256"] = "0" * 64

    for case, change, message in (
        ("missing", drop_accept, "its outputs lack accept; put them in again with hydra-calibrate"),
        ("stale", stale, "fitted on another model.onnx"),
    ):
        export = with_graph_outputs(folder, tmp_path / case, change)
        with pytest.raises(ServeError, match=message) as caught:
            write_triton_repository(export, tmp_path / "repo")
        assert "--overwrite" in str(caught.value)
        assert not (tmp_path / "repo").exists()


def test_a_real_in_graph_export_and_its_engine_declare_the_graphs_decisions(calibrated, tmp_path):
    pytest.importorskip("hydra_deploy.export.decision_graph")
    from hydra_deploy.evaluation.calibrate import store_decisions

    folder, record = calibrated
    export = tmp_path / "vit"
    shutil.copytree(folder, export)
    store_decisions(export, record, in_graph=True)  # the same model.onnx: the same fit
    engine = fake_engine(export, tmp_path / "eng", {"min": 1, "opt": 2, "max": 4})
    write_triton_repository(export, tmp_path / "repo", engine=engine)
    for name, model_file in (("vit", "model.onnx"), ("vit-trt", None)):
        config = load_config(tmp_path / "repo" / name)
        assert_matches_onnx(config, export / "model.onnx", max_batch=4)  # every output, typed
        types = types_of(config)
        assert {n: types[n] for n in DECISION_TYPES} == DECISION_TYPES
        if model_file is None:
            continue
        runner = load_runner(tmp_path / "repo" / name / "1" / model_file)
        x = np.random.default_rng(0).standard_normal((4, 3, 16, 16)).astype(np.float32)
        outputs = runner(x)
        for tensor in config.output:
            per_example = (
                list(tensor.reshape.shape) if tensor.HasField("reshape") else list(tensor.dims)
            )
            assert list(outputs[tensor.name].shape) == [4, *per_example], tensor.name
        assert outputs["prediction_set"].dtype == np.bool_ and outputs["accept"].dtype == np.bool_
    readme = (tmp_path / "repo" / "README.md").read_text()
    assert readme.count("`calibrated_probs`, `prediction_set`, `accept`, `ood_flag` |") == 2


def test_the_models_settings_are_one_group_given_whole_or_as_keywords(exports, tmp_path):
    """plan_repository and write_triton_repository share TritonModelOptions: the group and its
    fields as keywords (which win) plan the same models; a misspelt keyword names the fields."""
    from hydra_deploy.serve.triton_repo import TritonModelOptions, plan_repository

    options = TritonModelOptions(model_name="m", preferred_batch=[2], instances=2, kind="cpu")
    planned = plan_repository(exports["vit"], options)
    assert [m.pbtxt() for m in planned] == [
        m.pbtxt()
        for m in plan_repository(
            exports["vit"], model_name="m", preferred_batch=[2], instances=2, kind="cpu"
        )
    ]
    (model,) = plan_repository(exports["vit"], options, instances=3)
    assert (model.name, model.instances, model.kind) == ("m", 3, "cpu")
    with pytest.raises(ServeError, match="instances must be an integer >= 1"):
        TritonModelOptions(instances=0)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'instance'.*instances"):
        write_triton_repository(exports["vit"], tmp_path / "repo", instance=2)
    assert not (tmp_path / "repo").exists()
