"""Latency benchmark (hydra-bench): variants, timing arithmetic, backends, baselines and the CLI.

Everything runs on tiny models (the conftest ViT, or vit_ti16 at 32 pixels), except the quick
regression check against benchmarks/baselines/cpu_quick.json, which is what CI runs.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.bench import K, M, tiny_config, tiny_factory

from hydra_deploy.bench import BenchError, check
from hydra_deploy.bench import latency as bench
from hydra_deploy.cli import bench as cli

ROOT = Path(__file__).resolve().parents[2]
CPU_QUICK = ROOT / "benchmarks" / "baselines" / "cpu_quick.json"
HAS_ORT = bench.backend_status()["ort"] is None
HAS_CUDA = torch.cuda.is_available()
HAS_TENSORRT = bench.backend_status()["tensorrt"] is None


@pytest.fixture(scope="module")
def tiny_variants():
    return bench.build_variants(tiny_config(), tiny_factory)


@pytest.fixture(scope="module")
def tiny_result(tiny_variants):
    return bench.run_benchmark(tiny_config(), quiet=True, variants=tiny_variants)


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --------------------------------------------------------------------------------------------------
# result structure and arithmetic


def test_result_holds_every_backend_batch_and_variant(tiny_result):
    config = tiny_config()
    assert tiny_result["format"] == bench.RESULT_FORMAT
    assert list(tiny_result["results"]) == list(config.backends)
    for batches in tiny_result["results"].values():
        assert list(batches) == ["1", "3"]
        for rows in batches.values():
            assert list(rows) == list(bench.VARIANTS)
            for row in rows.values():
                assert len(row["times_ms"]) == config.rounds
                assert (
                    row["min_ms"]
                    <= row["q1_ms"]
                    <= row["median_ms"]
                    <= row["q3_ms"]
                    <= row["max_ms"]
                )
    env = tiny_result["environment"]
    assert env["torch_threads"] == 1 and env["versions"]["torch"]
    assert "cpu_model" in env and "gpu" in env
    json.dumps(tiny_result, allow_nan=False)  # JSON-able as written


def test_ratios_flops_and_gap_arithmetic(tiny_result, tiny_variants):
    hydra_model = tiny_variants["hydra"].modules[0]
    single_macs = tiny_variants.adapter.macs()
    for batches in tiny_result["results"].values():
        for batch, rows in batches.items():
            assert rows["single"]["ratio_vs_single"] == 1.0
            assert rows["single"]["flops_ratio"] == 1.0
            assert rows["deep_ensemble_seq"]["flops_ratio"] == M
            assert rows["deep_ensemble_batched"]["flops_ratio"] == pytest.approx(M)
            assert rows["hydra"]["flops_ratio"] == pytest.approx(
                hydra_model.macs["hydra"] / single_macs
            )
            for row in rows.values():
                assert row["gap"] == pytest.approx(row["ratio_vs_single"] / row["flops_ratio"])
                expected = row["macs_per_example"] * int(batch) / (row["median_ms"] / 1000) / 1e9
                assert row["gmacs_per_s"] == pytest.approx(expected)


def test_summarize_takes_the_median_of_same_round_ratios():
    variants = [
        bench.Variant("single", [], 100, 1.0, 1, False),
        bench.Variant("hydra", [], 250, 2.5, 1, True),
    ]
    times = {"single": [1.0, 2.0, 4.0], "hydra": [3.0, 3.0, 4.0]}  # ratios 3, 1.5, 1
    rows = bench.summarize(times, variants, batch=2)
    assert rows["hydra"]["ratio_vs_single"] == 1.5  # not median(hydra) / median(single) = 1.5 ...
    times = {"single": [1.0, 2.0, 4.0], "hydra": [3.0, 2.0, 5.0]}  # ratios 3, 1, 1.25
    rows = bench.summarize(times, variants, batch=2)
    assert rows["hydra"]["ratio_vs_single"] == 1.25  # ... here that would be 1.5
    assert rows["hydra"]["median_ms"] == 3000.0
    assert rows["hydra"]["gap"] == pytest.approx(1.25 / 2.5)
    assert rows["hydra"]["gmacs_per_s"] == pytest.approx(250 * 2 / 3.0 / 1e9)
    assert (
        rows["single"]["q1_ms"]
        == statistics.quantiles([1000, 2000, 4000], n=4, method="inclusive")[0]
    )


def test_rounds_rotate_the_order_after_warm_up():
    calls: list[str] = []

    def timer(name):
        return lambda: calls.append(name) or 0.001

    timers = {name: timer(name) for name in ("a", "b", "c")}
    times = bench.time_rounds(timers, rounds=3, warmup=2)
    assert calls[:6] == ["a", "a", "b", "b", "c", "c"]
    assert calls[6:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(len(v) == 3 for v in times.values())


# --------------------------------------------------------------------------------------------------
# variants


def test_batched_deep_ensemble_equals_members_run_one_by_one(tiny_variants):
    x = tiny_variants.example_inputs(3)
    seq, batched = tiny_variants["deep_ensemble_seq"], tiny_variants["deep_ensemble_batched"]
    assert len(seq.modules) == M and len(batched.modules) == 1
    with torch.inference_mode():
        one_by_one = torch.stack([member(*x) for member in seq.modules], dim=1)
        fused = batched(*x)
    assert fused.shape == (3, M, tiny_variants.adapter.num_classes)
    torch.testing.assert_close(fused, one_by_one, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(one_by_one[:, 0], one_by_one[:, 1])  # the members really differ


def test_hydra_trunk_computes_shared_layers_once(tiny_variants):
    trunk = tiny_variants["hydra_trunk"].modules[0]
    hydra = tiny_variants["hydra"].modules[0]
    assert tiny_variants.info["trunk_layers"] == 1  # half of the tiny ViT's 3 layers
    assert trunk.trunk_layers >= 1 and hydra.trunk_layers == 0
    assert trunk.macs["hydra"] < hydra.macs["hydra"]


def test_impossible_geometry_is_refused():
    with pytest.raises(BenchError, match=r"more than .* 4 heads"):
        bench.build_variants(tiny_config(heads_per_member=5), tiny_factory)
    with pytest.raises(BenchError, match="trunk-layers 3 does not fit"):
        bench.build_variants(tiny_config(trunk_layers=3), tiny_factory)
    with pytest.raises(BenchError, match="members"):
        tiny_config(members=0)
    with pytest.raises(BenchError, match="unknown backend 'cuda'"):
        tiny_config(backends=("cuda",))


# --------------------------------------------------------------------------------------------------
# backends


@pytest.mark.skipif(not HAS_ORT, reason="onnxruntime/onnx/onnx-graphsurgeon not installed")
def test_ort_member_logits_match_pytorch(tiny_result, tiny_variants, tmp_path):
    info = tiny_result["backends"]["ort"]
    assert info["intra_op_threads"] == 1
    assert set(info["max_abs_diff_vs_torch_fp32"]) == set(bench.VARIANTS)
    assert max(info["max_abs_diff_vs_torch_fp32"].values()) < 1e-4
    hydra = tiny_variants["hydra"]  # and directly, at a batch size the run did not use
    paths, done = bench.export_variant(
        hydra, tiny_variants, tmp_path / "hydra", exporter="torchscript", max_batch=3
    )
    assert done["exporter"] == "torchscript" and "cleanup" in done["passes"]
    backend = bench.OrtBackend(tmp_path, "torchscript", threads=1, spinning=False)
    x = tiny_variants.example_inputs(2)
    timer = bench.OrtTimer(
        [backend.session(p) for p in paths],
        bench.feed_of(tiny_variants.input_names, x),
        sequential=False,
    )
    with torch.inference_mode():
        np.testing.assert_allclose(timer.output(), hydra(*x).numpy(), atol=1e-4)
    assert timer() > 0


@pytest.mark.skipif(HAS_CUDA, reason="a CUDA device is present: its backends are measured")
def test_absent_cuda_backends_are_skipped_with_the_reason():
    chosen, skipped = bench.resolve_backends(None)
    assert "torch" in chosen and "torch-cuda-bf16" not in chosen
    assert "no CUDA device" in skipped["torch-cuda-bf16"]
    assert "no CUDA device" in skipped["torch-cuda-fp16"]


@pytest.mark.skipif(HAS_TENSORRT, reason="TensorRT is installed: the backend is measured")
def test_absent_tensorrt_is_skipped_and_refused_when_asked_for(capsys):
    _, skipped = bench.resolve_backends(None)
    assert "tensorrt" in skipped
    code, _, err = run_cli(capsys, "--backbone", "vit_ti16", "--backend", "tensorrt")
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("error: backend tensorrt cannot run here")
    assert "pip install" in err


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("backend", ["torch-cuda-bf16", "torch-cuda-fp16"])
def test_cuda_graph_backend_matches_pytorch(tiny_variants, backend):
    if backend == "torch-cuda-bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no BF16")
    config = tiny_config(backends=(backend,), batches=(1, 4))
    result = bench.run_benchmark(config, quiet=True, variants=tiny_variants)
    info = result["backends"][backend]
    assert info["cuda_graphs"] and not info["eager_fallback"]
    assert max(info["max_abs_diff_vs_torch_fp32"].values()) < 0.1
    assert result["results"][backend]["4"]["single"]["ratio_vs_single"] == 1.0


@pytest.mark.skipif(not (HAS_TENSORRT and HAS_CUDA), reason="TensorRT or a CUDA device missing")
def test_tensorrt_backend_matches_pytorch(tiny_variants):
    result = bench.run_benchmark(
        tiny_config(backends=("tensorrt",)), quiet=True, variants=tiny_variants
    )
    assert max(result["backends"]["tensorrt"]["max_abs_diff_vs_torch_fp32"].values()) < 0.05


# --------------------------------------------------------------------------------------------------
# baselines and check


def scaled(baseline, factor, backend="torch", batch="3", variant="hydra"):
    out = copy.deepcopy(baseline)
    out["ratios"][backend][batch][variant] *= factor
    return out


def test_check_passes_against_its_own_baseline(tiny_result):
    baseline = check.make_baseline(tiny_result, tolerance=0.15)
    report = check.compare(tiny_result, baseline)
    assert report.passed and not report.improvements and not report.not_checked
    assert len(report.within) == len(tiny_result["results"]) * 2 * (len(bench.VARIANTS) - 1)
    assert report.lines()[-1].startswith("check passed")


def test_check_flags_a_regression_and_reports_an_improvement(tiny_result):
    baseline = check.make_baseline(tiny_result, tolerance=0.15)
    baseline = scaled(scaled(baseline, 1 / 1.5), 2.0, variant="deep_ensemble_seq")
    report = check.compare(tiny_result, baseline)
    assert not report.passed
    assert [(f.backend, f.batch, f.variant) for f in report.regressions] == [
        ("torch", "3", "hydra")
    ]
    assert [f.variant for f in report.improvements] == ["deep_ensemble_seq"]
    line = report.lines()[0]
    assert line.startswith("REGRESSION: torch batch 3 hydra: ratio") and "+50.0%" in line
    assert check.compare(tiny_result, baseline, tolerance=0.6).passed  # a wider tolerance


def test_check_lists_baseline_entries_not_measured(tiny_result):
    baseline = check.make_baseline(tiny_result)
    baseline["ratios"]["tensorrt"] = {"8": {"hydra": 1.2}}
    baseline["ratios"]["torch"]["64"] = {"hydra": 2.0}
    report = check.compare(tiny_result, baseline)
    assert report.passed
    assert sorted(report.not_checked) == ["tensorrt batch 8 hydra", "torch batch 64 hydra"]
    assert (
        "not checked: tensorrt batch 8 hydra (in the baseline, not measured now)" in report.lines()
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [("backbone", "vit_b16"), ("members", 5), ("heads_per_member", 1), ("trunk_layers", 2)],
)
def test_check_refuses_a_baseline_of_other_settings(tiny_result, key, value):
    baseline = {**check.make_baseline(tiny_result), key: value}
    with pytest.raises(BenchError, match=f"other settings: {key}"):
        check.compare(tiny_result, baseline)


def test_check_module_imports_without_torch():
    code = "import sys, hydra_deploy.bench.check; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_baseline_round_trips_through_a_file(tiny_result, tmp_path):
    path = tmp_path / "b.json"
    check.write_baseline(path, check.make_baseline(tiny_result, tolerance=0.5, command="x"))
    loaded = check.load_baseline(path)
    assert loaded["tolerance"] == 0.5 and loaded["members"] == M
    assert loaded["ratios"] == check.ratios_of(tiny_result)
    assert loaded["machine"]["cpu_count"] == tiny_result["environment"]["cpu_count"]


def test_cli_check_exits_1_on_a_regression(tiny_result, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "run_benchmark", lambda config, quiet: copy.deepcopy(tiny_result))
    path = tmp_path / "base.json"
    path.write_text(json.dumps(scaled(check.make_baseline(tiny_result), 1 / 2)))
    argv = ["--backbone", "tiny_vit", "--members", M, "--heads-per-member", K, "--check", path]
    code, out, err = run_cli(capsys, *argv, "--tolerance", "0.15")
    assert code == 1
    regressions = [line for line in err.splitlines() if line.startswith("REGRESSION")]
    assert regressions[0].startswith("REGRESSION: torch batch 3 hydra")
    assert "re-measured: torch batch 3 hydra: " in out  # timed again before the verdict
    assert "a regression again" in out and "check FAILED" in out
    code, out, err = run_cli(capsys, *argv, "--tolerance", "1.5", "--quiet")
    assert (code, out, err) == (0, "", "")


# --------------------------------------------------------------------------------------------------
# command line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--members", "0"], "members (--members) must be an integer >= 1"),
        (["--heads-per-member", "4"], "more than vit_ti16's 3 heads per layer"),
        (["--backend", "gpu"], "unknown backend 'gpu'"),
        (["--batch", "0"], "batch (--batch) must be an integer >= 1"),
        (["--check", "missing.json"], "baseline 'missing.json' does not exist"),
        (["--check", "NOT_JSON"], "is not a JSON file"),
        (["--check", "OTHER"], "other settings: backbone 'vit_ti16' (baseline: 'vit_b16')"),
        (["--tolerance", "-1"], "tolerance must be a fraction > 0"),
    ],
)
def test_cli_bad_inputs_give_one_line_errors(capsys, tmp_path, argv, message):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text(
        json.dumps(
            {
                "format": check.BASELINE_FORMAT,
                "backbone": "vit_b16",
                "members": 3,
                "heads_per_member": 1,
                "ratios": {},
            }
        )
    )
    files = {
        "NOT_JSON": tmp_path / "bad.json",
        "OTHER": tmp_path / "other.json",
        "missing.json": "missing.json",
    }
    argv = [files.get(a, a) for a in argv]
    code, out, err = run_cli(
        capsys,
        "--backbone",
        "vit_ti16",
        "--img-size",
        "32",
        "--heads-per-member",
        "1",
        "--backend",
        "torch",
        *argv,
    )
    assert code in (1, 2)
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err
    assert out == ""


def test_cli_refuses_an_existing_output_without_overwrite(capsys, tmp_path):
    (tmp_path / "r.json").write_text("{}")
    code, _, err = run_cli(capsys, "--backbone", "vit_ti16", "--out", tmp_path / "r.json")
    assert code == 1 and "--overwrite" in err


def test_cli_end_to_end_writes_result_plot_and_a_baseline_it_passes(capsys, tmp_path):
    argv = [
        "--backbone",
        "vit_ti16",
        "--img-size",
        "32",
        "--members",
        "3",
        "-k",
        "1",
        "--batch",
        "1",
        "2",
        "--backend",
        "torch",
        "--rounds",
        "2",
        "--warmup",
        "0",
        "--threads",
        "1",
    ]
    outputs = ["--out", tmp_path / "r.json", "--write-baseline", tmp_path / "b.json", "--json"]
    if importlib.util.find_spec("matplotlib"):
        outputs += ["--plot", tmp_path / "p.png"]
    code, out, err = run_cli(capsys, *argv, *outputs)
    assert code == 0, err
    printed = json.loads(out)  # --json: stdout holds the JSON alone; the table went to stderr
    assert printed == json.loads((tmp_path / "r.json").read_text())
    assert "deep_ensemble_batched" in err and "GMAC/s" in err
    baseline = check.load_baseline(tmp_path / "b.json")
    assert baseline["command"].startswith("hydra-bench --backbone vit_ti16")
    assert baseline["command"] == (
        "hydra-bench --backbone vit_ti16 --members 3 --heads-per-member 1 --batch 1 2 --backend "
        "torch --rounds 2 --warmup 0 --threads 1 --img-size 32 --seed 0"
    )
    assert check.compare(printed, baseline).passed
    if "--plot" in outputs:
        assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_report_holds_the_table_and_claims(tiny_result):
    found = check.claims(tiny_result, gap_batch=3)
    text = bench.markdown_report(tiny_result, found, command="hydra-bench --backbone tiny_vit")
    assert "| torch | 3 | hydra |" in text and "hydra-bench --backbone tiny_vit" in text
    assert "hydra gap <= 1.1" in text and "hydra_trunk < hydra" in text
    assert {c["claim"] for c in found} == {
        "hydra gap <= 1.1",
        "hydra < deep ensemble",
        "hydra_trunk < hydra",
    }


def load_script(name: str):
    folder = str(ROOT / "benchmarks")
    if folder not in sys.path:  # the scripts import their shared `common` module, as when run
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_latency_script_writes_json_markdown_and_claims(tmp_path):
    script = load_script("latency")
    argv = [
        "--backbone",
        "vit_ti16",
        "--img-size",
        "32",
        "-k",
        "1",
        "--batch",
        "8",
        "--backend",
        "torch",
        "--variants",
        "hydra",
        "hydra_trunk",
        "--rounds",
        "1",
        "--warmup",
        "0",
        "--threads",
        "1",
        "--out",
        tmp_path / "l.json",
        "--md",
        tmp_path / "l.md",
        "--plot",
        tmp_path / "l.png",
        "--quiet",
    ]
    if not importlib.util.find_spec("matplotlib"):
        argv = [*argv[: argv.index("--plot")], "--quiet"]
    assert script.main([str(a) for a in argv]) == 0
    result = json.loads((tmp_path / "l.json").read_text())
    assert list(result["results"]["torch"]["8"]) == ["single", "hydra", "hydra_trunk"]
    assert {c["claim"] for c in result["claims"]} == {"hydra gap <= 1.1", "hydra_trunk < hydra"}
    markdown = (tmp_path / "l.md").read_text()
    assert markdown.count("| torch | 8 |") == 3
    assert ".venv/bin/python benchmarks/latency.py --backbone vit_ti16" in markdown


def test_ort_profile_script_splits_every_kernel_into_roles(tmp_path, capsys):
    script = load_script("profile_ort")
    out = tmp_path / "p.json"
    argv = [
        "--backbone",
        "vit_ti16",
        "--img-size",
        "32",
        "--heads-per-member",
        "1",
        "--batch",
        "2",
        "--runs",
        "2",
        "--threads",
        "1",
        "--out",
        str(out),
        "--quiet",
    ]
    assert script.main(argv) == 0
    result = json.loads(out.read_text())
    for name in ("single", "hydra"):
        variant = result["variants"][name]
        roles, ops = variant["kernel_ms_by_role"], variant["kernel_ms_by_op"]
        assert set(roles) == set(script.ROLES) and min(roles.values()) >= 0
        assert sum(roles.values()) == pytest.approx(sum(ops.values()), rel=1e-9)  # nothing lost
        assert roles["mlp"] > 0 and roles["qkv"] > 0 and roles["attention"] > 0
        assert len(variant["wall_ms"]) == 2
    assert "kernels (sum)" in capsys.readouterr().out


def test_gpu_script_stops_with_the_reason_without_cuda(capsys):
    if HAS_CUDA:
        pytest.skip("a CUDA device is present")
    assert load_script("gpu_latency").main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no CUDA device") and err.count("\n") == 1


# --------------------------------------------------------------------------------------------------
# the quick regression check CI runs


@pytest.mark.latency
def test_quick_cpu_check_against_the_committed_baseline(capsys):
    """Re-measure the baseline's own configuration and check it with the baseline's tolerance."""
    baseline = check.load_baseline(CPU_QUICK)
    assert baseline["tolerance"] >= 0.3, "CI machines are noisy: keep the tolerance generous"
    argv = shlex.split(baseline["command"])
    assert argv[0] == "hydra-bench"
    code, _, err = run_cli(capsys, *argv[1:], "--check", CPU_QUICK, "--quiet")
    assert code == 0, f"latency regression against {CPU_QUICK.name}:\n{err}"
