"""Split-conformal prediction sets: the conformal quantile, the set rule, and the registry of set
scores (numpy only: edge code).

A set score is one class registered with :func:`register_set_score` (as timm's
``@register_model``): its numpy half beside its graph half, so a new score is one entry.

- :meth:`SetScore.room`: what each class [B, C] holds against the set's bar, float64 (higher =
  more plausible): ``1 -`` its nonconformity score, computed without the cancellation of
  ``1 - score`` near 1. :func:`class_scores` is ``1 - room``.
- :attr:`SetScore.top_always_in`: the top class (p descending, ties by lower index) is in every
  set; :attr:`SetScore.sorts`: the room depends on the classes' ranking (one TopK in the graph).
- :attr:`SetScore.Params` and :meth:`SetScore.fit`: its fitted parameters (a frozen dataclass;
  RAPS's lambda and k_reg), fitted on the temperature part; hydra.json records each field under
  ``metadata["key"]`` (default: its name), checked on read against ``metadata["low"]``
  (:class:`~hydra_deploy.export_folder.SetRule`). :attr:`SetScore.recorded`: constant entries
  written beside them (LAC and APS write RAPS's zero penalty, which every reader of
  ``hydra-decisions/1`` requires).
- :meth:`SetScore.graph_room`: the same room as ONNX nodes, built through :class:`SetGraph`, the
  small op builder :mod:`hydra_deploy.export.decision_graph` supplies (this module imports no
  onnx).

Membership is decided for every score as ``room >= set_floor(qhat)`` (:func:`set_floor`, a
tolerance relative to the room), plus the top class for scores that always hold it
(:func:`set_members`): the one rule every runner, the graph and the benchmarks use. ``qhat`` is the
ceil((n + 1)(1 - alpha))-th smallest calibration score (:func:`conformal_quantile`); over
exchangeable data the set holds the true class with probability at least 1 - alpha (marginally).

Entries: ``lac`` (the default), ``{y : p_y >= 1 - qhat}``, may be empty; ``aps``, deterministic,
the score of y the sum of p_j over the classes ranked at or above y (p descending, ties by lower
index), never empty; ``raps``, APS plus ``lambda * max(0, rank - k_reg)``
(:class:`RAPS` overrides :meth:`APS.rank_penalty`); ``topk``, the k top-ranked classes, k the
conformal quantile of the true classes' ranks (:class:`TopK`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

import numpy as np

from hydra_deploy.errors import DataError, ParameterError

__all__ = [
    "APS",
    "LAC",
    "RAPS",
    "RAPS_LAMBDAS",
    "SET_FLOOR",
    "SET_METHODS",
    "SET_SCORES",
    "SET_TOLERANCE",
    "NoParams",
    "RapsParams",
    "SetGraph",
    "SetScore",
    "TooFewExamples",
    "TopK",
    "class_room",
    "class_scores",
    "conformal_quantile",
    "fit_raps",
    "min_calibration_size",
    "prediction_sets",
    "register_set_score",
    "set_floor",
    "set_members",
    "set_score",
]

#: RAPS's lambdas tried on the temperature part (Angelopoulos et al. 2020's grid, and 0).
RAPS_LAMBDAS = (0.0, 0.001, 0.01, 0.1, 0.2, 0.5)
_EPS = 1e-9  # (n + 1)(1 - alpha) computed in floats: 20 * 0.95 must give 19, not 19.000000000000004
#: How far below qhat's room a class's own room may fall and still count as inside, relative to
#: that room (the probability for LAC, the probability mass ranked below the class for APS/RAPS):
#: scores equal in exact arithmetic (confident members put p on atoms like k / M) must not fall on
#: either side of qhat by a rounding error, and the graph (float32) must agree with numpy (float64).
#: Relative, so a confident input's set never grows by a rounding of 1e-6 (an absolute 1e-6 on a
#: cumulative score near 1 took in every class). Counting such ties as inside can only raise
#: coverage.
SET_TOLERANCE = 1e-6
#: ... plus this absolute floor: float64's rounding of 1 - qhat where qhat is near 1 (2 ulps of 1)
SET_FLOOR = 2.0**-51


# --- checks ---------------------------------------------------------------------------------------
def _level(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ParameterError(f"`{name}` must be a number in (0, 1), got {value!r}")
    if not 0.0 < float(value) < 1.0:
        raise ParameterError(f"`{name}` must be in (0, 1), got {value}")
    return float(value)


# --- the conformal quantile -----------------------------------------------------------------------
def min_calibration_size(alpha: float) -> int:
    """The fewest calibration examples for which ceil((n + 1)(1 - alpha)) <= n."""
    alpha = _level(alpha, "alpha")
    n = max(1, math.ceil(1.0 / alpha - 1.0 - 1e-6))
    while math.ceil((n + 1) * (1.0 - alpha) - _EPS) > n:
        n += 1
    while n > 1 and math.ceil(n * (1.0 - alpha) - _EPS) <= n - 1:
        n -= 1
    return n


class TooFewExamples(DataError):
    """:func:`conformal_quantile` refused: ``count`` examples where ``needed`` are the fewest."""

    def __init__(self, message: str, count: int, needed: int) -> None:
        super().__init__(message)
        self.count, self.needed = count, needed


def conformal_quantile(scores: Any, alpha: float, *, what: str = "calibration examples") -> float:
    """The ceil((n + 1)(1 - alpha))-th smallest of ``scores``: the split-conformal threshold at
    level 1 - alpha. Refused (naming the smallest n alpha allows) where that rank exceeds n."""
    alpha = _level(alpha, "alpha")
    values = np.sort(np.asarray(scores, dtype=np.float64).ravel())
    n = len(values)
    rank = math.ceil((n + 1) * (1.0 - alpha) - _EPS)
    if rank > n:
        needed = min_calibration_size(alpha)
        raise TooFewExamples(
            f"{what}: {n} given, too few for alpha {alpha:g}: a conformal threshold at level "
            f"{1 - alpha:g} needs at least {needed}; give more labelled data, or a larger alpha",
            n,
            needed,
        )
    return float(values[max(rank, 1) - 1])


# --- ranks ----------------------------------------------------------------------------------------
def _ranked(probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order [B, C]: classes by p descending, ties by lower index; sorted p [B, C])."""
    order = np.argsort(-probs, axis=1, kind="stable")
    return order, np.take_along_axis(probs, order, axis=1)


def _by_class(by_rank: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Values [B, C] by rank (``order`` from :func:`_ranked`) back in class order."""
    out = np.empty(order.shape, dtype=np.float64)
    np.put_along_axis(out, order, by_rank, axis=1)
    return out


def _true_ranks(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """The 1-based rank of each example's true class (p descending, ties by lower index)."""
    order, _ = _ranked(probs)
    return np.argmax(order == labels[:, None], axis=1) + 1


# --- the registry ---------------------------------------------------------------------------------
class SetGraph(Protocol):
    """What a score's graph half may call (:mod:`hydra_deploy.export.decision_graph` supplies
    it). Every name given is prefixed ``decisions/``; each node's output is its name."""

    #: the class count C
    classes: int
    #: [B, C] float32: the calibrated probabilities (NaN for an example with non-finite logits)
    probs: str

    def const(
        self, name: str, value: Any, dtype: Any = np.float32, shape: tuple[int, ...] | None = None
    ) -> str:
        """An initializer (one per name), of ``shape`` when given: give it the rank of the tensor
        it meets (TensorRT's parser adds an unnamed broadcasting layer otherwise)."""
        ...

    def op(self, op_type: str, inputs: Sequence[str], name: str, outputs: int = 1, **attrs: Any):
        """One node (an operator of :data:`~hydra_deploy.export.decision_graph.DECISION_OPS`);
        its output name, or the list of its ``outputs`` names."""
        ...

    def ranked(self) -> tuple[str, str]:
        """(sorted p [B, C] float32, order [B, C] int64): the classes by p descending, ties by lower
        index, as :func:`_ranked` (one TopK over all C classes, made once)."""
        ...

    def by_class(self, by_rank: str, name: str) -> str:
        """[B, C] values by rank back in class order (one ScatterElements over :meth:`ranked`'s
        order)."""
        ...


@dataclass(frozen=True)
class NoParams:
    """The parameters of a score fitted by its quantile alone: none."""


class SetScore(ABC):
    """One set score: its numpy half (:meth:`room`, :meth:`fit`) beside its graph half
    (:meth:`graph_room`). Subclass, name it and register it with :func:`register_set_score`."""

    #: the name ``--sets`` and the record use
    name: ClassVar[str]
    #: its fitted parameters: a frozen dataclass of floats and ints (see the module docstring)
    Params: ClassVar[type] = NoParams
    #: constant entries its record carries beside the parameters (written, not read back)
    recorded: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    #: the top class is in every set (the set is never empty)
    top_always_in: ClassVar[bool] = True
    #: the room depends on the classes' ranking (the graph sorts all C classes: one TopK, whose
    #: K TensorRT limits)
    sorts: ClassVar[bool] = True

    def params(self, params: Any = None, **values: Any) -> Any:
        """Its :attr:`Params` from an instance, or from values by field name (none: the defaults).
        A value named by another score's parameters is ignored (the calls before the registry
        passed RAPS's ``lam`` and ``k_reg`` for every method); a name no score has is refused."""
        if params is not None:
            if values or not isinstance(params, self.Params):
                raise ParameterError(
                    f"{self.name.upper()} sets take {self.Params.__name__} parameters, got "
                    f"{params!r}{' and ' + ', '.join(values) if values else ''}"
                )
            return params
        own = {f.name for f in fields(self.Params)}
        known = {f.name for score in SET_SCORES.values() for f in fields(score.Params)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ParameterError(
                f"{self.name.upper()} sets have no parameter {', '.join(unknown)} (theirs: "
                f"{', '.join(sorted(own)) or 'none'})"
            )
        return self.Params(**{k: v for k, v in values.items() if k in own})

    def fit(self, probs: np.ndarray, labels: np.ndarray, alpha: float) -> Any:
        """Its parameters, fitted on the temperature part's calibrated probabilities (float64)
        and labels (may raise :class:`TooFewExamples`)."""
        return self.Params()

    @abstractmethod
    def room(self, probs: np.ndarray, params: Any) -> np.ndarray:
        """[B, C] float64: what each class holds against the set's bar (higher = more plausible)."""

    @abstractmethod
    def graph_room(self, g: SetGraph, params: Any) -> str:
        """[B, C] float32: :meth:`room` as nodes of ``g``, in class order."""

    def room_magnitude(self, probs: np.ndarray, params: Any) -> np.ndarray:
        """[B, C]: the size of the terms each class's room is computed from: the graph's float32
        room lies within a few float32 roundings of that size from the float64 one (0: the graph
        computes the room exactly, only the ranking may differ)."""
        return np.abs(self.room(probs, params))

    def room_drift(self, ranks: np.ndarray) -> np.ndarray:
        """[B, C]: how many times a per-class error of the probabilities the room can move by
        (``ranks``: each class's 1-based rank, p descending): by default the mass summed over the
        ranks (the scores that sort); LAC 1 (the probability itself); top-k 0 (only its ranking,
        whose near-ties a comparison treats apart). hydra-compare's tolerance of a set rule."""
        return np.asarray(ranks, dtype=np.float64)


#: name -> the registered score, in the order registered (``--sets``' choices)
SET_SCORES: dict[str, SetScore] = {}


def register_set_score(cls: type[SetScore]) -> type[SetScore]:
    """Class decorator: register one instance of ``cls`` under ``cls.name``."""
    if cls.name in SET_SCORES:
        raise ValueError(
            f"a set score named {cls.name!r} is already registered: give the new one another name"
        )
    SET_SCORES[cls.name] = cls()
    return cls


def set_score(method: str) -> SetScore:
    """The registered score ``method``; refused, naming the registered ones, otherwise."""
    score = SET_SCORES.get(method) if isinstance(method, str) else None
    if score is None:
        raise ParameterError(f"`sets` must be one of {', '.join(SET_SCORES)}, got {method!r}")
    return score


# --- the entries ----------------------------------------------------------------------------------
#: RAPS's zero penalty, which every record of the first set scores carries
_NO_PENALTY = MappingProxyType({"lambda": 0.0, "k_reg": 0})


@register_set_score
class LAC(SetScore):
    """Least ambiguous set-valued classifier: the room of y is p_y, the set ``{y : p_y >= 1 -
    qhat}`` (the smallest sets on average; may be empty: nothing is plausible)."""

    name = "lac"
    recorded = _NO_PENALTY
    top_always_in = False
    sorts = False

    def room(self, probs: np.ndarray, params: Any) -> np.ndarray:
        return np.array(probs, dtype=np.float64)

    def room_drift(self, ranks: np.ndarray) -> np.ndarray:
        return np.ones(np.shape(ranks))

    def graph_room(self, g: SetGraph, params: Any) -> str:
        return g.probs


@register_set_score
class APS(SetScore):
    """Adaptive prediction sets, deterministic: the score of y is the sum of p_j over the classes
    ranked at or above y, so its room is the probability mass ranked strictly below y (a sum of
    the smaller p_j, smallest first: a confident input's tiny tail keeps its digits), less
    :meth:`rank_penalty`; the set holds the top class."""

    name = "aps"
    recorded = _NO_PENALTY

    def rank_penalty(self, classes: int, params: Any) -> np.ndarray | None:
        """[C] float64 added to the score by rank (rank 1 first), or None (APS: none)."""
        return None

    def room(self, probs: np.ndarray, params: Any) -> np.ndarray:
        order, sorted_p = _ranked(np.asarray(probs, dtype=np.float64))
        # mass ranked strictly below each rank: a reversed cumulative sum, smallest terms first
        at_or_below = np.cumsum(sorted_p[:, ::-1], axis=1)[:, ::-1]
        below = np.zeros_like(sorted_p)
        below[:, :-1] = at_or_below[:, 1:]
        penalty = self.rank_penalty(below.shape[1], params)
        if penalty is not None:
            below = below - penalty[None, :]
        return _by_class(below, order)

    def graph_room(self, g: SetGraph, params: Any) -> str:
        sorted_p, _ = g.ranked()
        # below[b, r] = sum of sorted_p[b, j] over j > r: a MatMul with a strictly triangular 0/1
        # matrix (smallest terms included, never 1 - cumulative; CumSum is no single TRT layer)
        ranks = np.arange(g.classes)
        strictly_below = g.const("strictly_below", ranks[:, None] > ranks[None, :])  # [C, C]
        room = g.op("MatMul", [sorted_p, strictly_below], "mass_below")  # [B, C], by rank
        penalty = self.rank_penalty(g.classes, params)
        if penalty is not None:
            constant = g.const(f"{self.name}_penalty", penalty, shape=(1, g.classes))
            room = g.op("Sub", [room, constant], f"{self.name}_room")
        return g.by_class(room, "class_room")


@dataclass(frozen=True)
class RapsParams:
    """RAPS's penalty: ``lam * max(0, rank - k_reg)``."""

    lam: float = field(default=0.0, metadata={"key": "lambda", "low": 0.0})
    k_reg: int = field(default=0, metadata={"low": 0})


@register_set_score
class RAPS(APS):
    """Regularized APS: APS plus ``lam * max(0, rank - k_reg)``; k_reg is the conformal quantile
    of the true classes' ranks on the temperature part, lam the one of :data:`RAPS_LAMBDAS` whose
    sets are smallest there."""

    name = "raps"
    Params = RapsParams
    recorded: ClassVar[Mapping[str, Any]] = MappingProxyType({})

    def rank_penalty(self, classes: int, params: RapsParams) -> np.ndarray:
        ranks = np.arange(1, classes + 1, dtype=np.float64)
        return params.lam * np.maximum(0.0, ranks - params.k_reg)

    def fit(
        self, probs: np.ndarray, labels: np.ndarray, alpha: float, lambdas=RAPS_LAMBDAS
    ) -> RapsParams:
        """k_reg: the conformal quantile of the true classes' ranks; lam: the one of ``lambdas``
        whose sets (thresholded on the same data) are smallest on average (ties: the smaller)."""
        p = np.asarray(probs, dtype=np.float64)
        y = np.asarray(labels, dtype=np.int64)
        ranks = _true_ranks(p, y)
        k_reg = int(
            conformal_quantile(ranks, alpha, what="examples of the temperature part (RAPS)")
        )
        best: tuple[float, RapsParams] | None = None
        for lam in lambdas:
            params = RapsParams(float(lam), k_reg)
            room = self.room(p, params)
            qhat = conformal_quantile(1.0 - room[np.arange(len(y)), y], alpha)
            size = float(set_members(room, qhat, _ranked(p)[0][:, 0]).sum(axis=1).mean())
            if best is None or size < best[0] - 1e-12:
                best = (size, params)
        assert best is not None
        return best[1]

    def room_magnitude(self, probs: np.ndarray, params: RapsParams) -> np.ndarray:
        order, _ = _ranked(np.asarray(probs, dtype=np.float64))
        by_rank = np.broadcast_to(self.rank_penalty(order.shape[1], params), order.shape)
        return np.abs(self.room(probs, params)) + 2.0 * _by_class(by_rank, order)


@register_set_score
class TopK(SetScore):
    """Top-k sets: the score of y is its rank, 1 + the classes ranked above it (a larger p, or an
    equal p and a lower index: the ranking of every set rule), so qhat, the conformal quantile of
    the true classes' ranks, is a whole number k and the set is the k top-ranked classes (room
    ``1 - rank >= 1 - k``); the top class is always in. No parameters."""

    name = "topk"

    def room(self, probs: np.ndarray, params: Any) -> np.ndarray:
        order, _ = _ranked(np.asarray(probs, dtype=np.float64))
        one_minus_rank = -np.arange(order.shape[1], dtype=np.float64)  # by rank, rank 1 first
        return _by_class(np.broadcast_to(one_minus_rank, order.shape), order)

    def graph_room(self, g: SetGraph, params: Any) -> str:
        sorted_p, _ = g.ranked()
        zeros = g.op("Sub", [sorted_p, sorted_p], "topk_zeros")  # [B, C]: 0 (NaN where p is NaN)
        minus_rank = g.const("topk_one_minus_rank", -np.arange(g.classes), shape=(1, g.classes))
        by_rank = g.op("Add", [zeros, minus_rank], "topk_room")  # whole numbers: exact in float32
        return g.by_class(by_rank, "class_room")

    def room_magnitude(self, probs: np.ndarray, params: Any) -> np.ndarray:
        return np.zeros(np.shape(probs))  # the graph's room is exact: only the ranking may differ

    def room_drift(self, ranks: np.ndarray) -> np.ndarray:
        return np.zeros(np.shape(ranks))  # whole numbers: only the ranking moves them


#: The registered set scores' names (``--sets``' choices, the record's ``method``).
SET_METHODS = tuple(SET_SCORES)


# --- the set rule ---------------------------------------------------------------------------------
def fit_raps(
    probs: Any, labels: Any, alpha: float, *, lambdas: Sequence[float] = RAPS_LAMBDAS
) -> tuple[float, int]:
    """RAPS's (lambda, k_reg) on tuning data (:meth:`RAPS.fit`)."""
    params = SET_SCORES["raps"].fit(probs, labels, alpha, lambdas=lambdas)  # type: ignore[call-arg]
    return params.lam, params.k_reg


def class_room(probs: Any, method: str = "lac", params: Any = None, **values: Any) -> np.ndarray:
    """What each class [B, C] holds against the set's bar under score ``method`` (higher = more
    plausible; :meth:`SetScore.room`): ``lac`` p_y; ``aps`` the probability mass ranked below y;
    ``raps`` that minus ``lam * max(0, rank - k_reg)``. ``params``: the score's parameters, or
    give them by name (``lam=0.1, k_reg=2``)."""
    score = set_score(method)
    return score.room(np.asarray(probs, dtype=np.float64), score.params(params, **values))


def class_scores(probs: Any, method: str = "lac", params: Any = None, **values: Any) -> np.ndarray:
    """The nonconformity score of every class [B, C] (lower = more plausible): ``1 -``
    :func:`class_room`. ``lac``: 1 - p_y. ``aps``: the sum of p_j over the classes ranked at or
    above y (ranks by p descending, ties by lower class index). ``raps``: APS + ``lam`` *
    max(0, rank - ``k_reg``), rank 1 for the top class."""
    return 1.0 - class_room(probs, method, params, **values)


def set_floor(qhat: float | Sequence[float] | np.ndarray) -> np.ndarray:
    """The least room (:func:`class_room`) a class needs to be in the set at threshold ``qhat``,
    float64: ``1 - qhat`` (score <= qhat is room >= 1 - qhat) less :data:`SET_TOLERANCE` of
    itself and :data:`SET_FLOOR`, so ties within rounding count as inside."""
    room = 1.0 - np.asarray(qhat, dtype=np.float64)
    return room - (SET_TOLERANCE * np.abs(room) + SET_FLOOR)


def prediction_sets(
    probs: Any,
    qhat: float | Sequence[float] | np.ndarray,
    method: str = "lac",
    params: Any = None,
    **values: Any,
) -> np.ndarray:
    """The prediction sets [B, C] (bool) at threshold ``qhat`` (a number, or one per class for
    class-conditional sets): the classes whose score is at most it, ties within rounding inside
    (compared as room >= :func:`set_floor`), plus the top class for the scores that always hold it
    (APS, RAPS: never empty; LAC may be empty)."""
    p = np.asarray(probs, dtype=np.float64)
    score = set_score(method)
    top = _ranked(p)[0][:, 0] if score.top_always_in else None
    return set_members(score.room(p, score.params(params, **values)), qhat, top)


def set_members(
    room: np.ndarray, qhat: float | Sequence[float] | np.ndarray, top: np.ndarray | None = None
) -> np.ndarray:
    """:func:`prediction_sets` from a :func:`class_room` [B, C] computed once (for many
    thresholds): room >= :func:`set_floor` (``qhat``), plus the ``top`` class [B] of each
    example for the scores that always hold it (None for LAC)."""
    floor = set_floor(qhat)
    if floor.ndim == 1:
        floor = floor[None, :]
    members = np.asarray(room) >= floor
    if top is not None:
        members[np.arange(len(members)), top] = True
    return members
