"""INT8 (ONNX Runtime) and BF16 (PyTorch on the CPU) in the latency benchmark: the flags, the rows
they add, the CPU without BF16, the INT8 profile and issue 27's target lines.

Timing runs here use tiny models, one or two rounds, and assert structure only: no test's verdict
depends on how busy the machine is.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import shlex
import sys
from pathlib import Path

import helpers.bench as bench_helpers
import pytest
from helpers.bench import M, tiny_factory

from hydra_deploy.bench import BenchError, check
from hydra_deploy.bench import latency as bench
from hydra_deploy.bench.latency import machine
from hydra_deploy.cli import bench as cli

ROOT = Path(__file__).resolve().parents[2]
HAS_ORT = bench.backend_status()["ort"] is None
HAS_INT8 = HAS_ORT and bench.int8_unavailable() is None
HAS_BF16 = bench.cpu_bf16_reason() is None
NO_BF16 = frozenset({"fpu", "sse2", "avx2", "avx512f"})  # an x86 CPU without BF16 instructions


def tiny_config(**changes) -> bench.BenchConfig:
    """The tests' tiny benchmark with every precision, short."""
    precise = dict(batches=(1, 2), rounds=2, warmup=0, precisions=bench.PRECISIONS)
    precise.update(int8_calibration_examples=32, int8_profile_runs=1)
    return bench_helpers.tiny_config(**{**precise, **changes})


@pytest.fixture(scope="module")
def tiny_variants():
    return bench.build_variants(tiny_config(), tiny_factory)


@pytest.fixture(scope="module")
def precision_result(tiny_variants):
    return bench.run_benchmark(tiny_config(), quiet=True, variants=tiny_variants)


def load_script(name: str):
    folder = str(ROOT / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------------
# configuration and flags


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ((), ("fp32",)),
        (("bf16",), ("fp32", "bf16")),
        (("int8",), ("fp32", "int8-dynamic", "int8-static")),
        (("bf16,int8-static",), ("fp32", "int8-static", "bf16")),
        (("all",), bench.PRECISIONS),
        (("INT8-Dynamic", "fp32"), ("fp32", "int8-dynamic")),
    ],
)
def test_precisions_are_normalized_with_fp32_always_first(given, expected):
    assert bench.normalize_precisions(given) == expected
    assert bench.BenchConfig(backbone="x", precisions=given).precisions == expected


def test_config_defaults_and_refusals():
    config = bench.BenchConfig(backbone="x")
    assert config.precisions == ("fp32",) and config.low_precisions == ()
    assert config.to_dict()["precisions"] == ["fp32"]
    assert [p.backend for p in tiny_config().low_precisions] == [
        "ort-int8-dynamic",
        "ort-int8-static",
        "torch-cpu-bf16",
    ]
    with pytest.raises(BenchError, match="unknown precision 'int4'; choose from fp32"):
        bench.BenchConfig(backbone="x", precisions=("int4",))
    with pytest.raises(
        BenchError, match=r"\(--int8-calibration-examples\) must be an integer >= 32"
    ):
        bench.BenchConfig(backbone="x", int8_calibration_examples=31)
    with pytest.raises(BenchError, match=r"int8_profile_runs \(--int8-profile-runs\) must be"):
        bench.BenchConfig(backbone="x", int8_profile_runs=-1)
    assert bench.BenchConfig(backbone="x", int8_profile_runs=0).int8_profile_runs == 0


def test_cli_flags_reach_the_config_and_the_repeat_command():
    args = cli.build_parser().parse_args(
        ["--backbone", "vit_ti16", "--precision", "int8-static,bf16", "--int8-profile-runs", "0"]
    )
    config = cli.config_from_args(args)
    assert config.precisions == ("fp32", "int8-static", "bf16")
    assert config.int8_profile_runs == 0
    assert config.int8_calibration_examples == bench.BenchConfig("x").int8_calibration_examples
    command = cli.command_for(config, 2, ["torch", "ort"])
    assert "--precision fp32 int8-static bf16 --int8-profile-runs 0" in command
    assert "--int8-calibration-examples" not in command  # the default is not repeated
    plain = cli.config_from_args(cli.build_parser().parse_args(["--backbone", "vit_ti16"]))
    assert plain.precisions == ("fp32",)
    assert "--precision" not in cli.command_for(plain, 2, ["torch"])


def test_latency_script_is_fp32_and_quick_a_small_scratch_run_of_every_precision():
    script = load_script("latency")
    plain = script.build_parser().parse_args([])
    assert cli.config_from_args(plain).precisions == ("fp32",)  # INT8 at ViT-B/16 size: opt in
    quick = script.build_parser(quick=True).parse_args(["--quick"])
    config = cli.config_from_args(quick)
    assert config.precisions == bench.PRECISIONS
    assert (config.backbone, config.img_size, config.rounds) == ("vit_ti16", 32, 2)
    assert config.variants == ("single", "hydra", "fused_deep_ensemble")  # the targets' variants
    assert set(config.batches) >= set(check.INT8_TARGET_BATCHES)
    assert quick.out.parent == script.QUICK_DIR and quick.md.parent == script.QUICK_DIR


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--precision", "int4"], "unknown precision 'int4'"),
        (["--int8-calibration-examples", "0"], "(--int8-calibration-examples) must be"),
    ],
)
def test_cli_bad_precision_flags_give_one_line_errors(capsys, argv, message):
    code = cli.main(["--backbone", "vit_ti16", "--img-size", "32", "--backend", "torch", *argv])
    err = capsys.readouterr().err
    assert code in (1, 2)
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


# --------------------------------------------------------------------------------------------------
# the CPU's flags and BF16 support


X86 = (
    "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx512f amx_bf16 amx_int8 avx512_vnni\n"
)
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\nCPU implementer\t: 0x41\n"


def test_cpu_flags_are_read_from_x86_and_arm_cpuinfo():
    assert bench.cpu_flags_of(X86) >= {"amx_bf16", "amx_int8", "avx512_vnni"}
    assert bench.cpu_flags_of(ARM) >= {"bf16", "i8mm"}
    assert bench.cpu_flags_of("processor\t: 0\n") is None


def test_bf16_support_follows_the_flags(monkeypatch):
    monkeypatch.setattr(machine, "cpu_flags", lambda: bench.cpu_flags_of(X86))
    assert bench.cpu_bf16_reason() is None
    features = bench.cpu_features()
    assert features["amx_bf16"] and features["avx512_vnni"] and not features["avx512_bf16"]
    line = bench.cpu_features_line({"cpu_features": features, "cpu_bf16": True})
    assert "AMX yes (amx_bf16, amx_int8)" in line and "AVX-512 BF16 no" in line
    assert line.endswith("BF16 in PyTorch on this CPU: native.")
    monkeypatch.setattr(machine, "cpu_flags", lambda: NO_BF16)
    reason = bench.cpu_bf16_reason()
    assert "no BF16 instructions" in reason and "fell back to FP32" in reason
    assert "\n" not in reason
    monkeypatch.setattr(machine, "cpu_flags", lambda: None)
    assert "cannot be read" in bench.cpu_bf16_reason()


def test_bf16_on_a_cpu_without_it_is_one_skipped_line_not_a_crash(monkeypatch, tiny_variants):
    monkeypatch.setattr(machine, "cpu_flags", lambda: NO_BF16)
    config = tiny_config(backends=("torch",), precisions=("bf16",), batches=(1,), rounds=1)
    result = bench.run_benchmark(config, quiet=True, variants=tiny_variants)
    assert list(result["results"]) == ["torch"]  # the FP32 rows stand
    reason = result["skipped"]["torch-cpu-bf16"]
    assert "no BF16 instructions" in reason and "fell back to FP32" in reason
    assert result["environment"]["cpu_bf16"] is False
    assert result["environment"]["cpu_features"]["amx_bf16"] is False
    text = bench.markdown_report(result)
    assert text.count("torch-cpu-bf16") == 1  # one line, in the skipped list
    assert "- skipped torch-cpu-bf16: this CPU" in text
    assert "not native" in text


def test_a_precision_whose_runtime_is_not_measured_is_skipped_with_the_flag_to_add():
    config = tiny_config(backends=("torch",))
    chosen, skipped = bench.resolve_precisions(config, ["torch"])
    assert [p.precision for p in chosen] == (["bf16"] if HAS_BF16 else [])
    for name in ("ort-int8-dynamic", "ort-int8-static"):
        assert skipped[name].endswith("which this run does not measure; add --backend ort")


# --------------------------------------------------------------------------------------------------
# the rows a run with every precision adds


def test_every_precision_adds_rows_against_the_fp32_single_model(precision_result):
    results = precision_result["results"]
    expected = ["torch"] + (["torch-cpu-bf16"] if HAS_BF16 else [])
    if HAS_ORT:
        expected += ["ort"] + (["ort-int8-dynamic", "ort-int8-static"] if HAS_INT8 else [])
    assert list(results) == expected
    assert precision_result["config"]["backends"] == (["torch", "ort"] if HAS_ORT else ["torch"])
    assert precision_result["config"]["precisions"] == list(bench.PRECISIONS)
    for backend, batches in results.items():
        assert list(batches) == ["1", "2"]
        for rows in batches.values():
            assert list(rows) == list(bench.VARIANTS)
            for row in rows.values():
                assert row["ratio_vs_fp32_single"] > 0
                assert row["gap"] == pytest.approx(row["ratio_vs_single"] / row["flops_ratio"])
                assert len(row["times_ms"]) == 2
                if backend in ("torch", "ort"):
                    assert row["ratio_vs_fp32_single"] == pytest.approx(row["ratio_vs_single"])
            assert rows["single"]["ratio_vs_single"] == 1.0
    json.dumps(precision_result, allow_nan=False)


def test_each_lower_precision_is_timed_beside_the_fp32_single_model_only(tiny_variants):
    """The FP32 backend times every variant, then keeps its single model only; each lower
    precision is loaded after that, timed in rounds with that single model, and closed."""
    config = tiny_config(batches=(1,), rounds=2, warmup=0, int8_profile_runs=0)
    reference = bench.reference_outputs(tiny_variants, 1)
    events: list[tuple] = []

    class Recorded(bench.Timer):
        def __init__(self, logits):
            self.logits = logits

        def run(self):
            return self.logits

    class Fake(bench.Backend):
        def __init__(self, name: str, precision: str) -> None:
            self.name, self.precision = name, precision

        def load(self, variants, batches):
            super().load(variants, batches)
            events.append(("load", self.name))

        def timer(self, variant, inputs):
            events.append(("timer", self.name, variant.name))
            return Recorded(reference[variant.name])

        def keep_only(self, names):
            events.append(("keep_only", self.name, tuple(sorted(names))))

        def close(self):
            events.append(("close", self.name))

    backends = [Fake("ort", "fp32"), Fake("ort-int8-dynamic", "int8-dynamic")]
    measured = bench.measure_backends(
        backends, tiny_variants, config, reference, bench.Progress(1, enabled=False)
    )
    names = [v.name for v in tiny_variants.variants]
    assert events == [
        ("load", "ort"),
        *(("timer", "ort", name) for name in names),
        ("keep_only", "ort", ("single",)),
        ("load", "ort-int8-dynamic"),
        ("timer", "ort", "single"),
        *(("timer", "ort-int8-dynamic", name) for name in names),
        ("close", "ort-int8-dynamic"),
    ]
    rows, info = measured["ort-int8-dynamic"]
    assert set(rows["1"]) == set(names)
    assert all(row["ratio_vs_fp32_single"] > 0 for row in rows["1"].values())
    assert info["timed_with"] == "ort" and "same rounds" in info["fp32_reference"]
    assert set(measured["ort"][0]["1"]) == set(names)  # the FP32 rows: every variant, once


@pytest.mark.skipif(not HAS_BF16, reason="this CPU has no BF16 instructions")
def test_bf16_rows_ran_under_cpu_autocast(precision_result):
    info = precision_result["backends"]["torch-cpu-bf16"]
    assert info["precision"] == "bf16" and info["timed_with"] == "torch"
    assert info["autocast"] == 'torch.autocast("cpu", dtype=torch.bfloat16)'
    assert info["cpu_bf16_instructions"]
    diffs = info["max_abs_diff_vs_torch_fp32"]
    assert set(diffs) == set(bench.VARIANTS)
    assert 0 < max(diffs.values()) < 1.0  # BF16 moved the logits, a little


@pytest.mark.skipif(not HAS_INT8, reason="onnxruntime or hydra_deploy.export.int8 missing")
@pytest.mark.parametrize("method", ["dynamic", "static"])
def test_int8_rows_quantize_the_shared_fp32_exports_and_profile_them(precision_result, method):
    name = f"ort-int8-{method}"
    info = precision_result["backends"][name]
    assert info["precision"] == f"int8-{method}" and info["timed_with"] == "ort"
    assert info["fp32_reference"].startswith("ort's single model, timed in the same rounds")
    assert info["int8"]["method"] == method
    assert ("random inputs" in (info["int8"]["calibration"] or "")) == (method == "static")
    assert info["intra_op_threads"] == 1
    for variant in bench.VARIANTS:
        export = info["exports"][variant]
        assert export["fp32_export"] == "the ort backend's"  # exported once, quantized twice
        assert export["files"] == (M if variant == "deep_ensemble_seq" else 1)
    assert set(info["max_abs_diff_vs_torch_fp32"]) == set(bench.VARIANTS)
    profile = info["profile"]
    assert profile["batch"] == bench.profile_batch((1, 2)) == 2 and profile["runs"] == 1
    assert list(profile["variants"]) == ["single", "hydra", "fused_deep_ensemble"]
    for breakdown in profile["variants"].values():
        shares = breakdown["share_by_class"]
        assert sum(shares.values()) == pytest.approx(1.0)
        assert sum(o["ms"] for o in breakdown["ops"]) == pytest.approx(breakdown["kernel_ms"])
    # the single model's products run on integer kernels, and the profile sees them (how much of
    # the fused graphs ORT runs in INT8 is what the profile is there to show, not assumed here)
    assert profile["variants"]["single"]["share_by_class"]["int8"] > 0
    assert "profile" not in precision_result["backends"]["ort"]  # FP32 is not profiled


@pytest.mark.skipif(not HAS_INT8, reason="onnxruntime or hydra_deploy.export.int8 missing")
def test_report_and_plot_hold_the_precision_rows(precision_result, tmp_path):
    targets = check.int8_targets(precision_result, batches=(1, 2))
    assert {t["backend"] for t in targets} == {"ort-int8-dynamic", "ort-int8-static"}
    assert all(t["passed"] in (True, False) for t in targets)
    text = bench.markdown_report(precision_result, targets=targets)
    assert "## INT8 and BF16 against the single FP32 model" in text
    assert "| ort-int8-static | hydra |" in text and "| ort-int8-dynamic | 2 | hydra |" in text
    assert "## INT8 targets (issue 27)" in text
    assert "### Where the INT8 time goes: ort-int8-dynamic, batch 2" in text
    assert "calibrated on 32 random inputs" in text
    if importlib.util.find_spec("matplotlib"):
        png = bench.plot_latency(precision_result, tmp_path / "p.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fused_deep_ensemble_prunes_independent_members_and_keeps_their_mlps(tiny_variants):
    fused = tiny_variants["fused_deep_ensemble"]
    hydra = tiny_variants["hydra"]
    model = fused.modules[0]
    assert model.num_members == M and model.trunk_layers == 0
    assert any("per-member" in str(v) for v in model.merge.values())
    # the same heads and M MLP streams; M embeddings and classifiers of their own on top
    assert fused.macs_per_example >= hydra.macs_per_example
    assert fused.flops_ratio < M  # pruned: less than the full deep ensemble
    assert fused.parameters > hydra.parameters
    assert tiny_variants.info["fused_deep_ensemble_spec"] == tiny_variants.info["hydra_spec"]


def test_quick_latency_script_writes_the_precision_rows_and_targets(tmp_path):
    script = load_script("latency")
    out = {"--out": tmp_path / "l.json", "--md": tmp_path / "l.md", "--plot": tmp_path / "l.png"}
    if not importlib.util.find_spec("matplotlib"):
        del out["--plot"]
    argv = ["--quick", "--variants", "hydra", "--batch", "2", "--threads", "1", "--quiet"]
    argv += [str(x) for pair in out.items() for x in pair]
    assert script.main(argv) == 0
    result = json.loads((tmp_path / "l.json").read_text())
    assert result["config"]["precisions"] == list(bench.PRECISIONS)
    assert result["config"]["backbone"] == "vit_ti16" and result["config"]["rounds"] == 2
    lower = [name for name in result["results"] if name not in ("torch", "ort")]
    assert set(lower) | set(result["skipped"]) >= {
        "torch-cpu-bf16",
        "ort-int8-dynamic",
        "ort-int8-static",
    }
    for name in lower:
        rows = result["results"][name]["2"]
        assert list(rows) == ["single", "hydra"]
        assert {"ratio_vs_fp32_single", "ratio_vs_single", "gap", "median_ms"} <= set(rows["hydra"])
    markdown = (tmp_path / "l.md").read_text()
    assert "--quick" in markdown and "CPU features" in markdown
    if HAS_INT8:
        assert {t["backend"] for t in result["int8_targets"]} == {
            "ort-int8-dynamic",
            "ort-int8-static",
        }
        assert "## INT8 targets (issue 27)" in markdown
        assert "batch 1: hydra INT8 <= 0.8 x single FP32: NOT MEASURED" in markdown


# --------------------------------------------------------------------------------------------------
# the INT8 profile's precision classes


@pytest.mark.parametrize(
    ("op", "types", "expected"),
    [
        ("MatMulInteger", {"uint8", "int8", "int32"}, "int8"),
        ("DynamicQuantizeMatMul", {"float", "int8"}, "int8"),
        ("QLinearMatMul", set(), "int8"),
        ("Reshape", {"int8", "int64"}, "int8"),
        ("DynamicQuantizeLinear", {"float", "uint8"}, "convert"),
        ("DequantizeLinear", {"int8", "float"}, "convert"),
        ("LayerNormalization", {"float"}, "float"),
        ("MatMul", {"float"}, "float"),
        ("Softmax", set(), "float"),
        ("Shape", {"int64"}, "other"),
    ],
)
def test_profiled_operators_are_sorted_by_precision(op, types, expected):
    assert bench.precision_of(op, types) == expected


def test_precision_breakdown_shares_add_up():
    profile = bench.KernelProfile(
        per_node_us={"a": 3000.0, "b": 1000.0, "c": 500.0, "d": 500.0},
        op_type={
            "a": "MatMulInteger",
            "b": "LayerNormalization",
            "c": "DynamicQuantizeLinear",
            "d": "Softmax",
        },
        node_types={"a": frozenset({"uint8", "int8", "int32"}), "b": frozenset({"float"})},
        wall_ms=[6.0, 5.0, 7.0],
    )
    found = bench.precision_breakdown(profile)
    assert found["kernel_ms"] == pytest.approx(5.0)
    assert found["median_wall_ms"] == 6.0
    assert found["share_by_class"] == pytest.approx(
        {"int8": 0.6, "float": 0.3, "convert": 0.1, "other": 0.0}
    )
    assert [(o["op"], o["precision"]) for o in found["ops"]][:2] == [
        ("MatMulInteger", "int8"),
        ("LayerNormalization", "float"),
    ]


# --------------------------------------------------------------------------------------------------
# issue 27's targets from given numbers


def row(ratio_fp32: float, ratio: float = 1.0, flops: float = 1.0) -> dict:
    return {
        "ratio_vs_fp32_single": ratio_fp32,
        "ratio_vs_single": ratio,
        "flops_ratio": flops,
        "gap": ratio / flops,
    }


def breakdown(int8: float, float_: float, convert: float, ms: float) -> dict:
    return {
        "kernel_ms": ms,
        "share_by_class": {"int8": int8, "float": float_, "convert": convert, "other": 0.0},
        "ops": [
            {"op": "LayerNormalization", "precision": "float", "ms": ms * float_, "share": float_},
            {"op": "MatMulInteger", "precision": "int8", "ms": ms * int8, "share": int8},
        ],
    }


GIVEN = {
    "results": {
        "ort": {"1": {"single": row(1.0), "hydra": row(2.4, 2.4, 2.27)}},
        "ort-int8-dynamic": {
            "1": {
                "single": row(0.40),
                "hydra": row(0.70, 1.75, 2.27),  # passes 0.8; gap 0.771
                "fused_deep_ensemble": row(1.10, 2.75, 2.27),  # misses 1.0 by 0.1
            },
            "8": {
                "single": row(0.37),
                "hydra": row(0.90, 2.43, 2.27),  # misses 0.8 by 0.1; gap 1.070 misses 1.05
                "fused_deep_ensemble": row(0.95, 2.57, 2.27),
            },
        },
    },
    "backends": {
        "ort": {"precision": "fp32"},
        "ort-int8-dynamic": {
            "precision": "int8-dynamic",
            "profile": {
                "batch": 8,
                "runs": 3,
                "variants": {
                    "single": breakdown(0.8, 0.15, 0.05, 100.0),
                    "hydra": breakdown(0.6, 0.3, 0.1, 250.0),
                },
            },
        },
    },
}


def test_int8_targets_are_computed_from_the_ratios():
    targets = check.int8_targets(GIVEN)
    by = {(t["batch"], t["target"]): t for t in targets}
    assert {t["backend"] for t in targets} == {"ort-int8-dynamic"}  # FP32 rows are not targets
    assert len(targets) == 3 * 3
    hydra_1 = by[(1, "hydra INT8 <= 0.8 x single FP32")]
    assert hydra_1["passed"] is True and hydra_1["value"] == 0.70 and hydra_1["missed_by"] is None
    hydra_8 = by[(8, "hydra INT8 <= 0.8 x single FP32")]
    assert hydra_8["passed"] is False and hydra_8["missed_by"] == pytest.approx(0.1)
    assert "missed by 0.100 (+12.5%)" in hydra_8["detail"]
    ensemble_1 = by[(1, "fused_deep_ensemble INT8 <= 1 x single FP32")]
    assert ensemble_1["passed"] is False and ensemble_1["missed_by"] == pytest.approx(0.1)
    assert by[(8, "fused_deep_ensemble INT8 <= 1 x single FP32")]["passed"] is True
    gap_8 = by[(8, "hydra INT8 / single INT8 <= 1.05 x FLOPs ratio")]
    assert gap_8["passed"] is False and gap_8["value"] == pytest.approx(2.43 / 2.27)
    assert gap_8["detail"].startswith("ratio 2.430 / FLOPs ratio 2.270 = 1.070; missed by 0.020")
    assert by[(1, "hydra INT8 / single INT8 <= 1.05 x FLOPs ratio")]["passed"] is True
    for target in (
        "hydra INT8 <= 0.8 x single FP32",
        "hydra INT8 / single INT8 <= 1.05 x FLOPs ratio",
    ):
        missing = by[(16, target)]
        assert missing["passed"] is None and "not measured (batch 16" in missing["detail"]
    stricter = check.int8_targets(GIVEN, batches=(1,), hydra_max=0.6, max_gap=0.5)
    assert [t["passed"] for t in stricter] == [False, False, False]


def test_target_lines_and_why_from_the_profile():
    targets = check.int8_targets(GIVEN)
    lines = [check.target_line(t) for t in targets]
    assert (
        "ort-int8-dynamic batch 8: hydra INT8 <= 0.8 x single FP32: FAIL (0.900 x the single FP32 model; missed by 0.100 (+12.5%))"
        in lines
    )
    assert (
        "ort-int8-dynamic batch 1: hydra INT8 <= 0.8 x single FP32: PASS (0.700 x the single FP32 model)"
        in lines
    )
    assert any(
        line.endswith("NOT MEASURED (not measured (batch 16 is not in this run))") for line in lines
    )
    why = bench.target_reasons(GIVEN, targets)
    assert len(why) == 3  # hydra vs 0.8, the gap, the fused deep ensemble (no profile of it)
    ratio_line = next(w for w in why if "hydra INT8 <= 0.8" in w)
    assert "(missed at batch 8)" in ratio_line
    assert (
        "only 60% of the INT8 hydra graph's kernel time runs in INT8; 30% stays in float"
        in ratio_line
    )
    assert "LayerNormalization 30%" in ratio_line and "10% converts" in ratio_line
    gap_line = next(w for w in why if "FLOPs ratio (missed" in w)
    assert (
        "take 40% of the INT8 hydra graph's kernel time against 20% of the INT8 single" in gap_line
    )
    assert "250.0 against 100.0 ms per run" in gap_line
    ensemble_line = next(w for w in why if "fused_deep_ensemble" in w)
    assert "no ONNX Runtime profile of the INT8 fused_deep_ensemble graph" in ensemble_line


def test_markdown_report_states_the_targets_with_their_verdicts():
    result = copy.deepcopy(GIVEN)
    result.update(
        config={
            "backbone": "vit_b16",
            "members": 3,
            "heads_per_member": 4,
            "threads": 2,
            "rounds": 5,
            "warmup": 2,
        },
        model={"disjoint": True, "trunk_layers": 6, "num_layers": 12},
        environment={"cpu_model": "CPU", "cpu_count": 2, "versions": {}},
        created="now",
    )
    for backend in result["results"].values():  # the table's columns
        for rows in backend.values():
            for r in rows.values():
                r.update(
                    median_ms=1.0,
                    q1_ms=1.0,
                    q3_ms=1.0,
                    min_ms=1.0,
                    max_ms=1.0,
                    macs_per_example=1e9,
                    gmacs_per_s=1.0,
                )
    targets = check.int8_targets(result)
    text = bench.markdown_report(result, targets=targets)
    assert "## INT8 targets (issue 27)" in text
    assert "- ort-int8-dynamic batch 8: hydra INT8 <= 0.8 x single FP32: FAIL" in text
    assert "Why (from the ONNX Runtime profile" in text
    assert "| ort-int8-dynamic | hydra | 0.700 | 0.900 |" in text
    assert "| hydra | 250.0 | 60% | 30% | 10% | LayerNormalization 30% |" in text
    assert "CPU features" not in text  # an older result without them still renders


@pytest.mark.parametrize(
    "argv",
    [
        ["--backbone", "vit_ti16"],
        ["--backbone", "minilm", "--seq-len", "64", "--classes", "5", "--variants", "hydra"],
        ["--backbone", "vit_s16", "-m", "2", "-k", "3", "--batch", "1", "4", "--backend", "ort"],
        [
            "--backbone",
            "vit_ti16",
            "--exporter",
            "torchscript",
            "--ort-spinning",
            "--lowering",
            "bmm",
            "--cuda-replays",
            "3",
            "--trunk-layers",
            "2",
            "--img-size",
            "32",
        ],
        [
            "--backbone",
            "vit_ti16",
            "--precision",
            "all",
            "--int8-calibration-examples",
            "64",
            "--int8-profile-runs",
            "1",
            "--rounds",
            "3",
            "--warmup",
            "1",
            "--seed",
            "5",
        ],
    ],
)
def test_the_repeat_command_gives_the_same_config(argv):
    """command_for is generated from BenchConfig's fields: parsing it back gives the config."""
    config = cli.config_from_args(cli.build_parser().parse_args(argv))
    command = cli.command_for(config, 2, ["torch"])
    again = cli.config_from_args(cli.build_parser().parse_args(shlex.split(command)[1:]))
    assert again == dataclasses.replace(config, threads=2, backends=("torch",))
    assert ("--seq-len" in command) == (config.backbone == "minilm")  # where it applies
