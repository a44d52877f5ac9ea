"""Tests of hydra_deploy.specs: validation, JSON round trips, masks, overlap and constructors."""

from __future__ import annotations

import itertools
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_deploy.errors import SpecError
from hydra_deploy.specs import FORMAT, HydraSpec, MemberSpec

# --------------------------------------------------------------------------------------------------
# fixtures and strategies

HAND_HEADS = [
    [[0, 3], [1, 2], []],
    [[0, 1, 2, 3], [2], [3]],
    [[0, 3], [0, 1], [1, 3]],
]


def hand_spec(**changes: Any) -> HydraSpec:
    """3 members, 3 layers x 4 heads."""
    kwargs: dict[str, Any] = dict(
        backbone="toy-vit",
        num_layers=3,
        num_heads=4,
        head_dim=8,
        members=HAND_HEADS,
        mlp_merge="average",
        importance="taylor",
        seed=0,
    )
    kwargs.update(changes)
    return HydraSpec(**kwargs)


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def specs(draw: st.DrawFn) -> HydraSpec:
    """Random valid specs: M 1..5, layers 1..6, heads 1..8, subsets incl. empty, optional meta."""
    num_members = draw(st.integers(1, 5))
    num_layers = draw(st.integers(1, 6))
    num_heads = draw(st.integers(1, 8))
    layer = st.sets(st.integers(0, num_heads - 1)).map(sorted)
    members = draw(
        st.lists(
            st.lists(layer, min_size=num_layers, max_size=num_layers),
            min_size=num_members,
            max_size=num_members,
        )
    )
    return HydraSpec(
        backbone=draw(st.text(min_size=1, max_size=12).filter(str.strip)),
        num_layers=num_layers,
        num_heads=num_heads,
        head_dim=draw(st.integers(1, 128)),
        members=members,
        mlp_merge=draw(st.sampled_from(["average", "grouped"])),
        importance=draw(st.sampled_from([None, "taylor", "circuit", "random", "manual"])),
        seed=draw(st.none() | st.integers(0, 2**31)),
        meta=draw(st.dictionaries(st.text(max_size=6), json_values, max_size=3)),
    )


def kept_pairs(spec: HydraSpec, m: int) -> set[tuple[int, int]]:
    return {(layer, h) for layer, kept in enumerate(spec.members[m].heads) for h in kept}


# --------------------------------------------------------------------------------------------------
# MemberSpec


def test_member_spec_normalises_to_tuples() -> None:
    member = MemberSpec([[0, 3], (1,), np.array([2, 5]), range(0), {4, 1}])
    assert member.heads == ((0, 3), (1,), (2, 5), (), (1, 4))
    assert all(type(h) is int for layer in member.heads for h in layer)
    assert member.num_layers == 5
    assert [member.num_kept(layer) for layer in range(5)] == [2, 1, 2, 0, 2]
    assert member.total_kept == 7
    assert hash(member) == hash(MemberSpec(((0, 3), (1,), (2, 5), (), (1, 4))))


def test_member_spec_dict_round_trip() -> None:
    member = MemberSpec([[0, 3], [], [1]])
    assert member.to_dict() == {"heads": [[0, 3], [], [1]]}
    assert MemberSpec.from_dict(member.to_dict()) == member


@pytest.mark.parametrize(
    ("heads", "pattern"),
    [
        ([[0, True]], "layer 0: head True (bool) is not an integer"),
        ([[0], [1.0]], "layer 1: head 1.0 (float) is not an integer"),
        ([[0], ["1"]], "layer 1: head '1' (str) is not an integer"),
        ([[2, -1]], "layer 0: head -1 is negative"),
        ([[1], [4, 4]], "layer 1: head 4 is listed twice"),
        ([[3, 1]], "layer 0: heads must be in ascending order, got [3, 1]"),
        ([3], "layer 0: expected a sequence of head indices, got 3 (int)"),
        (5, "heads must be a sequence"),
        ("01", "heads must be a sequence"),
    ],
)
def test_member_spec_rejects(heads: Any, pattern: str) -> None:
    with pytest.raises(SpecError, match=re.escape(pattern)):
        MemberSpec(heads)


def test_member_spec_num_kept_bad_layer() -> None:
    with pytest.raises(SpecError, match=re.escape("layer 2 is out of range 0..1")):
        MemberSpec([[0], [1]]).num_kept(2)


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"heads": [[0]], "extra": 1}, "unknown key(s) 'extra'"),
        ({}, "missing key 'heads'"),
        ([[0]], "expected an object"),
    ],
)
def test_member_spec_from_dict_rejects(data: Any, pattern: str) -> None:
    with pytest.raises(SpecError, match=re.escape(pattern)):
        MemberSpec.from_dict(data)


# --------------------------------------------------------------------------------------------------
# HydraSpec construction and validation


def test_members_accept_memberspecs_lists_and_dicts() -> None:
    a = hand_spec()
    b = hand_spec(members=[MemberSpec(h) for h in HAND_HEADS])
    c = hand_spec(members=[{"heads": h} for h in HAND_HEADS])
    d = hand_spec(members=(tuple(tuple(layer) for layer in h) for h in HAND_HEADS))
    assert a == b == c == d
    assert isinstance(a.members, tuple)
    assert all(isinstance(m, MemberSpec) for m in a.members)
    assert a.num_members == 3
    assert hash(a) == hash(b)


def test_meta_not_compared_and_copied() -> None:
    meta = {"note": ["x"]}
    spec = hand_spec(meta=meta)
    meta["note"].append("y")
    assert spec.meta == {"note": ["x"]}
    assert spec == hand_spec(meta={"other": 1}) == hand_spec()


def test_spec_is_frozen() -> None:
    spec = hand_spec()
    with pytest.raises(AttributeError):
        spec.num_heads = 5  # type: ignore[misc]


def test_format_is_class_constant_not_field() -> None:
    assert HydraSpec.FORMAT == FORMAT == "hydra-spec/1"
    assert "FORMAT" not in {f.name for f in __import__("dataclasses").fields(HydraSpec)}


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        (
            {"members": [[[0], [1], [4]], [[0], [1], [2]]]},
            "member 0, layer 2: head 4 is out of range 0..3 (num_heads=4)",
        ),
        (
            {"members": [[[0], [1], [2]], [[0], [1], [2]], [[0], [1, 2, 7], [2]]]},
            "member 2, layer 1: head 7 is out of range 0..3 (num_heads=4)",
        ),
        ({"members": [[[0], [-1], [2]]]}, "member 0, layer 1: head -1 is negative"),
        ({"members": [[[0], [1], [2]], [[0], [1], [3, 3]]]}, "member 1, layer 2: head 3 is listed"),
        (
            {"members": [[[0], [1], [2]], [[3, 1], [1], [2]]]},
            "member 1, layer 0: heads must be in ascending order, got [3, 1]",
        ),
        (
            {"members": [[[0], [1], [2]], [[0], [1]]]},
            "member 1 has 2 layers, expected num_layers=3",
        ),
        (
            {"members": [[[0], [1], [True]]]},
            "member 0, layer 2: head True (bool) is not an integer",
        ),
        ({"members": [{"heads": [[0], [1], [2]], "hedas": 1}]}, "member 0: unknown key(s) 'hedas'"),
        ({"members": []}, "a HydraSpec needs at least one member (got 0)"),
        ({"members": MemberSpec([[0], [1], [2]])}, "wrap it in [...]"),
        ({"members": 3}, "members must be a sequence"),
        ({"mlp_merge": "avg"}, "mlp_merge must be one of 'average', 'grouped', got 'avg'"),
        ({"mlp_merge": None}, "mlp_merge must be one of 'average', 'grouped'"),
        ({"num_layers": 0}, "num_layers must be an int >= 1, got 0"),
        ({"num_layers": True}, "num_layers must be an int >= 1, got True (bool)"),
        ({"num_heads": 0}, "num_heads must be an int >= 1, got 0"),
        ({"num_heads": False}, "num_heads must be an int >= 1, got False (bool)"),
        ({"num_heads": 4.0}, "num_heads must be an int >= 1, got 4.0 (float)"),
        ({"head_dim": -8}, "head_dim must be an int >= 1, got -8"),
        ({"head_dim": True}, "head_dim must be an int >= 1, got True (bool)"),
        ({"backbone": ""}, "backbone must be a non-empty str"),
        ({"backbone": 3}, "backbone must be a non-empty str"),
        ({"seed": True}, "seed must be an int or None, got True (bool)"),
        ({"seed": "0"}, "seed must be an int or None"),
        ({"importance": 3}, "importance must be None or a non-empty str"),
        ({"meta": [1]}, "meta must be a dict"),
        ({"meta": {"x": {1, 2}}}, "meta['x'] is {1, 2} (set), which JSON cannot store"),
        ({"meta": {"x": float("nan")}}, "meta['x'] is nan"),
        ({"meta": {1: "a"}}, "meta has key 1 (int); JSON object keys must be str"),
    ],
)
def test_validation_errors(changes: dict[str, Any], pattern: str) -> None:
    with pytest.raises(SpecError, match=re.escape(pattern)):
        hand_spec(**changes)


def test_spec_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        hand_spec(num_heads=0)


def test_numpy_ints_accepted() -> None:
    spec = hand_spec(num_layers=np.int64(3), num_heads=np.int32(4), seed=np.int64(7))
    assert type(spec.num_layers) is int and type(spec.num_heads) is int and type(spec.seed) is int
    assert spec == hand_spec(seed=7)


def test_replace_and_with_members() -> None:
    spec = hand_spec(meta={"k": 1})
    other = spec.replace(mlp_merge="grouped", seed=3)
    assert (other.mlp_merge, other.seed, other.members, other.meta) == (
        "grouped",
        3,
        spec.members,
        {"k": 1},
    )
    fewer = spec.with_members(HAND_HEADS[:1])
    assert fewer.num_members == 1 and fewer.members[0] == spec.members[0]
    with pytest.raises(SpecError, match=re.escape("member 0, layer 0: head 9 is out of range")):
        spec.with_members([[[9], [], []]])
    with pytest.raises(SpecError, match=re.escape("unknown HydraSpec field(s) 'seeed'")):
        spec.replace(seeed=1)
    with pytest.raises(SpecError, match="num_heads"):
        spec.replace(num_heads=3)  # member 0 keeps head 3


# --------------------------------------------------------------------------------------------------
# serialisation


def test_exact_dict_layout() -> None:
    spec = hand_spec()
    d = spec.to_dict()
    assert d == {
        "format": "hydra-spec/1",
        "backbone": "toy-vit",
        "num_layers": 3,
        "num_heads": 4,
        "head_dim": 8,
        "members": [
            {"heads": [[0, 3], [1, 2], []]},
            {"heads": [[0, 1, 2, 3], [2], [3]]},
            {"heads": [[0, 3], [0, 1], [1, 3]]},
        ],
        "mlp_merge": "average",
        "importance": "taylor",
        "seed": 0,
    }
    assert list(d) == [
        "format",
        "backbone",
        "num_layers",
        "num_heads",
        "head_dim",
        "members",
        "mlp_merge",
        "importance",
        "seed",
    ]
    with_meta = hand_spec(meta={"source": "unit"}).to_dict()
    assert list(with_meta)[-1] == "meta" and with_meta["meta"] == {"source": "unit"}


def test_to_json_text_is_indented_and_parses() -> None:
    spec = hand_spec()
    text = spec.to_json()
    assert json.loads(text) == spec.to_dict()
    assert text.startswith('{\n  "format": "hydra-spec/1",')
    assert "[0, 1, 2, 3]" in text  # lists of heads stay on one line
    compact = spec.to_json(indent=None)
    assert "\n" not in compact.strip() and json.loads(compact) == spec.to_dict()


@settings(deadline=None, max_examples=50)
@given(specs())
def test_round_trip_property(spec: HydraSpec) -> None:
    via_dict = HydraSpec.from_dict(spec.to_dict())
    via_json = HydraSpec.from_json(spec.to_json())
    via_compact = HydraSpec.from_json(spec.to_json(indent=None))
    via_dumps = HydraSpec.from_json(json.dumps(spec.to_dict()))
    for other in (via_dict, via_json, via_compact, via_dumps):
        assert other == spec
        assert other.meta == spec.meta
        assert other.to_dict() == spec.to_dict()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.json"
        text = spec.to_json(path)
        assert path.read_text(encoding="utf-8") == text
        for source in (path, str(path)):
            loaded = HydraSpec.from_json(source)
            assert loaded == spec and loaded.meta == spec.meta
        assert os.listdir(tmp) == ["spec.json"]  # no temp file left behind


def test_to_json_file_overwrites_atomically(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    path.write_text("old", encoding="utf-8")
    hand_spec().to_json(path)
    assert HydraSpec.from_json(path) == hand_spec()
    hand_spec(seed=5).to_json(str(path))
    assert HydraSpec.from_json(path).seed == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.json"]


def test_to_json_unwritable_folder(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "spec.json"
    with pytest.raises(SpecError, match=re.escape(f"cannot write spec to '{missing}'")):
        hand_spec().to_json(missing)


def good_dict() -> dict[str, Any]:
    return hand_spec().to_dict()


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda d: d.pop("format"), "no 'format' key; understood formats: 'hydra-spec/1'"),
        (
            lambda d: d.update(format="hydra-spec/2"),
            "unsupported spec format 'hydra-spec/2'; understood formats: 'hydra-spec/1'",
        ),
        (lambda d: d.update(format=1), "unsupported spec format 1"),
        (lambda d: d.pop("members"), "missing required key(s): 'members'"),
        (lambda d: d.pop("num_heads"), "missing required key(s): 'num_heads'"),
        (
            lambda d: d.update(membres=d.pop("members")),
            "unknown key(s) in spec: 'membres' (did you mean 'membres' -> 'members'?)",
        ),
        (lambda d: d.update(colour="red"), "unknown key(s) in spec: 'colour'"),
        (lambda d: d.update(num_layers="3"), "num_layers must be an int >= 1, got '3' (str)"),
        (lambda d: d.update(num_heads=4.0), "num_heads must be an int >= 1, got 4.0 (float)"),
        (lambda d: d.update(head_dim=True), "head_dim must be an int >= 1, got True (bool)"),
        (lambda d: d.update(members={"heads": []}), "'members' must be a list"),
        (lambda d: d.update(members=[[[0], [1], [2]]]), "member 0: expected an object"),
        (lambda d: d["members"][1].pop("heads"), "member 1: missing key 'heads'"),
        (
            lambda d: d["members"][2]["heads"].__setitem__(1, [1, 0]),
            "member 2, layer 1: heads must be in ascending order, got [1, 0]",
        ),
        (
            lambda d: d["members"][1]["heads"].__setitem__(2, [5]),
            "member 1, layer 2: head 5 is out of range 0..3 (num_heads=4)",
        ),
        (lambda d: d.update(meta=[1]), "'meta' must be a JSON object"),
        (lambda d: d.update(seed=1.5), "seed must be an int or None"),
        (lambda d: d.update(mlp_merge="sum"), "mlp_merge must be one of 'average', 'grouped'"),
    ],
)
def test_from_dict_errors(mutate: Any, pattern: str) -> None:
    d = good_dict()
    mutate(d)
    with pytest.raises(SpecError, match=re.escape(pattern)):
        HydraSpec.from_dict(d)


def test_from_dict_defaults_for_optional_keys() -> None:
    d = good_dict()
    for key in ("mlp_merge", "importance", "seed"):
        d.pop(key)
    spec = HydraSpec.from_dict(d)
    assert (spec.mlp_merge, spec.importance, spec.seed, spec.meta) == ("average", None, None, {})


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(SpecError, match="a spec must be a JSON object"):
        HydraSpec.from_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        (
            '{"format": "hydra-spec/1",\n  "backbone": }',
            "invalid JSON in spec JSON at line 2, column 15",
        ),
        ("{", "invalid JSON in spec JSON at line 1, column 2"),
        ("", "invalid JSON in spec JSON at line 1, column 1"),
        ("[1, 2]", "a spec must be a JSON object, got [1, 2] (list)"),
    ],
)
def test_from_json_bad_text(text: str, pattern: str) -> None:
    with pytest.raises(SpecError, match=re.escape(pattern)):
        HydraSpec.from_json(text)


def test_from_json_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  "format": "hydra-spec/1",\n  oops\n}\n', encoding="utf-8")
    with pytest.raises(SpecError, match=re.escape(f"spec file '{path}' at line 3, column 3")):
        HydraSpec.from_json(path)


def test_from_json_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    for source in (path, str(path)):
        with pytest.raises(SpecError, match=re.escape(f"spec file '{path}' does not exist")):
            HydraSpec.from_json(source)


def test_from_json_folder(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="is a folder"):
        HydraSpec.from_json(tmp_path)


def test_from_json_file_errors_name_file_and_member(tmp_path: Path) -> None:
    d = good_dict()
    d["members"][1]["heads"][0] = [2, 2]
    path = tmp_path / "dup.json"
    path.write_text(json.dumps(d), encoding="utf-8")
    with pytest.raises(
        SpecError, match=re.escape("member 1, layer 0: head 2 is listed twice")
    ) as e:
        HydraSpec.from_json(path)
    assert str(path) in str(e.value)


def test_from_json_bytes_and_bad_type() -> None:
    spec = hand_spec()
    assert HydraSpec.from_json(spec.to_json().encode("utf-8")) == spec
    with pytest.raises(SpecError, match="expects JSON text or a path"):
        HydraSpec.from_json(3)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# masks and statistics


def test_head_mask_hand_case() -> None:
    spec = hand_spec()
    mask = spec.head_mask(0)
    assert mask.dtype == np.float32 and mask.shape == (3, 4)
    np.testing.assert_array_equal(mask, [[1, 0, 0, 1], [0, 1, 1, 0], [0, 0, 0, 0]])
    masks = spec.head_masks()
    assert masks.dtype == np.float32 and masks.shape == (3, 3, 4)
    np.testing.assert_array_equal(masks[1], [[1, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 1]])
    np.testing.assert_array_equal(masks[2], [[1, 0, 0, 1], [1, 1, 0, 0], [0, 1, 0, 1]])
    np.testing.assert_array_equal(masks[0], mask)
    counts = spec.heads_per_layer()
    assert np.issubdtype(counts.dtype, np.integer)
    np.testing.assert_array_equal(counts, [[2, 2, 0], [4, 1, 1], [2, 2, 2]])


@pytest.mark.parametrize("bad", [3, -1, True, 1.0, "0"])
def test_head_mask_bad_member(bad: Any) -> None:
    with pytest.raises(SpecError, match=re.escape("out of range 0..2 (num_members=3)")):
        hand_spec().head_mask(bad)


def test_overlap_and_shared_heads_hand_case() -> None:
    spec = hand_spec()
    # member 0: {(0,0),(0,3),(1,1),(1,2)}; member 1: 6 pairs; member 2: 6 pairs
    np.testing.assert_array_equal(spec.shared_heads(), [[4, 3, 3], [3, 6, 3], [3, 3, 6]])
    np.testing.assert_allclose(
        spec.overlap(), [[1.0, 3 / 7, 3 / 7], [3 / 7, 1.0, 3 / 9], [3 / 7, 3 / 9, 1.0]]
    )


def test_overlap_of_empty_members_is_one() -> None:
    spec = HydraSpec("x", 2, 3, 4, members=[[[], []], [[], []], [[0], []]])
    np.testing.assert_allclose(spec.overlap(), [[1, 1, 0], [1, 1, 0], [0, 0, 1]])
    np.testing.assert_array_equal(spec.shared_heads(), [[0, 0, 0], [0, 0, 0], [0, 0, 1]])


@settings(deadline=None, max_examples=50)
@given(specs())
def test_masks_overlap_shared_property(spec: HydraSpec) -> None:
    M, L, H = spec.num_members, spec.num_layers, spec.num_heads
    masks = spec.head_masks()
    assert masks.shape == (M, L, H)
    pairs = [kept_pairs(spec, m) for m in range(M)]
    for m in range(M):
        assert {(int(a), int(b)) for a, b in zip(*np.nonzero(masks[m]), strict=True)} == pairs[m]
        np.testing.assert_array_equal(spec.head_mask(m), masks[m])
    np.testing.assert_array_equal(spec.heads_per_layer(), masks.sum(axis=2).astype(int))
    overlap, shared = spec.overlap(), spec.shared_heads()
    assert overlap.shape == shared.shape == (M, M)
    for i, j in itertools.product(range(M), repeat=2):
        inter, union = pairs[i] & pairs[j], pairs[i] | pairs[j]
        assert shared[i, j] == len(inter)
        expected = len(inter) / len(union) if union else 1.0
        assert overlap[i, j] == pytest.approx(expected)
    np.testing.assert_array_equal(overlap, overlap.T)
    np.testing.assert_array_equal(shared, shared.T)
    np.testing.assert_array_equal(np.diag(overlap), np.ones(M))
    assert ((overlap >= 0) & (overlap <= 1)).all()


@settings(deadline=None, max_examples=50)
@given(specs())
def test_shared_prefix_property(spec: HydraSpec) -> None:
    n = spec.shared_prefix_layers()
    assert 0 <= n <= spec.num_layers
    heads = [m.heads for m in spec.members]
    assert all(h[:n] == heads[0][:n] for h in heads)
    if n < spec.num_layers:
        assert len({h[n] for h in heads}) > 1


def test_shared_prefix_hand_cases() -> None:
    assert hand_spec().shared_prefix_layers() == 0
    same_first = HydraSpec("x", 3, 4, 8, members=[[[0], [1], [2]], [[0], [1], [3]]])
    assert same_first.shared_prefix_layers() == 2
    assert hand_spec(members=HAND_HEADS[:1]).shared_prefix_layers() == 3
    assert HydraSpec.full("x", 4, 2, 8, members=3).shared_prefix_layers() == 4


# --------------------------------------------------------------------------------------------------
# summary


def test_summary_contents() -> None:
    spec = hand_spec()
    text = spec.summary()
    lines = text.splitlines()
    assert "toy-vit" in lines[0] and "3 layers x 4 heads" in lines[0] and "3 members" in lines[0]
    assert "mlp_merge=average" in lines[0] and "importance=taylor" in lines[0]
    assert "seed=0" in lines[0] and "head_dim 8" in lines[0]
    header = next(line for line in lines if line.startswith("member"))
    assert header.split() == ["member", "L0", "L1", "L2", "total", "%"]
    rows = {line.split()[0]: line.split()[1:] for line in lines if re.match(r"m\d+ +\d+ ", line)}
    assert rows["m0"] == ["2", "2", "0", "4", "33.3%"]
    assert rows["m1"] == ["4", "1", "1", "6", "50.0%"]
    assert rows["m2"] == ["2", "2", "2", "6", "50.0%"]
    assert "overlap" in text
    ov_rows = [line.split() for line in lines if re.match(r"m\d+ +\d\.\d\d", line)]
    assert ov_rows == [
        ["m0", "1.00", "0.43", "0.43"],
        ["m1", "0.43", "1.00", "0.33"],
        ["m2", "0.43", "0.33", "1.00"],
    ]
    assert str(spec) == text
    assert repr(spec).startswith("HydraSpec(backbone='toy-vit', num_layers=3")


def test_summary_readable_for_12_layers() -> None:
    spec = HydraSpec.random("vit-base", 12, 12, 64, 4, 6, seed=1)
    lines = spec.summary().splitlines()
    assert max(len(line) for line in lines[1:]) <= 100
    header = next(line for line in lines if line.startswith("member"))
    assert header.split()[1:13] == [f"L{i}" for i in range(12)]
    assert sum(1 for line in lines if re.match(r"m\d+ +\d+ ", line)) == 4


# --------------------------------------------------------------------------------------------------
# random() and full()


@settings(deadline=None, max_examples=50)
@given(
    num_layers=st.integers(1, 6),
    num_heads=st.integers(2, 8),
    members=st.integers(1, 4),
    data=st.data(),
)
def test_random_property(
    num_layers: int, num_heads: int, members: int, data: st.DataObject
) -> None:
    counts = data.draw(
        st.lists(st.integers(1, num_heads - 1), min_size=members, max_size=members), label="counts"
    )
    shared = data.draw(st.integers(0, num_layers - 1), label="shared")
    seed = data.draw(st.integers(0, 1000), label="seed")
    arg: int | list[int] = counts[0] if len(set(counts)) == 1 else counts
    try:
        spec = HydraSpec.random(
            "b", num_layers, num_heads, 16, members, arg, shared_layers=shared, seed=seed
        )
    except SpecError as e:  # only when members cannot differ (too few distinct subsets)
        assert "cannot all differ" in str(e)
        return
    assert spec.importance == "random" and spec.seed == seed
    counts_arr = spec.heads_per_layer()
    for m in range(members):
        assert list(counts_arr[m, shared:]) == [counts[m]] * (num_layers - shared)
        assert list(counts_arr[m, :shared]) == [counts[0]] * shared
        assert spec.members[m].heads[:shared] == spec.members[0].heads[:shared]
    assert spec.shared_prefix_layers() >= shared
    assert len({m.heads for m in spec.members}) == members  # pairwise different
    again = HydraSpec.random(
        "b", num_layers, num_heads, 16, members, arg, shared_layers=shared, seed=seed
    )
    assert again == spec


def test_random_counts_and_shared_layers() -> None:
    spec = HydraSpec.random("vit", 6, 12, 64, 3, [4, 6, 8], shared_layers=2, seed=3)
    np.testing.assert_array_equal(
        spec.heads_per_layer(), [[4] * 6, [4, 4, 6, 6, 6, 6], [4, 4, 8, 8, 8, 8]]
    )
    assert spec.shared_prefix_layers() >= 2
    assert all(m.heads[:2] == spec.members[0].heads[:2] for m in spec.members)
    assert spec.num_layers == 6 and spec.num_heads == 12 and spec.head_dim == 64


def test_random_deterministic_and_seed_dependent() -> None:
    a = HydraSpec.random("vit", 12, 12, 64, 4, 5, seed=11)
    b = HydraSpec.random("vit", 12, 12, 64, 4, 5, seed=11)
    c = HydraSpec.random("vit", 12, 12, 64, 4, 5, seed=12)
    assert a == b and a.to_json() == b.to_json()
    assert a != c
    assert a.seed == 11 and a.importance == "random"


@settings(deadline=None, max_examples=50)
@given(
    num_layers=st.integers(1, 5),
    num_heads=st.integers(2, 10),
    members=st.integers(2, 4),
    data=st.data(),
)
def test_random_disjoint_property(
    num_layers: int, num_heads: int, members: int, data: st.DataObject
) -> None:
    per = num_heads // members
    if per == 0:
        with pytest.raises(SpecError, match="cannot all differ"):
            HydraSpec.random("b", num_layers, num_heads, 8, members, 0, disjoint=True)
        return
    k = data.draw(st.integers(1, per), label="k")
    shared = data.draw(st.integers(0, num_layers - 1), label="shared")
    spec = HydraSpec.random(
        "b",
        num_layers,
        num_heads,
        8,
        members,
        k,
        shared_layers=shared,
        disjoint=True,
        seed=data.draw(st.integers(0, 99), label="seed"),
    )
    for layer in range(shared, num_layers):
        sets = [set(m.heads[layer]) for m in spec.members]
        assert all(len(s) == k for s in sets)
        for a, b in itertools.combinations(sets, 2):
            assert not a & b
    for layer in range(shared):
        assert len({m.heads[layer] for m in spec.members}) == 1
    assert len({m.heads for m in spec.members}) == members


def test_random_members_differ_in_tight_case() -> None:
    # 2 heads, keep 1, one layer: exactly two possible members -> both must be used
    for seed in range(20):
        spec = HydraSpec.random("b", 1, 2, 4, 2, 1, seed=seed)
        assert {m.heads for m in spec.members} == {((0,),), ((1,),)}


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"members": 2, "heads_per_member": 4}, "members 0 and 1 cannot all differ: each keeps 4"),
        ({"members": 3, "heads_per_member": 0}, "members 0, 1 and 2 cannot all differ"),
        ({"members": 5, "heads_per_member": 1, "num_layers": 1}, "allows only 4 distinct choices"),
        ({"members": 2, "heads_per_member": 2, "shared_layers": 3}, "every layer shared"),
        ({"members": 3, "heads_per_member": 2, "disjoint": True}, "sum(heads_per_member)=6 > num_"),
        ({"members": 2, "heads_per_member": [0, 0, 1]}, "heads_per_member has 3 entries"),
        ({"members": 2, "heads_per_member": 5}, "member 0 must be an int in 0..4 (num_heads=4)"),
        ({"members": 2, "heads_per_member": [1, -1]}, "member 1 must be an int in 0..4"),
        ({"members": 2, "heads_per_member": True}, "heads_per_member must be an int"),
        ({"members": 2, "heads_per_member": 1, "shared_layers": 4}, "shared_layers must be an int"),
        ({"members": 2, "heads_per_member": 1, "shared_layers": -1}, "shared_layers must be"),
        ({"members": 0, "heads_per_member": 1}, "members must be an int >= 1, got 0"),
        ({"members": 2, "heads_per_member": 1, "num_heads": 0}, "num_heads must be an int >= 1"),
        ({"members": 2, "heads_per_member": 1, "seed": 1.5}, "seed must be an int or None"),
        ({"members": 2, "heads_per_member": 1, "mlp_merge": "x"}, "mlp_merge must be one of"),
    ],
)
def test_random_errors(kwargs: dict[str, Any], pattern: str) -> None:
    args: dict[str, Any] = {"backbone": "b", "num_layers": 3, "num_heads": 4, "head_dim": 8}
    args.update(kwargs)
    with pytest.raises(SpecError, match=re.escape(pattern)):
        HydraSpec.random(**args)


def test_random_single_member_may_keep_everything() -> None:
    spec = HydraSpec.random("b", 3, 4, 8, 1, 4)
    assert spec.members[0].heads == ((0, 1, 2, 3),) * 3
    assert HydraSpec.random("b", 3, 4, 8, 2, [4, 3]).num_members == 2  # counts differ -> fine


def test_full() -> None:
    spec = HydraSpec.full("vit", 2, 3, 16)
    assert spec.num_members == 1 and spec.importance == "manual"
    assert spec.members[0].heads == ((0, 1, 2), (0, 1, 2))
    np.testing.assert_array_equal(spec.head_masks(), np.ones((1, 2, 3), dtype=np.float32))
    many = HydraSpec.full("vit", 2, 3, 16, members=4)
    assert many.num_members == 4
    np.testing.assert_array_equal(many.overlap(), np.ones((4, 4)))
    with pytest.raises(SpecError, match="members must be an int >= 1, got 0"):
        HydraSpec.full("vit", 2, 3, 16, members=0)
