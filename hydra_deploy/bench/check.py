"""Regression guard for latency: baselines of ratios, and the comparison against one.

A baseline holds, per backend, batch and variant, the latency ratio to the single model measured
on one kind of machine (never absolute times: they do not carry across machines or runs). A run
checked against it fails when a ratio is more than ``tolerance`` (relative) above the baseline's;
:func:`confirm` keeps, of a failed comparison, only what regresses again when re-measured
(:func:`hydra_deploy.bench.latency.check_run` does the re-measure).

Baseline file (``hydra-bench --write-baseline PATH``)::

    {"format": "hydra-bench-baseline/1", "created": "...", "backbone": "vit_s16", "members": 3,
     "heads_per_member": 2, "trunk_layers": 6, "img_size": null, "seq_len": null, "classes": null,
     "batches": [1, 2], "backends": ["torch", "ort"], "threads": 2,
     "tolerance": 0.5, "tolerance_note": "...", "command": "hydra-bench ...",
     "machine": {...}, "ratios": {"ort": {"1": {"hydra": 2.41, ...}, ...}, ...}}

This module needs no torch: it reads and compares JSON.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hydra_deploy.atomic import atomic_write_json
from hydra_deploy.bench import BenchError
from hydra_deploy.errors import counted

BASELINE_FORMAT = "hydra-bench-baseline/1"
DEFAULT_TOLERANCE = 0.15
#: Settings that change what a ratio means: a baseline for other values is refused.
CONFIG_KEYS = (
    "backbone",
    "members",
    "heads_per_member",
    "trunk_layers",
    "img_size",
    "seq_len",
    "classes",
)
MACHINE_KEYS = ("cpu_model", "cpu_count", "platform", "python", "versions", "gpu")


# --------------------------------------------------------------------------------------------------
# baselines


def run_settings(result: Mapping[str, Any]) -> dict[str, Any]:
    """The CONFIG_KEYS of a result, with the values the run resolved (trunk layers, seq_len)."""
    config, model = result["config"], result["model"]
    return {
        "backbone": config["backbone"],
        "members": config["members"],
        "heads_per_member": config["heads_per_member"],
        "trunk_layers": model["trunk_layers"],
        "img_size": config.get("img_size"),
        "seq_len": model.get("seq_len"),
        "classes": config.get("classes"),
    }


def ratios_of(result: Mapping[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """{backend: {batch: {variant: ratio to single}}} of a result (``single`` left out)."""
    return {
        backend: {
            batch: {name: row["ratio_vs_single"] for name, row in rows.items() if name != "single"}
            for batch, rows in batches.items()
        }
        for backend, batches in result["results"].items()
    }


def make_baseline(
    result: Mapping[str, Any],
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    tolerance_note: str | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """A baseline of ``result``'s ratios, with the run's settings, machine and a tolerance."""
    check_tolerance(tolerance)
    env = result["environment"]
    return {
        "format": BASELINE_FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **run_settings(result),
        "batches": [int(b) for b in result["config"]["batches"]],
        "backends": list(result["results"]),
        "threads": result["config"]["threads"],
        "rounds": result["config"]["rounds"],
        "tolerance": tolerance,
        "tolerance_note": tolerance_note
        or f"a ratio more than {tolerance:.0%} above the baseline's is a regression",
        "command": command,
        "machine": {key: env.get(key) for key in MACHINE_KEYS},
        "ratios": ratios_of(result),
    }


def write_baseline(path: str | os.PathLike, baseline: Mapping[str, Any]) -> None:
    try:
        atomic_write_json(path, baseline)
    except OSError as err:
        raise BenchError(f"cannot write the baseline {str(path)!r}: {err}") from err


def load_baseline(path: str | os.PathLike) -> dict[str, Any]:
    """Read a baseline file; BenchError when it is missing, not JSON or not a baseline."""
    path = Path(path)
    if not path.is_file():
        raise BenchError(
            f"baseline {str(path)!r} does not exist; write one with hydra-bench ... "
            "--write-baseline PATH (or see benchmarks/baselines/)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise BenchError(
            f"baseline {str(path)!r} is not a JSON file ({err}); rewrite it with hydra-bench ... "
            "--write-baseline PATH"
        ) from err
    if not isinstance(data, dict) or data.get("format") != BASELINE_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise BenchError(
            f"{str(path)!r} is not a hydra-bench baseline (format {found!r}, expected "
            f"{BASELINE_FORMAT!r}); write one with hydra-bench ... --write-baseline PATH"
        )
    missing = [
        key for key in ("backbone", "members", "heads_per_member", "ratios") if key not in data
    ]
    if missing or not isinstance(data["ratios"], dict):
        raise BenchError(
            f"baseline {str(path)!r} lacks {', '.join(missing) or 'a ratios table'}; rewrite it "
            "with hydra-bench ... --write-baseline PATH"
        )
    return data


def check_tolerance(tolerance: float) -> float:
    if not isinstance(tolerance, (int, float)) or not 0 < tolerance < 10:
        raise BenchError(f"the tolerance must be a fraction > 0 (0.15 = 15%), got {tolerance!r}")
    return float(tolerance)


def refuse_mismatch(baseline: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
    """BenchError when the baseline was measured with other settings than ``settings``.

    A setting that is None in ``settings`` (not known before the run) is not compared.
    """
    wrong = [
        f"{key} {settings[key]!r} (baseline: {baseline.get(key)!r})"
        for key in CONFIG_KEYS
        if settings.get(key) is not None and key in baseline and baseline[key] != settings[key]
    ]
    if wrong:
        flags = " ".join(
            f"--{key.replace('_', '-')} {baseline[key]}"
            for key in CONFIG_KEYS
            if baseline.get(key) is not None
        )
        raise BenchError(
            f"the baseline was measured with other settings: {'; '.join(wrong)}; run with the "
            f"baseline's settings ({flags}) or write a new baseline with --write-baseline"
        )


# --------------------------------------------------------------------------------------------------
# comparison


@dataclass(frozen=True)
class Finding:
    backend: str
    batch: str
    variant: str
    ratio: float
    baseline: float

    @property
    def change(self) -> float:
        """Relative change of the ratio against the baseline (+0.2: 20% slower relative to single)."""
        return self.ratio / self.baseline - 1.0

    def line(self, kind: str, tolerance: float) -> str:
        return (
            f"{kind}: {self.backend} batch {self.batch} {self.variant}: ratio {self.ratio:.3f} "
            f"vs baseline {self.baseline:.3f} ({self.change:+.1%}, tolerance {tolerance:.0%})"
        )


@dataclass
class CheckReport:
    """Every baseline entry sorted into regressions, improvements, within tolerance and not
    checked (not measured in this run); entries measured now but absent from the baseline too."""

    tolerance: float
    regressions: list[Finding] = field(default_factory=list)
    improvements: list[Finding] = field(default_factory=list)
    within: list[Finding] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    not_in_baseline: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: One line per regression re-measured (see :func:`confirm`): both ratios and the verdict.
    remeasured: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.regressions

    def lines(self) -> list[str]:
        out = [f.line("REGRESSION", self.tolerance) for f in self.regressions]
        out += [f.line("improvement", self.tolerance) for f in self.improvements]
        out += [
            f"not checked: {entry} (in the baseline, not measured now)"
            for entry in self.not_checked
        ]
        out += [f"not in baseline: {entry}" for entry in self.not_in_baseline]
        out += [f"re-measured: {entry}" for entry in self.remeasured]
        out += [f"note: {note}" for note in self.notes]
        verdict = "FAILED" if self.regressions else "passed"
        out.append(
            f"check {verdict}: {counted(len(self.regressions), 'regression')}, "
            f"{counted(len(self.improvements), 'improvement')}, {len(self.within)} within {self.tolerance:.0%}, "
            f"{len(self.not_checked)} not checked"
        )
        return out

    def to_dict(self) -> dict[str, Any]:
        def rows(items: Sequence[Finding]) -> list[dict[str, Any]]:
            return [
                {
                    "backend": f.backend,
                    "batch": f.batch,
                    "variant": f.variant,
                    "ratio": f.ratio,
                    "baseline": f.baseline,
                    "change": f.change,
                }
                for f in items
            ]

        return {
            "passed": self.passed,
            "tolerance": self.tolerance,
            "regressions": rows(self.regressions),
            "improvements": rows(self.improvements),
            "within": rows(self.within),
            "not_checked": self.not_checked,
            "not_in_baseline": self.not_in_baseline,
            "remeasured": self.remeasured,
            "notes": self.notes,
        }


def compare(
    result: Mapping[str, Any], baseline: Mapping[str, Any], tolerance: float | None = None
) -> CheckReport:
    """Compare a run's ratios with a baseline's (``tolerance`` None: the baseline's, else 0.15).

    A ratio above ``baseline * (1 + tolerance)`` is a regression; below
    ``baseline * (1 - tolerance)`` an improvement (refresh the baseline to keep it). Raises
    BenchError when the baseline was measured with other settings.
    """
    refuse_mismatch(baseline, run_settings(result))
    tolerance = check_tolerance(
        tolerance if tolerance is not None else baseline.get("tolerance", DEFAULT_TOLERANCE)
    )
    report = CheckReport(tolerance)
    now = ratios_of(result)
    for backend, batches in baseline["ratios"].items():
        for batch, variants in batches.items():
            for variant, expected in variants.items():
                measured = now.get(backend, {}).get(str(batch), {}).get(variant)
                if measured is None:
                    report.not_checked.append(f"{backend} batch {batch} {variant}")
                    continue
                finding = Finding(backend, str(batch), variant, measured, float(expected))
                if measured > expected * (1 + tolerance):
                    report.regressions.append(finding)
                elif measured < expected * (1 - tolerance):
                    report.improvements.append(finding)
                else:
                    report.within.append(finding)
    for backend, batches in now.items():
        for batch, variants in batches.items():
            for variant in variants:
                if variant not in baseline["ratios"].get(backend, {}).get(batch, {}):
                    report.not_in_baseline.append(f"{backend} batch {batch} {variant}")
    threads = baseline.get("threads")
    if threads is not None and threads != result["config"]["threads"]:
        report.notes.append(
            f"the baseline ran with {threads} threads, this run with "
            f"{result['config']['threads']}; ratios can shift with threads"
        )
    return report


def failed_entries(report: CheckReport) -> dict[str, set[str]]:
    """What a re-measure of ``report``'s regressions must time: {"backends", "batches",
    "variants"}, each the set of names (batches as text) that regressed."""
    return {
        "backends": {f.backend for f in report.regressions},
        "batches": {f.batch for f in report.regressions},
        "variants": {f.variant for f in report.regressions},
    }


def confirm(first: CheckReport, again: CheckReport) -> CheckReport:
    """The verdict after re-measuring ``first``'s regressions (``again``: the re-measured run
    compared with the same baseline): an entry stays a regression only when it regressed in both
    runs; one that passed on re-measuring is sorted by its new ratio. Either way both ratios are
    kept in ``remeasured``. One machine hiccup during a run (another job starting) then cannot
    fail the check, and a real regression, slower in every run, still does.
    """

    def key(f: Finding) -> tuple[str, str, str]:
        return f.backend, f.batch, f.variant

    verdicts = {
        key(f): (f, kind)
        for kind, found in (
            ("regression", again.regressions),
            ("improvement", again.improvements),
            ("within", again.within),
        )
        for f in found
    }
    out = CheckReport(
        first.tolerance,
        improvements=list(first.improvements),
        within=list(first.within),
        not_checked=list(first.not_checked),
        not_in_baseline=list(first.not_in_baseline),
        notes=list(first.notes),
    )
    for f in first.regressions:
        where = f"{f.backend} batch {f.batch} {f.variant}"
        if key(f) not in verdicts:
            out.regressions.append(f)
            out.remeasured.append(f"{where}: ratio {f.ratio:.3f}, not measured again")
            continue
        g, kind = verdicts[key(f)]
        {"regression": out.regressions, "improvement": out.improvements, "within": out.within}[
            kind
        ].append(g)
        verdict = "a regression again" if kind == "regression" else "passed"
        out.remeasured.append(
            f"{where}: ratio {f.ratio:.3f}, then {g.ratio:.3f} (baseline {f.baseline:.3f}, "
            f"limit {f.baseline * (1 + first.tolerance):.3f}): {verdict}"
        )
    return out


# --------------------------------------------------------------------------------------------------
# the claims


def claims(
    result: Mapping[str, Any], *, max_gap: float = 1.10, gap_batch: int = 8
) -> list[dict[str, Any]]:
    """The latency claims, per backend and batch, from one result's ratios:

    - ``hydra gap <= max_gap`` (at ``gap_batch`` only): Hydra's latency ratio is at most
      ``max_gap`` x its FLOPs ratio;
    - ``hydra < deep ensemble``: Hydra's ratio is below the faster deep ensemble's
      (sequential or batched, whichever was measured and is faster);
    - ``hydra_trunk < hydra``: the shared trunk is faster than plain Hydra.
    """
    out: list[dict[str, Any]] = []
    for backend, batches in result["results"].items():
        for batch, rows in batches.items():
            out += _batch_claims(backend, batch, rows, max_gap, gap_batch)
    return out


def _batch_claims(
    backend: str, batch: str, rows: Mapping[str, Any], max_gap: float, gap_batch: int
) -> list[dict[str, Any]]:
    def claim(text: str, passed: bool, detail: str) -> dict[str, Any]:
        return {
            "backend": backend,
            "batch": int(batch),
            "claim": text,
            "passed": bool(passed),
            "detail": detail,
        }

    out: list[dict[str, Any]] = []
    hydra = rows.get("hydra")
    if hydra is None:
        return out
    if int(batch) == gap_batch:
        out.append(
            claim(
                f"hydra gap <= {max_gap:g}",
                hydra["gap"] <= max_gap,
                f"ratio {hydra['ratio_vs_single']:.3f} / FLOPs ratio "
                f"{hydra['flops_ratio']:.3f} = {hydra['gap']:.3f}",
            )
        )
    ensembles = {n: rows[n] for n in ("deep_ensemble_seq", "deep_ensemble_batched") if n in rows}
    if ensembles:
        name, best = min(ensembles.items(), key=lambda kv: kv[1]["ratio_vs_single"])
        out.append(
            claim(
                "hydra < deep ensemble",
                hydra["ratio_vs_single"] < best["ratio_vs_single"],
                f"{hydra['ratio_vs_single']:.3f} vs {name} {best['ratio_vs_single']:.3f}",
            )
        )
    trunk = rows.get("hydra_trunk")
    if trunk is not None:
        out.append(
            claim(
                "hydra_trunk < hydra",
                trunk["ratio_vs_single"] < hydra["ratio_vs_single"],
                f"{trunk['ratio_vs_single']:.3f} vs {hydra['ratio_vs_single']:.3f}",
            )
        )
    return out


# --------------------------------------------------------------------------------------------------
# issue 27's INT8 targets

#: Batches the INT8 targets are stated at.
INT8_TARGET_BATCHES = (1, 8, 16)


def int8_backends(result: Mapping[str, Any]) -> list[str]:
    """The result's INT8 backends (``ort-int8-dynamic``, ``ort-int8-static``), as measured."""
    infos = result.get("backends", {})
    return [
        name
        for name in result["results"]
        if str(infos.get(name, {}).get("precision", "")).startswith("int8")
    ]


def int8_targets(
    result: Mapping[str, Any],
    *,
    batches: Sequence[int] = INT8_TARGET_BATCHES,
    hydra_max: float = 0.8,
    ensemble_max: float = 1.0,
    max_gap: float = 1.05,
) -> list[dict[str, Any]]:
    """Issue 27's latency targets, per INT8 backend and batch, from one result's ratios:

    - ``hydra INT8 <= hydra_max x single FP32``: ``ratio_vs_fp32_single`` of the INT8 ``hydra``
      row (the same runtime's single FP32 model, timed in the same rounds);
    - ``fused_deep_ensemble INT8 <= ensemble_max x single FP32``: the same for the fused deep
      ensemble (each member pruned to its heads, per-member MLPs);
    - ``hydra INT8 / single INT8 <= max_gap x FLOPs ratio``: the INT8 ``hydra`` row's ``gap``.

    Each entry: backend, batch, target, variant, value, limit, passed (None: the batch or the
    variant was not measured), missed_by (value - limit where missed) and a one-line detail.
    """
    out: list[dict[str, Any]] = []
    checks = (
        ("hydra", f"hydra INT8 <= {hydra_max:g} x single FP32", "ratio_vs_fp32_single", hydra_max),
        (
            "fused_deep_ensemble",
            f"fused_deep_ensemble INT8 <= {ensemble_max:g} x single FP32",
            "ratio_vs_fp32_single",
            ensemble_max,
        ),
        ("hydra", f"hydra INT8 / single INT8 <= {max_gap:g} x FLOPs ratio", "gap", max_gap),
    )
    for backend in int8_backends(result):
        measured = result["results"][backend]
        for batch in batches:
            rows = measured.get(str(batch))
            for variant, target, key, limit in checks:
                entry: dict[str, Any] = {
                    "backend": backend,
                    "batch": int(batch),
                    "target": target,
                    "variant": variant,
                    "limit": limit,
                    "value": None,
                    "passed": None,
                    "missed_by": None,
                }
                row = None if rows is None else rows.get(variant)
                if row is None or row.get(key) is None:
                    what = f"batch {batch}" if rows is None else f"{variant} at batch {batch}"
                    entry["detail"] = f"not measured ({what} is not in this run)"
                    out.append(entry)
                    continue
                value = float(row[key])
                entry.update(value=value, passed=value <= limit)
                if key == "gap":
                    detail = (
                        f"ratio {row['ratio_vs_single']:.3f} / FLOPs ratio "
                        f"{row['flops_ratio']:.3f} = {value:.3f}"
                    )
                else:
                    detail = f"{value:.3f} x the single FP32 model"
                if not entry["passed"]:
                    entry["missed_by"] = value - limit
                    detail += f"; missed by {value - limit:.3f} ({value / limit - 1:+.1%})"
                entry["detail"] = detail
                out.append(entry)
    return out


def target_line(entry: Mapping[str, Any]) -> str:
    """``ort-int8-static batch 8: hydra INT8 <= 0.8 x single FP32: PASS (0.712 x ...)``."""
    verdict = {True: "PASS", False: "FAIL", None: "NOT MEASURED"}[entry["passed"]]
    return f"{entry['backend']} batch {entry['batch']}: {entry['target']}: {verdict} ({entry['detail']})"
