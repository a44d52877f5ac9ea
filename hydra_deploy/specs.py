"""Hydra ensemble specifications: which attention heads each member keeps.

A Hydra ensemble is ``M`` members built from one Transformer backbone; member ``m`` keeps, in each
layer ``l``, a subset of that layer's attention heads. :class:`MemberSpec` is one member's choice,
:class:`HydraSpec` the whole ensemble plus the backbone geometry it refers to. Both are immutable
and validated on construction, so an invalid spec can never exist. Specs are stored as JSON in the
``hydra-spec/1`` format (see :meth:`HydraSpec.to_dict`).

Only numpy and the standard library are used, so this module is cheap to import.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import itertools
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import numpy as np

from hydra_deploy.atomic import atomic_write_text
from hydra_deploy.errors import SpecError, counted, spelled

__all__ = [
    "FORMAT",
    "IMPORTANCE_METHODS",
    "MLP_MERGE_MODES",
    "SUPPORTED_FORMATS",
    "HydraSpec",
    "MemberSpec",
]

FORMAT = "hydra-spec/1"
"""The format string written by :meth:`HydraSpec.to_dict`."""

SUPPORTED_FORMATS: tuple[str, ...] = (FORMAT,)
"""Format strings :meth:`HydraSpec.from_dict` understands."""

MLP_MERGE_MODES: tuple[str, ...] = ("average", "grouped")
"""Allowed values of :attr:`HydraSpec.mlp_merge`."""

IMPORTANCE_METHODS: tuple[str, ...] = ("taylor", "circuit", "random", "manual")
"""Known values of :attr:`HydraSpec.importance` (any non-empty string is accepted)."""

_REQUIRED_KEYS = ("format", "backbone", "num_layers", "num_heads", "head_dim", "members")
_OPTIONAL_KEYS = ("mlp_merge", "importance", "seed", "meta")
_ALL_KEYS = _REQUIRED_KEYS + _OPTIONAL_KEYS
_MAX_RESAMPLES = 1000
_MAX_META_DEPTH = 100  # nesting levels of meta (deeper would exhaust the stack)


# --------------------------------------------------------------------------------------------------
# small helpers


def _fail(where: str, message: str) -> NoReturn:
    raise SpecError(f"{where}: {message}" if where else message)


def _where(member: int | None, layer: int | None = None) -> str:
    parts = []
    if member is not None:
        parts.append(f"member {member}")
    if layer is not None:
        parts.append(f"layer {layer}")
    return ", ".join(parts)


def _is_int(value: object) -> bool:
    """True for Python / numpy integers, False for bools."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_sequence(value: object) -> bool:
    """True for iterables that may hold heads or layers (not strings, bytes or mappings)."""
    if isinstance(value, (str, bytes, bytearray, Mapping)):
        return False
    if isinstance(value, np.ndarray):
        return value.ndim >= 1
    return isinstance(value, Iterable)


def _describe(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def _check_count(name: str, value: object, minimum: int = 1) -> int:
    if not _is_int(value) or int(value) < minimum:  # type: ignore[call-overload]
        raise SpecError(f"{name} must be an int >= {minimum}, got {_describe(value)}")
    return int(value)  # type: ignore[call-overload]


def _quoted(names: Iterable[object]) -> str:
    return ", ".join(repr(n) for n in names)


def _and_list(items: Sequence[object], limit: int = 6) -> str:
    words = [str(i) for i in items[:limit]]
    if len(items) > limit:
        return ", ".join(words) + f", ... ({len(items)} in all)"
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " and " + words[-1]


def _check_json_value(value: object, where: str, depth: int = 0) -> Any:
    """Return a deep copy of a JSON-able value (tuples become lists); SpecError otherwise."""
    if depth > _MAX_META_DEPTH:
        _fail("", f"meta is nested more than {_MAX_META_DEPTH} levels deep; keep it shallow")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            _fail("", f"{where} is {value!r}, which JSON cannot store; use a finite number or None")
        return value
    if isinstance(value, (list, tuple)):
        return [_check_json_value(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                _fail("", f"{where} has key {_describe(k)}; JSON object keys must be str")
            out[k] = _check_json_value(v, f"{where}[{k!r}]", depth + 1)
        return out
    _fail("", f"{where} is {_describe(value)}, which JSON cannot store; use plain JSON values")


def _coerce_heads(heads: object, member: int | None) -> tuple[tuple[int, ...], ...]:
    """Validate and normalise one member's nested head lists (structure only, not ranges)."""
    if not _is_sequence(heads):
        _fail(
            _where(member),
            f"heads must be a sequence with one sequence of head indices per layer, "
            f"got {_describe(heads)}",
        )
    layers: list[tuple[int, ...]] = []
    for layer, kept in enumerate(heads):  # type: ignore[arg-type]
        where = _where(member, layer)
        if not _is_sequence(kept):
            _fail(where, f"expected a sequence of head indices, got {_describe(kept)}")
        values: list[int] = []
        for head in kept:
            if not _is_int(head):
                _fail(where, f"head {_describe(head)} is not an integer; use int head indices")
            if int(head) < 0:
                _fail(where, f"head {int(head)} is negative; head indices count from 0")
            values.append(int(head))
        if isinstance(kept, (set, frozenset)):
            values.sort()
        seen: set[int] = set()
        for head in values:
            if head in seen:
                _fail(where, f"head {head} is listed twice; list each head once")
            seen.add(head)
        if any(a > b for a, b in itertools.pairwise(values)):
            _fail(where, f"heads must be in ascending order, got {values}; sort them")
        layers.append(tuple(values))
    return tuple(layers)


def _member_from_mapping(data: object, member: int | None) -> MemberSpec:
    where = _where(member)
    if not isinstance(data, Mapping):
        _fail(where, f'expected an object {{"heads": [[...], ...]}}, got {_describe(data)}')
    unknown = [k for k in data if k != "heads"]
    if unknown:
        _fail(where, f"unknown key(s) {_quoted(unknown)}; a member has only 'heads'")
    if "heads" not in data:
        _fail(where, "missing key 'heads'")
    return MemberSpec(_coerce_heads(data["heads"], member))


def _dumps(obj: Any, indent: int | None, level: int = 0) -> str:
    """JSON text like ``json.dumps(obj, indent=indent)``, but lists of scalars stay on one line."""
    if indent is None:
        return json.dumps(obj, allow_nan=False)
    pad = " " * (indent * (level + 1))
    end = " " * (indent * level)
    if isinstance(obj, Mapping):
        if not obj:
            return "{}"
        items = [f"{pad}{json.dumps(k)}: {_dumps(v, indent, level + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    if isinstance(obj, (list, tuple)):
        if not obj:
            return "[]"
        if not any(isinstance(v, (Mapping, list, tuple)) for v in obj):
            return json.dumps(list(obj), allow_nan=False)
        items = [pad + _dumps(v, indent, level + 1) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + end + "]"
    return json.dumps(obj, allow_nan=False)


def _atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically; failures become SpecError."""
    try:
        atomic_write_text(path, text)
    except OSError as e:
        raise SpecError(f"cannot write spec to '{path}': {e.strerror or e}") from e


# --------------------------------------------------------------------------------------------------
# MemberSpec


@dataclass(frozen=True)
class MemberSpec:
    """The heads one ensemble member keeps: ``heads[l]`` = ascending head indices kept in layer l.

    Any nested iterables of ints are accepted and stored as tuples; sets are sorted. Bools,
    non-integers, negative, duplicate or unsorted indices raise :class:`SpecError`. Whether the
    indices fit a backbone is checked by :class:`HydraSpec`.
    """

    heads: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "heads", _coerce_heads(self.heads, None))

    @property
    def num_layers(self) -> int:
        """Number of layers this member describes."""
        return len(self.heads)

    def num_kept(self, layer: int) -> int:
        """Number of heads kept in ``layer``."""
        if not _is_int(layer) or not 0 <= int(layer) < self.num_layers:
            raise SpecError(
                f"layer {layer!r} is out of range 0..{self.num_layers - 1} "
                f"(num_layers={self.num_layers})"
            )
        return len(self.heads[int(layer)])

    @property
    def total_kept(self) -> int:
        """Number of heads kept over all layers."""
        return sum(len(kept) for kept in self.heads)

    def to_dict(self) -> dict[str, Any]:
        """``{"heads": [[...], ...]}``."""
        return {"heads": [list(kept) for kept in self.heads]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemberSpec:
        """Inverse of :meth:`to_dict`; unknown or missing keys raise :class:`SpecError`."""
        return _member_from_mapping(data, None)


# --------------------------------------------------------------------------------------------------
# HydraSpec


@dataclass(frozen=True)
class HydraSpec:
    """An ensemble of ``M`` head subsets of one backbone with ``num_layers`` x ``num_heads`` heads.

    ``members`` accepts :class:`MemberSpec` objects, nested head lists or ``{"heads": ...}`` dicts
    and is stored as a tuple of :class:`MemberSpec`. ``mlp_merge`` is ``"average"`` or
    ``"grouped"``; ``importance`` names how the heads were chosen (see ``IMPORTANCE_METHODS``);
    ``meta`` holds free-form JSON-able extras and is ignored by ``==`` and ``hash``.
    """

    backbone: str
    num_layers: int
    num_heads: int
    head_dim: int
    members: tuple[MemberSpec, ...]
    mlp_merge: str = "average"
    importance: str | None = None
    seed: int | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    FORMAT: ClassVar[str] = FORMAT

    # ---------------------------------------------------------------------------- validation

    def __post_init__(self) -> None:
        if not isinstance(self.backbone, str) or not self.backbone.strip():
            raise SpecError(
                f"backbone must be a non-empty str naming the model, got {_describe(self.backbone)}"
            )
        for name in ("num_layers", "num_heads", "head_dim"):
            object.__setattr__(self, name, _check_count(name, getattr(self, name)))
        if not isinstance(self.mlp_merge, str) or self.mlp_merge not in MLP_MERGE_MODES:
            raise SpecError(
                f"mlp_merge must be one of {_quoted(MLP_MERGE_MODES)}, "
                f"got {_describe(self.mlp_merge)}"
            )
        if self.importance is not None and (
            not isinstance(self.importance, str) or not self.importance
        ):
            raise SpecError(
                f"importance must be None or a non-empty str such as "
                f"{_quoted(IMPORTANCE_METHODS)}, got {_describe(self.importance)}"
            )
        if self.seed is not None:
            if not _is_int(self.seed):
                raise SpecError(f"seed must be an int or None, got {_describe(self.seed)}")
            object.__setattr__(self, "seed", int(self.seed))
        if not isinstance(self.meta, Mapping):
            raise SpecError(f"meta must be a dict of JSON-able values, got {_describe(self.meta)}")
        object.__setattr__(self, "meta", _check_json_value(self.meta, "meta"))
        object.__setattr__(self, "members", self._coerce_members(self.members))

    def _coerce_members(self, members: object) -> tuple[MemberSpec, ...]:
        if isinstance(members, MemberSpec):
            raise SpecError(
                "members must be a sequence of members, got one MemberSpec; wrap it in [...]"
            )
        if not _is_sequence(members):
            raise SpecError(
                "members must be a sequence of MemberSpec, nested head lists or "
                f'{{"heads": ...}} dicts, got {_describe(members)}'
            )
        out: list[MemberSpec] = []
        for m, item in enumerate(members):  # type: ignore[arg-type]
            if isinstance(item, MemberSpec):
                out.append(item)
            elif isinstance(item, Mapping):
                out.append(_member_from_mapping(item, m))
            else:
                out.append(MemberSpec(_coerce_heads(item, m)))
        if not out:
            raise SpecError("a HydraSpec needs at least one member (got 0)")
        for m, member in enumerate(out):
            if member.num_layers != self.num_layers:
                raise SpecError(
                    f"member {m} has {counted(member.num_layers, 'layer')}, expected "
                    f"num_layers={self.num_layers}; give one list of heads per layer"
                )
            for layer, kept in enumerate(member.heads):
                if kept and kept[-1] >= self.num_heads:
                    bad = next(h for h in kept if h >= self.num_heads)
                    raise SpecError(
                        f"member {m}, layer {layer}: head {bad} is out of range "
                        f"0..{self.num_heads - 1} (num_heads={self.num_heads})"
                    )
        return tuple(out)

    # ---------------------------------------------------------------------------- basics

    @property
    def num_members(self) -> int:
        """Number of ensemble members ``M``."""
        return len(self.members)

    def __str__(self) -> str:
        return self.summary()

    def replace(self, **changes: Any) -> HydraSpec:
        """A new, validated spec with some fields changed (like :func:`dataclasses.replace`)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise SpecError(
                f"unknown HydraSpec field(s) {_quoted(unknown)}; "
                f"fields are {_quoted(sorted(names))}"
            )
        return dataclasses.replace(self, **changes)

    def with_members(self, members: Iterable[Any]) -> HydraSpec:
        """A new, validated spec with the same backbone and settings but other members."""
        return self.replace(members=members)

    def _member_index(self, member: object) -> int:
        if not _is_int(member) or not 0 <= int(member) < self.num_members:  # type: ignore[call-overload]
            raise SpecError(
                f"member index {member!r} is out of range 0..{self.num_members - 1} "
                f"(num_members={self.num_members})"
            )
        return int(member)  # type: ignore[call-overload]

    # ---------------------------------------------------------------------------- (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        """The ``hydra-spec/1`` JSON layout; ``meta`` is included only when non-empty."""
        d: dict[str, Any] = {
            "format": FORMAT,
            "backbone": self.backbone,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "members": [m.to_dict() for m in self.members],
            "mlp_merge": self.mlp_merge,
            "importance": self.importance,
            "seed": self.seed,
        }
        if self.meta:
            d["meta"] = copy.deepcopy(self.meta)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HydraSpec:
        """Inverse of :meth:`to_dict`; checks the format, missing, unknown and mistyped keys."""
        if not isinstance(data, Mapping):
            raise SpecError(f"a spec must be a JSON object, got {_describe(data)}")
        understood = _quoted(SUPPORTED_FORMATS)
        if "format" not in data:
            raise SpecError(
                f"spec has no 'format' key; understood formats: {understood} "
                f'(add "format": "{FORMAT}")'
            )
        if not isinstance(data["format"], str) or data["format"] not in SUPPORTED_FORMATS:
            raise SpecError(
                f"unsupported spec format {data['format']!r}; understood formats: {understood}"
            )
        unknown = [k for k in data if k not in _ALL_KEYS]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(str(k), _ALL_KEYS, n=1)
                if close:
                    hints.append(f"{k!r} -> {close[0]!r}?")
            hint = f" (did you mean {', '.join(hints)})" if hints else ""
            raise SpecError(
                f"unknown key(s) in spec: {_quoted(unknown)}{hint}; allowed keys: "
                f"{', '.join(_ALL_KEYS)}"
            )
        missing = [k for k in _REQUIRED_KEYS if k not in data]
        if missing:
            raise SpecError(f"spec is missing required key(s): {_quoted(missing)}")
        raw_members = data["members"]
        if not isinstance(raw_members, (list, tuple)):
            raise SpecError(
                f"'members' must be a list of member objects, got {_describe(raw_members)}"
            )
        members = tuple(_member_from_mapping(item, m) for m, item in enumerate(raw_members))
        meta = data.get("meta", {})
        if not isinstance(meta, Mapping):
            raise SpecError(f"'meta' must be a JSON object, got {_describe(meta)}")
        return cls(
            backbone=data["backbone"],
            num_layers=data["num_layers"],
            num_heads=data["num_heads"],
            head_dim=data["head_dim"],
            members=members,
            mlp_merge=data.get("mlp_merge", "average"),
            importance=data.get("importance"),
            seed=data.get("seed"),
            meta=dict(meta),
        )

    def to_json(self, path: str | os.PathLike[str] | None = None, indent: int | None = 2) -> str:
        """The spec as JSON text; when ``path`` is given the file is also written atomically."""
        text = _dumps(self.to_dict(), indent) + "\n"
        if path is not None:
            _atomic_write(Path(path), text)
        return text

    @classmethod
    def from_json(cls, source: str | bytes | os.PathLike[str]) -> HydraSpec:
        """Load a spec from JSON text or a file path (a str not starting with ``{`` is a path)."""
        path: Path | None = None
        if isinstance(source, (bytes, bytearray)):
            try:
                text = bytes(source).decode("utf-8-sig")
            except UnicodeDecodeError as e:
                raise SpecError(f"spec JSON is not valid UTF-8: {e}") from None
        elif isinstance(source, str) and (not source.strip() or source.lstrip()[0] in "{["):
            text = source
        elif isinstance(source, (str, os.PathLike)):
            path = Path(source)
            try:
                text = path.read_text(encoding="utf-8-sig")
            except FileNotFoundError:
                raise SpecError(f"spec file '{path}' does not exist; check the path") from None
            except IsADirectoryError:
                raise SpecError(f"spec path '{path}' is a folder, not a JSON file") from None
            except UnicodeDecodeError as e:
                raise SpecError(f"spec file '{path}' is not UTF-8 text: {e}") from None
            except OSError as e:
                raise SpecError(f"cannot read spec file '{path}': {e.strerror or e}") from None
            except ValueError as e:  # a NUL byte or a lone surrogate: no file can have this name
                raise SpecError(
                    f"cannot read spec file {str(path)[:80]!r}: not a usable file name ({e}); pass "
                    "a path, or JSON text starting with '{'"
                ) from None
        else:
            raise SpecError(f"from_json expects JSON text or a path, got {_describe(source)}")
        origin = f"spec file '{path}'" if path is not None else "spec JSON"
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(
                f"invalid JSON in {origin} at line {e.lineno}, column {e.colno}: {e.msg}"
            ) from None
        except ValueError as e:  # an integer with more digits than Python converts
            raise SpecError(f"cannot parse {origin}: {e}") from None
        except RecursionError:
            raise SpecError(
                f"{origin} is nested too deeply to parse; a spec is an object holding lists of "
                "head indices"
            ) from None
        if path is None:
            return cls.from_dict(data)
        try:
            return cls.from_dict(data)
        except SpecError as e:
            raise SpecError(f"{origin}: {e}") from None

    # ---------------------------------------------------------------------------- analysis

    def head_mask(self, member: int) -> np.ndarray:
        """float32 ``[num_layers, num_heads]`` mask, 1.0 where ``member`` keeps the head."""
        m = self._member_index(member)
        mask = np.zeros((self.num_layers, self.num_heads), dtype=np.float32)
        for layer, kept in enumerate(self.members[m].heads):
            mask[layer, list(kept)] = 1.0
        return mask

    def head_masks(self) -> np.ndarray:
        """float32 ``[M, num_layers, num_heads]`` masks of all members."""
        return np.stack([self.head_mask(m) for m in range(self.num_members)])

    def heads_per_layer(self) -> np.ndarray:
        """int64 ``[M, num_layers]``: number of heads each member keeps in each layer."""
        return np.array(
            [[len(kept) for kept in m.heads] for m in self.members], dtype=np.int64
        ).reshape(self.num_members, self.num_layers)

    def shared_heads(self) -> np.ndarray:
        """int64 ``[M, M]``: number of (layer, head) pairs both members keep."""
        flat = self.head_masks().reshape(self.num_members, -1).astype(np.int64)
        return flat @ flat.T

    def overlap(self) -> np.ndarray:
        """float64 ``[M, M]`` Jaccard overlap of kept (layer, head) pairs; two empty sets -> 1.0."""
        inter = self.shared_heads().astype(np.float64)
        sizes = np.diag(inter)
        union = sizes[:, None] + sizes[None, :] - inter
        return np.where(union > 0, inter / np.maximum(union, 1.0), 1.0)

    def shared_prefix_layers(self) -> int:
        """Number of leading layers in which every member keeps exactly the same heads."""
        first = self.members[0].heads
        for layer in range(self.num_layers):
            if any(m.heads[layer] != first[layer] for m in self.members[1:]):
                return layer
        return self.num_layers

    def summary(self) -> str:
        """Human-readable text: header, heads kept per member and layer, pairwise overlap."""
        L, H, M = self.num_layers, self.num_heads, self.num_members
        lines = [
            f"HydraSpec {self.backbone!r}: {L} layers x {H} heads (head_dim {self.head_dim}), "
            f"{M} member{'s' if M != 1 else ''}, mlp_merge={self.mlp_merge}, "
            f"importance={self.importance}, seed={self.seed}",
            f"heads kept per member and layer (of {H} per layer, {L * H} in all):",
        ]
        counts = self.heads_per_layer()
        label_w = max(len("member"), len(f"m{M - 1}"))
        col_w = [max(len(f"L{layer}"), len(str(H))) for layer in range(L)]
        total_w = max(len("total"), len(str(L * H)))
        header = " ".join(
            [f"{'member':<{label_w}}"]
            + [f"{f'L{layer}':>{w}}" for layer, w in enumerate(col_w)]
            + [f"{'total':>{total_w}}", f"{'%':>6}"]
        )
        lines.append(header)
        for m in range(M):
            total = int(counts[m].sum())
            row = (
                [f"{f'm{m}':<{label_w}}"]
                + [f"{int(c):>{w}}" for c, w in zip(counts[m], col_w, strict=True)]
                + [f"{total:>{total_w}}", f"{100.0 * total / (L * H):>5.1f}%"]
            )
            lines.append(" ".join(row))
        shared = self.shared_prefix_layers()
        if M > 1:
            lines.append(
                f"shared prefix: {shared} layer{'s' if shared != 1 else ''} identical in all "
                "members"
            )
        lines.append("pairwise overlap (Jaccard of kept (layer, head) pairs):")
        ov = self.overlap()
        name_w = len(f"m{M - 1}")
        lines.append(" " * name_w + "".join(f"{f'm{j}':>6}" for j in range(M)))
        for i in range(M):
            lines.append(f"{f'm{i}':<{name_w}}" + "".join(f"{ov[i, j]:>6.2f}" for j in range(M)))
        return "\n".join(lines)

    # ---------------------------------------------------------------------------- constructors

    @classmethod
    def full(
        cls, backbone: str, num_layers: int, num_heads: int, head_dim: int, members: int = 1
    ) -> HydraSpec:
        """``members`` members that all keep every head (``importance="manual"``)."""
        num_layers = _check_count("num_layers", num_layers)
        num_heads = _check_count("num_heads", num_heads)
        members = _check_count("members", members)
        heads = [tuple(range(num_heads))] * num_layers
        return cls(
            backbone=backbone,
            num_layers=num_layers,
            num_heads=num_heads,
            head_dim=head_dim,
            members=[MemberSpec(heads) for _ in range(members)],
            importance="manual",
        )

    @classmethod
    def random(
        cls,
        backbone: str,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        members: int,
        heads_per_member: int | Sequence[int],
        *,
        shared_layers: int = 0,
        disjoint: bool = False,
        seed: int | None = 0,
        mlp_merge: str = "average",
    ) -> HydraSpec:
        """Random head subsets drawn with ``numpy.random.default_rng(seed)``.

        In every layer member ``m`` keeps ``heads_per_member`` heads (one int for all, or one int
        per member). The first ``shared_layers`` layers are identical in all members: they keep
        member 0's heads (hence member 0's count). With ``disjoint=True`` members keep disjoint
        sets in every other layer. When ``members > 1`` the members are guaranteed to differ
        pairwise; a request where that is impossible raises :class:`SpecError`.
        """
        L = _check_count("num_layers", num_layers)
        H = _check_count("num_heads", num_heads)
        M = _check_count("members", members)
        counts = _head_counts(heads_per_member, M, H)
        if not _is_int(shared_layers) or not 0 <= int(shared_layers) <= L:
            raise SpecError(
                f"shared_layers must be an int in 0..{L} (num_layers={L}), "
                f"got {_describe(shared_layers)}"
            )
        shared = int(shared_layers)
        if not isinstance(disjoint, (bool, np.bool_)):
            raise SpecError(f"disjoint must be a bool, got {_describe(disjoint)}")
        if seed is not None and not _is_int(seed):
            raise SpecError(f"seed must be an int or None, got {_describe(seed)}")
        free = L - shared
        if disjoint and free > 0 and sum(counts) > H:
            raise SpecError(
                f"disjoint=True needs the members' head counts to fit in one layer, but "
                f"sum(heads_per_member)={sum(counts)} > num_heads={H}; keep fewer heads per member"
            )
        if M > 1:
            cls._check_can_differ(counts, H, free, shared, bool(disjoint))
        heads = _RandomHeads(np.random.default_rng(seed), counts, L, H, shared).draw(disjoint)
        return cls(
            backbone=backbone,
            num_layers=L,
            num_heads=H,
            head_dim=head_dim,
            members=[MemberSpec(h) for h in heads],
            mlp_merge=mlp_merge,
            importance="random",
            seed=seed,
        )

    @staticmethod
    def _check_can_differ(
        counts: list[int], H: int, free: int, shared: int, disjoint: bool
    ) -> None:
        """Raise SpecError when members with these head counts cannot all differ."""
        M = len(counts)
        if free == 0:
            raise SpecError(
                f"the {M} members cannot differ: "
                + spelled(
                    f"shared_layers={shared} makes every layer shared; use shared_layers < "
                    "num_layers",
                    f"--shared-layers {shared} makes every layer shared; use a smaller "
                    "--shared-layers",
                )
            )
        groups: dict[int, list[int]] = {}
        for m, k in enumerate(counts):
            groups.setdefault(k, []).append(m)
        for k, idx in groups.items():
            if len(idx) < 2:
                continue
            if disjoint:
                capacity = 1 if k == 0 else len(idx)  # non-empty disjoint sets always differ
            else:
                per_layer = math.comb(H, k)
                capacity = 1
                for _ in range(free):
                    capacity *= per_layer
                    if capacity >= len(idx):
                        break
            if capacity < len(idx):
                raise SpecError(
                    f"members {_and_list(idx)} cannot all differ: each keeps {k} of {H} heads in "
                    f"{free} non-shared layer{'s' if free != 1 else ''}, which allows only "
                    f"{capacity} distinct choice{'s' if capacity != 1 else ''}; give them "
                    f"different heads_per_member, or use fewer members or shared layers"
                )


def _head_counts(heads_per_member: Any, M: int, H: int) -> list[int]:
    """``heads_per_member`` (one int for all, or one per member) as one count in 0..H per member."""
    if _is_int(heads_per_member):
        raw_counts: list[object] = [heads_per_member] * M
    elif _is_sequence(heads_per_member):
        raw_counts = list(heads_per_member)
        if len(raw_counts) != M:
            raise SpecError(
                f"heads_per_member has {counted(len(raw_counts), 'entry')}, expected one per "
                "member "
                f"(members={M})"
            )
    else:
        raise SpecError(
            f"heads_per_member must be an int or one int per member, "
            f"got {_describe(heads_per_member)}"
        )
    counts: list[int] = []
    for m, k in enumerate(raw_counts):
        if not _is_int(k) or not 0 <= int(k) <= H:  # type: ignore[call-overload]
            raise SpecError(
                f"heads_per_member for member {m} must be an int in 0..{H} "
                f"(num_heads={H}), got {_describe(k)}"
            )
        counts.append(int(k))  # type: ignore[call-overload]
    return counts


@dataclass
class _RandomHeads:
    """The draws of :meth:`HydraSpec.random` (checked arguments), in its seeded order."""

    rng: np.random.Generator
    counts: list[int]
    L: int
    H: int
    shared: int

    def subset(self, k: int) -> tuple[int, ...]:
        return tuple(sorted(self.rng.choice(self.H, size=k, replace=False).tolist()))

    def draw(self, disjoint: bool) -> list[list[tuple[int, ...]]]:
        """Per member the heads kept in every layer: the shared layers keep member 0's draw, the
        others disjoint slices of one permutation, or independent draws (members kept distinct)."""
        M, L = len(self.counts), self.L
        heads: list[list[tuple[int, ...]]] = [[() for _ in range(L)] for _ in range(M)]
        for layer in range(self.shared):
            kept = self.subset(self.counts[0])
            for m in range(M):
                heads[m][layer] = kept
        if disjoint:
            for layer in range(self.shared, L):
                perm = self.rng.permutation(self.H).tolist()
                start = 0
                for m, k in enumerate(self.counts):
                    heads[m][layer] = tuple(sorted(perm[start : start + k]))
                    start += k
            return heads
        for m, k in enumerate(self.counts):
            for layer in range(self.shared, L):
                heads[m][layer] = self.subset(k)
        for m in range(1, M):
            self._resample_repeats(heads, m)
        return heads

    def _resample_repeats(self, heads: list[list[tuple[int, ...]]], m: int) -> None:
        """Redraw member ``m`` while it equals an earlier one (possible only for equal counts)."""
        tries = 0
        while any(heads[m] == heads[j] for j in range(m)):
            tries += 1
            if tries > _MAX_RESAMPLES:
                raise SpecError(
                    f"could not draw {len(heads)} distinct members in {_MAX_RESAMPLES} tries "
                    f"(member {m} keeps repeating an earlier one); use more heads, more "
                    f"non-shared layers or fewer members"
                )
            for layer in range(self.shared, self.L):
                heads[m][layer] = self.subset(self.counts[m])
