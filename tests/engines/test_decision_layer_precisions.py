"""Issue 34, part 3: a weakly typed reduced-precision build keeps every floating-point layer of the
in-graph decisions (``hydra-calibrate --in-graph``) in FP32: the trtexec lines ``hydra-build
--trtexec`` prints and the Python (Polygraphy) build pin each one by its name, on every TensorRT
generation the stand-ins model; the strongly typed generations pin nothing and still build.

The stand-ins (tests/helpers/trt_standins.py) refuse a weak FP16/BF16 build that leaves a decision
layer unpinned; tests/helpers/decision_layers.py says which layers TensorRT's parser makes of the
decision nodes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import onnx
import pytest
from helpers import trt_standins
from helpers.decision_layers import decision_layers, uncovered_decision_layers
from helpers.decisions import calibrate_export, tiny_export

from hydra_deploy.cli.build import main as build_main
from hydra_deploy.engines.onnx_summary import DECISION_PREFIX, fp32_layer_names, read_onnx
from hydra_deploy.engines.tensorrt import GpuInfo, execute_plan, plan_build
from hydra_deploy.engines.trtexec import trtexec_command
from hydra_deploy.errors import EngineError
from hydra_deploy.export.decision_graph import PREFIX

ORIN = GpuInfo("Orin (nvgpu)", 8, 7, "12.2")
# (sets, class-conditional, accept score, OOD score): every score, every set method
RULES = {
    "aps": ("aps", False, "msp", "msp"),
    "raps": ("raps", True, "predictive_entropy", "mutual_information"),
    "lac": ("lac", False, "mutual_information", "predictive_entropy"),
}
# a TensorRT release of each generation, as the Python build reads tensorrt.__version__
VERSIONS = {"8.6": "8.6.1.6", "10": "10.3.0.30", "10.12": "10.13.0.35", "11": "11.0.0"}


@pytest.fixture(scope="module")
def decided(tmp_path_factory):
    """{rules: a tiny export with those decisions in model.onnx} and "fp16": the APS one marked
    as an FP16 graph (the strongly typed generations build only typed graphs; the recipes read
    hydra.json's precision)."""
    root = tmp_path_factory.mktemp("decided")
    plain = tiny_export(root / "plain")
    folders = {}
    for name, (sets, conditional, accept, ood) in RULES.items():
        folder = root / name
        shutil.copytree(plain, folder)
        calibrate_export(
            folder,
            in_graph=True,
            alpha=0.3 if conditional else 0.1,  # class-conditional: enough examples per class
            sets=sets,
            class_conditional=conditional,
            accept_score=accept,
            ood_score=ood,
        )
        folders[name] = folder
    typed = root / "fp16"
    shutil.copytree(folders["aps"], typed)
    info = json.loads((typed / "hydra.json").read_text())
    (typed / "hydra.json").write_text(json.dumps({**info, "precision": "fp16"}, indent=2))
    folders["fp16"] = typed
    return folders


@pytest.fixture(scope="module")
def trtexec_of(tmp_path_factory):
    """generation -> a folder with a stand-in trtexec of that generation."""
    root = tmp_path_factory.mktemp("bin")
    for generation in trt_standins.RELEASES:
        trt_standins.write_trtexec(root / generation, generation)
    return {generation: root / generation for generation in trt_standins.RELEASES}


def run_trtexec(bin_folder: Path, argv, report: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "FAKE_TRTEXEC_REPORT": str(report)}
    return subprocess.run(
        [str(bin_folder / "trtexec"), *argv[1:]],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def decision_nodes(folder: Path) -> dict[str, str]:
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    return {n.name: n.op_type for n in model.graph.node if n.name.startswith(PREFIX)}


def test_the_prefix_is_the_same_in_both_modules():
    assert DECISION_PREFIX == PREFIX  # onnx_summary reads files without the onnx package


@pytest.mark.parametrize("rules", list(RULES))
def test_fp32_layers_are_exactly_the_float_decision_layers(decided, rules):
    """fp32_layer_names lists every decision node that reads or writes a float tensor (by ONNX
    type inference), and none that computes on integers or booleans only; no decision node makes a
    floating-point layer that a name cannot reach."""
    path = decided[rules] / "model.onnx"
    named, unreachable = decision_layers(path)
    assert unreachable == []
    pinned = fp32_layer_names(read_onnx(path))
    nodes = decision_nodes(decided[rules])
    assert [n for n in pinned if n.startswith(PREFIX)] == [n for n in nodes if n in named]
    left = {op for name, op in nodes.items() if name not in pinned}
    assert left <= {"Equal", "Gather", "And", "Or", "Not"}
    assert {"Exp", "ReduceMax", "ReduceSum", "Div", "Sub", "Greater"} <= {nodes[n] for n in named}
    comparisons = [n for n in named if nodes[n] in ("Less", "Greater")]
    assert len(comparisons) >= 3  # the set, accept and OOD comparisons, and the finite guard


def trtexec_json(capsys, folder: Path, *options: str) -> dict[str, dict]:
    """What ``hydra-build FOLDER --trtexec --json OPTIONS`` prints, by generation."""
    code = build_main([str(folder), "--trtexec", "--json", *options])
    out = capsys.readouterr().out
    assert code == 0
    return {c["trt"]: c for c in json.loads(out)["commands"]}


@pytest.mark.parametrize("rules", list(RULES))
def test_hydra_build_trtexec_lines_pin_every_decision_layer(
    capsys, decided, trtexec_of, tmp_path, rules
):
    """The FP16 lines of an FP32 graph (8.6 and 10: weakly typed) pin every floating-point
    decision layer to FP32, and that generation's trtexec (stand-in) takes them; 10.12 and 11
    build only typed graphs and say so."""
    named, _ = decision_layers(decided[rules] / "model.onnx")
    commands = trtexec_json(capsys, decided[rules], "--precision", "fp16")
    report = tmp_path / "report.json"
    for trt in ("8.6", "10"):
        argv = commands[trt]["argv"]
        assert "--fp16" in argv and "--stronglyTyped" not in argv
        layers = next(a for a in argv if a.startswith("--layerPrecisions="))
        given = {p.rsplit(":", 1)[0] for p in layers.split("=", 1)[1].split(",")}
        assert set(named) <= given
        result = run_trtexec(trtexec_of[trt], argv, report)
        assert result.returncode == 0, result.stderr
        seen = json.loads(report.read_text())
        assert seen["uncovered"] == [] and seen["unmatched"] == []
        assert set(named) <= set(seen["matched"])
    for trt in ("10.12", "11"):
        assert commands[trt].get("argv") is None and "--precision fp16" in commands[trt]["error"]
    # BF16 on 10 (weakly typed too)
    bf16 = trtexec_command(decided[rules], precision="bf16", trt="10")
    result = run_trtexec(trtexec_of["10"], bf16.argv, report)
    assert result.returncode == 0, result.stderr
    assert json.loads(report.read_text())["uncovered"] == []


def test_typed_graph_lines_on_every_generation(capsys, decided, trtexec_of, tmp_path):
    """An FP16 graph with decisions: 8.6 builds it weakly typed and pins every decision layer; 10,
    10.12 and 11 build it strongly typed, with no layer precisions (the graph's float32 decisions
    stay float32), and their trtexec takes the line."""
    named, _ = decision_layers(decided["fp16"] / "model.onnx")
    commands = trtexec_json(capsys, decided["fp16"])
    report = tmp_path / "report.json"
    for trt, command in commands.items():
        argv = command["argv"]
        result = run_trtexec(trtexec_of[trt], argv, report)
        assert result.returncode == 0, result.stderr
        seen = json.loads(report.read_text())
        assert seen["uncovered"] == []
        if trt == "8.6":
            assert "--fp16" in argv and set(named) <= set(seen["matched"])
        else:
            assert "--stronglyTyped" in argv
            assert not any(a.startswith(("--fp16", "--layerPrecisions")) for a in argv)


def test_the_trtexec_standin_refuses_an_unpinned_decision_layer(decided, trtexec_of, tmp_path):
    """The stand-in's check itself: a line that leaves out one decision layer (or pins it to
    FP16) fails naming it; the same line without --fp16 (an FP32 build) needs no pins."""
    command = trtexec_command(decided["raps"], precision="fp16", trt="10")
    argv = list(command.argv)
    index = next(i for i, a in enumerate(argv) if a.startswith("--layerPrecisions="))
    names = argv[index].split("=", 1)[1].split(",")
    dropped = f"{PREFIX}mass_below"
    assert f"{dropped}:fp32" in names
    others = [n for n in names if n != f"{dropped}:fp32"]
    report = tmp_path / "report.json"
    for changed in (others, [*others, f"{dropped}:fp16"]):
        argv[index] = "--layerPrecisions=" + ",".join(changed)
        result = run_trtexec(trtexec_of["10"], argv, report)
        assert result.returncode == 1
        assert dropped in result.stderr and "FAILED" in result.stderr
        assert json.loads(report.read_text())["uncovered"] == [dropped]
    fp32 = trtexec_command(decided["raps"], precision="fp32", trt="10")
    assert run_trtexec(trtexec_of["10"], fp32.argv, report).returncode == 0


def test_decision_layers_names_what_the_parser_splits(tmp_path):
    """A decision node that TensorRT's parser makes into several layers (LogSoftmax: Softmax,
    an unnamed Log and an unnamed Shuffle) or broadcasts across ranks cannot be pinned by name."""
    from onnx import TensorProto, helper

    shape = ["batch", 3, 5]
    nodes = [
        helper.make_node("Identity", ["x"], ["member_logits"], name="logits"),
        helper.make_node("LogSoftmax", ["member_logits"], ["lsm"], name=f"{PREFIX}lsm", axis=-1),
        helper.make_node("Mul", ["lsm", f"{PREFIX}two"], ["out"], name=f"{PREFIX}scaled"),
    ]
    two = helper.make_tensor(f"{PREFIX}two", TensorProto.FLOAT, [], [2.0])  # rank 0: broadcast
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, shape)],
        [two],
    )
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    named, unreachable = decision_layers(path)
    assert named == [f"{PREFIX}scaled"]
    assert [u.split(" ")[0] for u in unreachable] == [f"{PREFIX}lsm", f"{PREFIX}scaled"]
    everything = {f"{PREFIX}lsm", f"{PREFIX}scaled"}
    assert len(uncovered_decision_layers(path, everything, everything)) == 2


use_standins = trt_standins.install


@pytest.mark.parametrize("trt", list(VERSIONS))
def test_the_python_build_pins_every_decision_layer(decided, tmp_path, monkeypatch, trt):
    """hydra-build's own build (Polygraphy): on 8.6 and 10 an FP16 build of the FP32 graph pins
    every floating-point decision layer to FP32; on 10.12 and 11 that build is refused (the
    typed graph is the way) and the typed graph builds strongly typed with nothing pinned."""
    version = VERSIONS[trt]
    calls = use_standins(monkeypatch, version)
    named, _ = decision_layers(decided["aps"] / "model.onnx")
    if trt in ("8.6", "10"):
        plan = plan_build(
            decided["aps"], precision="fp16", trt_version=version, gpu=ORIN, out=tmp_path
        )
        execute_plan(plan)
        assert not plan.strongly_typed
        assert all(calls["pinned"].get(n) is trt_standins.DataType.FLOAT for n in named)
    else:
        with pytest.raises(EngineError, match="--precision fp16"):
            plan_build(
                decided["aps"], precision="fp16", trt_version=version, gpu=ORIN, out=tmp_path
            )
    typed = plan_build(decided["fp16"], trt_version=version, gpu=ORIN, out=tmp_path / "typed")
    execute_plan(typed)
    if trt == "8.6":  # no strong typing: weakly typed FP16 with the same pins
        assert all(calls["pinned"].get(n) is trt_standins.DataType.FLOAT for n in named)
    else:
        assert typed.strongly_typed and calls["pinned"] == {}


@pytest.mark.parametrize("version", [VERSIONS["8.6"], VERSIONS["10"]])
def test_polygraphy_set_layer_precisions_covers_the_decisions(decided, version):
    """Polygraphy's SetLayerPrecisions (stand-in) with fp32_layer_names pins every decision layer;
    without one of them it refuses, naming it."""
    calls: dict = {}
    poly = trt_standins.polygraphy_module(version, calls)
    path = decided["lac"] / "model.onnx"
    names = fp32_layer_names(read_onnx(path))
    fp32 = trt_standins.DataType.FLOAT
    loader = poly.NetworkFromOnnxPath(str(path), strongly_typed=False)
    _, network, _ = poly.SetLayerPrecisions(loader, {n: fp32 for n in names})()
    assert calls["uncovered"] == []
    named, _ = decision_layers(path)
    assert all(layer.precision is fp32 for layer in network.layers if layer.name in named)
    dropped = f"{PREFIX}prediction_set"  # LAC: the comparison p >= floor
    assert dropped in names
    with pytest.raises(RuntimeError, match=dropped):
        poly.SetLayerPrecisions(loader, {n: fp32 for n in names if n != dropped})()
