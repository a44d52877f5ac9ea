"""Exact randomised conformal p-values of a stream of scores against a reference that grows with it.

The export carries ``n`` in-distribution reference scores (oriented higher = more unusual, as the
OOD rule's). The stream's t-th score ``s_t`` gets

    p_t = (#{r > s_t} + U_t * (#{r == s_t} + 1)) / (N_t + 1),   U_t ~ Uniform(0, 1]

over the ``N_t = n + t - 1`` scores seen before it: the reference and the stream's earlier scores.
When the reference and the stream are exchangeable (the null: nothing has changed), p_1, p_2, ...
are independent and uniform on (0, 1] (Vovk, Gammerman and Shafer, *Algorithmic Learning in a
Random World*, 2005, ch. 8: the randomised conformal p-values of an exchangeable sequence), so any
betting martingale over them is a test martingale and Ville's inequality holds.

Comparing every input with the *fixed* reference alone does not give this: the p-values then share
the same n reference scores and are dependent, and a product martingale over them raises false
alarms above its level (7.4% at a nominal 5% with 1000 reference scores, in the simulation the
project's issue 37 reports). So the stream's scores join the reference; the state grows by one
number per input (8 bytes), kept sorted.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

import numpy as np

from hydra_deploy.errors import ParameterError

__all__ = ["ConformalPValues", "stream_pvalues"]


class ConformalPValues:
    """Randomised conformal p-values of a stream against ``reference`` plus the stream so far.

    ``seed`` fixes the randomisation (the same stream and seed give the same p-values, also after
    :meth:`from_state`).
    """

    def __init__(self, reference: Any, *, seed: int = 0) -> None:
        ref = np.asarray(reference, dtype=np.float64).reshape(-1)
        if ref.size == 0:
            raise ParameterError("`reference` is empty: a conformal p-value needs reference scores")
        if not np.all(np.isfinite(ref)):
            raise ParameterError(
                f"`reference` holds {int(np.sum(~np.isfinite(ref)))} non-finite scores"
            )
        self.reference = np.sort(ref)
        self.stream: list[float] = []  # the stream's scores so far, sorted
        self.seed = int(seed)
        self.count = 0  # p-values given
        self._rng = np.random.default_rng(self.seed)

    @property
    def size(self) -> int:
        """How many scores the next p-value is compared with."""
        return self.reference.size + len(self.stream)

    def _counts(self, score: float) -> tuple[int, int]:
        """(# greater, # equal) among the reference and the stream so far."""
        ref, stream = self.reference, self.stream
        ref_low = int(np.searchsorted(ref, score, side="left"))
        ref_high = int(np.searchsorted(ref, score, side="right"))
        low, high = bisect.bisect_left(stream, score), bisect.bisect_right(stream, score)
        greater = (ref.size - ref_high) + (len(stream) - high)
        return greater, (ref_high - ref_low) + (high - low)

    def pvalue(self, score: float) -> float:
        """The next input's p-value (small: more unusual than the reference); ``score`` joins it."""
        score = float(score)
        if score != score:
            raise ParameterError("a score is NaN: the monitor needs a number for every input")
        greater, equal = self._counts(score)
        u = 1.0 - self._rng.random()  # in (0, 1]: p is never 0
        p = _pvalue(greater, equal, u, self.size)
        bisect.insort(self.stream, score)
        self.count += 1
        return p

    def pvalues(self, scores: Iterable[float]) -> np.ndarray:
        return np.array([self.pvalue(s) for s in scores], dtype=np.float64)

    def state(self) -> dict[str, Any]:
        """What :meth:`from_state` needs besides the reference (the export carries it)."""
        return {
            "seed": self.seed,
            "count": self.count,
            "stream": list(self.stream),
            "rng": self._rng.bit_generator.state,
        }

    @classmethod
    def from_state(cls, reference: Any, state: dict[str, Any]) -> ConformalPValues:
        made = cls(reference, seed=int(state["seed"]))
        made.stream = sorted(float(s) for s in state["stream"])
        made.count = int(state["count"])
        made._rng.bit_generator.state = state["rng"]
        return made


def _pvalue(greater: Any, equal: Any, u: Any, size: Any) -> Any:
    """The randomised p-value from the counts among ``size`` earlier scores (one formula for both
    paths, so they agree to the bit)."""
    return (greater + u * (equal + 1)) / (size + 1)


def _prefix(tree: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Per row, the sum of a Fenwick tree's first ``index`` entries."""
    rows = np.arange(tree.shape[0])
    total = np.zeros(tree.shape[0], dtype=np.int64)
    index = index.copy()
    while np.any(index > 0):
        live = index > 0
        total[live] += tree[rows[live], index[live]]
        index[live] -= index[live] & -index[live]
    return total


def _add(tree: np.ndarray, index: np.ndarray) -> None:
    rows = np.arange(tree.shape[0])
    index = index.copy()
    size = tree.shape[1]
    while np.any(index < size):
        live = index < size
        tree[rows[live], index[live]] += 1
        index[live] += index[live] & -index[live]


def _dense_ranks(streams: np.ndarray) -> np.ndarray:
    """Per row, each value's rank among the row's distinct values (ties share one), from 1."""
    order = np.argsort(streams, axis=1, kind="stable")
    ordered = np.take_along_axis(streams, order, axis=1)
    steps = np.concatenate(
        [np.ones((streams.shape[0], 1), dtype=np.int64), (ordered[:, 1:] != ordered[:, :-1])],
        axis=1,
    )
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.cumsum(steps, axis=1), axis=1)
    return ranks


def stream_pvalues(reference: Any, streams: Any, u: Any) -> np.ndarray:
    """The p-values :class:`ConformalPValues` gives, for many streams at once (simulations).

    ``streams`` [S, T]: S streams of T scores, each against ``reference`` plus its own earlier
    scores; ``u`` [S, T]: the randomisation, in (0, 1]. Equal, bit for bit, to feeding each row to
    a :class:`ConformalPValues` that draws the same ``u``. O(S T log T) time, an S x T tree.
    """
    ref = np.sort(np.asarray(reference, dtype=np.float64).reshape(-1))
    values = np.asarray(streams, dtype=np.float64)
    draws = np.asarray(u, dtype=np.float64)
    if values.ndim != 2 or draws.shape != values.shape:
        raise ParameterError(
            f"`streams` must be [streams, steps] and `u` the same shape; got {values.shape} and "
            f"{draws.shape}"
        )
    low = np.searchsorted(ref, values, side="left")
    high = np.searchsorted(ref, values, side="right")
    ref_greater, ref_equal = ref.size - high, high - low
    ranks = _dense_ranks(values)
    tree = np.zeros((values.shape[0], int(ranks.max(initial=0)) + 1), dtype=np.int64)
    out = np.empty_like(values)
    for t in range(values.shape[1]):
        rank = ranks[:, t]
        at_most, below = _prefix(tree, rank), _prefix(tree, rank - 1)
        greater = ref_greater[:, t] + (t - at_most)
        equal = ref_equal[:, t] + (at_most - below)
        out[:, t] = _pvalue(greater, equal, draws[:, t], ref.size + t)
        _add(tree, rank)
    return out
