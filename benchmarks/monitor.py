"""The drift monitor on the uncertainty benchmarks' stored logits (issue 37): false alarms, delays,
label-free accuracy.

For each task (digits, WordNet), seed and row of ``benchmarks/results/uq_<task>/logits.npz``, the
in-distribution test set is split at random (seeded by seed) into a temperature part (T fitted on
it), a reference part (the quantile part ``hydra-calibrate`` would keep: the monitor's reference of
OOD scores, the calibrated max-probability negated) and a stream pool (the rest). Then:

- **false alarms**: ``--null-streams`` random orders of the whole stream pool, without repetition
  (exchangeable with the reference): the share of streams whose martingale ever reaches
  1 / alpha; and a synthetic null of ``--null-steps`` steps (Gaussian scores, 1000 reference);
- **delays**: ``--delay-streams`` streams of 100 pool inputs, then the switch to the shifted copies
  (of examples outside the temperature part, each once) or to inputs that are OOD with a chance of
  5%, 20% or 100% (OOD examples drawn from the task's OOD sets, each once per stream; the
  in-distribution ones from the pool, with repetition, since the pool is too small for 900 steps),
  for up to ``--horizon`` inputs: the median and 90th percentile of the inputs between the switch
  and the alarm, the share of streams with no alarm in the horizon, and the share that alarmed
  before the switch;
- **label-free accuracy**: on the shifted copies, |mean calibrated confidence - accuracy|.

Both betting rules of :mod:`hydra_deploy.monitor` run on the same streams: ``jumper`` (Simple
Jumper: the issue's reference monitor) and ``mixture``. Everything is the library's: T
(:func:`~hydra_deploy.decisions.fit_temperature`), the scores, the p-values
(:func:`~hydra_deploy.monitor.pvalues.stream_pvalues`) and the bettors.

    .venv/bin/python benchmarks/monitor.py --task digits      # about 5 min on one core
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from hydra_deploy.atomic import atomic_write_json, atomic_write_text
from hydra_deploy.decisions import calibrated_scores, fit_temperature
from hydra_deploy.monitor.betting import betting_rule
from hydra_deploy.monitor.pvalues import stream_pvalues
from hydra_deploy.uncertainty.metrics import ood_score

RESULTS = Path(__file__).resolve().parent / "results"
RULES = ("jumper", "mixture")
ALPHA = 0.05
TEMPERATURE_PART = 200
REFERENCE_PART = 200
BEFORE_SWITCH = 100
OOD_SHARES = (0.05, 0.2, 1.0)
SCORE = "msp"  # the OOD rule's default score


def first_alarms(pvalues: np.ndarray, rule: str, alpha: float = ALPHA) -> np.ndarray:
    """Per stream, the index of the first input whose martingale reaches 1 / alpha (-1: none)."""
    streams, steps = pvalues.shape
    bettor = betting_rule(rule, streams=(streams,))
    first = np.full(streams, -1)
    level = -math.log(alpha)
    for t in range(steps):
        bettor.bet(pvalues[:, t])
        crossed = (np.asarray(bettor.log_wealth) >= level) & (first < 0)
        first[crossed] = t
    return first


def _uniforms(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    return 1.0 - rng.random(shape)  # (0, 1], as the monitor draws


def _scores(logits: np.ndarray, temperature: float) -> dict[str, np.ndarray]:
    scores = calibrated_scores(logits.astype(np.float64), temperature)
    return {"ood": ood_score(scores, SCORE), "msp": scores["msp"], "pred": scores["prediction"]}


def false_alarms(reference: np.ndarray, pool: np.ndarray, streams: int, seed: int) -> dict:
    rng = np.random.default_rng([seed, 1])
    orders = np.stack([pool[rng.permutation(pool.size)] for _ in range(streams)])
    pvalues = stream_pvalues(reference, orders, _uniforms(rng, orders.shape))
    return {rule: float(np.mean(first_alarms(pvalues, rule) >= 0)) for rule in RULES}


def _order_statistic(values: np.ndarray, q: float) -> float | None:
    """The q-quantile as an order statistic (no interpolation); None when empty or no alarm."""
    if not values.size:
        return None
    value = float(np.quantile(values, q, method="inverted_cdf"))
    return value if math.isfinite(value) else None


def _delay_summary(first: np.ndarray, horizon: int) -> dict[str, Any]:
    early = first >= 0
    early &= first < BEFORE_SWITCH
    late = first >= BEFORE_SWITCH
    delays = np.where(late, first - BEFORE_SWITCH + 1, np.inf)[~early]
    return {
        "median": _order_statistic(delays, 0.5),
        "p90": _order_statistic(delays, 0.9),
        "no_alarm": float(np.mean(~np.isfinite(delays))) if delays.size else None,
        "before_switch": float(np.mean(early)),
        "horizon": horizon,
    }


def delays(
    reference: np.ndarray,
    pool: np.ndarray,
    after: dict[str, Any],
    streams: int,
    horizon: int,
    seed: int,
) -> dict[str, dict[str, Any]]:
    """Delays per scenario and rule (see the module's docstring)."""
    rng = np.random.default_rng([seed, 2])
    out: dict[str, dict[str, Any]] = {}
    ood = after["ood"]
    scenarios: dict[str, Any] = {"shift": None, **{f"ood {q:g}": q for q in OOD_SHARES}}
    for name, share in scenarios.items():
        steps = min(horizon, after["shift"].size if share is None else horizon)
        if share is not None and share == 1.0:
            steps = min(horizon, ood.size)
        rows = []
        for _ in range(streams):
            head = pool[rng.permutation(pool.size)[:BEFORE_SWITCH]]
            if share is None:
                tail = after["shift"][rng.permutation(after["shift"].size)[:steps]]
            else:
                is_ood = rng.random(steps) < share
                tail = pool[rng.integers(0, pool.size, size=steps)]
                picks = ood[rng.permutation(ood.size)]
                tail[is_ood] = picks[np.arange(int(is_ood.sum())) % ood.size]
            rows.append(np.concatenate([head, tail]))
        stack = np.stack(rows)
        pvalues = stream_pvalues(reference, stack, _uniforms(rng, stack.shape))
        out[name] = {rule: _delay_summary(first_alarms(pvalues, rule), steps) for rule in RULES}
    return out


def one_row(data: Any, seed: int, row: str, args: argparse.Namespace) -> dict[str, Any]:
    labels = data["labels/id"]
    logits = data[f"{seed}/{row}/id"]
    rng = np.random.default_rng([2037, seed])
    order = rng.permutation(labels.size)
    t_part = order[:TEMPERATURE_PART]
    ref_part = order[TEMPERATURE_PART : TEMPERATURE_PART + REFERENCE_PART]
    pool_part = order[TEMPERATURE_PART + REFERENCE_PART :]
    temperature = fit_temperature(logits[t_part].astype(np.float64), labels[t_part])
    id_scores = _scores(logits, temperature)
    shift_labels = data["labels/shift"]
    keep = np.setdiff1d(np.arange(shift_labels.size), t_part)  # copies of examples outside T
    shift = _scores(data[f"{seed}/{row}/shift"][keep], temperature)
    oods = [k for k in data.files if k.startswith(f"{seed}/{row}/ood:")]
    ood = np.concatenate([_scores(data[k], temperature)["ood"] for k in oods])
    reference, pool = id_scores["ood"][ref_part], id_scores["ood"][pool_part]
    accuracy = float(np.mean(shift["pred"] == shift_labels[keep]))
    return {
        "temperature": temperature,
        "false_alarms": false_alarms(reference, pool, args.null_streams, seed),
        "delays": delays(
            reference,
            pool,
            {"shift": shift["ood"], "ood": ood},
            args.delay_streams,
            args.horizon,
            seed,
        ),
        "shift_accuracy": accuracy,
        "shift_confidence": float(np.mean(shift["msp"])),
        "estimate_error": abs(float(np.mean(shift["msp"])) - accuracy),
    }


def synthetic_null(streams: int, steps: int) -> dict[str, float]:
    rng = np.random.default_rng(37)
    reference = rng.normal(size=1000)
    scores = rng.normal(size=(streams, steps))
    pvalues = stream_pvalues(reference, scores, _uniforms(rng, scores.shape))
    return {rule: float(np.mean(first_alarms(pvalues, rule) >= 0)) for rule in RULES}


def _fmt(value: Any) -> str:
    if value is None:
        return "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def report(task: str, results: dict[str, Any]) -> str:
    lines = [
        f"# The drift monitor on {task}",
        "",
        "Written by `benchmarks/monitor.py` from the stored logits (see its docstring for the "
        f"protocol). Alarm at 1/alpha = {1 / ALPHA:g}.",
        "",
        f"Synthetic null ({results['settings']['null_steps']} steps, "
        f"{results['settings']['synthetic_streams']} streams): "
        + ", ".join(f"{rule} {results['synthetic_null'][rule]:.2%}" for rule in RULES),
        "",
        "## False alarms on in-distribution streams (share of streams, per seed)",
        "",
        "| row | " + " | ".join(RULES) + " |",
        "|---|" + "---|" * len(RULES),
    ]
    rows = results["rows"]
    for row, seeds in rows.items():
        cells = [" / ".join(f"{s['false_alarms'][r]:.1%}" for s in seeds.values()) for r in RULES]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    scenarios = list(next(iter(next(iter(rows.values())).values()))["delays"])
    for scenario in scenarios:
        lines += [
            "",
            f"## Delay after the switch to {scenario} (median / 90th percentile inputs; "
            "no alarm in the horizon; per seed)",
            "",
            "| row | " + " | ".join(RULES) + " |",
            "|---|" + "---|" * len(RULES),
        ]
        for row, seeds in rows.items():
            cells = []
            for rule in RULES:
                parts = []
                for s in seeds.values():
                    d = s["delays"][scenario][rule]
                    parts.append(
                        f"{_fmt(d['median'])}/{_fmt(d['p90'])}"
                        + (f" ({d['no_alarm']:.0%} none)" if d["no_alarm"] else "")
                    )
                cells.append("; ".join(parts))
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Label-free accuracy on the shifted copies: |mean calibrated confidence - accuracy|",
        "",
        "| row | per seed (points) |",
        "|---|---|",
    ]
    for row, seeds in rows.items():
        cells = " / ".join(f"{100 * s['estimate_error']:.1f}" for s in seeds.values())
        lines.append(f"| {row} | {cells} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--task", choices=("digits", "wordnet"), required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rows", nargs="+", default=None, help="rows of the logits file (default all)")
    p.add_argument("--null-streams", type=int, default=1000)
    p.add_argument("--delay-streams", type=int, default=200)
    p.add_argument("--horizon", type=int, default=900)
    p.add_argument("--null-steps", type=int, default=20_000)
    p.add_argument("--synthetic-streams", type=int, default=1000)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    source = RESULTS / f"uq_{args.task}" / "logits.npz"
    data = np.load(source)
    rows = args.rows or sorted(
        {k.split("/")[1] for k in data.files if k.split("/")[0].isdigit()},
        key=lambda r: [k.split("/")[1] for k in data.files].index(r),
    )
    started = time.perf_counter()
    results: dict[str, Any] = {
        "task": args.task,
        "settings": {**{k: v for k, v in vars(args).items() if k != "out"}, "alpha": ALPHA},
        "synthetic_null": synthetic_null(args.synthetic_streams, args.null_steps),
        "rows": {},
    }
    for row in rows:
        results["rows"][row] = {str(s): one_row(data, s, row, args) for s in args.seeds}
        print(f"{row}: done at {time.perf_counter() - started:.0f} s", flush=True)
    results["seconds"] = time.perf_counter() - started
    results["settings"]["rows"] = rows
    out = args.out or RESULTS / f"monitor_{args.task}"
    atomic_write_json(out / "results.json", results)
    atomic_write_text(out / "report.md", report(args.task, results))
    print(report(args.task, results))
    print(json.dumps({"seconds": round(results["seconds"])}))


if __name__ == "__main__":
    main()
