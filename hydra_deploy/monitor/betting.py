"""Betting on p-values: test martingales that grow when the p-values stop looking uniform.

A betting function ``f`` with ``integral_0^1 f(p) dp = 1`` and ``f >= 0`` turns independent uniform
p-values into a martingale ``M_t = prod f_t(p_t)`` (``f_t`` may depend on p_1..p_{t-1}) with
``E[M_t] = 1``. Ville's inequality: ``P(sup_t M_t >= 1/alpha) <= alpha``, over the whole stream.
Both rules keep their wealth in logs (a long stream neither overflows nor underflows) and bet on
one stream (``streams=()``) or on many at once (``streams=(4000,)``: the benchmarks' simulations):

- :class:`SimpleJumper` (Vovk, Nouretdinov and Gammerman, "Testing exchangeability on-line",
  ICML 2003; Vovk 2021, "Testing randomness online"): three bettors ``f_e(p) = 1 + e (p - 1/2)``,
  ``e`` in (-1, 0, 1), a share ``jump`` of the capital re-spread evenly before each bet. It follows
  a change of direction (small p-values, then large) and recovers after a quiet stretch.
- :class:`PowerMixture`: the mixture over ``e`` of the power bettors ``e p^(e - 1)`` (a grid of
  ``e`` in (0, 1), equal weights), each run from the start: it bets on small p-values only (inputs
  more unusual than the reference: what an OOD score shows under shift) and grows faster there.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hydra_deploy.errors import ParameterError

__all__ = ["BETTING_RULES", "PowerMixture", "SimpleJumper", "betting_rule"]


def _logsumexp(values: np.ndarray) -> Any:
    """log(sum(exp(values))) over the last axis (a float for one stream, an array for many)."""
    top = np.max(values, axis=-1, keepdims=True)
    safe = np.where(np.isfinite(top), top, 0.0)
    out = np.log(np.sum(np.exp(values - safe), axis=-1)) + safe[..., 0]
    return float(out) if out.ndim == 0 else out


class SimpleJumper:
    """Vovk's Simple Jumper: capital over the bettors ``1 + e (p - 1/2)``, ``e`` in (-1, 0, 1)."""

    name = "jumper"
    EPSILONS = np.array([-1.0, 0.0, 1.0])

    def __init__(self, jump: float = 0.01, streams: tuple[int, ...] = ()) -> None:
        if not 0.0 <= float(jump) <= 1.0:
            raise ParameterError(f"`jump` {jump} must be in [0, 1] (Vovk's default: 0.01)")
        self.jump = float(jump)
        self.streams = tuple(streams)
        self.reset()

    @property
    def log_wealth(self) -> Any:
        return _logsumexp(self.log_capital)

    def bet(self, p: Any) -> None:
        """Stake on ``p`` (one per stream)."""
        before = np.asarray(self.log_wealth)[..., None]
        # re-spread a share `jump` of the total evenly: C_e <- (1 - J) C_e + J W / 3
        with np.errstate(divide="ignore"):
            spread = math.log(self.jump / 3.0) + before if self.jump > 0 else -math.inf
            kept = self.log_capital + (math.log1p(-self.jump) if self.jump < 1 else -math.inf)
            self.log_capital = np.logaddexp(kept, spread)
            stake = 1.0 + self.EPSILONS * (np.asarray(p, dtype=np.float64)[..., None] - 0.5)
            self.log_capital = self.log_capital + np.log(stake)

    def reset(self, where: Any = True) -> None:
        """Back to wealth 1 (``where``: a mask of the streams to reset)."""
        fresh = np.full((*self.streams, 3), math.log(1.0 / 3.0))
        if where is True:
            self.log_capital = fresh
        else:
            self.log_capital = np.where(np.asarray(where)[..., None], fresh, self.log_capital)

    def state(self) -> dict[str, Any]:
        return {"rule": self.name, "jump": self.jump, "log_capital": self.log_capital.tolist()}

    def restore(self, state: dict[str, Any]) -> None:
        self.log_capital = np.asarray(state["log_capital"], dtype=np.float64)


class PowerMixture:
    """The equal mixture of the power bettors ``e p^(e - 1)`` over ``e`` in a grid of (0, 1)."""

    name = "mixture"

    def __init__(self, grid: int = 20, streams: tuple[int, ...] = ()) -> None:
        if int(grid) < 1:
            raise ParameterError(f"`grid` {grid} must be at least 1")
        # midpoints of (0, 1): e = 1 (no bet) and e = 0 (all on p = 0) left out
        self.epsilons = (np.arange(int(grid)) + 0.5) / int(grid)
        self.streams = tuple(streams)
        self.reset()

    @property
    def log_wealth(self) -> Any:
        return _logsumexp(self.log_weight)

    def bet(self, p: Any) -> None:
        """Stake on ``p`` (one per stream)."""
        log_p = np.log(np.asarray(p, dtype=np.float64))[..., None]
        self.log_weight = self.log_weight + np.log(self.epsilons) + (self.epsilons - 1.0) * log_p

    def reset(self, where: Any = True) -> None:
        """Back to wealth 1 (``where``: a mask of the streams to reset)."""
        size = self.epsilons.size
        fresh = np.full((*self.streams, size), -math.log(size))
        if where is True:
            self.log_weight = fresh
        else:
            self.log_weight = np.where(np.asarray(where)[..., None], fresh, self.log_weight)

    def state(self) -> dict[str, Any]:
        return {
            "rule": self.name,
            "grid": self.epsilons.size,
            "log_weight": self.log_weight.tolist(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.log_weight = np.asarray(state["log_weight"], dtype=np.float64)


BETTING_RULES = {"jumper": SimpleJumper, "mixture": PowerMixture}


def betting_rule(name: str, **settings: Any) -> SimpleJumper | PowerMixture:
    """A fresh betting rule by name (``jumper`` or ``mixture``) with its ``settings``."""
    if name not in BETTING_RULES:
        raise ParameterError(
            f"unknown betting rule {name!r}: choose one of {', '.join(sorted(BETTING_RULES))}"
        )
    return BETTING_RULES[name](**settings)
