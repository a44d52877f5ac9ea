"""Member selection: M different head subsets of one backbone -> a HydraSpec.

Members differ for two reasons, both seeded: each member's importance is estimated on its own
bootstrap resample of the data, and (with ``temperature > 0``) the kept heads of a layer are drawn
without replacement with probability rising with importance (Gumbel top-k over the layer's
standardised scores: ``temperature=0`` keeps the top-k). With ``objective="ood"`` the circuit
search of member m scores heads by how well the ensemble of members 0..m separates ID from OOD.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from hydra_deploy.backbones import BackboneAdapter, load_backbone
from hydra_deploy.errors import DataError, HydraError, SpecError
from hydra_deploy.pruning.data import load_data
from hydra_deploy.pruning.importance import (
    METHODS,
    Chooser,
    _ood_inputs,
    circuit_search,
    taylor_importance,
    top_k,
)
from hydra_deploy.specs import HydraSpec

logger = logging.getLogger("hydra_deploy")


def gumbel_chooser(rng: np.random.Generator, temperature: float) -> Chooser:
    """Draw k heads without replacement, P rising with the standardised score (Gumbel top-k)."""

    def choose(candidates: np.ndarray, scores: np.ndarray, k: int) -> np.ndarray:
        if temperature <= 0 or k >= len(candidates):
            return top_k(candidates, scores, k)
        spread = scores.std()
        z = (scores - scores.mean()) / (spread if spread > 0 else 1.0)
        keys = z / temperature + rng.gumbel(size=len(candidates))
        return top_k(candidates, keys, k)

    return choose


def heads_per_layer(
    backbone: BackboneAdapter,
    heads_per_member: int | Sequence[int] | None,
    keep_ratio: float | Sequence[float] | None,
    min_heads: int,
) -> list[int]:
    """Heads kept per layer: a count (or one per layer), or a ratio rounded per layer."""
    L, H = backbone.num_layers, backbone.num_heads
    if (heads_per_member is None) == (keep_ratio is None):
        raise HydraError("give exactly one of heads_per_member and keep_ratio")
    if heads_per_member is not None:
        counts = _per_layer(heads_per_member, L, "heads_per_member")
        counts = [int(c) for c in counts]
    else:
        ratios = [float(r) for r in _per_layer(keep_ratio, L, "keep_ratio")]
        bad = [r for r in ratios if not 0.0 < r <= 1.0]
        if bad:
            raise HydraError(
                f"keep_ratio must be within (0, 1] (the fraction of each layer's heads a member "
                f"keeps; 1 keeps all), got {bad[0]}"
            )
        counts = [max(min_heads, round(r * H)) for r in ratios]
    for layer, count in enumerate(counts):
        if not 0 <= count <= H:
            raise HydraError(f"layer {layer}: cannot keep {count} heads of {H}")
        if count < min_heads:
            raise HydraError(
                f"layer {layer}: {count} heads is below min_heads={min_heads}; lower min_heads "
                "(0 lets a member skip a layer's attention) or keep more heads"
            )
    return counts


def _per_layer(value: Any, L: int, name: str) -> list:
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        return [value] * L
    values = list(value)
    if len(values) != L:
        raise HydraError(f"{name} has {len(values)} entries, expected one per layer ({L})")
    return values


def select_members(
    backbone: Any,
    members: int,
    heads_per_member: int | Sequence[int] | None = None,
    keep_ratio: float | Sequence[float] | None = None,
    method: str = "taylor",
    data: Any = None,
    ood_data: Any = None,
    seed: int = 0,
    *,
    objective: str | None = None,
    temperature: float = 0.5,
    resample: bool = True,
    min_heads: int = 1,
    mlp_merge: str = "average",
    batch_size: int = 32,
    max_examples: int | None = 512,
    confident_fraction: float = 1.0,
    member_heads: Sequence[int | Sequence[int]] | None = None,
    conditioning: str = "member",
) -> HydraSpec:
    """Choose the heads of ``members`` members and return the HydraSpec.

    ``heads_per_member`` (per layer; an int or one per layer) or ``keep_ratio`` (rounded per
    layer, at least ``min_heads``) sets the counts. ``method``: ``"taylor"``, ``"circuit"`` or
    ``"random"``; ``data`` is labelled in-distribution data (any ``load_data`` input).
    ``objective`` (circuit): ``"loss"`` (default) or ``"ood"`` (default when ``ood_data`` is given).
    ``temperature``: 0 keeps each member's top heads; higher draws more diverse members.
    ``resample``: estimate each member's importance on its own bootstrap resample.
    ``conditioning`` (circuit): ``"member"`` scores each layer with the heads pruned so far
    masked, ``"headmap"`` with the circuit heads found so far masked (HeadMap's search).
    ``member_heads``: one head count per member (an int, or one per layer) instead of
    ``heads_per_member`` / ``keep_ratio``, so members prune by different ratios.
    Members come out distinct by construction: a member that repeats an earlier one is changed
    by the cheapest single swap (the kept head with the lowest score for the best pruned head of
    the same layer) that makes it new. Only asking for more members than there are distinct head
    subsets raises SpecError.
    """
    backbone = load_backbone(backbone)
    if not isinstance(members, (int, np.integer)) or isinstance(members, bool) or members < 1:
        raise SpecError(f"members must be a positive integer, got {members!r}")
    if method not in METHODS:
        raise HydraError(f"unknown selection method {method!r}; choose one of {METHODS}")
    if temperature < 0:
        raise HydraError(f"temperature must be >= 0, got {temperature}")
    if member_heads is not None:
        if heads_per_member is not None or keep_ratio is not None:
            raise HydraError("give member_heads or heads_per_member/keep_ratio, not both")
        if (
            not isinstance(member_heads, Sequence)
            or isinstance(member_heads, (str, bytes))
            or len(member_heads) != members
        ):
            raise HydraError(
                f"member_heads needs one head count per member ({members}), got {member_heads!r}"
            )
        member_counts = [heads_per_layer(backbone, k, None, min_heads) for k in member_heads]
    else:
        member_counts = [
            heads_per_layer(backbone, heads_per_member, keep_ratio, min_heads)
        ] * members
    for counts in {tuple(c) for c in member_counts}:
        _refuse_too_many(sum(c == list(counts) for c in member_counts), backbone.num_heads, counts)
    objective = objective or ("ood" if ood_data is not None and method == "circuit" else "loss")
    if objective == "ood" and ood_data is not None:  # read once, not once per member
        ood_data = _ood_inputs(ood_data, backbone, max_examples)
    if objective == "ood" and method != "circuit":
        raise HydraError("objective='ood' is a circuit objective; use method='circuit'")
    labelled = None
    if method != "random":
        if data is None:
            raise DataError(f"method {method!r} needs labelled data (data=...)")
        labelled = load_data(data, backbone, max_examples=max_examples)

    L, H = backbone.num_layers, backbone.num_heads
    chosen_masks: list[np.ndarray] = []
    for member in range(members):
        counts = member_counts[member]
        rng = np.random.default_rng([seed, member])
        chooser = gumbel_chooser(rng, temperature)
        member_data = labelled
        if labelled is not None and resample:
            member_data = labelled.resample(seed=int(rng.integers(2**31)))
        if method == "circuit":
            scores, mask = circuit_search(
                backbone,
                member_data,
                keep=counts,
                ood_data=ood_data,
                objective=objective,
                ensemble_masks=chosen_masks if objective == "ood" else (),
                chooser=chooser,
                batch_size=batch_size,
                max_examples=max_examples,
                confident_fraction=confident_fraction,
                conditioning=conditioning,
            )
        else:
            if method == "taylor":
                scores = taylor_importance(backbone, member_data, batch_size=batch_size)
            else:
                scores = rng.random((L, H))
            mask = np.zeros((L, H), dtype=np.float32)
            for layer in range(L):
                kept = chooser(np.arange(H), scores[layer], counts[layer])
                mask[layer, kept] = 1.0
        if any(np.array_equal(mask, other) for other in chosen_masks):
            mask = _distinct(mask, scores, chosen_masks)
            logger.info(
                "member %d repeated an earlier member's heads: the cheapest swap made it distinct",
                member,
            )
        chosen_masks.append(mask)
        logger.info("member %d: %d heads kept", member, int(mask.sum()))

    heads = [
        [[int(h) for h in np.flatnonzero(mask[layer])] for layer in range(L)]
        for mask in chosen_masks
    ]
    _refuse_identical(heads)
    spec = HydraSpec(
        backbone.name,
        L,
        H,
        backbone.head_dim,
        [{"heads": h} for h in heads],
        mlp_merge=mlp_merge,
        importance=method,
        seed=seed,
    )
    selection = {
        "heads_per_layer": member_counts[0] if member_heads is None else member_counts,
        "keep_ratio": keep_ratio,
        "temperature": temperature,
        "resample": "bootstrap" if resample else None,
        "objective": objective if method == "circuit" else None,
        "min_heads": min_heads,
        "max_examples": max_examples,
        "conditioning": conditioning if method == "circuit" else None,
        "data_examples": None if labelled is None else len(labelled),
    }
    if isinstance(keep_ratio, Sequence):
        selection["keep_ratio"] = [float(r) for r in keep_ratio]
    return spec.replace(meta={"selection": selection, "overlap": spec.overlap().round(4).tolist()})


def _refuse_too_many(members: int, num_heads: int, counts: Sequence[int]) -> None:
    """SpecError when fewer distinct head subsets exist than ``members`` asks for."""
    from math import comb, prod

    distinct = prod(comb(num_heads, k) for k in counts)
    if members > distinct:
        raise SpecError(
            f"{members} members cannot differ: keeping {counts[0] if len(set(counts)) == 1 else counts} "
            f"of {num_heads} heads per layer allows only {distinct} distinct member(s); keep fewer "
            "heads per member or ask for fewer members"
        )


def _distinct(mask: np.ndarray, scores: np.ndarray, taken: Sequence[np.ndarray]) -> np.ndarray:
    """``mask`` changed as little as ``scores`` allow so that it equals no mask in ``taken``.

    Tries single swaps (drop kept head ``a``, keep pruned head ``b`` of the same layer) in the
    order of their cost ``scores[l, a] - scores[l, b]``; when every single swap repeats a taken
    mask, swaps are applied to the cheapest new candidates in turn (breadth first). The caller has
    checked that enough distinct masks exist.
    """

    def swaps(current: np.ndarray) -> list[np.ndarray]:
        options = []
        for layer in range(current.shape[0]):
            kept, pruned = np.flatnonzero(current[layer]), np.flatnonzero(current[layer] == 0)
            for a in kept:
                for b in pruned:
                    cost = float(scores[layer, a] - scores[layer, b])
                    options.append((cost, layer, int(a), int(b)))
        out = []
        for _, layer, a, b in sorted(options):
            new = current.copy()
            new[layer, a], new[layer, b] = 0.0, 1.0
            out.append(new)
        return out

    frontier, seen = [mask], {mask.tobytes()}
    while frontier:
        following = []
        for current in frontier:
            for candidate in swaps(current):
                if candidate.tobytes() in seen:
                    continue
                if not any(np.array_equal(candidate, other) for other in taken):
                    return candidate
                seen.add(candidate.tobytes())
                following.append(candidate)
        frontier = following
    raise SpecError("no distinct head subset is left for this member")  # excluded by the caller


def _refuse_identical(heads: list) -> None:
    for a in range(len(heads)):
        for b in range(a + 1, len(heads)):
            if heads[a] == heads[b]:
                raise SpecError(
                    f"members {a} and {b} keep identical heads; raise temperature, use resample=True, "
                    "keep fewer heads per member, or change the seed"
                )
