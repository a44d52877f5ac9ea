"""hydra-build: trtexec lines, the missing-TensorRT message, bad arguments, exit codes."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
from helpers.vit import tiny_vit

from hydra_deploy.cli.build import build_parser, main
from hydra_deploy.engines.trtexec import trtexec_command
from hydra_deploy.errors import EngineError, command_spelling
from hydra_deploy.export import export_onnx
from hydra_deploy.fusion import fuse
from hydra_deploy.specs import HydraSpec

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=2, seed=1)
    out = tmp_path_factory.mktemp("cli-build") / "export"
    export_onnx(fuse(backbone, spec), out, batch=(1, 2, 4), exporter="torchscript", validate=False)
    return out


@pytest.fixture(scope="module")
def typed_export_dir(export_dir, tmp_path_factory):
    """The same export marked as a strongly typed FP16 graph (what the recipes read)."""
    out = tmp_path_factory.mktemp("cli-build-fp16") / "export"
    shutil.copytree(export_dir, out)
    info = json.loads((out / "hydra.json").read_text())
    (out / "hydra.json").write_text(json.dumps({**info, "precision": "fp16"}))
    return out


@pytest.fixture(scope="module")
def int8_export_dir(export_dir, tmp_path_factory):
    """The same export quantized to Q/DQ pairs by ONNX Runtime (tests/helpers/int8.py)."""
    from helpers.int8 import quantized_folder

    return quantized_folder(export_dir, tmp_path_factory.mktemp("cli-build-int8") / "export")


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_trtexec_for_one_generation_prints_the_exact_command(capsys, export_dir):
    code, out, _ = run(capsys, export_dir, "--trtexec", "--trt", "10", "--precision", "fp16")
    assert code == 0
    assert out.splitlines() == [str(trtexec_command(export_dir, precision="fp16", trt="10"))]


def test_trtexec_options_reach_the_command(capsys, typed_export_dir, tmp_path):
    code, out, _ = run(
        capsys,
        typed_export_dir,
        "--trtexec",
        "--trt",
        "10.12",
        "--out",
        tmp_path,
        "--gpu-tag",
        "orin-sm87",
        "--min-batch",
        "2",
        "--opt-batch",
        "3",
        "--max-batch",
        "8",
        "--timing-cache",
        tmp_path / "t.cache",
    )
    assert code == 0
    expected = trtexec_command(
        typed_export_dir,
        trt="10.12",
        out=tmp_path,
        gpu="orin-sm87",
        min_batch=2,
        opt_batch=3,
        max_batch=8,
        timing_cache=tmp_path / "t.cache",
    )
    assert out.splitlines() == [expected.shell]
    assert "--stronglyTyped" in expected.argv and "--fp16" not in expected.argv


def test_trtexec_for_every_generation(capsys, export_dir):
    code, out, err = run(capsys, export_dir, "--trtexec")
    assert code == 0
    lines = out.splitlines()
    for trt in ("8.6", "10"):
        assert str(trtexec_command(export_dir, trt=trt)) in lines
    # an FP32 export cannot be built in FP16 on the strongly typed generations: say why
    unavailable = [line for line in lines if line.startswith("# not available")]
    assert len(unavailable) == 2
    assert all("--precision fp16" in line for line in unavailable)
    assert "fused MHA kernel" in err


def test_trtexec_json(capsys, typed_export_dir):
    code, out, _ = run(capsys, typed_export_dir, "--trtexec", "--json")
    assert code == 0
    commands = {c["trt"]: c for c in json.loads(out)["commands"]}
    assert set(commands) == {"8.6", "10", "10.12", "11"}
    for trt, command in commands.items():
        assert command["argv"] == list(trtexec_command(typed_export_dir, trt=trt).argv)
        assert command["strongly_typed"] == (trt != "8.6") and command["precision"] == "fp16"


@pytest.mark.skipif(
    HAS_TENSORRT, reason="TensorRT is installed; this checks the message without it"
)
def test_build_without_tensorrt_exits_1_with_one_line(capsys, export_dir):
    code, out, err = run(capsys, export_dir)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: TensorRT is not installed")
    assert "pip install 'hydra-deploy[trt]'" in err
    assert str(trtexec_command(export_dir, precision="fp16", trt="10")) in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["{missing}", "--trtexec"], "does not exist"),
        (["{empty}", "--trtexec"], "not an export folder"),
        (["{empty}"], "not an export folder"),
        (
            ["{export}", "--trtexec", "--min-batch", "8", "--max-batch", "4"],
            "1 <= min <= opt <= max",
        ),
        (
            ["{export}", "--trtexec", "--trt", "8.6", "--precision", "bf16"],
            "BF16 needs TensorRT 10",
        ),
        (["{export}", "--trtexec", "--trt", "10.12"], "--precision fp16"),
        (["{typed}", "--trtexec", "--trt", "10", "--precision", "bf16"], "exported in fp16"),
        (["{export}", "--trt", "10"], "add --trtexec"),
        (["{export}", "--gpu-tag", "x"], "--gpu-tag names trtexec outputs"),
    ],
)
def test_bad_arguments_exit_1_with_the_reason(
    capsys, tmp_path, export_dir, typed_export_dir, argv, message
):
    (tmp_path / "empty").mkdir()
    places = {
        "missing": tmp_path / "missing",
        "empty": tmp_path / "empty",
        "export": export_dir,
        "typed": typed_export_dir,
    }
    code, out, err = run(capsys, *(a.format(**places) for a in argv))
    assert code == 1 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_usage_errors_and_help(capsys, export_dir):
    with pytest.raises(SystemExit) as exit_info:
        main([str(export_dir), "--precision", "int8"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        main([str(export_dir), "--trtexec", "--trt", "9"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        main([str(export_dir), "--strongly-typed", "--weakly-typed"])
    assert exit_info.value.code == 2
    capsys.readouterr()
    help_text = build_parser().format_help()
    assert "--trtexec" in help_text and "examples:" in help_text and "--overwrite" in help_text


def test_debug_raises_the_engine_error(tmp_path):
    with pytest.raises(EngineError, match="does not exist"):
        main([str(tmp_path / "missing"), "--trtexec", "--debug"])


@pytest.fixture
def fake_tensorrt(monkeypatch):
    """TensorRT 10.3 on an Orin, as far as hydra-build can tell: the stand-ins for tensorrt and
    Polygraphy's loaders (tests/helpers/trt_standins.py; the build returns a buffer-only IHostMemory and
    writes the timing cache, as the real ones do) and for the GPU query."""
    import sys

    from helpers import trt_standins

    import hydra_deploy.engines.tensorrt as engines_trt

    version = "10.3.0.30"
    monkeypatch.setitem(sys.modules, "tensorrt", trt_standins.tensorrt_module(version))
    monkeypatch.setitem(
        sys.modules,
        "polygraphy.backend.trt",
        trt_standins.polygraphy_module(version, engine=b"engine"),
    )
    monkeypatch.setattr(
        engines_trt, "detect_gpu", lambda: engines_trt.GpuInfo("Orin (nvgpu)", 8, 7)
    )


def test_build_json_and_overwrite(capsys, export_dir, tmp_path, fake_tensorrt):
    code, out, err = run(capsys, export_dir, "--out", tmp_path, "--max-batch", "8", "--json")
    assert code == 0, err
    result = json.loads(out)
    engine = tmp_path / f"model.{result['onnx_sha256'][:12]}.fp16.orin-nvgpu-sm87.trt10.3.engine"
    assert result["engine_path"] == str(engine) and engine.read_bytes() == b"engine"
    sidecar = json.loads(engine.with_suffix(".json").read_text())
    assert sidecar["engine"] == engine.name and sidecar["engine_bytes"] == len(b"engine")
    assert (tmp_path / "timing.orin-nvgpu-sm87.trt10.3.cache").read_bytes() == b"timing-cache"
    assert (result["precision"], result["strongly_typed"], result["builder_flags"]) == (
        "fp16",
        False,
        ["fp16"],
    )
    assert result["batch_profile"] == {"min": 1, "opt": 2, "max": 8}
    code, out, err = run(capsys, export_dir, "--out", tmp_path, "--max-batch", "8")
    assert code == 1 and "--overwrite" in err
    code, out, err = run(capsys, export_dir, "--out", tmp_path, "--max-batch", "8", "--overwrite")
    assert code == 0 and out.startswith(f"wrote {engine} (fp16, weakly typed, batch 1/2/8")
    code, out, err = run(
        capsys, export_dir, "--out", tmp_path, "--precision", "bf16", "--weakly-typed", "--quiet"
    )
    assert (
        code == 0
        and out == ""
        and any(p.name.endswith(".bf16.orin-nvgpu-sm87.trt10.3.engine") for p in tmp_path.iterdir())
    )


def commands_by_generation(lines: list[str]) -> dict[str, str]:
    """``# <generation>`` header -> the command (or ``# not available`` line) under it."""
    found, header = {}, None
    for line in lines:
        if line.startswith("# TensorRT"):
            header = line[2:]
        elif header and not line.startswith("# note:") and line:
            found[header] = line
    return found


@pytest.mark.parametrize("which", ["fp32", "fp16", "int8"])
def test_the_export_hint_is_what_hydra_build_prints(
    capsys, export_dir, typed_export_dir, int8_export_dir, which
):
    """Issue 26: hydra-export's hint and hydra-build --trtexec come from one source
    (trtexec_commands), so they agree on every generation: a typed graph builds --stronglyTyped
    from TensorRT 10.0 on (JetPack 6.1/6.2 included), not only on 10.12+/11."""
    from hydra_deploy.cli.export import trtexec_lines
    from hydra_deploy.engines.precision_rules import GENERATION_NAMES

    folder = {"fp32": export_dir, "fp16": typed_export_dir, "int8": int8_export_dir}[which]
    code, out, _ = run(capsys, folder, "--trtexec")
    assert code == 0
    with command_spelling({}):  # hydra-export prints its hint inside the command
        hint = trtexec_lines({}, folder)
    # the same lines; the hint names the folder it just wrote where hydra-build says EXPORT_DIR
    assert hint == [line.replace("EXPORT_DIR", str(folder)) for line in out.splitlines() if line]
    commands = commands_by_generation(hint)
    assert set(commands) == set(GENERATION_NAMES.values())
    for trt, name in GENERATION_NAMES.items():
        typed = which != "fp32" and trt != "8.6"
        assert ("--stronglyTyped" in commands[name].split()) == typed
        if which == "fp32" and trt in ("10.12", "11"):
            assert (
                commands[name].startswith("# not available")
                and "--precision fp16" in commands[name]
            )
        else:
            assert commands[name] == str(trtexec_command(folder, trt=trt))


def test_the_export_precision_help_says_what_the_rules_do():
    """The --precision help of hydra-export states the typing rule that choose_precision applies."""
    from hydra_deploy.cli.export import build_parser as export_parser
    from hydra_deploy.engines.precision_rules import GENERATIONS, choose_precision

    (action,) = [a for a in export_parser()._actions if "--precision" in a.option_strings]
    assert "--stronglyTyped from 10.0 on" in action.help and "8.6 weakly typed" in action.help
    assert "10.12+/11" not in action.help
    for graph in ("fp16", "bf16", "int8"):
        for trt in GENERATIONS:
            if graph == "bf16" and trt == "8.6":  # no BF16 before TensorRT 10
                continue
            assert choose_precision(None, graph, trt).strongly_typed == (trt != "8.6")
