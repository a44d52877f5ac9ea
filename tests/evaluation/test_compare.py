"""hydra-compare / compare_export: parity per member and per score, tolerances per precision."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shutil

import numpy as np
import pytest
from helpers.vit import tiny_vit

from hydra_deploy.cli.compare import main
from hydra_deploy.errors import HydraError
from hydra_deploy.evaluation.compare import compare_export
from hydra_deploy.export import export_onnx
from hydra_deploy.fusion import fuse
from hydra_deploy.parity import TOLERANCES, compare_outputs, tolerance_for
from hydra_deploy.specs import HydraSpec


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=2, seed=2)
    out = tmp_path_factory.mktemp("compare") / "export"
    export_onnx(fuse(backbone, spec), out, batch=(1, 2, 4), uq_outputs=True, validate=False)
    return out


@pytest.fixture(scope="module")
def tampered(export_dir, tmp_path_factory):
    """The same folder with member 1's last-layer attention weights changed in the saved weights."""
    from safetensors.numpy import load_file, save_file

    out = tmp_path_factory.mktemp("tampered") / "export"
    shutil.copytree(export_dir, out)
    weights = load_file(str(out / "weights.safetensors"))
    weights["blocks.2.attn.qkv.weight"][1] *= 1.5
    save_file(weights, str(out / "weights.safetensors"))
    return out


def invoke(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_good_export_passes(export_dir):
    report = compare_export(export_dir, batch=6)  # above the max batch 4: the runner splits
    assert report.passed and report.batch == 6 and report.precision == "fp32"
    (ort,) = report.backends
    assert ort.status == "compared" and ort.tolerance == TOLERANCES["fp32"]
    assert sorted({c.member for c in ort.members}) == [0, 1, 2]
    names = {c.name for c in ort.scores}
    assert {
        "probs",
        "msp",
        "predictive_entropy",
        "expected_entropy",
        "mutual_information",
        "disagreement",
        "prediction",
        "graph:probs",
        "graph:mutual_information",
    } <= names
    logits = [c for c in ort.members if c.name == "member_logits"]
    assert all(0 <= c.value <= 1e-4 for c in logits)
    json.dumps(report.to_dict(), allow_nan=False)  # JSON-ready


def test_cli_passes_and_prints_a_table(export_dir, tmp_path):
    x = np.random.default_rng(1).standard_normal((3, 3, 16, 16)).astype(np.float32)
    np.savez(tmp_path / "inputs.npz", x=x)
    code, out, err = invoke(str(export_dir), "--inputs", str(tmp_path / "inputs.npz"))
    assert code == 0, err
    assert "onnxruntime" in out and "fp32 tolerances: PASS" in out and "member 2" in out
    assert out.rstrip().endswith("PASSED") and "3 inputs" in out
    headers = [line.split() for line in out.splitlines() if line.startswith(("member ", "score "))]
    named = [h for h in headers if "needs" in h or "measure" in h]  # both tables name every column
    assert len(named) == 2 and all(h[-1] == "verdict" for h in named)


def test_tampered_export_fails_and_names_the_member(tampered):
    report = compare_export(tampered, batch=4)
    assert not report.passed
    failing = {c.member for c in report.backends[0].members if not c.passed}
    assert failing == {1}
    code, out, err = invoke(str(tampered), "--batch", "4")
    assert code == 1
    assert "FAIL" in out and "onnxruntime: member 1 member_logits max_abs_diff" in out
    assert "member 0 member_logits" not in out
    code, out, err = invoke(str(tampered), "--json")
    assert code == 1 and "member 1" in err
    data = json.loads(out)
    assert data["passed"] is False and any("member 1" in f for f in data["failures"])


def test_bf16_export_skips_onnx_runtime_with_the_reason(export_dir, tmp_path):
    folder = tmp_path / "bf16"
    shutil.copytree(export_dir, folder)
    info = json.loads((folder / "hydra.json").read_text())
    info["precision"] = "bf16"
    (folder / "hydra.json").write_text(json.dumps(info))
    report = compare_export(folder, batch=2)
    (ort,) = report.backends
    assert ort.status == "skipped" and "BF16 MatMul" in ort.reason and "--engine" in ort.reason
    code, out, _ = invoke(str(folder))
    assert code == 0 and "onnxruntime: skipped: ONNX Runtime's CPU kernels" in out


@pytest.mark.skipif(
    importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed"
)
def test_engine_without_tensorrt_is_an_error(export_dir, tmp_path):
    engine = tmp_path / "model.engine"
    engine.write_bytes(b"x")
    code, _, err = invoke(str(export_dir), "--engine", str(engine))
    assert code == 1 and "TensorRT is not installed" in err


def test_not_an_export_folder(tmp_path):
    code, _, err = invoke(str(tmp_path))
    assert code == 1 and "is not an export folder" in err


# --- the tolerance logic on synthetic outputs (numpy only) ----------------------------------------
def _logits(seed=0, batch=200, members=4, classes=10, scale=4.0):
    return np.random.default_rng(seed).normal(0, scale, (batch, members, classes))


def test_tolerance_rows_follow_the_architecture_table():
    assert TOLERANCES["fp32"].logits == 1e-4 and TOLERANCES["fp32"].probs == 1e-5
    assert TOLERANCES["fp16"].probs == 2e-2 and TOLERANCES["fp16"].entropy == 5e-2
    assert TOLERANCES["bf16"].probs == 5e-2 and TOLERANCES["bf16"].argmax == 0.98
    assert tolerance_for("best") == TOLERANCES["bf16"] and tolerance_for(None).precision == "fp32"
    with pytest.raises(HydraError, match="no tolerances for precision 'int4'"):
        tolerance_for("int4")


def test_fp16_rounding_passes_fp16_but_not_fp32():
    ref = _logits()
    fp16 = ref.astype(np.float16).astype(np.float64)  # what FP16 rounding alone does
    members, scores = compare_outputs(ref, {"member_logits": fp16}, TOLERANCES["fp16"])
    assert all(c.passed for c in members + scores)
    members, _ = compare_outputs(ref, {"member_logits": fp16}, TOLERANCES["fp32"])
    assert not all(c.passed for c in members if c.name == "member_logits")


def test_a_wrong_member_fails_its_logit_bound_and_argmax_agreement():
    ref = _logits(seed=1)
    broken = ref.copy()
    broken[:, 2] = _logits(seed=2)[:, 2]  # member 2 computes garbage, like a broken kernel
    members, scores = compare_outputs(ref, {"member_logits": broken}, TOLERANCES["fp16"])
    failing = {(c.member, c.name) for c in members if not c.passed}
    assert failing == {(2, "member_logits"), (2, "argmax")}
    assert not all(c.passed for c in scores if c.name in ("probs", "disagreement"))


def test_nonfinite_outputs_fail_without_raising():
    ref = _logits(batch=5)
    bad = ref.copy()
    bad[0, 0, 0] = np.inf
    members, scores = compare_outputs(ref, {"member_logits": bad}, TOLERANCES["bf16"])
    assert not members[0].passed and members[0].value == np.inf
    assert not all(c.passed for c in scores)


# --- an export with decisions (hydra-calibrate) --------------------------------------------------------
GRAPH_DECISIONS = [
    "graph:calibrated_probs",
    "graph:prediction_set",
    "graph:accept",
    "graph:ood_flag",
]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """{"json": decisions in hydra.json only, "graph": the same record in model.onnx too}."""
    from helpers.decisions import calibrated_export

    from hydra_deploy.evaluation.calibrate import store_decisions

    root = tmp_path_factory.mktemp("calibrated")
    folder, calibration = calibrated_export(root / "json")
    found = {"json": folder, "record": calibration.record}
    if importlib.util.find_spec("hydra_deploy.export.decision_graph") is not None:
        shutil.copytree(folder, root / "graph")
        store_decisions(root / "graph", calibration.record, in_graph=True)
        found["graph"] = root / "graph"
    return found


def decision_names(report) -> list[str]:
    (ort,) = report.backends
    return [c.name for c in ort.scores if c.name.split(":")[0] in ("graph", "decisions")]


def test_in_graph_decisions_are_compared_with_the_references(calibrated):
    if "graph" not in calibrated:
        pytest.skip("hydra_deploy.export.decision_graph (hydra-calibrate --in-graph) is missing")
    report = compare_export(calibrated["graph"], batch=6)
    assert report.passed, report.failures()
    (ort,) = report.backends
    checks = {c.name: c for c in ort.scores}
    assert decision_names(report) == GRAPH_DECISIONS
    assert checks["graph:calibrated_probs"].value <= 1e-5
    for name in GRAPH_DECISIONS[1:]:
        assert checks[name].kind == "agreement" and checks[name].value == 1.0, name
    assert {"probs", "msp", "prediction"} <= set(checks)  # the score checks are all there
    code, out, err = invoke(str(calibrated["graph"]), "--batch", "4")
    assert code == 0, err
    assert "graph:accept" in out and "graph:prediction_set" in out and "PASSED" in out
    json.dumps(report.to_dict(), allow_nan=False)


def test_decisions_in_hydra_json_are_applied_to_the_backends_logits(calibrated, tmp_path, caplog):
    report = compare_export(calibrated["json"], batch=5)
    assert report.passed, report.failures()
    assert decision_names(report) == [
        "decisions:calibrated_probs",
        "decisions:prediction_set",
        "decisions:accept",
        "decisions:ood_flag",
    ]
    stale = tmp_path / "stale"
    shutil.copytree(calibrated["json"], stale)
    info = json.loads((stale / "hydra.json").read_text())
    info["decisions"]["onnx_sha256"] = "0" * 64  # fitted on another model.onnx
    (stale / "hydra.json").write_text(json.dumps(info))
    with caplog.at_level("WARNING", logger="hydra_deploy"):
        report = compare_export(stale, batch=5)  # the numbers are still compared
    assert report.passed and decision_names(report) == []
    assert any("fitted on another model.onnx" in r.getMessage() for r in caplog.records)


def test_a_flipped_decision_fails_unless_it_sits_on_its_threshold(calibrated):
    import dataclasses

    from hydra_deploy.decisions import apply_decisions, calibrated_scores
    from hydra_deploy.engines import load_runner
    from hydra_deploy.evaluation.compare import decision_checks

    record = calibrated["record"]
    x = np.random.default_rng(3).standard_normal((8, 3, 16, 16)).astype(np.float32)
    with load_runner(calibrated["json"]) as runner:
        logits = runner(x)["member_logits"].astype(np.float64)
    msp = calibrated_scores(logits, record.temperature)["msp"]
    on_tau = dataclasses.replace(
        record, selective=dataclasses.replace(record.selective, tau=float(msp[2]))
    )
    tolerance = tolerance_for("fp32")
    for rule, excused in ((record, False), (on_tau, True)):
        accept = apply_decisions(logits, rule)["accept"].copy()
        accept[2] = not accept[2]
        checks = {
            c.name: c
            for c in decision_checks(
                rule, logits, {"member_logits": logits, "accept": accept}, tolerance
            )
        }
        assert checks["graph:accept"].passed is excused
        assert checks["graph:accept"].value == (1.0 if excused else 7 / 8)
        assert checks["decisions:prediction_set"].passed  # not in the outputs: applied


@pytest.mark.parametrize("method", ["lac", "aps", "raps", "topk"])
def test_a_set_is_undecided_only_where_the_tolerance_can_move_it(method):
    """hydra-compare lets a backend decide a class either way only where a probability error
    within tolerance can move its room past the bar: top-k's room is whole ranks, so without a
    near-tie nothing is undecided; LAC's room is p itself, APS/RAPS's a sum over the ranks."""
    from hydra_deploy.decisions import class_room, fit_decisions, set_floor
    from hydra_deploy.evaluation.compare import _undecided

    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, size=(400, 2, 10)).astype(np.float32)
    labels = rng.integers(0, 10, size=400)
    record = fit_decisions(
        logits, labels, onnx_sha256="0" * 64, data_sha256="0" * 64, sets=method, ood_alpha=None
    )
    tolerance = tolerance_for("fp16")
    undecided = _undecided(record, logits, tolerance)["prediction_set"]
    probs = np.exp(logits.astype(np.float64) / record.temperature)
    probs = (probs / probs.sum(axis=2, keepdims=True)).mean(axis=1)
    room = class_room(probs, method, record.sets.params)
    gap = np.abs(room - set_floor(record.sets.qhat[0]))
    ranked = np.sort(probs, axis=1)[:, ::-1]
    tie_free = (np.diff(ranked, axis=1) < -2 * tolerance.probs).all(axis=1)
    if method == "topk":
        assert not undecided[tie_free].any()
    else:
        drift = 1.0 if method == "lac" else np.argsort(np.argsort(-probs, axis=1), axis=1) + 1.0
        assert (undecided | ~tie_free[:, None])[gap <= tolerance.probs * drift].all()
        assert not undecided[tie_free[:, None] & (gap > tolerance.probs * drift)].any()
