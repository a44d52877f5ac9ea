"""hydra-run --monitor and hydra-monitor on a tiny calibrated export: the per-input fields and the
summary, a stream split over runs by --monitor-state, a replay equal to the live run, the plot,
and the errors."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import shutil

import numpy as np
import pytest
from helpers.vit import tiny_vit

from hydra_deploy.cli.calibrate import main as calibrate_main
from hydra_deploy.cli.monitor import main as monitor_main
from hydra_deploy.cli.run import main as run_main
from hydra_deploy.engines import load_runner
from hydra_deploy.export import export_onnx
from hydra_deploy.fusion import fuse
from hydra_deploy.monitor import BETTING_RULES
from hydra_deploy.options import MONITOR_RULES
from hydra_deploy.specs import HydraSpec
from hydra_deploy.uncertainty import ensemble_scores

CLASSES = ["ant", "bee", "cat", "dog", "eel"]
FIELDS = ["monitor_score", "monitor_set_mass", "monitor_pvalue", "monitor_martingale"]


def invoke(main, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny export before and after hydra-calibrate, and a stream: 40 inputs like the
    calibration data (a.npz), then 40 more (b.npz), then 40 shifted by 2 (c.npz)."""
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=2, seed=1)
    root = tmp_path_factory.mktemp("monitor")
    bare = root / "bare"
    export_onnx(fuse(backbone, spec), bare, batch=(1, 2, 4), class_names=CLASSES, validate=False)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(380, 3, 16, 16)).astype(np.float32)
    with load_runner(bare) as runner:
        logits = runner(x[:300])["member_logits"]
    y = np.where(rng.random(300) < 0.85, ensemble_scores(logits)["prediction"], rng.integers(0, 5))
    np.savez(root / "calib.npz", x=x[:300], y=y)
    np.savez(root / "a.npz", x=x[300:340])
    np.savez(root / "b.npz", x=x[340:380])
    np.savez(root / "c.npz", x=(2 + rng.normal(size=(40, 3, 16, 16))).astype(np.float32))
    export = root / "export"
    shutil.copytree(bare, export)
    code, _, err = invoke(calibrate_main, export, "--data", root / "calib.npz", "--risk", "0.3")
    assert code == 0, err
    return {"root": root, "bare": bare, "export": export}


def _run(built, *inputs: str, extra: tuple[str, ...] = ()) -> tuple[dict, str]:
    root = built["root"]
    paths = [root / f"{name}.npz" for name in inputs]
    code, out, err = invoke(run_main, built["export"], *paths, "--monitor", "--json", "-", *extra)
    assert code == 0, err
    return json.loads(out), err


def test_the_rule_names_are_the_monitor_s():
    assert set(MONITOR_RULES) == set(BETTING_RULES)


def test_run_monitor_adds_per_input_fields_and_the_summary(built):
    report, err = _run(built, "a", "b", "c", extra=("--monitor-window", "20"))
    results = report["results"]
    assert len(results) == 120
    for result in results:
        assert all(isinstance(result[f], float) for f in FIELDS)
        assert isinstance(result["monitor_alarm"], bool) and 0 < result["monitor_pvalue"] <= 1
    summary = report["monitor"]
    assert summary["inputs"] == 120 and summary["window"] == 20
    assert set(summary["rates"]) >= {"abstained", "empty_set"}
    alarms = [i for i, r in enumerate(results) if r["monitor_alarm"]]
    assert [a["index"] for a in summary["alarms"]] == alarms
    assert alarms and alarms[0] >= 80  # the shift (inputs 80-119) alarms; the ID part does not
    assert summary["estimates"]["accuracy"] is not None
    assert "drift alarm" in err and "estimated accuracy" in err


def test_outputs_without_monitor_are_unchanged(built):
    npz = built["root"] / "a.npz"
    code, out, _ = invoke(run_main, built["export"], npz, "--json", "-")
    assert code == 0
    report = json.loads(out)
    assert "monitor" not in report and not any("monitor_" in k for k in report["results"][0])
    code, out, _ = invoke(run_main, built["export"], npz, "--monitor", "--csv", "-", "--quiet")
    row = next(csv.DictReader(io.StringIO(out)))
    assert {*FIELDS, "monitor_alarm"} <= set(row)


def test_monitor_state_resumes_exactly(built, tmp_path):
    state = tmp_path / "monitor.json"
    whole, _ = _run(built, "a", "b", "c", extra=("--monitor-rule", "mixture"))
    first, _ = _run(built, "a", extra=("--monitor-rule", "mixture", "--monitor-state", state))
    assert state.exists()
    second, _ = _run(built, "b", "c", extra=("--monitor-state", state))
    split = first["results"] + second["results"]
    for key in ("monitor_pvalue", "monitor_martingale", "monitor_alarm"):
        assert [r[key] for r in split] == [r[key] for r in whole["results"]]
    for key in ("inputs", "alarms", "rates", "martingale"):
        assert second["monitor"][key] == whole["monitor"][key]
    code, _, err = invoke(
        run_main, built["export"], built["root"] / "a.npz", "--monitor", "--monitor-state", state,
        "--monitor-alpha", "0.1",
    )  # fmt: skip
    assert code == 1 and "--monitor-alpha 0.05" in err and "new --monitor-state" in err


def test_replay_of_the_json_equals_the_live_run(built, tmp_path):
    live, _ = _run(built, "a", "c", extra=("--monitor-window", "25"))
    stored = tmp_path / "watched.json"
    stored.write_text(json.dumps(live))
    code, out, err = invoke(
        monitor_main, stored, "--model", built["export"], "--monitor-window", "25", "--json", "-"
    )
    assert code == 0, err
    replayed = json.loads(out)
    for key in ("pvalue", "martingale", "alarm"):
        assert replayed["per_input"][key] == [r[f"monitor_{key}"] for r in live["results"]]
    summary, want = replayed["monitor"], live["monitor"]
    for key in ("inputs", "alarms", "rates", "martingale"):
        assert summary[key] == want[key]
    assert summary["estimates"] == pytest.approx(want["estimates"])
    code, out, _ = invoke(monitor_main, stored, "--model", built["export"])
    assert code == 0 and "drift alarm" in out and "expected <=" in out


def test_replay_without_monitor_fields_computes_the_msp_score(built, tmp_path, caplog):
    """Without --monitor the JSON holds the calibrated confidence (float32): its negation is the
    record's msp score up to that rounding, so the replay is close to the live run, not equal."""
    live, _ = _run(built, "a", "c")
    code, out, _ = invoke(
        run_main, built["export"], built["root"] / "a.npz", built["root"] / "c.npz", "--json", "-"
    )
    stored = tmp_path / "plain.json"
    stored.write_text(out)
    with caplog.at_level("WARNING", logger="hydra_deploy"):
        code, out, err = invoke(monitor_main, stored, "--model", built["export"], "--json", "-")
    assert code == 0, err
    assert "rerun hydra-run with --monitor" in caplog.text
    replayed = json.loads(out)["per_input"]
    live_alarms = [i for i, r in enumerate(live["results"]) if r["monitor_alarm"]]
    alarms = np.flatnonzero(replayed["alarm"]).tolist()
    assert len(replayed["pvalue"]) == 80 and alarms and min(alarms) >= 40 and live_alarms
    shifted = [r["monitor_pvalue"] for r in live["results"][40:]]
    assert np.mean(replayed["pvalue"][40:]) == pytest.approx(np.mean(shifted), abs=0.1)


def test_replay_of_score_dataset_parquet_with_member_logits(built, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    live, _ = _run(built, "a", "c")
    x = np.concatenate([np.load(built["root"] / f"{n}.npz")["x"] for n in ("a", "c")])
    with load_runner(built["export"]) as runner:
        logits = runner(x)["member_logits"].astype(np.float32)
    out_dir = tmp_path / "scores.parquet"
    out_dir.mkdir()
    for part, rows in enumerate((slice(0, 50), slice(50, 80))):  # two shards, read in order
        table = pa.table(
            {
                "item": [f"x[{i}]" for i in range(rows.start, rows.stop)],
                "member_logits": [m.tolist() for m in logits[rows]],
                "unreadable": pa.array([None] * (rows.stop - rows.start), pa.string()),
            }
        )
        pq.write_table(table, out_dir / f"part-{part:05d}.parquet")
    code, out, err = invoke(monitor_main, out_dir, "--model", built["export"], "--json", "-")
    assert code == 0, err
    replayed = json.loads(out)["per_input"]
    assert replayed["pvalue"] == pytest.approx([r["monitor_pvalue"] for r in live["results"]])


def test_the_plot_is_a_png(built, tmp_path):
    live, _ = _run(built, "a", "c")
    stored = tmp_path / "watched.json"
    stored.write_text(json.dumps(live))
    png = tmp_path / "watch.png"
    code, _, err = invoke(
        monitor_main, stored, "--model", built["export"], "--plot", png, "--quiet"
    )
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = invoke(monitor_main, stored, "--model", built["export"], "--plot", png)
    assert code == 1 and "--overwrite" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--monitor", "--monitor-alpha", "2"), "--monitor-alpha"),
        (("--monitor", "--monitor-window", "0"), "--monitor-window"),
        (("--monitor-alpha", "0.1"), "--monitor-alpha set the monitor: add --monitor"),
        (("--monitor", "--raw"), "leave out --raw"),
        (("--monitor", "--allow-nonfinite"), "leave out --allow-nonfinite"),
    ],
)
def test_bad_monitor_options_are_one_line_errors(built, argv, message):
    code, _, err = invoke(run_main, built["export"], built["root"] / "a.npz", *argv)
    assert code == 1 and message in err and "\n" not in err.strip()


def test_an_export_without_a_reference_or_another_model_s_state_is_refused(built, tmp_path):
    a = built["root"] / "a.npz"
    code, _, err = invoke(run_main, built["bare"], a, "--monitor")
    assert code == 1 and "holds no monitor reference" in err and "hydra-calibrate" in err
    code, _, err = invoke(monitor_main, a, "--model", built["bare"])
    assert code == 1 and "holds no monitor reference" in err
    state = tmp_path / "monitor.json"
    _run(built, "a", extra=("--monitor-state", state))
    held = json.loads(state.read_text())
    held["onnx_sha256"] = "0" * 64
    state.write_text(json.dumps(held))
    code, _, err = invoke(run_main, built["export"], a, "--monitor", "--monitor-state", state)
    assert code == 1 and "another model file" in err


def test_replay_of_a_raw_json_names_the_flag(built, tmp_path):
    code, out, _ = invoke(
        run_main, built["export"], built["root"] / "a.npz", "--raw", "--json", "-"
    )
    stored = tmp_path / "raw.json"
    stored.write_text(out)
    code, _, err = invoke(monitor_main, stored, "--model", built["export"])
    assert code == 1 and "--monitor" in err and "without --raw" in err


def test_monitor_json_file_and_unreadable_scores(built, tmp_path):
    live, _ = _run(built, "a")
    stored = tmp_path / "watched.json"
    stored.write_text(json.dumps(live))
    target = tmp_path / "out" / "monitor.json"
    code, out, err = invoke(monitor_main, stored, "--model", built["export"], "--json", target)
    assert code == 0, err
    written = json.loads(target.read_text())
    assert written["monitor"]["inputs"] == 40 and len(written["per_input"]["pvalue"]) == 40
    assert "drift alarm" in out
    (tmp_path / "other.json").write_text(json.dumps({"count": 0}))
    code, _, err = invoke(monitor_main, tmp_path / "other.json", "--model", built["export"])
    assert code == 1 and "not hydra-run's JSON" in err
    code, _, err = invoke(monitor_main, tmp_path / "missing.json", "--model", built["export"])
    assert code == 1 and "does not exist" in err
    code, _, err = invoke(monitor_main, tmp_path, "--model", built["export"])
    assert code == 1 and "part-*.parquet" in err
