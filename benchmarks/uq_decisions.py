"""The uncertainty benchmarks' decisions, recomputed from the stored member logits: temperature
scaling, prediction sets, answer-or-abstain and the OOD flag (every rule from
``hydra_deploy.decisions``) over random splits of the in-distribution test set."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from uq_rows import set_path
from uq_task import ROWS, Recipe, Task

from hydra_deploy.atomic import atomic_path
from hydra_deploy.decisions import (
    accept_mask,
    calibrated_scores,
    class_room,
    conformal_quantile,
    fit_ood,
    fit_raps,
    fit_selective,
    fit_temperature,
    ood_mask,
    selective_grid,
    selective_start,
    set_members,
)
from hydra_deploy.errors import DataError
from hydra_deploy.uncertainty.metrics import (
    ece,
    nll,
    ood_metrics,
)

#: the levels of the prediction sets (coverage 1 - alpha)
ALPHAS = (0.01, 0.02, 0.05, 0.1)
SET_METHODS = ("lac", "aps", "raps")
#: answer or abstain: the selective risk certified (the claims' and the tables'), the other risks
#: measured beside it, and the chance it is allowed to fail
TARGET_RISK = 0.05
OTHER_RISKS = (0.1,)
DELTA = 0.1
#: the OOD flag: at most this share of in-distribution inputs flagged
OOD_ALPHA = 0.05
#: the coverages at which the risk-coverage curve is read
CURVE_COVERAGE = tuple(round(0.05 * i, 2) for i in range(1, 21))
#: the splits' random generator is seeded by (SPLIT_SEED, seed)
SPLIT_SEED = 2025
LOGITS_FILE = "logits.npz"


def alpha_key(alpha: float) -> str:
    return f"{alpha:g}"


def split_parts(
    count: int, recipe: Recipe, seed: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``recipe.splits`` random (temperature rows, quantile rows, tested rows) of ``count``
    in-distribution test examples, the same for every row of a seed (paired comparisons)."""
    t, q = recipe.calibration_temperature, recipe.calibration_quantile
    if t < 1 or q < 1 or count - t - q < 1:
        raise ValueError(
            f"the in-distribution test set ({count} examples) cannot be split into a temperature "
            f"part of {t}, a quantile part of {q} and a tested part of at least one example"
        )
    rng = np.random.default_rng([SPLIT_SEED, seed])
    parts = []
    for _ in range(recipe.splits):
        order = rng.permutation(count)
        parts.append((np.sort(order[:t]), np.sort(order[t : t + q]), np.sort(order[t + q :])))
    return parts


def _sets(
    room: np.ndarray,
    top: np.ndarray,
    method: str,
    qhat: float,
    rows: np.ndarray | slice = slice(None),
) -> np.ndarray:
    """The library's sets (:func:`~hydra_deploy.decisions.set_members`) of ``rows`` from a class
    room computed once per split."""
    return set_members(room[rows], qhat, None if method == "lac" else top[rows])


def certify(
    confidence: np.ndarray,
    correct: np.ndarray,
    grid: np.ndarray,
    start: int,
    target_risk: float = TARGET_RISK,
    procedure: str = "graph",
) -> float | None:
    """:func:`~hydra_deploy.decisions.fit_selective`'s threshold at ``target_risk`` and DELTA
    (the library's default procedure, started at ``start``, or ``procedure``), or None where it
    refuses."""
    try:
        tau, _ = fit_selective(
            confidence, correct, grid, target_risk, DELTA, start=start, procedure=procedure
        )
    except DataError:
        return None
    return tau


def _risk_curve(confidence: np.ndarray, errors: np.ndarray) -> list[float]:
    """Selective risk of the most confident ``c`` share, at each coverage of CURVE_COVERAGE."""
    order = np.argsort(-confidence, kind="stable")
    cumulative = np.cumsum(errors[order])
    answered = np.maximum(1, np.ceil(np.asarray(CURVE_COVERAGE) * len(order) - 1e-9).astype(int))
    return [float(v) for v in cumulative[answered - 1] / answered]


def decide_row(
    logits: dict[str, np.ndarray],
    labels: np.ndarray,
    parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
    seed: int = 0,
) -> dict[str, Any]:
    """Temperature scaling and every decision of :mod:`hydra_deploy.decisions` for one row of one
    seed, over the random splits ``parts`` of the in-distribution test set.

    ``logits``: member logits per evaluation set (``id``, ``shift`` aligned with the first
    ``len(shift)`` ID examples, ``ood:<name>``). Per split: T fitted on the temperature part
    (:func:`fit_temperature`); RAPS's parameters and the selective grid on it too; every quantile
    (set thresholds per method and alpha, the selective threshold at TARGET_RISK and DELTA, the
    OOD threshold at OOD_ALPHA) on the quantile part; every metric on the tested part, on the
    shifted copies of the tested examples and on the OOD sets. Returns the means over splits
    (and the spread over splits of the coverages); an alpha too small for the quantile part is
    reported ``available: False`` with the reason."""
    y = np.asarray(labels, dtype=np.int64)
    shift_count = len(logits["shift"])
    oods = [k for k in logits if k.startswith("ood:")]
    raw = {k: calibrated_scores(v, 1.0) for k, v in logits.items()}
    values: dict[tuple, list] = {}
    refused: dict[tuple, str] = {}

    def put(key: tuple, value: Any) -> None:
        values.setdefault(key, []).append(value)

    for index, (t, q, tested) in enumerate(parts):
        temperature = fit_temperature(logits["id"][t], y[t])
        put(("temperature",), temperature)
        cal = {k: calibrated_scores(v, temperature) for k, v in logits.items()}
        shifted = tested[tested < shift_count]
        ys = y[shifted]
        # temperature-scaled metrics beside the raw ones, on the tested part
        for tag, sc in (("raw", raw), ("scaled", cal)):
            for where, s_id, rows, yy in (
                ("test", sc["id"], tested, y[tested]),
                ("shift", sc["shift"], shifted, ys),
            ):
                probs = s_id["probs"][rows]
                put(
                    ("scaling", where, tag, "accuracy"),
                    float((s_id["prediction"][rows] == yy).mean()),
                )
                put(("scaling", where, tag, "nll"), nll(probs, yy))
                put(("scaling", where, tag, "ece"), ece(probs, yy))
            for k in oods:
                m = ood_metrics(-sc["id"]["msp"][tested], -sc[k]["msp"])
                for metric in ("auroc", "fpr95"):
                    put(("scaling", "ood", k[4:], tag, metric), m[metric])
        # prediction sets
        tops = {k: v["prediction"] for k, v in cal.items()}
        rooms_cache: dict[tuple, dict[str, np.ndarray]] = {}
        for method in SET_METHODS:
            for alpha in ALPHAS:
                key = ("sets", method, alpha_key(alpha))
                if key in refused:
                    continue
                try:
                    lam, k_reg = (
                        fit_raps(cal["id"]["probs"][t], y[t], alpha)
                        if method == "raps"
                        else (0.0, 0)
                    )
                    if (method, lam, k_reg) not in rooms_cache:
                        rooms_cache[(method, lam, k_reg)] = {
                            k: class_room(v["probs"], method, lam=lam, k_reg=k_reg)
                            for k, v in cal.items()
                        }
                    rooms = rooms_cache[(method, lam, k_reg)]
                    qhat = conformal_quantile(1.0 - rooms["id"][q, y[q]], alpha)
                except DataError as err:
                    refused[key] = str(err)
                    continue
                sets = _sets(rooms["id"], tops["id"], method, qhat, tested)
                sizes = sets.sum(axis=1)
                put((*key, "coverage"), float(sets[np.arange(len(tested)), y[tested]].mean()))
                put((*key, "mean_size"), float(sizes.mean()))
                put((*key, "empty"), float((sizes == 0).mean()))
                if method == "raps":
                    put((*key, "lam"), lam)
                    put((*key, "k_reg"), k_reg)
                if len(shifted):
                    sets = _sets(rooms["shift"], tops["shift"], method, qhat, shifted)
                    put((*key, "shift_coverage"), float(sets[np.arange(len(ys)), ys].mean()))
                    put((*key, "shift_mean_size"), float(sets.sum(axis=1).mean()))
                for k in oods:
                    sets = _sets(rooms[k], tops[k], method, qhat)
                    put((*key, "ood_mean_size", k[4:]), float(sets.sum(axis=1).mean()))
        # answer or abstain at TARGET_RISK (msp), and at OTHER_RISKS
        msp = {k: v["msp"] for k, v in cal.items()}
        correct = tops["id"] == y
        grid = selective_grid(msp["id"][t])
        for risk_level in (TARGET_RISK, *OTHER_RISKS):
            start = selective_start(msp["id"][t], correct[t], grid, risk_level, len(q))
            certified = certify(msp["id"][q], correct[q], grid, start, risk_level)
            head = (
                ("selective",) if risk_level == TARGET_RISK else ("selective_at", f"{risk_level:g}")
            )
            put((*head, "refused"), float(certified is None))
            # what Bonferroni alone (the test before the graph test) answers on the same split
            before = certify(msp["id"][q], correct[q], grid, start, risk_level, "bonferroni")
            put(
                (*head, "bonferroni_answered"),
                0.0
                if before is None
                else float(accept_mask(msp["id"][tested], "msp", before).mean()),
            )
            wheres = (
                ("", msp["id"][tested], correct[tested]),
                ("shift_", msp["shift"][shifted], tops["shift"][shifted] == ys),
            )
            # the guarantee against a known population: the examples outside the temperature
            # part are the population, a quantile part is drawn from it with replacement (iid),
            # and the risk at its tau is the population's (no finite tested part, no overlap)
            population = np.setdiff1d(np.arange(len(y)), t)
            draw = np.random.default_rng([SPLIT_SEED, seed, index, 1]).choice(
                population, len(q), replace=True
            )
            drawn = certify(msp["id"][draw], correct[draw], grid, start, risk_level)
            if drawn is not None:  # refused: abstain on everything, no risk taken
                answered = accept_mask(msp["id"][population], "msp", drawn)
                wrong = ~correct[population][answered]
                drawn_risk = float(wrong.mean()) if answered.any() else 0.0
            put((*head, "population_exceeds"), float(drawn is not None and drawn_risk > risk_level))
            for where, conf, ok in wheres if risk_level == TARGET_RISK else wheres[:1]:
                # none certified: abstain on everything
                answered = (
                    np.zeros(len(conf), bool)
                    if certified is None
                    else accept_mask(conf, "msp", certified)
                )
                risk = float((~ok[answered]).mean()) if answered.any() else None
                put((*head, f"{where}answered"), float(answered.mean()))
                put((*head, f"{where}risk"), risk)
                put((*head, f"{where}exceeds"), float(risk is not None and risk > risk_level))
            if risk_level != TARGET_RISK:
                continue
            for k in oods:
                answered = (
                    np.zeros(len(msp[k]), bool)
                    if certified is None
                    else accept_mask(msp[k], "msp", certified)
                )
                put(("selective", "ood_answered", k[4:]), float(answered.mean()))
        put(("selective", "curve"), _risk_curve(msp["id"][tested], ~correct[tested]))
        # the OOD flag at OOD_ALPHA (msp)
        try:
            threshold = fit_ood(-msp["id"][q], OOD_ALPHA)
        except DataError as err:
            refused[("ood_flag",)] = str(err)
            continue
        put(("ood_flag", "test"), float(ood_mask(-msp["id"][tested], threshold).mean()))
        put(("ood_flag", "shift"), float(ood_mask(-msp["shift"][shifted], threshold).mean()))
        for k in oods:
            put(("ood_flag", "ood", k[4:]), float(ood_mask(-msp[k], threshold).mean()))

    out: dict[str, Any] = {"splits": len(parts)}
    for key, got in values.items():
        if key[-1] == "curve":
            set_path(out, key, [float(v) for v in np.mean(got, axis=0)])
            continue
        present = [v for v in got if v is not None]
        set_path(out, key, float(np.mean(present)) if present else None)
        if key[-1] in ("coverage", "shift_coverage", "temperature"):
            set_path(out, (*key[:-1], f"{key[-1]}_std"), float(np.std(got)))
    for tag in ("raw", "scaled"):
        for metric in ("auroc", "fpr95"):
            set_path(
                out,
                ("scaling", "ood_mean", tag, metric),
                float(np.mean([out["scaling"]["ood"][k[4:]][tag][metric] for k in oods])),
            )
    for key, reason in refused.items():
        if key[-1] == "reason":
            set_path(out, key, reason)
        else:
            set_path(out, key, {"available": False, "reason": reason})
    for method in SET_METHODS:
        for alpha in ALPHAS:
            cell = out["sets"][method][alpha_key(alpha)]
            cell.setdefault("available", True)
    return out


def decide_one(
    job: tuple[dict[str, np.ndarray], np.ndarray, tuple[int, int, int], int],
) -> dict[str, Any]:
    logits, labels, sizes, seed = job
    t, q, splits = sizes
    recipe = Recipe(0, 0.0, 0, 0.0, 1, 0)
    recipe.calibration_temperature, recipe.calibration_quantile, recipe.splits = t, q, splits
    return decide_row(logits, labels, split_parts(len(labels), recipe, seed), seed)


def decisions(
    logits: dict[int, dict[str, dict[str, np.ndarray]]],
    labels: np.ndarray,
    recipe: Recipe,
    workers: int = 1,
) -> dict[int, dict[str, Any]]:
    """:func:`decide_row` for every seed and row of ``logits`` [seed][row][set], in ``workers``
    processes (the results do not depend on it)."""
    sizes = (recipe.calibration_temperature, recipe.calibration_quantile, recipe.splits)
    keys = [(seed, row) for seed in logits for row in ROWS]
    jobs = [(logits[seed][row], labels, sizes, seed) for seed, row in keys]
    if workers > 1 and len(jobs) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("spawn")  # no fork of a process running torch
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context) as pool:
            results = list(pool.map(decide_one, jobs))
    else:
        results = [decide_one(job) for job in jobs]
    out: dict[int, dict[str, Any]] = {}
    for (seed, row), result in zip(keys, results, strict=True):
        out.setdefault(seed, {})[row] = result
    return out


def save_logits(
    path: Path, logits: dict[int, dict[str, dict[str, np.ndarray]]], task: Task
) -> None:
    """Every seed's member logits per row and evaluation set (float16) and the labels, written
    atomically: what ``--render`` recomputes the decisions from."""
    arrays = {
        f"{seed}/{row}/{s}": v.astype(np.float16)
        for seed, rows in logits.items()
        for row, sets in rows.items()
        for s, v in sets.items()
    }
    arrays["labels/id"] = task.test[1].numpy().astype(np.int64)
    arrays["labels/shift"] = task.shift[1].numpy().astype(np.int64)
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        np.savez_compressed(handle, **arrays)


def load_logits(path: Path) -> tuple[dict[int, dict[str, dict[str, np.ndarray]]], np.ndarray]:
    """(logits [seed][row][set] as float64, the ID labels) of :func:`save_logits`."""
    logits: dict[int, dict[str, dict[str, np.ndarray]]] = {}
    with np.load(path) as stored:
        labels = stored["labels/id"]
        for name in stored.files:
            if name.startswith("labels/"):
                continue
            seed, row, s = name.split("/", 2)
            logits.setdefault(int(seed), {}).setdefault(row, {})[s] = stored[name].astype(
                np.float64
            )
    return logits, labels


def decision_claims(alpha: float) -> tuple[tuple, ...]:
    """(claim, row, against, path, margin) of the decisions, at the claim alpha."""
    size = ("sets", "lac", alpha_key(alpha), "mean_size")
    answered = ("selective", "answered")
    pct = f"{(1 - alpha) * 100:g}%"
    return tuple(
        (
            f"{row} + T {verb} {against} + T",
            row,
            against,
            path,
            0.0,
        )
        for row in ("Hydra (Taylor)", "Hydra (Taylor, grouped MLP)", "Hydra (fused deep ensemble)")
        for against in ("single", "deep ensemble")
        for path, verb in (
            (size, f"gives smaller {pct} LAC sets than"),
            (answered, f"answers more at {TARGET_RISK:.0%} selective risk than"),
        )
    )


def decision_targets(alpha: float) -> tuple[tuple, ...]:
    size = ("sets", "lac", alpha_key(alpha), "mean_size")
    answered = ("selective", "answered")
    pct = f"{(1 - alpha) * 100:g}%"
    return (
        (
            f"Hydra (Taylor) + T gives smaller mean {pct} LAC sets than single + T",
            "Hydra (Taylor)",
            "single",
            size,
            0.0,
        ),
        (
            f"Hydra (Taylor) + T answers more at {TARGET_RISK:.0%} selective risk than single + T",
            "Hydra (Taylor)",
            "single",
            answered,
            0.0,
        ),
        (
            f"Hydra (fused deep ensemble) + T within 0.03 of the deep ensemble + T on the mean "
            f"{pct} LAC set size",
            "Hydra (fused deep ensemble)",
            "deep ensemble",
            size,
            -0.03,
        ),
        (
            f"Hydra (fused deep ensemble) + T within 0.03 of the deep ensemble + T on the share "
            f"answered at {TARGET_RISK:.0%} selective risk",
            "Hydra (fused deep ensemble)",
            "deep ensemble",
            answered,
            -0.03,
        ),
    )
