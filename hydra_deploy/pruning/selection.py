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
from math import comb, prod
from typing import Any

import numpy as np

from hydra_deploy.backbones import BackboneAdapter, load_backbone
from hydra_deploy.errors import (
    DataError,
    HydraError,
    ParameterError,
    SpecError,
    counted,
    said,
    spelled,
)
from hydra_deploy.options import SelectionOptions
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
                f"layer {layer}: {counted(count, 'head')} is below min_heads={min_heads}; lower "
                "min_heads "
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
    members: int | None = None,
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
    options: SelectionOptions | None = None,
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
    ``options``: a :class:`~hydra_deploy.options.SelectionOptions` instead of those keywords.
    Members come out distinct by construction: a member that repeats an earlier one is changed
    by the cheapest single swap (the kept head with the lowest score for the best pruned head of
    the same layer) that makes it new. Only asking for more members than there are distinct head
    subsets raises SpecError.
    """
    backbone = load_backbone(backbone)
    if options is not None:
        arguments = {k: v for k, v in locals().items() if k not in ("backbone", "options")}
        return select_members(backbone, **_from_options(backbone, options, arguments))
    _check_arguments(members, method, temperature)
    member_counts = _member_counts(
        backbone, members, heads_per_member, keep_ratio, member_heads, min_heads
    )
    objective, ood_data, labelled = _read_inputs(
        backbone, method, objective, data, ood_data, max_examples
    )
    masks = _choose_masks(
        backbone,
        method,
        labelled,
        member_counts,
        seed=seed,
        temperature=temperature,
        resample=resample,
        ood_data=ood_data,
        objective=objective,
        batch_size=batch_size,
        max_examples=max_examples,
        confident_fraction=confident_fraction,
        conditioning=conditioning,
    )
    spec = _spec_of(backbone, masks, mlp_merge=mlp_merge, importance=method, seed=seed)
    selection = {
        "heads_per_layer": member_counts[0] if member_heads is None else member_counts,
        "keep_ratio": _plain_ratio(keep_ratio),
        "temperature": temperature,
        "resample": "bootstrap" if resample else None,
        "objective": objective if method == "circuit" else None,
        "min_heads": min_heads,
        "max_examples": max_examples,
        "conditioning": conditioning if method == "circuit" else None,
        "data_examples": None if labelled is None else len(labelled),
    }
    return spec.replace(meta={"selection": selection, "overlap": spec.overlap().round(4).tolist()})


def _plain_ratio(keep_ratio: Any) -> Any:
    """``keep_ratio`` as JSON (a list of floats when one per layer)."""
    return [float(r) for r in keep_ratio] if isinstance(keep_ratio, Sequence) else keep_ratio


def _check_arguments(members: Any, method: str, temperature: float) -> None:
    if not isinstance(members, (int, np.integer)) or isinstance(members, bool) or members < 1:
        raise SpecError(f"members must be a positive integer, got {members!r}")
    if method not in METHODS:
        raise HydraError(f"unknown selection method {method!r}; choose one of {METHODS}")
    if temperature < 0:
        raise HydraError(f"temperature must be >= 0, got {temperature}")


def _read_inputs(
    backbone: BackboneAdapter,
    method: str,
    objective: str | None,
    data: Any,
    ood_data: Any,
    max_examples: int | None,
) -> tuple[str, Any, Any]:
    """(objective, OOD inputs, labelled data) of a selection, each read once."""
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
    return objective, ood_data, labelled


def _choose_masks(
    backbone: BackboneAdapter,
    method: str,
    labelled: Any,
    member_counts: list[list[int]],
    *,
    seed: int,
    temperature: float,
    resample: bool,
    **circuit: Any,
) -> list[np.ndarray]:
    """Each member's kept-heads mask [L, H], distinct from the earlier members' ones."""
    chosen_masks: list[np.ndarray] = []
    for member, counts in enumerate(member_counts):
        rng = np.random.default_rng([seed, member])
        member_data = labelled
        if labelled is not None and resample:
            member_data = labelled.resample(seed=int(rng.integers(2**31)))
        chooser = gumbel_chooser(rng, temperature)
        scores, mask = _choose_member(
            backbone, method, member_data, counts, chooser, rng, chosen_masks, **circuit
        )
        if any(np.array_equal(mask, other) for other in chosen_masks):
            mask = _distinct(mask, scores, chosen_masks)
            logger.info(
                "member %d repeated an earlier member's heads: the cheapest swap made it distinct",
                member,
            )
        chosen_masks.append(mask)
        logger.info("member %d: %d heads kept", member, int(mask.sum()))
    return chosen_masks


def _spec_of(backbone: BackboneAdapter, masks: list[np.ndarray], **fields: Any) -> HydraSpec:
    """The HydraSpec of the members' masks; SpecError when two members keep the same heads."""
    L = backbone.num_layers
    heads = [
        [[int(h) for h in np.flatnonzero(mask[layer])] for layer in range(L)] for mask in masks
    ]
    _refuse_identical(heads)
    return HydraSpec(
        backbone.name,
        L,
        backbone.num_heads,
        backbone.head_dim,
        [{"heads": h} for h in heads],
        **fields,
    )


#: select_members' keywords for SelectionOptions' fields (the others have the fields' names)
_KEYWORD_OF_FIELD = {"importance": "method", "calib": "data", "ood": "ood_data"}
_KEYWORD_DEFAULTS = {
    "heads_per_member": None,
    "keep_ratio": None,
    "method": "taylor",
    "data": None,
    "ood_data": None,
    "seed": 0,
    "objective": None,
    "temperature": 0.5,
    "max_examples": 512,
    "conditioning": "member",
}


def _differs(value: Any, default: Any) -> bool:
    """Whether a keyword was given (data may be arrays: compared by identity with None)."""
    return value is not None if default is None else bool(value != default)


def _from_options(
    backbone: BackboneAdapter, options: SelectionOptions, arguments: dict[str, Any]
) -> dict[str, Any]:
    """select_members' arguments with ``options`` put in for the selection keywords (refused when
    given besides them)."""
    mixed = [k for k, v in _KEYWORD_DEFAULTS.items() if _differs(arguments[k], v)]
    if mixed:
        raise ParameterError(
            f"{', '.join(f'`{k}`' for k in mixed)} given besides `options`: set "
            "SelectionOptions' fields instead"
        )
    members = arguments["members"]
    if members is not None and options.members is not None and members != options.members:
        raise ParameterError(
            f"`members` {members} disagrees with the options' members {options.members}"
        )
    members = members if members is not None else (options.members or 3)
    fields = (*_KEYWORD_OF_FIELD, *(k for k in _KEYWORD_DEFAULTS if hasattr(options, k)))
    keywords = {_KEYWORD_OF_FIELD.get(name, name): getattr(options, name) for name in fields}
    keywords["method"] = options.method
    if options.heads_per_member is None and options.keep_ratio is None:
        keywords["heads_per_member"] = max(1, backbone.num_heads // max(members, 1))
    return {**arguments, **keywords, "members": members}


def _member_counts(
    backbone: BackboneAdapter,
    members: int,
    heads_per_member: Any,
    keep_ratio: Any,
    member_heads: Any,
    min_heads: int,
) -> list[list[int]]:
    """Heads kept per layer, per member; SpecError when the members cannot all differ."""
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
    return member_counts


def _choose_member(
    backbone: BackboneAdapter,
    method: str,
    member_data: Any,
    counts: list[int],
    chooser: Chooser,
    rng: np.random.Generator,
    chosen_masks: list[np.ndarray],
    **circuit: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """(scores, mask [L, H]) of one member: a circuit search, or top heads by Taylor importance
    or random scores, drawn by ``chooser``."""
    L, H = backbone.num_layers, backbone.num_heads
    if method == "circuit":
        objective = circuit["objective"]
        return circuit_search(
            backbone,
            member_data,
            keep=counts,
            ensemble_masks=chosen_masks if objective == "ood" else (),
            chooser=chooser,
            **circuit,
        )
    if method == "taylor":
        scores = taylor_importance(backbone, member_data, batch_size=circuit["batch_size"])
    else:
        scores = rng.random((L, H))
    mask = np.zeros((L, H), dtype=np.float32)
    for layer in range(L):
        kept = chooser(np.arange(H), scores[layer], counts[layer])
        mask[layer, kept] = 1.0
    return scores, mask


def _refuse_too_many(members: int, num_heads: int, counts: Sequence[int]) -> None:
    """SpecError when fewer distinct head subsets exist than ``members`` asks for."""
    distinct = prod(comb(num_heads, k) for k in counts)
    if members > distinct:
        raise SpecError(
            f"{members} members cannot differ: keeping {counts[0] if len(set(counts)) == 1 else counts} "
            f"of {num_heads} heads per layer allows only {counted(distinct, 'distinct member')}; "
            "keep fewer "
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
                    f"members {a} and {b} keep identical heads; "
                    + said("raise `temperature`, ")
                    + spelled("use resample=True, ", "")
                    + said("keep fewer heads per member, or change the `seed`")
                )
