"""A result as a table, as Markdown and as a plot of latency against batch size."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra_deploy.bench import BenchError
from hydra_deploy.optional import missing, missing_message

TABLE_HEADER = (
    "backend",
    "batch",
    "variant",
    "median_ms",
    "IQR_ms",
    "min-max_ms",
    "ratio",
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
                        f"{r['flops_ratio']:.3f}",
                        f"{r['gap']:.3f}",
                        f"{r['macs_per_example'] / 1e9:.3g}",
                        f"{r['gmacs_per_s']:.3g}",
                    ]
                )
    return rows


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
    result: Mapping[str, Any], claims: Sequence[Mapping[str, Any]] = (), command: str | None = None
) -> str:
    """The result as Markdown: the run, the machine, the table, skipped backends and claims."""
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
    if command:
        parts += ["Reproduce:", "", "```", command, "```", ""]
    parts += [
        "ratio = median over rounds of (variant time / single time in the same round); "
        "gap = ratio / FLOPs ratio.",
        "",
        markdown_table(TABLE_HEADER, table_rows(result)),
        "",
    ]
    for name, reason in result.get("skipped", {}).items():
        parts.append(f"- skipped {name}: {reason}")
    if claims:
        parts += ["", "## Claims", ""]
        parts += [
            f"- {c['backend']} batch {c['batch']}: {c['claim']}: "
            f"{'PASS' if c['passed'] else 'FAIL'} ({c['detail']})"
            for c in claims
        ]
    return "\n".join(parts).rstrip() + "\n"


def require_matplotlib() -> None:
    if missing("matplotlib"):
        raise BenchError(
            missing_message(
                "matplotlib", purpose="the latency plot", extra_hint="or leave out --plot"
            )
        )


def plot_latency(result: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Latency against batch size, one panel per backend, one line per variant (PNG, atomic)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    backends = list(result["results"])
    if not backends:
        raise BenchError("nothing was measured, so there is nothing to plot")
    fig, axes = plt.subplots(1, len(backends), figsize=(5.5 * len(backends), 4.2), squeeze=False)
    for axis, backend in zip(axes[0], backends, strict=True):
        batches = result["results"][backend]
        xs = [int(b) for b in batches]
        for variant in next(iter(batches.values())):
            ys = [batches[b][variant]["median_ms"] for b in batches]
            axis.plot(xs, ys, marker="o", label=variant)
        axis.set(
            title=backend,
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
        axis.legend(fontsize=8)
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
