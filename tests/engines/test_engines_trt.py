"""TensorRT builds and trtexec recipes: precision rules, plans, names, sidecars, commands, scripts.

Everything but the last test runs without TensorRT: the plan is pure Python, the build step is
checked against stand-ins for TensorRT and Polygraphy's loaders, and the shell recipes run against
stand-in ``trtexec`` binaries of each TensorRT release that reject the options that release lacks
(tests/helpers/trt_standins.py says what each stand-in copies from which source).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import trt_standins
from helpers.vit import tiny_hydra

from hydra_deploy.decisions import fit_decisions
from hydra_deploy.engines.build_source import load_source
from hydra_deploy.engines.onnx_summary import fp32_layer_names, read_onnx
from hydra_deploy.engines.precision_rules import choose_precision, generation_of
from hydra_deploy.engines.tensorrt import (
    BuildPlan,
    GpuInfo,
    build_engine,
    execute_plan,
    plan_build,
)
from hydra_deploy.engines.trtexec import trtexec_command
from hydra_deploy.errors import EngineError
from hydra_deploy.evaluation.calibrate import store_decisions
from hydra_deploy.export import export_onnx
from hydra_deploy.export_folder import file_sha256

ROOT = Path(__file__).resolve().parents[2]
HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
H200 = GpuInfo("NVIDIA H200", 9, 0, "12.8")
ORIN = GpuInfo("Orin (nvgpu)", 8, 7, "12.2")
T4 = GpuInfo("Tesla T4", 7, 5, "12.4")


# --- fixtures: one tiny export of each kind, made once ----------------------------------------------
@pytest.fixture(scope="module")
def hydra():
    return tiny_hydra()


@pytest.fixture(scope="module")
def exports(hydra, tmp_path_factory):
    """{"fp32": plain export, "uq": with the ensemble head, "fp16"/"bf16": typed-graph stand-ins}.

    The typed ones copy the uq export and set hydra.json's precision: the plan and the recipes read
    only that field (the graph's own Casts matter to TensorRT, not to the command line).
    """
    root = tmp_path_factory.mktemp("engines")
    folders = {name: root / name for name in ("fp32", "uq", "fp16-real")}
    made = {"uq": {"uq_outputs": True}, "fp16-real": {"uq_outputs": True, "precision": "fp16"}}
    for name, folder in folders.items():
        options = made.get(name, {})
        export_onnx(
            hydra, folder, batch=(1, 4, 6), exporter="torchscript", validate=False, **options
        )
    for precision in ("fp16", "bf16"):
        folder = root / precision
        shutil.copytree(folders["uq"], folder)
        info = json.loads((folder / "hydra.json").read_text())
        info["precision"] = precision
        (folder / "hydra.json").write_text(json.dumps(info, indent=2))
        folders[precision] = folder
    folders["decisions"] = root / "decisions"  # the uq export with APS sets etc. in its graph
    shutil.copytree(folders["uq"], folders["decisions"])
    classes = info_of(folders["uq"])["outputs"][0]["shape"][2]
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(400, 3, classes))
    labels = logits.mean(axis=1).argmax(axis=1)
    record = fit_decisions(
        logits,
        labels,
        onnx_sha256=file_sha256(folders["decisions"] / "model.onnx"),
        data_sha256="0" * 64,
        sets="aps",
        risk=0.2,
    )
    store_decisions(folders["decisions"], record, in_graph=True)
    return folders


def info_of(folder: Path) -> dict:
    return json.loads((folder / "hydra.json").read_text())


# --- precision rules ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "requested, graph, trt, sm, expected",
    [
        # FP32 graph, TensorRT before 10.12 (Jetson): weak typing, LayerNorm pinned to FP32
        ("fp16", "fp32", "8.6", None, ("fp16", False, ("fp16",), True)),
        ("fp16", "fp32", "10.3", 87, ("fp16", False, ("fp16",), True)),
        ("bf16", "fp32", "10.3", 87, ("bf16", False, ("bf16",), True)),
        ("best", "fp32", "10.3", 87, ("bf16", False, ("bf16",), True)),
        ("fp32", "fp32", "10.3", 87, ("fp32", False, (), False)),
        (None, "fp32", "10.3", 87, ("fp16", False, ("fp16",), True)),
        # FP32 graph in FP32 on 10.12+: strongly typed (no deprecated weak path)
        ("fp32", "fp32", "10.13", 90, ("fp32", True, (), False)),
        ("fp32", "fp32", "11.0", 90, ("fp32", True, (), False)),
        # graphs that carry their precision: strongly typed from TensorRT 10 on, no flags
        ("fp16", "fp16", "10.3", 87, ("fp16", True, (), False)),
        ("fp16", "fp16", "10.13", 90, ("fp16", True, (), False)),
        ("best", "fp16", "11.0", 90, ("fp16", True, (), False)),
        (None, "bf16", "10.13", 90, ("bf16", True, (), False)),
        # ... but TensorRT 8.6 has no strongly typed networks: weak with the graph's precision
        ("fp16", "fp16", "8.6", 75, ("fp16", False, ("fp16",), True)),
        # INT8 (Q/DQ pairs): --int8 alone on 8.6 (the rest stays FP32: nothing to pin), strongly
        # typed from 10.0 on
        ("int8", "int8", "8.6", 87, ("int8", False, ("int8",), False)),
        (None, "int8", "8.6", None, ("int8", False, ("int8",), False)),
        (None, "int8", "10.3", 87, ("int8", True, (), False)),
        ("best", "int8", "10.11", 87, ("int8", True, (), False)),
        ("int8", "int8", "10.13", 90, ("int8", True, (), False)),
        ("int8", "int8", "11.0", 90, ("int8", True, (), False)),
    ],
)
def test_precision_choice(requested, graph, trt, sm, expected):
    choice = choose_precision(requested, graph, trt, sm=sm)
    got = (choice.precision, choice.strongly_typed, choice.builder_flags, choice.constrain_fp32)
    assert got == expected


@pytest.mark.parametrize(
    "requested, graph, trt, sm, strongly_typed, message",
    [
        ("fp16", "fp32", "10.12", 90, None, "--precision fp16"),  # weak typing deprecated
        ("fp16", "fp32", "11.0", 90, None, "removed weak typing"),
        ("best", "fp32", "11.0", 90, None, "--precision bf16"),
        ("fp16", "fp32", "10.3", 87, True, "computes in FP32"),
        ("bf16", "fp32", "8.6", 87, None, "BF16 needs TensorRT 10"),
        ("bf16", "fp32", "10.3", 75, None, "compute capability 8.0 or newer (this one is 7.5)"),
        ("bf16", "bf16", "10.3", 75, None, "re-export in FP16"),
        ("bf16", "bf16", "8.6", 90, None, "BF16 needs TensorRT 10"),
        ("fp32", "fp16", "10.13", 90, None, "exported in fp16"),
        ("fp16", "fp16", "8.6", 90, True, "no strongly typed networks"),
        ("fp16", "fp16", "11.0", 90, False, "builds every network strongly typed"),
        ("int8", "fp32", "10.3", 87, None, "unknown precision"),
        ("fp16", "fp32", "8.5", 87, None, "too old"),
        ("int8", "fp32", "10.3", 87, None, "--int8-method static"),
        ("int8", "fp16", "11.0", 90, None, "QuantizeLinear/DequantizeLinear"),
        ("fp16", "int8", "10.3", 87, None, "exported in int8"),
        ("fp32", "int8", "8.6", 87, None, "build it with precision int8"),
        ("int8", "int8", "8.6", 87, True, "no strongly typed networks"),
        ("int8", "int8", "11.0", 90, False, "builds every network strongly typed"),
    ],
)
def test_precision_choice_refuses(requested, graph, trt, sm, strongly_typed, message):
    with pytest.raises(EngineError) as err:
        choose_precision(requested, graph, trt, sm=sm, strongly_typed=strongly_typed)
    assert message in str(err.value)


def test_best_falls_back_to_fp16_with_a_note():
    old_gpu = choose_precision("best", "fp32", "10.3", sm=75)
    assert (old_gpu.precision, old_gpu.builder_flags) == ("fp16", ("fp16",))
    assert any("compute capability 8.0" in note for note in old_gpu.notes)
    old_trt = choose_precision("best", "fp32", "8.6", sm=90)
    assert old_trt.precision == "fp16" and any("TensorRT 10" in n for n in old_trt.notes)
    # the deprecated weak path on 10.12+ only when asked for, with a note
    weak = choose_precision("fp16", "fp32", "10.13", sm=90, strongly_typed=False)
    assert weak.builder_flags == ("fp16",) and any("deprecated" in n for n in weak.notes)
    # INT8: the weak --int8 path on 10.x only when asked for (deprecated from 10.12), unpinned
    for version, deprecated in (("10.3", False), ("10.13", True)):
        weak = choose_precision("int8", "int8", version, strongly_typed=False)
        assert (weak.builder_flags, weak.constrain_fp32) == (("int8",), False)
        assert any("deprecated" in n for n in weak.notes) == deprecated


@pytest.mark.parametrize(
    "version, generation",
    [
        ("8.6.1.6", "8.6"),
        ("10.0.1", "10"),
        ("10.3.0.30", "10"),
        ("10.11.0", "10"),
        ("10.12.0.36", "10.12"),
        ("10.13.2", "10.12"),
        ("11.4.1", "11"),
    ],
)
def test_generation_of(version, generation):
    assert generation_of(version) == generation


# --- reading the ONNX file without the onnx package -----------------------------------------------------
@pytest.mark.parametrize("kind", ["fp32", "uq"])
def test_read_onnx_matches_the_onnx_package(exports, kind):
    path = exports[kind] / "model.onnx"
    model = onnx.load(str(path))
    summary = read_onnx(path)
    assert [(n.name, n.op_type, list(n.input), list(n.output)) for n in model.graph.node] == [
        (n.name, n.op_type, list(n.inputs), list(n.outputs)) for n in summary.nodes
    ]
    assert summary.outputs == tuple(o.name for o in model.graph.output)
    assert summary.inputs == ({"name": "pixel_values", "shape": ["batch", 3, 16, 16]},)
    assert (
        summary.metadata["hydra_spec"]
        == {p.key: p.value for p in model.metadata_props}["hydra_spec"]
    )


def test_fp32_layers_are_layernorms_and_the_ensemble_head(exports):
    plain = fp32_layer_names(read_onnx(exports["fp32"] / "model.onnx"))
    model = onnx.load(str(exports["fp32"] / "model.onnx"))
    layernorms = [n.name for n in model.graph.node if n.op_type == "LayerNormalization"]
    assert plain == layernorms and len(layernorms) == 7  # 2 per block x 3 + final norm
    with_head = fp32_layer_names(read_onnx(exports["uq"] / "model.onnx"))
    head = with_head[len(layernorms) :]
    assert with_head[: len(layernorms)] == layernorms
    uq = onnx.load(str(exports["uq"] / "model.onnx"))
    ops = {n.name: n.op_type for n in uq.graph.node}
    assert {"LogSoftmax", "Exp", "ReduceSum", "Log"} <= {ops[name] for name in head}
    assert "TopK" not in {ops[name] for name in head}  # index outputs stay with TensorRT


# --- the plan: profile, typing, names, sidecar ---------------------------------------------------------------
def test_plan_for_a_typed_graph_on_a_datacentre_gpu(exports):
    plan = plan_build(exports["fp16"], trt_version="10.13.0.35", gpu=H200)
    sha12 = info_of(exports["fp16"])["onnx_sha256"][:12]
    assert isinstance(plan, BuildPlan)
    assert (plan.precision, plan.strongly_typed, plan.builder_flags, plan.fp32_layers) == (
        "fp16",
        True,
        (),
        (),
    )
    assert plan.precision_constraints is None
    assert plan.engine_path == exports["fp16"] / f"model.{sha12}.fp16.h200-sm90.trt10.13.engine"
    assert plan.sidecar_path == exports["fp16"] / f"model.{sha12}.fp16.h200-sm90.trt10.13.json"
    assert plan.timing_cache == exports["fp16"] / "timing.h200-sm90.trt10.13.cache"
    assert plan.load_timing_cache is None  # nothing to start from yet
    assert plan.batch == (1, 4, 6)  # hydra.json's profile
    assert plan.profile == {
        "pixel_values": {"min": [1, 3, 16, 16], "opt": [4, 3, 16, 16], "max": [6, 3, 16, 16]}
    }


def test_plan_for_an_fp32_graph_on_jetpack6(exports):
    plan = plan_build(
        exports["uq"],
        precision="fp16",
        trt_version="10.3.0.30",
        gpu=ORIN,
        min_batch=2,
        opt_batch=3,
        max_batch=16,
    )
    assert (plan.precision, plan.strongly_typed, plan.builder_flags) == ("fp16", False, ("fp16",))
    assert plan.fp32_layers == tuple(fp32_layer_names(read_onnx(exports["uq"] / "model.onnx")))
    assert plan.precision_constraints == "obey"
    assert plan.batch == (2, 3, 16)
    assert plan.profile["pixel_values"]["max"] == [16, 3, 16, 16]
    assert plan.engine_path.name.endswith(".fp16.orin-nvgpu-sm87.trt10.3.engine")
    # the same build as a trtexec line, for logs
    line = plan.trtexec_equivalent()
    assert "--fp16 --precisionConstraints=obey --layerPrecisions=LayerNormalization_0:fp32" in line
    assert f"--saveEngine={plan.engine_path}" in line


def test_one_options_group_serves_the_plan_the_build_the_recipes_and_hydra_build(exports, tmp_path):
    """EngineBuildOptions: the same settings as an object or as keywords give the same plan and
    the same trtexec line; hydra-build's flags parse into it; the plan's own settings (as decided)
    give its trtexec equivalent."""
    from hydra_deploy.cli.build import build_parser
    from hydra_deploy.engines.build_options import EngineBuildOptions
    from hydra_deploy.options import from_args

    settings = dict(precision="fp16", min_batch=2, opt_batch=3, max_batch=16, out=tmp_path)
    options = EngineBuildOptions(**settings)
    planned = plan_build(exports["uq"], options, trt_version="10.3.0.30", gpu=ORIN)
    assert planned == plan_build(exports["uq"], trt_version="10.3.0.30", gpu=ORIN, **settings)
    assert planned.requested_precision == "fp16" and planned.out_dir == tmp_path
    assert str(trtexec_command(exports["uq"], options, trt="10")) == str(
        trtexec_command(exports["uq"], trt="10", **settings)
    )
    # keywords win over the object's fields
    assert plan_build(exports["uq"], options, max_batch=8, trt_version="10.3", gpu=ORIN).batch == (
        2,
        3,
        8,
    )
    assert planned.trtexec_equivalent().startswith(
        str(
            trtexec_command(
                exports["uq"], planned.options, trt="10", engine=planned.engine_path, sm=87
            )
        )
    )
    argv = [str(exports["uq"]), "--precision", "fp16", "--min-batch", "2", "--opt-batch", "3"]
    argv += ["--max-batch", "16", "--out", str(tmp_path), "--weakly-typed"]
    parsed = from_args(EngineBuildOptions, build_parser().parse_args(argv))
    assert parsed == EngineBuildOptions(**settings, strongly_typed=False)
    assert parsed.given_flags() == [
        "--precision",
        "--out",
        "--min-batch",
        "--opt-batch",
        "--max-batch",
        "--strongly-typed/--weakly-typed",
    ]
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_bacth'.*max_batch"):
        plan_build(exports["uq"], max_bacth=8, trt_version="10.3", gpu=ORIN)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'overwrite'"):
        trtexec_command(exports["uq"], overwrite=True)


def test_plan_best_on_an_old_gpu_falls_back_to_fp16(exports):
    plan = plan_build(exports["fp32"], precision="best", trt_version="10.3.0", gpu=T4)
    assert plan.precision == "fp16" and plan.builder_flags == ("fp16",)
    assert any("building FP16 instead" in note for note in plan.notes)
    with pytest.raises(EngineError, match=r"compute capability 8\.0"):
        plan_build(exports["fp32"], precision="bf16", trt_version="10.3.0", gpu=T4)


def test_plan_defaults_out_folder_and_timing_cache(exports, tmp_path):
    cache = tmp_path / "shared.cache"
    cache.write_bytes(b"cache")
    plan = plan_build(
        exports["fp16"],
        trt_version="10.13.0",
        gpu=H200,
        out=tmp_path / "engines",
        timing_cache=cache,
    )
    assert plan.engine_path.parent == tmp_path / "engines"
    assert plan.timing_cache == cache and plan.load_timing_cache == cache


@pytest.mark.parametrize(
    "batch",
    [(0, 1, 4), (4, 2, 8), (1, 9, 8), (2, 2, 1)],
    ids=["zero", "opt<min", "opt>max", "max<min"],
)
def test_plan_refuses_a_bad_profile(exports, batch):
    with pytest.raises(EngineError, match="1 <= min <= opt <= max"):
        plan_build(
            exports["fp32"],
            trt_version="10.3.0",
            gpu=ORIN,
            min_batch=batch[0],
            opt_batch=batch[1],
            max_batch=batch[2],
        )


def test_sidecar_records_the_build(exports):
    plan = plan_build(exports["bf16"], trt_version="10.13.0.35", gpu=H200)
    sidecar = json.loads(json.dumps(plan.sidecar(build_seconds=1.5), allow_nan=False))
    info = info_of(exports["bf16"])
    assert sidecar["format"] == "hydra-engine/1"
    assert sidecar["engine"] == plan.engine_path.name
    assert (sidecar["precision"], sidecar["graph_precision"], sidecar["strongly_typed"]) == (
        "bf16",
        "bf16",
        True,
    )
    assert sidecar["gpu"] == {
        "name": "NVIDIA H200",
        "compute_capability": "9.0",
        "sm": 90,
        "tag": "h200-sm90",
    }
    assert sidecar["tensorrt_version"] == "10.13.0.35"
    assert sidecar["cuda"]["driver"] == "12.8" and "runtime" in sidecar["cuda"]
    assert sidecar["batch_profile"] == {"min": 1, "opt": 4, "max": 6}
    assert sidecar["profile"] == plan.profile
    assert sidecar["onnx_sha256"] == info["onnx_sha256"] and sidecar["onnx"] == "model.onnx"
    assert sidecar["spec"] == info["spec"]
    assert sidecar["outputs"] == info["outputs"] and sidecar["uq_outputs"] is True
    assert sidecar["timing_cache"] == "timing.h200-sm90.trt10.13.cache"
    assert sidecar["build_seconds"] == 1.5


@pytest.mark.parametrize(
    "name, major, minor, tag",
    [
        ("NVIDIA H200", 9, 0, "h200-sm90"),
        ("Orin (nvgpu)", 8, 7, "orin-nvgpu-sm87"),
        ("NVIDIA GeForce RTX 4090", 8, 9, "geforce-rtx-4090-sm89"),
        ("Tesla T4", 7, 5, "tesla-t4-sm75"),
    ],
)
def test_gpu_tag(name, major, minor, tag):
    assert GpuInfo(name, major, minor).tag == tag


# --- sources: export folders, bare ONNX files, and what is not an export ------------------------------------
def test_bare_onnx_file_builds_as_fp32_with_the_spec_from_metadata(exports, tmp_path, hydra):
    path = tmp_path / "other.onnx"
    shutil.copy(exports["fp32"] / "model.onnx", path)
    source = load_source(path)
    assert source.info is None and source.graph_precision == "fp32"
    assert source.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert source.spec == hydra.spec.to_dict()
    plan = plan_build(path, trt_version="10.3.0", gpu=ORIN)
    assert plan.batch == (1, 8, 32) and plan.engine_path.parent == tmp_path


def test_a_real_fp16_export_builds_strongly_typed(exports, tmp_path):
    folder = exports["fp16-real"]
    command = trtexec_command(folder, trt="10.12")
    assert command.precision == "fp16" and "--stronglyTyped" in command.argv
    assert not any(a.startswith(("--fp16", "--layerPrecisions")) for a in command.argv)
    # TensorRT 8.6 builds it weakly typed: its head is found by name; its LayerNorms cannot be
    # (8.6's parser leaves them unnamed), which the command's notes say
    old = trtexec_command(folder, trt="8.6")
    layer_arg = next(a for a in old.argv if a.startswith("--layerPrecisions="))
    model = onnx.load(str(folder / "model.onnx"))
    names = {n.name for n in model.graph.node}
    pinned = [item.removesuffix(":fp32") for item in layer_arg.split("=", 1)[1].split(",")]
    assert set(pinned) <= names and not any(n.startswith("LayerNormalization") for n in pinned)
    assert pinned and any("cannot pin the 7 LayerNormalization" in note for note in old.notes)
    # a bare copy of the file still says it is an FP16 graph (ONNX metadata)
    bare = tmp_path / "copy.onnx"
    shutil.copy(folder / "model.onnx", bare)
    assert load_source(bare).graph_precision == "fp16"
    plan = plan_build(bare, trt_version="10.13.0", gpu=H200)
    assert (plan.precision, plan.strongly_typed) == ("fp16", True)


def test_not_an_export(tmp_path, exports):
    with pytest.raises(EngineError, match="does not exist"):
        load_source(tmp_path / "missing")
    with pytest.raises(EngineError, match="not an export folder"):
        load_source(tmp_path)
    with pytest.raises(EngineError, match=r"neither an export folder nor an \.onnx file"):
        load_source(exports["fp32"] / "weights.safetensors")
    bad = tmp_path / "bad"
    shutil.copytree(exports["fp32"], bad)
    (bad / "hydra.json").write_text(json.dumps({"format": "something-else/1"}))
    with pytest.raises(EngineError, match="has format 'something-else/1'; this version reads"):
        load_source(bad)
    (bad / "hydra.json").write_text(json.dumps({**info_of(exports["fp32"]), "precision": "int4"}))
    with pytest.raises(EngineError, match="precision 'int4'"):
        plan_build(bad, trt_version="10.3.0", gpu=ORIN)
    (bad / "hydra.json").write_text(json.dumps(info_of(exports["fp32"])))
    (bad / "model.onnx").write_bytes(b"\x0a\x05short")  # truncated protobuf
    with pytest.raises(EngineError, match=r"not a readable ONNX file|holds no ONNX graph"):
        load_source(bad)


# --- trtexec commands, exactly ------------------------------------------------------------------------------------
def expected_argv(folder: Path, tail: list[str], stem: str, cache: str) -> list[str]:
    return [
        "trtexec",
        f"--onnx={folder}/model.onnx",
        "--minShapes=pixel_values:1x3x16x16",
        "--optShapes=pixel_values:4x3x16x16",
        "--maxShapes=pixel_values:6x3x16x16",
        *tail,
        f"--saveEngine={folder}/{stem}.engine",
        f"--timingCacheFile={folder}/{cache}",
        "--profilingVerbosity=detailed",
        "--dumpLayerInfo",
        f"--exportLayerInfo={folder}/{stem}.layers.json",
    ]


LN = ",".join(f"LayerNormalization_{i}:fp32" for i in range(7))


@pytest.mark.parametrize(
    "kind, precision, trt, tail",
    [
        ("fp32", "fp16", "8.6", ["--fp16"]),  # 8.6 leaves LayerNorm layers unnamed: no pins
        (
            "fp32",
            "fp16",
            "10",
            ["--fp16", "--precisionConstraints=obey", f"--layerPrecisions={LN}", "--noTF32"],
        ),
        (
            "fp32",
            "bf16",
            "10",
            ["--bf16", "--precisionConstraints=obey", f"--layerPrecisions={LN}", "--noTF32"],
        ),
        (
            "fp32",
            "best",
            "10",
            ["--fp16", "--precisionConstraints=obey", f"--layerPrecisions={LN}", "--noTF32"],
        ),
        ("fp32", "fp32", "8.6", ["--noTF32"]),
        ("fp32", "fp32", "10", ["--noTF32"]),
        ("fp32", "fp32", "10.12", ["--stronglyTyped", "--noTF32"]),
        ("fp32", "fp32", "11", ["--stronglyTyped", "--noTF32"]),
        ("fp16", "fp16", "10", ["--stronglyTyped"]),
        ("fp16", "fp16", "10.12", ["--stronglyTyped"]),
        ("fp16", None, "11", ["--stronglyTyped"]),
        ("bf16", "bf16", "10", ["--stronglyTyped"]),
        ("bf16", "best", "10.12", ["--stronglyTyped"]),
        ("bf16", "bf16", "11", ["--stronglyTyped"]),
    ],
)
def test_trtexec_command_per_generation(exports, kind, precision, trt, tail):
    folder = exports[kind]
    command = trtexec_command(folder, precision=precision, trt=trt)
    engine_precision = kind if kind != "fp32" else {"best": "fp16"}.get(precision, precision)
    stem = f"model.{info_of(folder)['onnx_sha256'][:12]}.{engine_precision}.trt{trt}"
    assert list(command.argv) == expected_argv(folder, tail, stem, f"timing.trt{trt}.cache")
    assert command.precision == engine_precision
    assert command.strongly_typed == ("--stronglyTyped" in tail)


def test_trtexec_command_on_trt86_for_a_typed_graph_keeps_the_head_in_fp32(exports):
    command = trtexec_command(exports["fp16"], precision="fp16", trt="8.6")
    names = [
        n
        for n in fp32_layer_names(read_onnx(exports["fp16"] / "model.onnx"))
        if not n.startswith("LayerNormalization")
    ]
    layer_arg = "--layerPrecisions=" + ",".join(f"{n}:fp32" for n in names)
    assert list(command.argv[5:8]) == ["--fp16", "--precisionConstraints=obey", layer_arg]
    assert "LogSoftmax_0:fp32" in layer_arg and "--stronglyTyped" not in command.argv


@pytest.mark.parametrize(
    "kind, precision, trt, message",
    [
        ("fp32", "fp16", "10.12", "hydra-export --from EXPORT_DIR --precision fp16"),
        ("fp32", "bf16", "11", "removed weak typing"),
        ("fp32", "bf16", "8.6", "BF16 needs TensorRT 10"),
        ("bf16", "bf16", "8.6", "BF16 needs TensorRT 10"),
        ("fp16", "bf16", "10.12", "exported in fp16"),
        ("fp32", "fp16", "9.9", "unknown TensorRT generation"),
    ],
)
def test_trtexec_command_refuses(exports, kind, precision, trt, message):
    with pytest.raises(EngineError) as err:
        trtexec_command(exports[kind], precision=precision, trt=trt)
    assert message in str(err.value)


def test_trtexec_command_options_and_quoting(exports, tmp_path):
    out = tmp_path / "engines with space"
    command = trtexec_command(
        exports["fp16"],
        trt="10.12",
        out=out,
        gpu="orin-sm87",
        layer_info=False,
        min_batch=2,
        opt_batch=2,
        max_batch=2,
        extra=["--useCudaGraph"],
    )
    sha12 = info_of(exports["fp16"])["onnx_sha256"][:12]
    assert command.engine == out / f"model.{sha12}.fp16.orin-sm87.trt10.12.engine"
    assert command.timing_cache == out / "timing.orin-sm87.trt10.12.cache"
    assert command.layer_info is None and "--dumpLayerInfo" not in command.argv
    assert "--maxShapes=pixel_values:2x3x16x16" in command.argv
    assert command.argv[-1] == "--useCudaGraph"
    assert shlex.split(str(command)) == list(command.argv)  # quoted for a shell
    assert "'--saveEngine=" in command.shell  # the space is quoted
    named = trtexec_command(
        exports["fp32"], trt="10", engine=tmp_path / "a.engine", timing_cache=tmp_path / "t.cache"
    )
    assert f"--saveEngine={tmp_path}/a.engine" in named.argv
    assert f"--exportLayerInfo={tmp_path}/a.layers.json" in named.argv
    assert f"--timingCacheFile={tmp_path}/t.cache" in named.argv


# --- the shell recipes print exactly trtexec_command's arguments --------------------------------------------------
@pytest.fixture(scope="module")
def trtexec_of(tmp_path_factory):
    """generation -> a folder holding a stand-in ``trtexec`` of a release of that generation
    (8.6.2, 10.3.0, 10.13.0, 11.0.0): it rejects options that release's sampleOptions.cpp lacks
    and echoes the others one per line."""
    root = tmp_path_factory.mktemp("bin")
    folders = {}
    for generation in trt_standins.RELEASES:
        folders[generation] = root / generation
        trt_standins.write_trtexec(folders[generation], generation)
    return folders


def run_script(bin_folder, script: str, *args: str, **env: str):
    environment = {**os.environ, "PATH": f"{bin_folder}{os.pathsep}{os.environ['PATH']}", **env}
    for key in (
        "OUT_DIR",
        "GPU_TAG",
        "MIN_BATCH",
        "OPT_BATCH",
        "MAX_BATCH",
        "DRY_RUN",
        "TRTEXEC",
        "TRT_VERSION",
        "FAKE_TRTEXEC_REPORT",
    ):
        if key not in env:
            environment.pop(key, None)
    return subprocess.run(
        ["bash", str(ROOT / "engines" / script), *args],
        capture_output=True,
        text=True,
        env=environment,
        timeout=60,
    )


@pytest.mark.parametrize(
    "script, kind, args, precision, trt",
    [
        ("build_trt86_fp16.sh", "fp32", [], "fp16", "8.6"),
        ("build_trt86_fp16.sh", "fp16", [], "fp16", "8.6"),
        ("build_jetpack6_fp16.sh", "uq", [], "fp16", "10"),
        ("build_jetpack6_fp16.sh", "fp16", [], "fp16", "10"),
        ("build_jetpack6_bf16.sh", "fp32", [], "bf16", "10"),
        ("build_strongly_typed.sh", "fp16", [], None, "10.12"),
        ("build_strongly_typed.sh", "bf16", ["11"], None, "11"),
        ("trtexec_build.sh", "fp32", ["10", "fp32"], "fp32", "10"),
        ("trtexec_build.sh", "fp32", ["10.12", "fp32"], "fp32", "10.12"),
        ("trtexec_build.sh", "uq", ["10", "best"], "best", "10"),
        ("build_trt86_fp16.sh", "decisions", [], "fp16", "8.6"),
        ("build_jetpack6_fp16.sh", "decisions", [], "fp16", "10"),
        ("trtexec_build.sh", "decisions", ["10", "fp16"], "fp16", "10"),
    ],
)
def test_scripts_run_the_command_trtexec_command_gives(
    trtexec_of, exports, script, kind, args, precision, trt
):
    folder = exports[kind]
    result = run_script(trtexec_of[trt], script, str(folder), *args)
    assert result.returncode == 0, result.stderr
    expected = trtexec_command(folder, precision=precision, trt=trt)
    assert result.stdout.splitlines() == list(expected.argv[1:])


def test_script_environment_and_dry_run(trtexec_of, exports, tmp_path):
    folder = exports["fp16"]
    env = dict(
        OUT_DIR=str(tmp_path / "out"),
        GPU_TAG="orin-sm87",
        MIN_BATCH="2",
        OPT_BATCH="3",
        MAX_BATCH="5",
    )
    result = run_script(
        trtexec_of["10"], "build_jetpack6_fp16.sh", str(folder), "--", "--useCudaGraph", **env
    )
    assert result.returncode == 0, result.stderr
    expected = trtexec_command(
        folder,
        precision="fp16",
        trt="10",
        out=tmp_path / "out",
        gpu="orin-sm87",
        min_batch=2,
        opt_batch=3,
        max_batch=5,
        extra=["--useCudaGraph"],
    )
    assert result.stdout.splitlines() == list(expected.argv[1:])
    dry = run_script(trtexec_of["10.12"], "build_strongly_typed.sh", str(folder), DRY_RUN="1")
    assert dry.returncode == 0, dry.stderr
    assert shlex.split(dry.stdout) == list(trtexec_command(folder, trt="10.12").argv)
    # a dry run for another machine: TRT_VERSION instead of the trtexec here
    other = run_script(
        trtexec_of["10"], "build_trt86_fp16.sh", str(folder), DRY_RUN="1", TRT_VERSION="8.6.2"
    )
    assert other.returncode == 0, other.stderr
    assert shlex.split(other.stdout)[1:] == list(trtexec_command(folder, trt="8.6").argv[1:])


@pytest.mark.parametrize(
    "script, kind, args, message",
    [
        ("build_strongly_typed.sh", "fp32", [], "hydra-export --from EXPORT_DIR --precision fp16"),
        ("trtexec_build.sh", "fp32", ["8.6", "bf16"], "BF16 needs TensorRT 10"),
        ("trtexec_build.sh", "fp16", ["10", "bf16"], "exported in fp16"),
        ("trtexec_build.sh", "fp32", ["9"], "unknown TensorRT generation"),
    ],
)
def test_scripts_refuse_what_trtexec_command_refuses(
    trtexec_of, exports, script, kind, args, message
):
    trt = args[0] if script == "trtexec_build.sh" and args[0] in trt_standins.RELEASES else "10.12"
    result = run_script(trtexec_of[trt], script, str(exports[kind]), *args)
    assert result.returncode == 1 and result.stdout == ""
    assert message in result.stderr


def test_script_refuses_a_folder_that_is_not_an_export(trtexec_of, tmp_path):
    result = run_script(trtexec_of["10"], "build_jetpack6_fp16.sh", str(tmp_path))
    assert result.returncode == 1 and "not an export folder" in result.stderr
    usage = run_script(trtexec_of["10"], "trtexec_build.sh")
    assert usage.returncode == 2 and "EXPORT_DIR TRT" in usage.stdout


@pytest.mark.parametrize("cut", ["half", "graph-length"])
def test_script_refuses_a_truncated_model_as_the_python_reader_does(
    trtexec_of, exports, tmp_path, cut
):
    """The script's own ONNX reader (the package need not be installed where it runs) has the
    package reader's truncation check and its words: a cut file is refused, not half read."""
    folder = tmp_path / "cut"
    shutil.copytree(exports["fp32"], folder)
    data = (folder / "model.onnx").read_bytes()
    # "graph-length": only a short tail is missing, so the graph's own length field overruns
    data = data[: len(data) // 2] if cut == "half" else data[:-7]
    (folder / "model.onnx").write_bytes(data)
    with pytest.raises(EngineError) as python_error:
        read_onnx(folder / "model.onnx")
    assert "truncated: a field runs past the end of the data" in str(python_error.value)
    result = run_script(trtexec_of["10"], "build_jetpack6_fp16.sh", str(folder))
    assert result.returncode == 1 and result.stdout == "", result.stderr
    assert result.stderr.strip() == f"error: {python_error.value}"
    assert "Traceback" not in result.stderr


# --- every generation's lines against that generation's trtexec ----------------------------------------------
@pytest.fixture(scope="module")
def text_export(tmp_path_factory):
    """A tiny BERT export: int64 token ids with a dynamic sequence axis (max length 64)."""
    from helpers.bert import tiny_text_export

    return tiny_text_export(tmp_path_factory.mktemp("text"))


def run_trtexec(bin_folder: Path, argv, **env: str):
    environment = {**os.environ, **env}
    return subprocess.run(
        [str(bin_folder / "trtexec"), *argv[1:]],
        capture_output=True,
        text=True,
        env=environment,
        timeout=60,
    )


GENERATION_LINES = [
    ("fp32", "fp16", "8.6"),
    ("uq", "fp16", "8.6"),
    ("fp16", "fp16", "8.6"),
    ("fp32", "fp32", "8.6"),
    ("fp32", "fp16", "10"),
    ("uq", "bf16", "10"),
    ("fp16", "fp16", "10"),
    ("bf16", "bf16", "10"),
    ("fp32", "fp32", "10"),
    ("fp16", "fp16", "10.12"),
    ("bf16", "bf16", "10.12"),
    ("fp32", "fp32", "10.12"),
    ("fp16", "fp16", "11"),
    ("bf16", "bf16", "11"),
    ("fp32", "fp32", "11"),
]


@pytest.mark.parametrize("kind, precision, trt", GENERATION_LINES)
def test_every_generations_lines_pass_that_generations_trtexec(
    trtexec_of, exports, kind, precision, trt
):
    command = trtexec_command(exports[kind], precision=precision, trt=trt)
    result = run_trtexec(trtexec_of[trt], command.argv)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == list(command.argv[1:])


def test_the_trtexec_stand_ins_are_as_strict_as_their_release(trtexec_of, exports):
    strong = trtexec_command(exports["fp16"], trt="10")  # --stronglyTyped
    refused = run_trtexec(trtexec_of["8.6"], strong.argv)
    assert refused.returncode == 1 and "Unknown option: --stronglyTyped" in refused.stderr
    bf16 = trtexec_command(exports["uq"], precision="bf16", trt="10")
    assert "Unknown option: --bf16" in run_trtexec(trtexec_of["8.6"], bf16.argv).stderr
    weak = trtexec_command(exports["fp32"], precision="fp16", trt="10")  # --fp16, --layerPrecisions
    refused = run_trtexec(trtexec_of["11"], weak.argv)
    assert refused.returncode == 1
    assert {"--fp16", "--precisionConstraints", "--layerPrecisions"} <= {
        line.split()[3] for line in refused.stderr.splitlines() if "Unknown option" in line
    }
    for generation, code in (("8.6", "8602"), ("10", "100300"), ("11", "110000")):
        banner = run_trtexec(trtexec_of[generation], ["trtexec", "--help"])
        assert banner.returncode == 0 and f"[TensorRT v{code}]" in banner.stdout


# Finding 4 (issue 18): trtexec enables TF32 unless --noTF32, strongly typed or not.
@pytest.mark.parametrize("trt", ["8.6", "10", "10.12", "11"])
def test_every_fp32_command_turns_tf32_off(exports, trt):
    command = trtexec_command(exports["fp32"], precision="fp32", trt=trt)
    assert "--noTF32" in command.argv
    assert "--noTF32" not in trtexec_command(exports["fp16"], trt="10.12").argv  # FP16: no matter


# Finding 2, trtexec side: on 8.6 --layerPrecisions cannot reach LayerNormalization layers.
def test_trt86_lines_pin_only_layers_that_exist_and_say_what_they_cannot(
    trtexec_of, exports, tmp_path
):
    report = tmp_path / "report.json"
    for kind in ("fp32", "uq"):
        command = trtexec_command(exports[kind], precision="fp16", trt="8.6")
        result = run_trtexec(trtexec_of["8.6"], command.argv, FAKE_TRTEXEC_REPORT=str(report))
        assert result.returncode == 0, result.stderr
        seen = json.loads(report.read_text())
        assert seen["unmatched"] == []  # every name given is a layer of 8.6's network
        assert any(
            "cannot pin the 7 LayerNormalization layers" in n and "hydra-build" in n
            for n in command.notes
        )
        assert bool(seen["matched"]) == (kind == "uq")  # the head's layers are named
        script = run_script(trtexec_of["8.6"], "build_trt86_fp16.sh", str(exports[kind]))
        assert script.returncode == 0, script.stderr
        assert script.stdout.splitlines() == list(command.argv[1:])
        assert "cannot pin the 7 LayerNormalization layers" in script.stderr
    # on TensorRT 10 the same names are layers: all of them are pinned
    command = trtexec_command(exports["uq"], precision="fp16", trt="10")
    result = run_trtexec(trtexec_of["10"], command.argv, FAKE_TRTEXEC_REPORT=str(report))
    seen = json.loads(report.read_text())
    assert result.returncode == 0 and seen["unmatched"] == []
    assert sum(n.startswith("LayerNormalization") for n in seen["matched"]) == 7


# Finding 3: JetPack 6.0 ships TensorRT 8.6.2, 6.1/6.2 ship 10.3; a recipe for another
# generation is refused before trtexec is run.
@pytest.mark.parametrize(
    "script, kind, args, installed, release, hint",
    [
        ("build_jetpack6_fp16.sh", "uq", [], "8.6", "8.6", "build_trt86_fp16.sh"),  # JetPack 6.0
        ("build_jetpack6_fp16.sh", "fp16", [], "8.6", "8.6", "build_trt86_fp16.sh"),
        ("build_jetpack6_bf16.sh", "fp32", [], "8.6", "8.6", "build_trt86_fp16.sh"),
        ("build_trt86_fp16.sh", "fp32", [], "10", "10.3", "build_jetpack6_fp16.sh"),  # JetPack 6.1
        ("build_strongly_typed.sh", "fp16", [], "10", "10.3", "build_jetpack6_fp16.sh"),
        (
            "build_strongly_typed.sh",
            "fp16",
            ["11"],
            "10.12",
            "10.13",
            "build_strongly_typed.sh EXPORT_DIR 10.12",
        ),
        (
            "trtexec_build.sh",
            "fp16",
            ["10.12"],
            "11",
            "11.0",
            "build_strongly_typed.sh EXPORT_DIR 11",
        ),
    ],
)
def test_scripts_refuse_a_recipe_for_another_tensorrt(
    trtexec_of, exports, script, kind, args, installed, release, hint
):
    result = run_script(trtexec_of[installed], script, str(exports[kind]), *args)
    assert result.returncode == 1 and result.stdout == ""
    assert f"this machine has TensorRT {release}" in result.stderr and hint in result.stderr


def test_scripts_without_trtexec_refuse_to_run_but_dry_run(exports, tmp_path):
    missing = dict(TRTEXEC=str(tmp_path / "no-trtexec"))
    result = run_script(tmp_path, "build_jetpack6_fp16.sh", str(exports["uq"]), **missing)
    assert result.returncode == 1 and "cannot run" in result.stderr
    dry = run_script(tmp_path, "build_jetpack6_fp16.sh", str(exports["uq"]), DRY_RUN="1", **missing)
    assert dry.returncode == 0 and "TensorRT version is unknown here" in dry.stderr
    assert shlex.split(dry.stdout)[1:] == list(
        trtexec_command(exports["uq"], precision="fp16", trt="10").argv[1:]
    )


# Finding 5: a text export's sequence axis, in the scripts as in trtexec_command.
@pytest.mark.parametrize(
    "script, args, precision, trt",
    [
        ("build_jetpack6_fp16.sh", [], "fp16", "10"),
        ("build_trt86_fp16.sh", [], "fp16", "8.6"),
        ("trtexec_build.sh", ["10.12", "fp32"], "fp32", "10.12"),
    ],
)
def test_scripts_print_the_same_command_for_text_exports(
    trtexec_of, text_export, script, args, precision, trt
):
    result = run_script(trtexec_of[trt], script, str(text_export), *args)
    assert result.returncode == 0, result.stderr
    expected = trtexec_command(text_export, precision=precision, trt=trt)
    assert result.stdout.splitlines() == list(expected.argv[1:])
    assert any(a.startswith("--maxShapes=input_ids:4x64") for a in expected.argv)


def test_use_cuda_graph_is_noted_as_a_no_op_on_trt11(exports):
    on11 = trtexec_command(exports["fp16"], trt="11", extra=["--useCudaGraph"])
    assert any("no-op on TensorRT 11" in note for note in on11.notes)
    assert not trtexec_command(exports["fp16"], trt="10.12", extra=["--useCudaGraph"]).notes


# Finding 7: Polygraphy before 0.49.6 passes EXPLICIT_BATCH, which TensorRT 11 lacks.
def test_the_trt_extra_needs_a_polygraphy_that_handles_tensorrt_11():
    import re

    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for group in ("trt", "dev"):
        (floor,) = [
            re.fullmatch(r"polygraphy>=([\d.]+)", r).group(1)
            for r in project["optional-dependencies"][group]
            if r.startswith("polygraphy")
        ]
        assert tuple(int(p) for p in floor.split(".")) >= (0, 49, 9), group


# Finding 8: a BF16 engine input is the runner's error, not numpy's TypeError.
def test_a_bf16_engine_input_is_a_runner_error():
    import numpy as np

    from hydra_deploy.engines import runner as runner_module
    from hydra_deploy.errors import RunnerError

    trt = trt_standins.tensorrt_module("10.3.0")
    assert runner_module._trt_dtype(trt, trt.int64) == "int64"
    dtype = runner_module._trt_dtype(trt, trt.bfloat16)
    assert dtype == "bfloat16"
    spec = runner_module.TensorSpec("pixel_values", (None, 3, 16, 16), dtype)
    with pytest.raises(RunnerError, match="bfloat16, which numpy cannot hold"):
        runner_module._check_one(spec, np.zeros((1, 3, 16, 16), np.float32), False)


# Finding 8: ONNX Runtime's TensorRT provider with its caches, then CUDA and CPU.
def test_the_tensorrt_provider_gets_caches_and_fallbacks(tmp_path, monkeypatch):
    from hydra_deploy.engines.runner import ort_tensorrt_cache_dir, resolve_providers

    available = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    caches = {
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": str(tmp_path),
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": str(tmp_path),
    }
    assert resolve_providers(["tensorrt"], available, cache_dir=tmp_path) == [
        ("TensorrtExecutionProvider", caches),
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    ]
    own = resolve_providers(
        [("trt", {"trt_fp16_enable": True, "trt_engine_cache_path": "/x"}), "cpu"],
        available,
        cache_dir=tmp_path,
    )
    assert own == [
        (
            "TensorrtExecutionProvider",
            {**caches, "trt_fp16_enable": True, "trt_engine_cache_path": "/x"},
        ),
        "CPUExecutionProvider",
    ]
    no_cuda = ["TensorrtExecutionProvider", "CPUExecutionProvider"]
    assert resolve_providers("tensorrt", no_cuda, cache_dir=tmp_path)[1:] == [
        "CPUExecutionProvider"
    ]
    monkeypatch.setenv("HYDRA_ORT_TRT_CACHE", str(tmp_path / "c"))
    assert ort_tensorrt_cache_dir() == tmp_path / "c"
    assert resolve_providers(["tensorrt"], available)[0][1]["trt_engine_cache_path"] == str(
        tmp_path / "c"
    )


# --- building: without TensorRT, with a stand-in for Polygraphy, and for real -----------------------------------
def test_import_needs_neither_tensorrt_nor_torch():
    code = (
        "import sys, hydra_deploy.engines.tensorrt, hydra_deploy.engines.trtexec, "
        "hydra_deploy.cli.build\n"
        "print(sorted(m for m in ('torch', 'timm', 'onnx', 'onnxruntime', 'tensorrt', "
        "'polygraphy') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"


@pytest.mark.skipif(
    HAS_TENSORRT, reason="TensorRT is installed; this checks the message without it"
)
def test_build_without_tensorrt_says_how_to_install_or_use_trtexec(exports):
    with pytest.raises(EngineError) as err:
        build_engine(exports["fp32"])
    message = str(err.value)
    assert "pip install 'hydra-deploy[trt]'" in message and "pypi.nvidia.com" in message
    assert str(trtexec_command(exports["fp32"], precision="fp16", trt="10")) in message
    assert "\n" not in message
    with pytest.raises(EngineError, match="hydra-deploy\\[trt\\]"):
        plan_build(exports["fp32"], gpu=H200)  # the installed TensorRT is asked for


use_standins = trt_standins.install


def test_execute_plan_composes_polygraphy_loaders_and_writes_atomically(
    exports, tmp_path, monkeypatch
):
    calls = use_standins(monkeypatch, "10.3.0.30")
    plan = plan_build(
        exports["uq"], precision="fp16", trt_version="10.3.0.30", gpu=ORIN, out=tmp_path
    )
    sidecar = execute_plan(plan)
    assert plan.engine_path.read_bytes() == b"serialized-engine"
    assert json.loads(plan.sidecar_path.read_text()) == sidecar
    assert sidecar["engine_bytes"] == len(b"serialized-engine") and sidecar["built_at"]
    cache = tmp_path / "timing.orin-nvgpu-sm87.trt10.3.cache"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [plan.engine_path.name, plan.sidecar_path.name, cache.name]
    )  # no temporary files left behind
    assert calls["network"] == (str(plan.onnx_path), False)
    assert calls["pinned"] == {name: trt_standins.DataType.FLOAT for name in plan.fp32_layers}
    assert sidecar["fp32_pinned"] == list(plan.fp32_layers)
    config = calls["config"]
    assert (config["fp16"], config["bf16"], config["precision_constraints"]) == (
        True,
        False,
        "obey",
    )
    assert config["load_timing_cache"] is None
    assert config["profiles"] == [
        {"pixel_values": ([1, 3, 16, 16], [4, 3, 16, 16], [6, 3, 16, 16])}
    ]
    assert calls["save_timing_cache"] == str(cache)
    with pytest.raises(EngineError, match="pass overwrite=True to rebuild it"):
        execute_plan(plan)
    # a strongly typed plan: no flags, no layer precisions
    calls.clear()
    typed = plan_build(exports["fp16"], trt_version="10.3.0.30", gpu=ORIN, out=tmp_path / "typed")
    execute_plan(typed)
    assert calls["network"] == (str(typed.onnx_path), True)
    assert calls["pinned"] == {}
    assert (calls["config"]["fp16"], calls["config"]["bf16"]) == (False, False)


# Finding 1 (issue 18): TensorRT returns an IHostMemory (buffer protocol, nbytes, no len()).
def test_a_buffer_only_engine_is_written_with_its_sidecar_and_timing_cache(
    exports, tmp_path, monkeypatch
):
    use_standins(monkeypatch, "10.3.0.30")
    engine = trt_standins.host_memory(b"x")
    with pytest.raises(TypeError):
        len(engine)  # what the real object does
    plan = plan_build(
        exports["fp32"], precision="fp16", trt_version="10.3.0.30", gpu=ORIN, out=tmp_path
    )
    sidecar = execute_plan(plan)
    assert plan.engine_path.read_bytes() == b"serialized-engine"
    assert json.loads(plan.sidecar_path.read_text())["engine_bytes"] == len(b"serialized-engine")
    assert (tmp_path / sidecar["timing_cache"]).read_bytes() == b"timing-cache"
    # the second build starts from that cache
    again = plan_build(
        exports["fp32"], precision="fp16", trt_version="10.3.0.30", gpu=ORIN, out=tmp_path
    )
    assert again.load_timing_cache == tmp_path / sidecar["timing_cache"]


def test_a_failed_build_or_an_unwritable_sidecar_leaves_no_engine(exports, tmp_path, monkeypatch):
    use_standins(monkeypatch, "10.3.0.30")
    module = sys.modules["polygraphy.backend.trt"]
    plan = plan_build(
        exports["fp32"], precision="fp16", trt_version="10.3.0.30", gpu=ORIN, out=tmp_path
    )
    monkeypatch.setattr(module.EngineBytesFromNetwork, "__call__", lambda self: None)
    with pytest.raises(EngineError, match="empty engine"):
        execute_plan(plan)
    assert not plan.engine_path.exists()
    monkeypatch.undo()
    use_standins(monkeypatch, "10.3.0.30")
    import hydra_deploy.atomic as atomic

    def refuse(path, data, indent=2):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic, "atomic_write_json", refuse)
    with pytest.raises(EngineError, match="the engine was removed"):
        execute_plan(plan)
    assert not plan.engine_path.exists()
    monkeypatch.undo()
    use_standins(monkeypatch, "10.3.0.30")
    execute_plan(plan)  # no engine was left behind, so the rebuild needs no --overwrite
    assert plan.sidecar_path.is_file()


# Finding 2: 8.6's parser leaves LayerNormalization layers unnamed; pins go by layer type.
@pytest.mark.parametrize("version", ["8.6.1.6", "10.3.0.30"])
def test_layernorms_are_pinned_by_layer_type_on_every_release(
    exports, tmp_path, monkeypatch, version, caplog
):
    calls = use_standins(monkeypatch, version)
    plan = plan_build(exports["uq"], precision="fp16", trt_version=version, gpu=ORIN, out=tmp_path)
    with caplog.at_level("INFO", logger="hydra_deploy.engines"):
        execute_plan(plan)
    assert "no layer is named" not in caplog.text and "decomposed" not in caplog.text
    # the logged trtexec line says what it cannot do on 8.6
    assert ("cannot pin the 7 LayerNormalization" in plan.trtexec_equivalent()) == (
        version.startswith("8.")
    )
    network = calls["parsed"]
    norms = [
        layer for layer in network.layers if layer.type is trt_standins.LayerType.NORMALIZATION
    ]
    assert len(norms) == 7
    assert all(
        layer.precision_is_set and layer.precision is trt_standins.DataType.FLOAT for layer in norms
    )
    assert any(layer.name.startswith("(Unnamed Layer*") for layer in norms) == version.startswith(
        "8."
    )
    head = [n for n in plan.fp32_layers if not n.startswith("LayerNormalization")]
    assert head and all(calls["pinned"][n] is trt_standins.DataType.FLOAT for n in head)


# Finding 6: the sidecar records the engine's own I/O dtypes (INT32 token ids on 8.6).
@pytest.mark.parametrize("version, ids", [("8.6.1.6", "int32"), ("10.3.0.30", "int64")])
def test_sidecar_records_the_engines_io_dtypes(text_export, tmp_path, monkeypatch, version, ids):
    use_standins(monkeypatch, version)
    plan = plan_build(text_export, precision="fp16", trt_version=version, gpu=ORIN, out=tmp_path)
    sidecar = execute_plan(plan)
    engine_inputs = {t["name"]: t["dtype"] for t in sidecar["engine_io"]["inputs"]}
    assert engine_inputs["input_ids"] == ids and engine_inputs["attention_mask"] == ids
    assert {t["name"]: t["dtype"] for t in sidecar["inputs"]} == engine_inputs
    assert info_of(text_export)["inputs"][0]["dtype"] == "int64"  # the export keeps its own


@pytest.mark.parametrize("version, ids", [("8.6.1.6", "int32"), ("10.3.0.30", "int64")])
def test_a_text_engine_gets_token_ids_in_its_own_dtype(
    text_export, tmp_path, monkeypatch, version, ids
):
    """Polygraphy copies input bytes as they are: the runner must cast int64 ids to an 8.6
    engine's INT32 (the stand-in TrtRunner refuses any other dtype)."""
    import numpy as np
    import onnxruntime as ort

    from hydra_deploy.engines import runner as runner_module
    from hydra_deploy.engines import tensorrt_runner
    from hydra_deploy.export_folder import read_info

    monkeypatch.setitem(sys.modules, "tensorrt", trt_standins.tensorrt_module(version))
    monkeypatch.setattr(tensorrt_runner, "_trt_runner_class", lambda: trt_standins.TrtRunner)
    monkeypatch.setattr(tensorrt_runner, "_compute_capability_here", lambda: None)
    monkeypatch.setattr(trt_standins.TrtRunner, "feeds", [])
    names = [i["name"] for i in info_of(text_export)["inputs"]]
    engine = trt_standins.engine_file(
        tmp_path / "model.engine",
        text_export / "model.onnx",
        version,
        {n: [[1, 1], [2, 16], [4, 64]] for n in names},
    )
    runner = runner_module.TensorRTRunner(engine, export=read_info(text_export))
    assert {spec.name: spec.dtype for spec in runner.inputs} == dict.fromkeys(names, ids)
    feed = {
        n: np.array([[2, 4, 5, 3], [2, 6, 3, 0]])
        if n == "input_ids"
        else np.array([[1, 1, 1, 1], [1, 1, 1, 0]])
        if n == "attention_mask"
        else np.zeros((2, 4), dtype=np.int64)
        for n in names
    }
    got = runner(feed)["member_logits"]
    assert trt_standins.TrtRunner.feeds == [dict.fromkeys(names, ids)]
    session = ort.InferenceSession(
        str(text_export / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    expected = session.run(["member_logits"], {n: a.astype(np.int64) for n, a in feed.items()})[0]
    np.testing.assert_allclose(got, expected, atol=1e-5)
    with pytest.raises(runner_module.RunnerError, match="only run on the TensorRT version"):
        engine.write_text(engine.read_text().replace(version, "9.9.9"))
        runner_module.TensorRTRunner(engine, export=read_info(text_export))


@pytest.mark.parametrize("kind", ["fp16", "bf16", "fp32"])
def test_a_trt11_build_never_touches_layer_precision(exports, tmp_path, monkeypatch, kind):
    """TensorRT 11 has no ILayer.precision (pyGraph.cpp v11.0); its builds are strongly typed."""
    calls = use_standins(monkeypatch, "11.0.0.1")
    plan = plan_build(exports[kind], precision=kind, trt_version="11.0.0.1", gpu=H200, out=tmp_path)
    sidecar = execute_plan(plan)
    assert plan.strongly_typed and calls["pinned"] == {} and sidecar["fp32_pinned"] == []
    assert calls["config"]["precision_constraints"] is None


def test_a_strongly_typed_or_bf16_build_on_trt86_fails_as_polygraphy_does(exports, monkeypatch):
    """The stand-ins refuse what Polygraphy cannot do on 8.6, so plans must never ask it."""
    use_standins(monkeypatch, "8.6.1.6")
    module = sys.modules["polygraphy.backend.trt"]
    with pytest.raises(trt_standins.Unavailable):
        module.NetworkFromOnnxPath(str(exports["fp16"] / "model.onnx"), strongly_typed=True)()
    with pytest.raises(trt_standins.Unavailable):
        module.CreateConfig(bf16=True)
    plan = plan_build(exports["fp16"], trt_version="8.6.1.6", gpu=ORIN)
    assert not plan.strongly_typed and plan.builder_flags == ("fp16",)


@pytest.mark.skipif(
    not HAS_TENSORRT,
    reason="TensorRT is not installed: pip install 'hydra-deploy[trt]' on a machine with an "
    "NVIDIA GPU to run this",
)
def test_real_engine_builds_and_matches_onnx_runtime(exports, tmp_path):
    import numpy as np
    import onnxruntime as ort
    from polygraphy.backend.common import BytesFromPath
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    engine = build_engine(exports["fp32"], precision="fp32", out=tmp_path)
    sidecar = json.loads(engine.with_suffix(".json").read_text())
    assert sidecar["precision"] == "fp32" and (tmp_path / sidecar["timing_cache"]).is_file()
    x = np.random.default_rng(0).standard_normal((5, 3, 16, 16)).astype(np.float32)
    session = ort.InferenceSession(
        str(exports["fp32"] / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    expected = session.run(["member_logits"], {"pixel_values": x})[0]
    with TrtRunner(EngineFromBytes(BytesFromPath(str(engine)))) as runner:
        got = runner.infer({"pixel_values": x})["member_logits"]
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=0)


def test_decision_layers_stay_in_fp32_under_weak_typing(exports):
    """hydra-calibrate --in-graph's float layers (softmaxes, tail sums, comparisons with the
    thresholds) are pinned to FP32 like the ensemble head, so an --fp16 engine decides on FP32
    numbers; the ops that compute no float (bool logic, indices) are left to TensorRT."""
    model = onnx.load(str(exports["decisions"] / "model.onnx"))
    pinned = set(fp32_layer_names(read_onnx(exports["decisions"] / "model.onnx")))
    decision_nodes = {
        n.name: n.op_type for n in model.graph.node if n.name.startswith("decisions/")
    }
    for op in (
        "ReduceMax",
        "Exp",
        "ReduceSum",
        "TopK",
        "MatMul",
        "ScatterElements",
        "Greater",
        "Less",
    ):
        named = [name for name, kind in decision_nodes.items() if kind == op]
        assert named, f"no {op} in the decision graph"
        assert set(named) <= pinned
    assert (
        not {
            name
            for name, kind in decision_nodes.items()
            if kind in ("And", "Or", "Not", "Equal", "Gather")
        }
        & pinned
    )
    command = trtexec_command(exports["decisions"], precision="fp16", trt="10")
    layers = next(a for a in command.argv if a.startswith("--layerPrecisions="))
    assert all(f"{name}:fp32" in layers for name in pinned)


# --- INT8: explicit quantization from the export's Q/DQ pairs (issue 27, item 2) --------------------------
@pytest.fixture(scope="module")
def int8_exports(exports, tmp_path_factory):
    """{"static", "dynamic", "asymmetric", "uint8"}: the uq export quantized by ONNX Runtime
    (tests/helpers/int8.py); only "static" is a graph TensorRT builds."""
    from helpers.int8 import KINDS, quantized_folder

    root = tmp_path_factory.mktemp("int8")
    return {kind: quantized_folder(exports["uq"], root / kind, kind) for kind in KINDS}


# per generation: 8.6 has no strong typing and needs the INT8 flag; 10.0 on: strongly typed, no
# flag (11 has none); every INT8 line keeps TF32 off for the FP32 layers, as the Python build does
INT8_TAILS = {
    "8.6": ["--int8", "--noTF32"],
    "10": ["--stronglyTyped", "--noTF32"],
    "10.12": ["--stronglyTyped", "--noTF32"],
    "11": ["--stronglyTyped", "--noTF32"],
}


def test_an_int8_export_is_read_from_its_graph(int8_exports, exports, tmp_path):
    from helpers.int8 import int8_record

    static = int8_exports["static"]
    summary = read_onnx(static / "model.onnx")
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in summary.nodes}
    assert load_source(static).graph_precision == "int8"
    # the zero points as the onnx package reads them: int8, all 0 (static); not 0 (asymmetric)
    for kind, symmetric in (("static", True), ("asymmetric", False)):
        model = onnx.load(str(int8_exports[kind] / "model.onnx"))
        values = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
        points = read_onnx(int8_exports[kind] / "model.onnx").zero_points
        assert points and all(
            (dtype, zeros) == (onnx.TensorProto.INT8, not values[name].any())
            for name, (dtype, zeros) in points.items()
        )
        assert all(zeros for _, zeros in points.values()) == symmetric
    # the graph decides, not hydra.json: a record saying fp32, a bare .onnx file without one
    relabelled = tmp_path / "relabelled"
    shutil.copytree(static, relabelled)
    record = {k: v for k, v in info_of(static).items() if k != "int8"}  # read_info: int8 only
    (relabelled / "hydra.json").write_text(json.dumps({**record, "precision": "fp32"}))
    assert load_source(relabelled).graph_precision == "int8"
    shutil.copy(static / "model.onnx", tmp_path / "bare.onnx")
    assert load_source(tmp_path / "bare.onnx").graph_precision == "int8"
    # records that contradict the graph are refused
    (relabelled / "hydra.json").write_text(json.dumps({**record, "precision": "fp16"}))
    with pytest.raises(EngineError, match="holds QuantizeLinear/DequantizeLinear pairs"):
        load_source(relabelled).graph_precision  # noqa: B018
    claimed = tmp_path / "claimed"
    shutil.copytree(exports["uq"], claimed)
    claim = {"precision": "int8", "int8": int8_record(claimed / "model.onnx", "static")}
    (claimed / "hydra.json").write_text(json.dumps({**info_of(exports["uq"]), **claim}))
    with pytest.raises(EngineError, match="holds no QuantizeLinear/DequantizeLinear pairs"):
        trtexec_command(claimed, trt="10")
    # an FP32 graph has no INT8 build here: TensorRT's calibration is not offered
    with pytest.raises(EngineError, match=r"unknown precision 'int8'.*--int8-method static"):
        trtexec_command(exports["uq"], precision="int8", trt="10")


@pytest.mark.parametrize("trt", ["8.6", "10", "10.12", "11"])
def test_trtexec_command_for_an_int8_export(int8_exports, trt):
    folder = int8_exports["static"]
    stem = f"model.{info_of(folder)['onnx_sha256'][:12]}.int8.trt{trt}"
    for precision in (None, "int8", "best"):
        command = trtexec_command(folder, precision=precision, trt=trt)
        tail = INT8_TAILS[trt]
        assert list(command.argv) == expected_argv(folder, tail, stem, f"timing.trt{trt}.cache")
        assert command.precision == "int8" and command.strongly_typed == (trt != "8.6")
        # the weak path says why it has no --fp16 (trtexec itself suggests one)
        assert any("--int8 turns on" in n for n in command.notes) == (trt == "8.6")
    with pytest.raises(EngineError, match="exported in int8"):
        trtexec_command(folder, precision="fp16", trt=trt)


def test_int8_lines_pass_their_generations_trtexec_and_no_other(trtexec_of, int8_exports):
    folder = int8_exports["static"]
    for trt in trt_standins.RELEASES:
        command = trtexec_command(folder, trt=trt)
        result = run_trtexec(trtexec_of[trt], command.argv)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == list(command.argv[1:])
        assert not {"--fp16", "--bf16", "--best", "--precisionConstraints"} & {
            a.split("=", 1)[0] for a in command.argv
        }
    # 11's trtexec parses no --int8 (only its safety builder does); 8.6's no --stronglyTyped
    weak = run_trtexec(trtexec_of["11"], trtexec_command(folder, trt="8.6").argv)
    assert weak.returncode == 1 and "Unknown option: --int8" in weak.stderr
    strong = run_trtexec(trtexec_of["8.6"], trtexec_command(folder, trt="10").argv)
    assert strong.returncode == 1 and "Unknown option: --stronglyTyped" in strong.stderr


@pytest.mark.parametrize(
    "script, args, trt",
    [
        ("build_trt86_int8.sh", [], "8.6"),  # JetPack 6.0
        ("build_jetpack6_int8.sh", [], "10"),  # JetPack 6.1 / 6.2
        ("build_strongly_typed.sh", [], "10.12"),
        ("build_strongly_typed.sh", ["11"], "11"),
        ("trtexec_build.sh", ["10", "int8"], "10"),
        ("trtexec_build.sh", ["8.6"], "8.6"),
        ("trtexec_build.sh", ["11", "best"], "11"),
    ],
)
def test_int8_scripts_run_the_command_trtexec_command_gives(
    trtexec_of, int8_exports, script, args, trt
):
    folder = int8_exports["static"]
    result = run_script(trtexec_of[trt], script, str(folder), *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == list(trtexec_command(folder, trt=trt).argv[1:])
    assert ("--int8 turns on" in result.stderr) == (trt == "8.6")


def test_int8_script_environment_and_dry_run(trtexec_of, int8_exports, tmp_path):
    folder = int8_exports["static"]
    env = dict(OUT_DIR=str(tmp_path), GPU_TAG="orin-sm87", MIN_BATCH="2", MAX_BATCH="5")
    result = run_script(
        trtexec_of["10"], "build_jetpack6_int8.sh", str(folder), "--", "--useCudaGraph", **env
    )
    assert result.returncode == 0, result.stderr
    expected = trtexec_command(
        folder,
        trt="10",
        out=tmp_path,
        gpu="orin-sm87",
        min_batch=2,
        max_batch=5,
        extra=["--useCudaGraph"],
    )
    assert result.stdout.splitlines() == list(expected.argv[1:])
    dry = run_script(tmp_path, "build_trt86_int8.sh", str(folder), DRY_RUN="1", TRT_VERSION="8.6.2")
    assert dry.returncode == 0, dry.stderr
    assert shlex.split(dry.stdout)[1:] == list(trtexec_command(folder, trt="8.6").argv[1:])


@pytest.mark.parametrize(
    "script, installed, release, hint",
    [
        ("build_jetpack6_int8.sh", "8.6", "8.6", "build_trt86_int8.sh"),  # JetPack 6.0
        ("build_trt86_int8.sh", "10", "10.3", "build_jetpack6_int8.sh"),  # JetPack 6.1 / 6.2
        ("build_jetpack6_int8.sh", "11", "11.0", "build_strongly_typed.sh EXPORT_DIR 11"),
    ],
)
def test_int8_scripts_refuse_a_recipe_for_another_tensorrt(
    trtexec_of, int8_exports, script, installed, release, hint
):
    result = run_script(trtexec_of[installed], script, str(int8_exports["static"]))
    assert result.returncode == 1 and result.stdout == ""
    assert f"this machine has TensorRT {release}" in result.stderr and hint in result.stderr


@pytest.mark.parametrize(
    "kind, message",
    [
        ("dynamic", "re-export with --int8-method static"),  # MatMulInteger, DynamicQuantizeLinear
        ("asymmetric", "a zero point that is not 0"),
        ("uint8", "a uint8 zero point"),
    ],
)
def test_int8_graphs_tensorrt_cannot_build_are_refused_everywhere(
    trtexec_of, int8_exports, capsys, kind, message
):
    """The library, hydra-build, hydra-export's hint and the scripts refuse them alike, in the same
    words, before any trtexec runs."""
    from hydra_deploy.cli.build import main as build_main
    from hydra_deploy.cli.export import trtexec_lines

    folder = int8_exports[kind]
    if kind == "dynamic":
        ops = {n.op_type for n in read_onnx(folder / "model.onnx").nodes}
        assert {"MatMulInteger", "DynamicQuantizeLinear"} <= ops
    for trt in ("8.6", "10", "10.12", "11"):
        with pytest.raises(EngineError, match=message) as err:
            trtexec_command(folder, trt=trt)
    with pytest.raises(EngineError, match=message):
        plan_build(folder, trt_version="10.3.0", gpu=ORIN)
    with pytest.raises(EngineError, match=message):  # before TensorRT is asked for
        build_engine(folder)
    assert trtexec_lines({}, folder) == [f"# no TensorRT can build this export: {err.value}"]
    assert build_main([str(folder), "--trtexec"]) == 1
    assert message in capsys.readouterr().err
    for script, args, trt in (
        ("build_trt86_int8.sh", [], "8.6"),
        ("build_jetpack6_int8.sh", [], "10"),
        ("trtexec_build.sh", ["11"], "11"),
    ):
        result = run_script(trtexec_of[trt], script, str(folder), *args)
        assert result.returncode == 1 and result.stdout == "", result.stderr
        assert result.stderr.strip() == f"error: {err.value}"


@pytest.mark.parametrize(
    "version, strongly_typed",
    [("8.6.1.6", False), ("10.3.0.30", True), ("10.13.0.35", True), ("11.0.0.1", True)],
)
def test_the_python_build_of_an_int8_export(
    int8_exports, tmp_path, monkeypatch, version, strongly_typed
):
    """The builder config the stand-ins receive: INT8 flag on 8.6 only, a strongly typed network
    from 10.0 on, no FP16/BF16 flag and no precision constraints anywhere (the stand-ins refuse a
    Q/DQ network without the flag on 8.6, any precision flag on a strongly typed network, and the
    flag on 11, which has none)."""
    folder = int8_exports["static"]
    calls = use_standins(monkeypatch, version)
    plan = plan_build(folder, trt_version=version, gpu=ORIN, out=tmp_path)
    flags = () if strongly_typed else ("int8",)
    assert (plan.precision, plan.strongly_typed, plan.builder_flags) == (
        "int8",
        strongly_typed,
        flags,
    )
    assert plan.fp32_layers == () and plan.precision_constraints is None
    sidecar = execute_plan(plan)
    assert calls["network"] == (str(plan.onnx_path), strongly_typed)
    config = calls["config"]
    assert (config["int8"], config["fp16"], config["bf16"]) == (not strongly_typed, False, False)
    assert config["precision_constraints"] is None and calls["pinned"] == {}
    assert sidecar["precision"] == "int8" and sidecar["builder_flags"] == list(flags)
    assert plan.engine_path.name.startswith(f"model.{info_of(folder)['onnx_sha256'][:12]}.int8.")
    logged = plan.trtexec_equivalent()
    assert ("--int8" in logged.split()) == (not strongly_typed)
    assert ("--stronglyTyped" in logged.split()) == strongly_typed


def test_the_standins_refuse_what_an_int8_build_must_not_ask(int8_exports, monkeypatch):
    path = str(int8_exports["static"] / "model.onnx")
    use_standins(monkeypatch, "8.6.1.6")
    module = sys.modules["polygraphy.backend.trt"]
    with pytest.raises(RuntimeError, match="kINT8 is not set"):
        module.EngineBytesFromNetwork(module.NetworkFromOnnxPath(path)(), config={})()
    use_standins(monkeypatch, "10.3.0.30")
    module = sys.modules["polygraphy.backend.trt"]
    typed = module.NetworkFromOnnxPath(path, strongly_typed=True)()
    with pytest.raises(RuntimeError, match="not allowed if graph is strongly typed"):
        module.EngineBytesFromNetwork(typed, config=module.CreateConfig(int8=True))()
    with pytest.raises(RuntimeError, match="reject calls to method setPrecision"):
        typed[1].layers[0].precision = trt_standins.DataType.FLOAT
    use_standins(monkeypatch, "11.0.0.1")
    with pytest.raises(trt_standins.Unavailable, match="'int8'"):
        sys.modules["polygraphy.backend.trt"].CreateConfig(int8=True)
