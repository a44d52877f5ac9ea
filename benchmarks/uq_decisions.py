"""The uncertainty benchmarks' decisions, recomputed from the stored member logits: temperature
scaling, prediction sets, answer-or-abstain and the OOD flag (every rule from
``hydra_deploy.decisions``) over random splits of the in-distribution test set."""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from uq_rows import set_path
from uq_task import ROWS, Recipe, Task

from hydra_deploy.atomic import atomic_path
from hydra_deploy.decisions import (
    accept_mask,
    calibrated_scores,
    class_scores,
    conformal_quantile,
    fit_ood,
    fit_selective,
    fit_temperature,
    ood_mask,
    prediction_sets,
    selective_grid,
    selective_start,
)
from hydra_deploy.errors import DataError
from hydra_deploy.set_scores import set_score
from hydra_deploy.uncertainty.metrics import (
    accuracy,
    ece,
    nll,
    ood_metrics,
    ood_score,
    selective_risk_at,
)

#: the levels of the prediction sets (coverage 1 - alpha)
ALPHAS = (0.01, 0.02, 0.05, 0.1)
#: the set methods the report shows (its tables' columns): a choice of the report, not a rule;
#: each method's rule is the library's (``hydra_deploy.decisions``, whose SET_METHODS may hold more)
REPORTED_SET_METHODS = ("lac", "aps", "raps")
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


@dataclass
class _Split:
    """One random split of one row: its parts, the calibrated scores of every evaluation set (T
    fitted on the temperature part) and what the split measures, appended to ``values``."""

    y: np.ndarray
    t: np.ndarray
    q: np.ndarray
    tested: np.ndarray
    shifted: np.ndarray  # the tested examples that have a shifted copy
    cal: dict[str, dict[str, np.ndarray]]
    oods: list[str]
    values: dict[tuple, list]
    refused: dict[tuple, str]

    def put(self, key: tuple, value: Any) -> None:
        self.values.setdefault(key, []).append(value)

    def scores(self, name: str, what: str) -> np.ndarray:
        """A calibrated score (``msp``, ``prediction``, ``probs``) of evaluation set ``name``."""
        return self.cal[name][what]


def _measure_scaling(s: _Split, raw: dict[str, dict[str, np.ndarray]]) -> None:
    """Accuracy, NLL and ECE (tested part, shifted copies) and OOD AUROC / FPR95 (MSP), without
    T (raw) and with it (scaled)."""
    ys = s.y[s.shifted]
    for tag, sc in (("raw", raw), ("scaled", s.cal)):
        for where, scores, rows, labels in (
            ("test", sc["id"], s.tested, s.y[s.tested]),
            ("shift", sc["shift"], s.shifted, ys),
        ):
            probs = scores["probs"][rows]
            s.put(("scaling", where, tag, "accuracy"), accuracy(probs, labels))
            s.put(("scaling", where, tag, "nll"), nll(probs, labels))
            s.put(("scaling", where, tag, "ece"), ece(probs, labels))
        for k in s.oods:
            m = ood_metrics(ood_score(sc["id"], "msp")[s.tested], ood_score(sc[k], "msp"))
            for metric in ("auroc", "fpr95"):
                s.put(("scaling", "ood", k[4:], tag, metric), m[metric])


def _coverage(sets: np.ndarray, labels: np.ndarray) -> float:
    return float(sets[np.arange(len(labels)), labels].mean())


def _measure_sets(s: _Split) -> None:
    """Every reported set method at every alpha, fitted by the library on this split (its
    parameters on the temperature part, qhat on the quantile part); coverage and sizes measured."""
    tune, held = s.scores("id", "probs")[s.t], s.scores("id", "probs")[s.q]
    for method in REPORTED_SET_METHODS:
        for alpha in ALPHAS:
            key = ("sets", method, alpha_key(alpha))
            if key in s.refused:
                continue
            try:
                params = set_score(method).fit(tune, s.y[s.t], alpha)
                true = class_scores(held, method, params)[np.arange(len(s.q)), s.y[s.q]]
                qhat = conformal_quantile(true, alpha)
            except DataError as err:
                s.refused[key] = str(err)
                continue

            def sets(name: str, rows: Any = slice(None), m=method, p=params, q=qhat) -> np.ndarray:
                return prediction_sets(s.scores(name, "probs")[rows], q, m, p)

            tested = sets("id", s.tested)
            sizes = tested.sum(axis=1)
            s.put((*key, "coverage"), _coverage(tested, s.y[s.tested]))
            s.put((*key, "mean_size"), float(sizes.mean()))
            s.put((*key, "empty"), float((sizes == 0).mean()))
            for name, value in asdict(params).items():  # RAPS's lam and k_reg
                s.put((*key, name), value)
            if len(s.shifted):
                shifted = sets("shift", s.shifted)
                s.put((*key, "shift_coverage"), _coverage(shifted, s.y[s.shifted]))
                s.put((*key, "shift_mean_size"), float(shifted.sum(axis=1).mean()))
            for k in s.oods:
                s.put((*key, "ood_mean_size", k[4:]), float(sets(k).sum(axis=1).mean()))


def _answered(confidence: np.ndarray, tau: float | None) -> np.ndarray:
    """The library's answer-or-abstain at ``tau``; where none was certified, abstain on all."""
    if tau is None:
        return np.zeros(len(confidence), bool)
    return accept_mask(confidence, "msp", tau)


def _population_exceeds(
    s: _Split, grid: np.ndarray, start: int, risk_level: float, draw_seed: list[int]
) -> float:
    """The guarantee against a known population: the examples outside the temperature part are
    the population, a quantile part is drawn from it with replacement (iid), and the risk at its
    tau is the population's (no finite tested part, no overlap). 1.0 where that risk exceeds
    ``risk_level``; refused: abstain on everything, no risk taken."""
    msp, correct = s.scores("id", "msp"), s.scores("id", "prediction") == s.y
    population = np.setdiff1d(np.arange(len(s.y)), s.t)
    draw = np.random.default_rng(draw_seed).choice(population, len(s.q), replace=True)
    drawn = certify(msp[draw], correct[draw], grid, start, risk_level)
    if drawn is None:
        return 0.0
    answered = accept_mask(msp[population], "msp", drawn)
    wrong = ~correct[population][answered]
    return float(answered.any() and wrong.mean() > risk_level)


def _measure_selective(s: _Split, draw_seed: list[int]) -> None:
    """Answer or abstain (MSP) at TARGET_RISK and at OTHER_RISKS: certified on the quantile part
    with the graph procedure (and, beside it, with Bonferroni alone); the share answered and
    the risk on the tested part (and, at TARGET_RISK, the shifted copies and the OOD sets)."""
    msp, correct = s.scores("id", "msp"), s.scores("id", "prediction") == s.y
    grid = selective_grid(msp[s.t])
    for risk_level in (TARGET_RISK, *OTHER_RISKS):
        start = selective_start(msp[s.t], correct[s.t], grid, risk_level, len(s.q))
        certified = certify(msp[s.q], correct[s.q], grid, start, risk_level)
        head = ("selective",) if risk_level == TARGET_RISK else ("selective_at", f"{risk_level:g}")
        s.put((*head, "refused"), float(certified is None))
        # what Bonferroni alone (the test before the graph test) answers on the same split
        before = certify(msp[s.q], correct[s.q], grid, start, risk_level, "bonferroni")
        s.put((*head, "bonferroni_answered"), float(_answered(msp[s.tested], before).mean()))
        s.put(
            (*head, "population_exceeds"),
            _population_exceeds(s, grid, start, risk_level, draw_seed),
        )
        shift_ok = s.scores("shift", "prediction")[s.shifted] == s.y[s.shifted]
        wheres = (
            ("", msp[s.tested], correct[s.tested]),
            ("shift_", s.scores("shift", "msp")[s.shifted], shift_ok),
        )
        for where, confidence, ok in wheres if risk_level == TARGET_RISK else wheres[:1]:
            answered = _answered(confidence, certified)
            risk = float((~ok[answered]).mean()) if answered.any() else None
            s.put((*head, f"{where}answered"), float(answered.mean()))
            s.put((*head, f"{where}risk"), risk)
            s.put((*head, f"{where}exceeds"), float(risk is not None and risk > risk_level))
        if risk_level == TARGET_RISK:
            for k in s.oods:
                answered = _answered(s.scores(k, "msp"), certified)
                s.put(("selective", "ood_answered", k[4:]), float(answered.mean()))
    curve = selective_risk_at(msp[s.tested], correct[s.tested], CURVE_COVERAGE)
    s.put(("selective", "curve"), [float(v) for v in curve])


def _measure_ood_flag(s: _Split) -> None:
    """The OOD flag at OOD_ALPHA (MSP), fitted on the quantile part: the share flagged."""
    scores = {k: ood_score(v, "msp") for k, v in s.cal.items()}
    try:
        threshold = fit_ood(scores["id"][s.q], OOD_ALPHA)
    except DataError as err:
        s.refused[("ood_flag",)] = str(err)
        return
    s.put(("ood_flag", "test"), float(ood_mask(scores["id"][s.tested], threshold).mean()))
    s.put(("ood_flag", "shift"), float(ood_mask(scores["shift"][s.shifted], threshold).mean()))
    for k in s.oods:
        s.put(("ood_flag", "ood", k[4:]), float(ood_mask(scores[k], threshold).mean()))


def _summarise(
    values: dict[tuple, list], refused: dict[tuple, str], splits: int, oods: list[str]
) -> dict[str, Any]:
    """The means over splits (the spread of the coverages and of T beside them), the OOD means,
    and every refused measurement as ``available: False`` with its reason."""
    out: dict[str, Any] = {"splits": splits}
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
        set_path(out, key, {"available": False, "reason": reason})
    for method in REPORTED_SET_METHODS:
        for alpha in ALPHAS:
            out["sets"][method][alpha_key(alpha)].setdefault("available", True)
    return out


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
    (:func:`fit_temperature`); the set methods' parameters and the selective grid on it too;
    every quantile (set thresholds per method and alpha, the selective threshold at TARGET_RISK
    and DELTA, the OOD threshold at OOD_ALPHA) on the quantile part; every metric on the tested
    part, on the shifted copies of the tested examples and on the OOD sets. Returns the means
    over splits (and the spread over splits of the coverages); an alpha too small for the
    quantile part is reported ``available: False`` with the reason."""
    y = np.asarray(labels, dtype=np.int64)
    oods = [k for k in logits if k.startswith("ood:")]
    raw = {k: calibrated_scores(v, 1.0) for k, v in logits.items()}
    values: dict[tuple, list] = {}
    refused: dict[tuple, str] = {}
    for index, (t, q, tested) in enumerate(parts):
        temperature = fit_temperature(logits["id"][t], y[t])
        split = _Split(
            y=y,
            t=t,
            q=q,
            tested=tested,
            shifted=tested[tested < len(logits["shift"])],
            cal={k: calibrated_scores(v, temperature) for k, v in logits.items()},
            oods=oods,
            values=values,
            refused=refused,
        )
        split.put(("temperature",), temperature)
        _measure_scaling(split, raw)
        _measure_sets(split)
        _measure_selective(split, [SPLIT_SEED, seed, index, 1])
        _measure_ood_flag(split)
    return _summarise(values, refused, len(parts), oods)


def decide_one(
    job: tuple[dict[str, np.ndarray], np.ndarray, tuple[int, int, int], int],
) -> dict[str, Any]:
    logits, labels, sizes, seed = job
    t, q, splits = sizes
    recipe = Recipe(0, 0.0, 0, 0.0, 1, 0)
    recipe.calibration_temperature, recipe.calibration_quantile, recipe.splits = t, q, splits
    return decide_row(logits, labels, split_parts(len(labels), recipe, seed), seed)


def decide_all(jobs: Sequence[tuple], workers: int) -> list[dict[str, Any]]:
    """:func:`decide_one` of every job, in ``workers`` processes (spawned: no fork of a process
    running torch) where there are several; the results do not depend on it."""
    if workers > 1 and len(jobs) > 1:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context) as pool:
            return list(pool.map(decide_one, jobs))
    return [decide_one(job) for job in jobs]


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
    results = decide_all([(logits[seed][row], labels, sizes, seed) for seed, row in keys], workers)
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
