"""export_onnx and hydra-export: the file runs in ONNX Runtime and equals PyTorch."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers.members import perturbed_members, random_spec, specs
from helpers.vit import tiny_vit
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_deploy.errors import ExportError
from hydra_deploy.export import export_onnx, validate_onnx
from hydra_deploy.export.validate import validation_batches
from hydra_deploy.fusion import fuse
from hydra_deploy.specs import HydraSpec


@pytest.fixture(scope="module")
def hydra():
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=[2, 1, 3], seed=0)
    return fuse(backbone, spec)


@pytest.fixture(scope="module", params=["dynamo", "torchscript"])
def exported(request, hydra, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "export"
    info = export_onnx(hydra, out, exporter=request.param, batch=(1, 4, 6))
    return out, info


def run_ort(path: Path, x: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["member_logits"], {"pixel_values": x.numpy()})[0]


def test_export_folder_contract(exported, hydra):
    out, info = exported
    assert sorted(p.name for p in out.iterdir()) == [
        "hydra.json",
        "model.onnx",
        "weights.safetensors",
    ]
    assert json.loads((out / "hydra.json").read_text()) == info.record
    model = onnx.load(str(out / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    assert next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == 17
    assert "Einsum" not in {n.op_type for n in model.graph.node}
    metadata = {p.key: p.value for p in model.metadata_props}
    assert HydraSpec.from_json(metadata["hydra_spec"]) == hydra.spec
    assert info.record["inputs"] == [
        {"name": "pixel_values", "shape": ["batch", 3, 16, 16], "dtype": "float32"}
    ]
    assert info.record["outputs"] == [
        {"name": "member_logits", "shape": ["batch", 3, 5], "dtype": "float32"}
    ]
    assert info.spec == hydra.spec.to_dict() and info.opset == 17
    assert info.preprocessing["input_size"] == [3, 16, 16]
    import hashlib

    assert info.onnx_sha256 == hashlib.sha256((out / "model.onnx").read_bytes()).hexdigest()
    assert set(info.validation["batches"]) == {"1", "3", "6"}


@pytest.mark.parametrize("batch", [1, 2, 5, 9])
def test_onnx_equals_pytorch_at_any_batch(exported, hydra, batch):
    out, _ = exported
    x = hydra.example_inputs(batch, seed=batch)
    with torch.no_grad():
        expected = hydra(x).numpy()
    np.testing.assert_allclose(run_ort(out / "model.onnx", x), expected, atol=1e-4, rtol=0)


def attention_matmuls(path: Path) -> list:
    """The score MatMul feeding each Softmax, as (its Q producer, its K producer) nodes."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(onnx.load(str(path)))
    pairs = []
    for softmax in [n for n in graph.nodes if n.op == "Softmax"]:
        scores = softmax.inputs[0].inputs[0]
        assert scores.op == "MatMul" and softmax.outputs[0].outputs[0].op == "MatMul"
        pairs.append(tuple(t.inputs[0] if t.inputs else None for t in scores.inputs))
    return pairs


def test_gelu_is_written_as_onnx_runtime_fuses_it(exported, hydra, tmp_path):
    """The dynamo exporter's x * (0.5 * (1 + erf(x / sqrt 2))) is reordered to (x * 0.5) * (...),
    which ONNX Runtime fuses into one GELU kernel; the values are unchanged (a product with 0.5 is
    exact): the raw and the reordered graph give identical outputs."""
    import onnxruntime as ort

    folder, info = exported
    if info.exporter != "dynamo":
        assert info.graph_passes["order_gelu"] == 0  # TorchScript's form is already fused
        return
    assert info.graph_passes["order_gelu"] == 3  # one per layer
    raw = tmp_path / "raw"
    unordered = ("cleanup", "fold_attention_scale")  # every default pass but order_gelu
    export_onnx(hydra, raw, exporter="dynamo", passes=unordered, batch=(1, 2, 2), validate=False)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    ops = {}
    for name, path in (("raw", raw), ("ordered", folder)):
        options.optimized_model_filepath = str(tmp_path / f"{name}.optimized.onnx")
        ort.InferenceSession(str(path / "model.onnx"), options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(str(tmp_path / f"{name}.optimized.onnx"))
        ops[name] = {n.op_type for n in optimized.graph.node}
    assert "Erf" in ops["raw"] and "Erf" not in ops["ordered"]
    assert ops["ordered"] & {"Gelu", "BiasGelu"}
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    outputs = [
        ort.InferenceSession(str(p / "model.onnx"), plain, providers=["CPUExecutionProvider"]).run(
            ["member_logits"], {"pixel_values": x}
        )[0]
        for p in (raw, folder)
    ]
    np.testing.assert_array_equal(outputs[0], outputs[1])


def test_attention_scale_is_folded_into_q(exported, hydra, tmp_path):
    import onnx_graphsurgeon as gs

    folded, info = exported
    if info.exporter != "dynamo":
        assert info.graph_passes["fold_attention_scale"] == 0  # the scale is not a constant
        return
    raw = tmp_path / "raw"
    export_onnx(hydra, raw, exporter="dynamo", passes=(), batch=(1, 2, 2), validate=False)
    assert all(q.op == "Mul" and k.op == "Mul" for q, k in attention_matmuls(raw / "model.onnx"))
    assert info.graph_passes["fold_attention_scale"] == 3  # one per layer, validated vs PyTorch
    for q, k in attention_matmuls(folded / "model.onnx"):
        assert k is None or k.op != "Mul"
        scale = [t for t in q.inputs if isinstance(t, gs.Constant)]
        assert q.op == "Mul" and len(scale) == 1
        assert float(scale[0].values.ravel()[0]) == pytest.approx(
            hydra.blocks[0].attn.head_dim ** -0.5
        )


def test_cleanup_gives_stable_names_and_no_dead_nodes(exported, hydra, tmp_path):
    first, info = exported
    again = tmp_path / "again"
    export_onnx(hydra, again, exporter=info.exporter, batch=(1, 4, 6), validate=False)
    names = []
    for folder in (first, again):
        model = onnx.load(str(folder / "model.onnx"))
        names.append([n.name for n in model.graph.node])
        used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
        assert all(any(o in used for o in n.output) for n in model.graph.node)  # no dead node
        for node in model.graph.node:
            op, index = node.name.rsplit("_", 1)
            assert op == node.op_type and index.isdigit()
    assert names[0] == names[1]


def test_unknown_pass_is_refused(hydra, tmp_path):
    with pytest.raises(ExportError, match="unknown graph pass"):
        export_onnx(hydra, tmp_path / "x", exporter="torchscript", passes=("fuse_everything",))
    assert list(tmp_path.iterdir()) == []


def test_saved_weights_are_the_fused_model(exported, hydra):
    from safetensors.torch import load_file

    out, _ = exported
    weights = load_file(str(out / "weights.safetensors"))
    state = hydra.state_dict()
    assert weights.keys() == state.keys()
    assert all(torch.equal(weights[k], state[k]) for k in state)


def test_validation_batches():
    assert validation_batches((1, 8, 32)) == [1, 3, 32]
    assert validation_batches((2, 8, 8)) == [2, 3, 8]
    assert validation_batches((1, 1, 1)) == [1]


def test_validation_catches_a_wrong_file(exported, hydra):
    out, _ = exported
    other = fuse(tiny_vit("token", seed=1), hydra.spec)  # same shapes, other weights
    with pytest.raises(ExportError, match=r"output member_logits max abs difference .* member \d"):
        validate_onnx(out / "model.onnx", other, other.example_inputs, [2])


def test_existing_folder_is_refused_and_kept(exported, hydra):
    out, _ = exported
    before = (out / "model.onnx").read_bytes()
    with pytest.raises(ExportError, match="overwrite"):
        export_onnx(hydra, out)
    assert (out / "model.onnx").read_bytes() == before


def test_bad_arguments_leave_nothing(hydra, tmp_path):
    with pytest.raises(ExportError, match="opset 12"):
        export_onnx(hydra, tmp_path / "a", opset=12)
    with pytest.raises(ExportError, match="min <= opt <= max"):
        export_onnx(hydra, tmp_path / "b", batch=(4, 2, 8))
    with pytest.raises(ExportError, match="HydraModel"):
        export_onnx(torch.nn.Linear(2, 2), tmp_path / "c")
    with pytest.raises(ExportError, match="unknown exporter"):
        export_onnx(hydra, tmp_path / "d", exporter="jit")
    assert list(tmp_path.iterdir()) == []


def test_failed_validation_leaves_no_folder(hydra, tmp_path, monkeypatch):
    import hydra_deploy.export.exporter as exporter

    def failing(*args, **kwargs):
        raise ExportError("ONNX Runtime differs from PyTorch (simulated)")

    monkeypatch.setattr(exporter, "validate_onnx", failing)
    with pytest.raises(ExportError, match="simulated"):
        export_onnx(hydra, tmp_path / "out", exporter="torchscript")
    assert list(tmp_path.iterdir()) == []  # no folder, no temporary left behind


def test_overwrite_replaces(hydra, tmp_path):
    out = tmp_path / "out"
    export_onnx(hydra, out, exporter="torchscript", batch=(1, 2, 2))
    (out / "stale.txt").write_text("old")
    export_onnx(hydra, out, exporter="torchscript", batch=(1, 2, 3), overwrite=True)
    assert not (out / "stale.txt").exists()
    assert json.loads((out / "hydra.json").read_text())["batch_profile"]["max"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --- hydra-export --------------------------------------------------------------------------------
def invoke(*argv: str) -> tuple[int, str, str]:
    from hydra_deploy.cli.export import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_cli_exports_and_prints_the_trtexec_line(tmp_path, caplog):
    out = tmp_path / "vit_ti16"
    code, stdout, err = invoke(
        "--backbone",
        "vit_ti16",
        "--members",
        "2",
        "--max-batch",
        "3",
        "--opt-batch",
        "2",
        "--exporter",
        "torchscript",
        "--out",
        str(out),
    )
    assert code == 0, err
    assert "validated in ONNX Runtime at batch 1, 3" in stdout
    assert f"trtexec --onnx={out / 'model.onnx'} --minShapes=pixel_values:1x3x224x224" in stdout
    assert "--maxShapes=pixel_values:3x3x224x224 --fp16" in stdout
    # TensorRT 10.12+ has no --fp16 for an FP32 graph: the hint (hydra-build --trtexec's lines)
    # says to export one that carries its precision
    assert f"hydra-export --from {out} --precision fp16" in stdout  # the folder just written
    assert "heads are drawn at random" in caplog.text  # no --calib: says so
    info = json.loads((out / "hydra.json").read_text())
    assert info["spec"]["num_layers"] == 12 and info["outputs"][0]["shape"] == ["batch", 2, 1000]
    code, _, err = invoke("--backbone", "vit_ti16", "--out", str(out))
    assert code == 1 and "--overwrite" in err and "Traceback" not in err


def test_cli_errors_are_one_line(tmp_path):
    code, _, err = invoke("--backbone", "vit_b17", "--out", str(tmp_path / "x"))
    assert code == 1 and err.count("\n") == 1 and "vit_b16" in err
    code, _, err = invoke("--backbone", "vit_ti16", "--opset", "9", "--out", str(tmp_path / "y"))
    assert code == 1 and "opset 9" in err
    code, _, err = invoke(
        "--backbone",
        "vit_ti16",
        "--min-batch",
        "5",
        "--max-batch",
        "4",
        "--out",
        str(tmp_path / "y"),
    )
    assert code == 1 and "got (5, 4, 4)" in err  # refused before anything is built
    assert not (tmp_path / "y").exists()


def test_average_pooling_exports_with_dynamo_at_opset_17(tmp_path):
    """The fused model writes its token mean as a sum and a division (no opset-18 ReduceMean)."""
    backbone = tiny_vit("avg_reg_ls")
    hydra = fuse(backbone, HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=2))
    info = export_onnx(hydra, tmp_path / "avg", batch=(1, 2, 3))  # validated against PyTorch
    assert info.opset == 17 and info.validation["passed"]
    assert info.exporter == "dynamo" and info.graph_passes["fold_attention_scale"] == 3


def test_auto_exporter_falls_back_when_dynamo_cannot_reach_the_opset(tmp_path, caplog):
    """torch.mean exports as opset-18 ReduceMean, which does not convert to 17 cleanly."""
    import logging

    from hydra_deploy.export.torch_onnx import export_module

    class Mean(torch.nn.Module):
        def forward(self, x):
            return x.mean(dim=1)

    caplog.set_level(logging.INFO, logger="hydra_deploy")
    path = tmp_path / "mean.onnx"
    used = export_module(
        Mean(),
        torch.randn(2, 5),
        path,
        input_names=["x"],
        output_names=["y"],
        opset=17,
        max_batch=4,
    )
    assert used == "torchscript"
    assert "retrying with the TorchScript exporter" in caplog.text
    assert "does not convert to 17" in caplog.text  # why dynamo's file was not used
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got[0], x.mean(1), atol=1e-6)


def test_polygraphy_runs_the_export(exported):
    """The file passes `polygraphy run --onnxrt` (the command a TensorRT user checks with)."""
    import shutil
    import subprocess
    import sys

    out, info = exported
    tool = shutil.which("polygraphy", path=str(Path(sys.executable).parent))
    if tool is None:
        pytest.skip(reason="polygraphy is not installed (it comes with the [dev] extra)")
    batch = info.batch_profile[2]
    result = subprocess.run(
        [
            tool,
            "run",
            str(out / "model.onnx"),
            "--onnxrt",
            "--input-shapes",
            f"pixel_values:[{batch},3,16,16]",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "PASSED" in result.stdout + result.stderr
    assert f"shape=({batch}, 3, 5)" in result.stdout + result.stderr


@settings(max_examples=8)
@given(data=st.data(), merge=st.sampled_from(["average", "grouped"]))
def test_onnx_equals_pytorch_for_random_specs(tiny_vits, data, merge, tmp_path_factory):
    """Property: for any spec (unequal and empty head sets, shared prefixes), ORT equals PyTorch."""
    config = data.draw(st.sampled_from(sorted(tiny_vits)))
    backbone = tiny_vits[config]
    spec = data.draw(specs(backbone, max_members=4))
    members = (
        perturbed_members(backbone, spec.num_members, seed=1) if merge == "grouped" else backbone
    )
    hydra = fuse(members, spec, merge)
    out = tmp_path_factory.mktemp("prop") / "export"
    export_onnx(hydra, out, exporter="torchscript", batch=(1, 2, 5), validate=False)
    for batch in (1, 5):
        x = hydra.example_inputs(batch, seed=batch)
        with torch.no_grad():
            expected = hydra(x).numpy()
        np.testing.assert_allclose(run_ort(out / "model.onnx", x), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("config", "finetuned"), [("token", False), ("avg_reg_ls", True), ("prenorm", True)]
)
def test_reexport_from_saved_spec_and_weights(tiny_vits, config, finetuned, tmp_path):
    """A folder alone rebuilds the fused model (same weights, same outputs) and exports again."""
    from hydra_deploy.export import load_export

    backbone = tiny_vits[config]
    spec = random_spec(backbone, members=3, heads_per_member=1, shared_layers=1, seed=2)
    members = perturbed_members(backbone, 3, seed=4) if finetuned else backbone
    hydra = fuse(members, spec, "grouped" if finetuned else "average")
    first = tmp_path / "first"
    export_onnx(hydra, first, exporter="torchscript", batch=(1, 2, 3))
    rebuilt = load_export(first)  # checks itself against first/model.onnx
    assert rebuilt.trunk_layers == hydra.trunk_layers and rebuilt.merge == hydra.merge
    state, again = hydra.state_dict(), rebuilt.state_dict()
    assert state.keys() == again.keys() and all(torch.equal(state[k], again[k]) for k in state)
    second = tmp_path / "second"
    export_onnx(rebuilt, second, exporter="torchscript", batch=(1, 2, 3))
    x = hydra.example_inputs(3, seed=9)
    np.testing.assert_allclose(
        run_ort(second / "model.onnx", x), run_ort(first / "model.onnx", x), atol=1e-5, rtol=0
    )


def test_load_export_refuses_broken_folders(exported, tmp_path):
    import shutil

    from hydra_deploy.export import load_export

    with pytest.raises(ExportError, match="not an export folder"):
        load_export(tmp_path)
    out, _ = exported
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    info = json.loads((broken / "hydra.json").read_text())
    info["format"] = "hydra-export/99"
    (broken / "hydra.json").write_text(json.dumps(info))
    with pytest.raises(ExportError, match="hydra-export/99"):
        load_export(broken)


def test_load_export_notices_weights_from_another_model(exported, hydra, tmp_path):
    import shutil

    from safetensors.torch import save_file

    from hydra_deploy.export import load_export

    out, _ = exported
    mixed = tmp_path / "mixed"
    shutil.copytree(out, mixed)
    other = fuse(tiny_vit("token", seed=1), hydra.spec)  # same structure, other weights
    save_file(other.state_dict(), str(mixed / "weights.safetensors"))
    with pytest.raises(ExportError, match="do not belong together"):
        load_export(mixed)
    assert load_export(mixed, check=False).num_members == 3


def test_cli_reexports_from_a_folder(exported, tmp_path):
    out, _ = exported
    code, _, err = invoke(
        "--from",
        str(out),
        "--uq-outputs",
        "--exporter",
        "torchscript",
        "--max-batch",
        "3",
        "--out",
        str(tmp_path / "again"),
    )
    assert code == 0, err
    info = json.loads((tmp_path / "again" / "hydra.json").read_text())
    assert (
        info["uq_outputs"] and info["spec"] == json.loads((out / "hydra.json").read_text())["spec"]
    )
    code, _, err = invoke(
        "--from", str(out), "--backbone", "vit_ti16", "--out", str(tmp_path / "x")
    )
    assert code == 1 and "--backbone NAME" in err
    code, _, err = invoke("--from", str(out))
    assert code == 1 and "--from needs --out" in err
    code, _, err = invoke("--out", str(tmp_path / "y"))
    assert code == 1 and "--from EXPORT_DIR" in err


REPRO_SCRIPT = """
import hashlib, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)  # as conftest.py sets it for the tests
from helpers.vit import tiny_vit
from hydra_deploy.export import export_onnx
from hydra_deploy.fusion import fuse
from hydra_deploy.specs import HydraSpec
backbone = tiny_vit("token")
spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=2, seed=0)
out = Path(sys.argv[1])
export_onnx(fuse(backbone, spec), out, exporter={exporter!r}, validate=False)
for name in ("model.onnx", "weights.safetensors", "hydra.json"):
    print(name, hashlib.sha256((out / name).read_bytes()).hexdigest())
"""


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_exports_are_reproducible_across_processes(exporter, tmp_path):
    """The same model, spec and seed give byte-identical files, also in another process with
    another hash seed (set and dict orders in the graph passes must not leak into the file)."""
    script = REPRO_SCRIPT.format(tests=str(Path(__file__).resolve().parents[1]), exporter=exporter)
    digests = []
    for run, hash_seed in enumerate(("1", "2")):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / f"run{run}")],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        digests.append([line for line in done.stdout.splitlines() if line.count(" ") == 1])
    assert len(digests[0]) == 3 and digests[0] == digests[1]


INTERRUPT_SCRIPT = """
import signal, sys, time
# Ctrl-C's handler even when pytest runs as a background job (its children then ignore SIGINT)
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)  # as conftest.py sets it for the tests
from helpers.vit import tiny_vit
import hydra_deploy.export.exporter as exporter
from hydra_deploy.fusion import fuse
from hydra_deploy.specs import HydraSpec
def slow_validation(*args, **kwargs):  # the model file is written: wait here to be interrupted
    print("validating", flush=True)
    time.sleep(60)
exporter.validate_onnx = slow_validation
backbone = tiny_vit("token")
spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=2, seed=0)
exporter.export_onnx(fuse(backbone, spec), sys.argv[1], exporter="torchscript")
"""


def test_an_interrupted_export_leaves_nothing_behind(tmp_path):
    """SIGINT while validating (model.onnx already written in the staging folder): no export
    folder appears under the output name and the staging folder is removed."""
    out = tmp_path / "export"
    script = INTERRUPT_SCRIPT.format(tests=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # blocks until validation starts
        assert line.strip() == "validating", proc.stderr.read()[-2000:]
        staged = list(tmp_path.glob(".export.*.tmp"))
        assert len(staged) == 1 and (staged[0] / "model.onnx").is_file()
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_constant_folding_prints_no_graphsurgeon_noise(capsys):
    """Folding a weight transpose makes a large constant on purpose: no "Large tensors" warning and
    no "colored module is not installed" note reach the user (issue 17, finding 9)."""
    import onnx_graphsurgeon as gs
    from onnx_graphsurgeon.logger import G_LOGGER

    from hydra_deploy.export import surgery

    weight = gs.Constant("weight", np.ones((1024, 512), np.float32))  # 2 MiB once transposed
    x = gs.Variable("x", np.float32, (2, 512))
    transposed = gs.Variable("transposed", np.float32, (512, 1024))
    y = gs.Variable("y", np.float32, (2, 1024))
    graph = gs.Graph(
        nodes=[
            gs.Node("Transpose", inputs=[weight], outputs=[transposed], attrs={"perm": [1, 0]}),
            gs.Node("MatMul", inputs=[x, transposed], outputs=[y]),
        ],
        inputs=[x],
        outputs=[y],
    )
    G_LOGGER.once_logged.clear()  # the warning is logged once per process
    severity, colors = G_LOGGER.severity, G_LOGGER.colors
    surgery.cleanup(graph)
    captured = capsys.readouterr()
    assert "Large tensors" not in captured.out + captured.err
    assert "colored" not in captured.out + captured.err
    assert (G_LOGGER.severity, G_LOGGER.colors) == (severity, colors)  # restored
    assert any(
        isinstance(t, gs.Constant) and t.shape == (512, 1024) for t in graph.tensors().values()
    )
