"""A result as a table, as Markdown and as a plot of latency against batch size; the INT8 and
BF16 rows against the FP32 single model, issue 27's targets and where the INT8 time goes."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra_deploy.bench import BenchError
from hydra_deploy.bench.check import target_line
from hydra_deploy.optional import lazy_module, missing, missing_message

# the plot only (--plot); require_matplotlib names the extra first
matplotlib = lazy_module("matplotlib", purpose="the latency plot", error=BenchError)
plt = lazy_module("matplotlib.pyplot", purpose="the latency plot", error=BenchError)
ticker = lazy_module("matplotlib.ticker", purpose="the latency plot", error=BenchError)

TABLE_HEADER = (
    "backend",
    "batch",
    "variant",
    "median_ms",
    "IQR_ms",
    "min-max_ms",
    "ratio",
    "ratio_fp32",
    "flops_ratio",
    "gap",
    "GMACs/ex",
    "GMAC/s",
)


def table_rows(result: Mapping[str, Any]) -> list[list[str]]:
    """One row per backend, batch and variant (the columns of ``TABLE_HEADER``)."""
    rows = []
    for backend, batches in result["results"].items():
        for batch, variants in batches.items():
            for name, r in variants.items():
                rows.append(
                    [
                        backend,
                        batch,
                        name,
                        f"{r['median_ms']:.2f}",
                        f"{r['q3_ms'] - r['q1_ms']:.2f}",
                        f"{r['min_ms']:.2f}-{r['max_ms']:.2f}",
                        f"{r['ratio_vs_single']:.3f}",
                        _fmt(r.get("ratio_vs_fp32_single")),
                        f"{r['flops_ratio']:.3f}",
                        f"{r['gap']:.3f}",
                        f"{r['macs_per_example'] / 1e9:.3g}",
                        f"{r['gmacs_per_s']:.3g}",
                    ]
                )
    return rows


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def cpu_features_line(env: Mapping[str, Any]) -> str | None:
    """``CPU features (/proc/cpuinfo flags): AMX yes (amx_bf16, ...); AVX-512 BF16 yes (...);
    VNNI ...; BF16 in PyTorch on this CPU: native.``; None for a result without them."""
    features = env.get("cpu_features")
    if features is None:
        return None if "cpu_features" not in env else "CPU features: /proc/cpuinfo not readable."

    def has(*names: str) -> str:
        found = [n for n in names if features.get(n)]
        return "yes (" + ", ".join(found) + ")" if found else "no"

    return (
        "CPU features (/proc/cpuinfo flags): AMX "
        + has("amx_bf16", "amx_int8", "amx_tile")
        + "; AVX-512 BF16 "
        + has("avx512_bf16")
        + "; VNNI (INT8 dot products) "
        + has("avx512_vnni", "avx_vnni")
        + f"; BF16 in PyTorch on this CPU: {'native' if env.get('cpu_bf16') else 'not native'}."
    )


def precision_rows(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): every variant of every CPU backend as its ratio to the same runtime's
    single FP32 model, one column per batch (the INT8 and BF16 rows beside the FP32 ones)."""
    batches: list[str] = []
    rows: list[list[str]] = []
    for measured in result["results"].values():
        for batch in measured:
            if batch not in batches:
                batches.append(batch)
    for backend, measured in result["results"].items():
        first = next(iter(measured.values()), {})
        if not any("ratio_vs_fp32_single" in row for row in first.values()):
            continue
        for variant in first:
            cells = [
                _fmt(measured.get(b, {}).get(variant, {}).get("ratio_vs_fp32_single"))
                for b in batches
            ]
            rows.append([backend, variant, *cells])
    return ["backend", "variant", *[f"batch {b}" for b in batches]], rows


def _top_float_ops(breakdown: Mapping[str, Any], count: int = 5) -> str:
    ops = [o for o in breakdown.get("ops", []) if o["precision"] == "float"][:count]
    return ", ".join(f"{o['op']} {o['share']:.0%}" for o in ops) or "none"


def profile_rows(profile: Mapping[str, Any]) -> list[list[str]]:
    """One row per profiled INT8 graph: kernel ms per run, share in INT8 / float / Q-DQ, and
    the operators that stay in float (largest share first)."""
    rows = []
    for variant, b in profile.get("variants", {}).items():
        share = b["share_by_class"]
        rows.append(
            [
                variant,
                f"{b['kernel_ms']:.1f}",
                f"{share['int8']:.0%}",
                f"{share['float']:.0%}",
                f"{share['convert']:.0%}",
                _top_float_ops(b),
            ]
        )
    return rows


PROFILE_HEADER = ("variant", "kernel ms/run", "INT8", "float", "(de)quantize", "largest float ops")


def target_reasons(result: Mapping[str, Any], targets: Sequence[Mapping[str, Any]]) -> list[str]:
    """Why each missed INT8 target is missed, from the run's ONNX Runtime profile of the INT8
    graphs: one line per backend and variant (what stays in float, what converts)."""
    lines: list[str] = []
    seen: set[tuple[str, str, str]] = set()
    for entry in targets:
        if entry["passed"] is not False:
            continue
        backend, variant = entry["backend"], entry["variant"]
        gap = "FLOPs" in entry["target"]
        key = (backend, variant, "gap" if gap else "ratio")
        if key in seen:
            continue
        seen.add(key)
        missed = [
            str(e["batch"])
            for e in targets
            if e["backend"] == backend and e["target"] == entry["target"] and e["passed"] is False
        ]
        head = f"{backend} {entry['target']} (missed at batch {', '.join(missed)})"
        profile = result.get("backends", {}).get(backend, {}).get("profile")
        graphs = (profile or {}).get("variants", {})
        if variant not in graphs:
            lines.append(
                f"{head}: no ONNX Runtime profile of the INT8 {variant} graph in this run "
                "(--int8-profile-runs 0, or the variant not measured)"
            )
            continue
        own = graphs[variant]
        share = own["share_by_class"]
        runs = profile["runs"]
        where = f"profile at batch {profile['batch']}, {runs} run{'s' * (runs != 1)}"
        if gap and "single" in graphs:
            single = graphs["single"]
            s_share = single["share_by_class"]
            lines.append(
                f"{head}: float and (de)quantize kernels take "
                f"{share['float'] + share['convert']:.0%} of the INT8 {variant} graph's kernel "
                f"time against {s_share['float'] + s_share['convert']:.0%} of the INT8 single "
                f"model's ({own['kernel_ms']:.1f} against {single['kernel_ms']:.1f} ms per run; "
                f"largest float ops: {_top_float_ops(own)}); the FLOPs ratio counts matrix "
                f"products only, so that work is outside it ({where})"
            )
        else:
            lines.append(
                f"{head}: only {share['int8']:.0%} of the INT8 {variant} graph's kernel time "
                f"runs in INT8; {share['float']:.0%} stays in float ({_top_float_ops(own)}) and "
                f"{share['convert']:.0%} converts to and from INT8 ({where})"
            )
    return lines


def describe_run(result: Mapping[str, Any]) -> str:
    """One line: backbone, M, k, trunk, threads and rounds of a result."""
    c, m = result["config"], result["model"]
    text = (
        f"{c['backbone']}: M={c['members']}, k={c['heads_per_member']} heads/member "
        f"({'disjoint' if m['disjoint'] else 'overlapping'}), trunk {m['trunk_layers']} of "
        f"{m['num_layers']} layers, {c['threads']} threads, {c['rounds']} rounds "
        f"(+{c['warmup']} warm-up)"
    )
    if "seq_len" in m:
        text += f", {m['seq_len']} tokens"
    return text


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_report(
    result: Mapping[str, Any],
    claims: Sequence[Mapping[str, Any]] = (),
    command: str | None = None,
    targets: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The result as Markdown: the run, the machine, the table, skipped backends and claims;
    with INT8 or BF16 rows, their ratios to the FP32 single model, issue 27's ``targets``
    (:func:`hydra_deploy.bench.check.int8_targets`), why a missed one is missed and the INT8
    profiles."""
    env = result["environment"]
    gpu = env.get("gpu") or {}
    parts = [
        "# Latency: Hydra against one model and a deep ensemble",
        "",
        f"{describe_run(result)}.",
        "",
        f"Machine: {env.get('cpu_model')} ({env.get('cpu_count')} CPUs)"
        + (f", GPU {gpu['name']}" if gpu else "")
        + f"; torch {env['versions'].get('torch')}, "
        f"onnxruntime {env['versions'].get('onnxruntime')}; {result['created']}.",
        "",
    ]
    features = cpu_features_line(env)
    if features:
        parts += [features, ""]
    if command:
        parts += ["Reproduce:", "", "```", command, "```", ""]
    parts += [
        "ratio = median over rounds of (variant time / single time in the same round); "
        "ratio_fp32 = the same against the single FP32 model of the same runtime (torch, ort), "
        "timed in the same rounds; gap = ratio / FLOPs ratio.",
        "",
        markdown_table(TABLE_HEADER, table_rows(result)),
        "",
    ]
    for name, reason in result.get("skipped", {}).items():
        parts.append(f"- skipped {name}: {reason}")
    header, rows = precision_rows(result)
    if any(row[0] not in ("torch", "ort") for row in rows):
        parts += [
            "",
            "## INT8 and BF16 against the single FP32 model",
            "",
            "Each cell: median over rounds of (variant time / the same runtime's single FP32 "
            "time in the same round).",
            "",
        ]
        parts += _precision_notes(result)
        parts += ["", markdown_table(header, rows)]
    if targets:
        parts += ["", "## INT8 targets (issue 27)", ""]
        parts += [f"- {target_line(t)}" for t in targets]
        reasons = target_reasons(result, targets)
        if reasons:
            parts += ["", "Why (from the ONNX Runtime profile of the INT8 graphs below):", ""]
            parts += [f"- {line}" for line in reasons]
    for name, info in result.get("backends", {}).items():
        profile = info.get("profile")
        if not profile or not profile.get("variants"):
            continue
        parts += [
            "",
            f"### Where the INT8 time goes: {name}, batch {profile['batch']}",
            "",
            f"ONNX Runtime's profiler ({profile['runs']} run{'s' * (profile['runs'] != 1)} after "
            "1 warm-up): kernel time by "
            "the precision each operator runs in (by its input and output types; Q/DQ: "
            "conversions to and from INT8).",
            "",
            markdown_table(PROFILE_HEADER, profile_rows(profile)),
        ]
    if claims:
        parts += ["", "## Claims", ""]
        parts += [
            f"- {c['backend']} batch {c['batch']}: {c['claim']}: "
            f"{'PASS' if c['passed'] else 'FAIL'} ({c['detail']})"
            for c in claims
        ]
    return "\n".join(parts).rstrip() + "\n"


def _precision_notes(result: Mapping[str, Any]) -> list[str]:
    """One line per INT8 / BF16 backend: how it ran."""
    notes = []
    for name, info in result.get("backends", {}).items():
        int8 = info.get("int8")
        if int8:
            calibration = int8.get("calibration")
            notes.append(
                f"- {name}: ONNX Runtime, {int8['method']} INT8 ({int8['quantizer']})"
                + (f"; calibrated on {calibration}" if calibration else "; weights only, no data")
                + "."
            )
        elif info.get("autocast"):
            found = info.get("cpu_bf16_instructions") or []
            notes.append(
                f"- {name}: PyTorch eager under {info['autocast']} (FP32 weights cast on every "
                "forward); BF16 instructions: " + (", ".join(found) or "none") + "."
            )
    return notes


def require_matplotlib() -> None:
    if missing("matplotlib"):
        raise BenchError(
            missing_message(
                "matplotlib", purpose="the latency plot", extra_hint="or leave out --plot"
            )
        )


def plot_latency(result: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Latency against batch size, one panel per runtime (its INT8 / BF16 backends dashed and
    dotted beside its FP32 lines), one line per variant and backend (PNG, atomic)."""
    require_matplotlib()
    matplotlib.use("Agg")  # before pyplot's first use imports it
    backends = list(result["results"])
    if not backends:
        raise BenchError("nothing was measured, so there is nothing to plot")
    infos = result.get("backends", {})
    panels: dict[str, list[str]] = {}  # runtime -> its backends (FP32 first, then INT8 / BF16)
    for backend in backends:
        panels.setdefault(infos.get(backend, {}).get("timed_with", backend), []).append(backend)
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for axis, (runtime, members) in zip(axes[0], panels.items(), strict=True):
        colors: dict[str, Any] = {}
        for index, backend in enumerate(members):
            batches = result["results"][backend]
            xs = [int(b) for b in batches]
            for variant in next(iter(batches.values())):
                ys = [batches[b][variant]["median_ms"] for b in batches]
                label = variant if backend == runtime else f"{variant} ({backend})"
                (line,) = axis.plot(
                    xs,
                    ys,
                    marker="o",
                    markersize=3 if index else 5,
                    linestyle=styles[index % len(styles)],
                    color=colors.get(variant),
                    label=label,
                )
                colors.setdefault(variant, line.get_color())
        axis.set(
            title=" + ".join(members),
            xlabel="batch size",
            ylabel="median latency (ms)",
            xscale="log",
            yscale="log",
        )
        axis.set_xticks(xs, [str(x) for x in xs])
        axis.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        axis.yaxis.set_minor_formatter(ticker.NullFormatter())
        axis.xaxis.set_minor_formatter(ticker.NullFormatter())
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=6 if len(members) > 1 else 8)
    fig.suptitle(describe_run(result), fontsize=9)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".png", dir=out.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        plt.close(fig)
    return out
