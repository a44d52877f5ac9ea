"""Fuzzing (issue 9): whatever a user or a damaged file hands in, the spec loader, the hydra.json
readers, the runner's input checks and the uncertainty scores and metrics answer with a result or
one of the project's own errors (a HydraError subclass), never a KeyError, TypeError,
RecursionError or the like; and finite inputs give finite outputs.

Each property calls the function under test through :func:`outcome`, which lets the project's
error through as a value and any other exception fail the test (hypothesis then shrinks it to the
smallest input). Example counts are a multiple of the profile's (25 in CI, derandomized; 300 with
``HYPOTHESIS_PROFILE=dev``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from helpers.vit import tiny_vit
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

from hydra_deploy.engines import load_runner
from hydra_deploy.engines.build_source import ExportSource, load_source
from hydra_deploy.errors import EngineError, ExportError, HydraError, RunnerError, SpecError
from hydra_deploy.export import export_onnx
from hydra_deploy.export.load import load_export
from hydra_deploy.fusion import fuse
from hydra_deploy.specs import FORMAT, MLP_MERGE_MODES, HydraSpec
from hydra_deploy.uncertainty import ensemble_scores
from hydra_deploy.uncertainty.metrics import (
    aurc,
    classification_metrics,
    ece,
    excess_aurc,
    fpr_at_tpr,
    nll,
    ood_metrics,
    ood_score,
    reliability_bins,
)


def examples(factor: float) -> settings:
    """``factor`` times the profile's example count; no deadline (sessions make examples slow)."""
    return settings(
        max_examples=max(5, int(settings.default.max_examples * factor)),
        deadline=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.filter_too_much,
        ],
    )


def outcome(call: Callable[[], Any], error: type[Exception] = HydraError) -> Any:
    """``call()``'s result, or the ``error`` it raised; any other exception fails the test."""
    try:
        result = call()
    except error as err:
        assert str(err).strip(), f"{type(err).__name__} with an empty message"
        event(f"refused: {type(err).__name__}")  # --hypothesis-show-statistics shows the mix
        return err
    event("accepted")
    return result


# --- JSON values and damaged documents -------------------------------------------------------------
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-3, 40), st.floats(), st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
finite_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)

# Texts that have broken parsers: deep nesting, integers too long to convert, NaN, a BOM, NUL and
# lone surrogates (not encodable as a file name or as UTF-8), half an object.
AWKWARD_TEXTS = [
    "",
    " \n",
    "\ufeff{}",
    "[" * 3000,
    '{"a":' * 3000,
    "[" * 3000 + "]" * 3000,
    "1" + "0" * 5000,
    "[1" + "0" * 5000 + "]",
    '{"format": 1' + "0" * 5000 + "}",
    "NaN",
    "[Infinity, -Infinity, NaN]",
    '{"format": NaN}',
    "a\x00b",
    "\x00",
    "\ud800",
    '{"x": "\ud800"}',
    "null",
    "[]",
    "{}",
    "{",
    '{"format": "hydra-spec/1"',
    ".",
    "..",
    "/",
    "1e999",
    "-0",
    "true",
]


def _paths(value: Any, path: tuple = ()):
    """Every node of a JSON document as a path of keys / indices (the root is ``()``)."""
    yield path
    if isinstance(value, dict):
        children = list(value.items())
    elif isinstance(value, list):
        children = list(enumerate(value))
    else:
        return
    for key, child in children:
        yield from _paths(child, (*path, key))


def _node(doc: Any, path: tuple) -> Any:
    for key in path:
        doc = doc[key]
    return doc


WRONG_TYPES: dict[str, Callable[[Any], Any]] = {
    "in a list": lambda v: [v],
    "in an object": lambda v: {"value": v},
    "as a string": lambda v: json.dumps(v),
    "null": lambda v: None,
    "true": lambda v: True,
    "a float": lambda v: float(v) + 0.5 if type(v) is int and abs(v) < 2**53 else 1.5,
    "negated": lambda v: -v if type(v) in (int, float) else -1,
    "zero": lambda v: 0,
    "huge": lambda v: 10**30,
    "empty list": lambda v: [],
    "empty object": lambda v: {},
}


@st.composite
def damaged(draw, document: Any, formats: list[Any], skip: tuple[str, ...] = ()) -> Any:
    """``document`` with 1-3 edits: a node deleted, replaced by a random JSON value or by a value
    of the wrong type, an unknown key added, the format set to another version, a value nested
    deeply. Nodes under the top-level keys in ``skip`` are not edited (the keys themselves are)."""
    doc = copy.deepcopy(document)
    for _ in range(draw(st.integers(1, 3))):
        nodes = [p for p in _paths(doc) if not (len(p) > 1 and p[0] in skip)]
        top = [p for p in nodes if len(p) == 1]
        path = draw(st.sampled_from(top) if top and draw(st.booleans()) else st.sampled_from(nodes))
        edit = draw(
            st.sampled_from(
                ["delete", "replace", "small int", "wrong type", "add key", "format", "nest"]
            )
        )
        if edit == "format" and isinstance(doc, dict):
            doc["format"] = draw(st.sampled_from(formats))
            continue
        if edit == "add key":
            target = _node(doc, path)
            if isinstance(target, dict):
                target[draw(st.text(max_size=10))] = draw(json_values)
                continue
            edit = "replace"
        if edit == "delete" and path:
            parent = _node(doc, path[:-1])
            del parent[path[-1]]
            continue
        old = _node(doc, path)
        if edit == "wrong type":
            new = WRONG_TYPES[draw(st.sampled_from(sorted(WRONG_TYPES)))](old)
        elif edit == "small int":  # often still valid: a seed, a head index, a batch size
            new = draw(st.integers(0, 8))
        elif edit == "nest":
            new = old
            for _ in range(draw(st.sampled_from([2, 50, 150, 600]))):
                new = [new]
        else:
            new = draw(json_values)
        if path:
            _node(doc, path[:-1])[path[-1]] = new
        else:
            doc = new
    return doc


# --- 1. the spec loader ----------------------------------------------------------------------------
@st.composite
def spec_documents(draw) -> dict[str, Any]:
    """``HydraSpec.random(...).to_dict()`` for random geometry, members, merge, seed and meta."""
    num_layers, num_heads = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    args = (
        draw(st.sampled_from(["vit_tiny_patch16_224", "b"])),
        num_layers,
        num_heads,
        draw(st.sampled_from([8, 64])),
    )
    kwargs = dict(
        heads_per_member=draw(st.integers(0, num_heads)),
        shared_layers=draw(st.integers(0, num_layers - 1)),
        seed=draw(st.integers(0, 2**16)),
        mlp_merge=draw(st.sampled_from(MLP_MERGE_MODES)),
    )
    try:
        spec = HydraSpec.random(*args, members=draw(st.integers(1, 4)), **kwargs)
    except SpecError:  # members that cannot all differ (one head, no free layer, ...): one member
        spec = HydraSpec.random(*args, members=1, **kwargs)
    if draw(st.booleans()):
        spec = dataclasses.replace(
            spec, meta=draw(st.dictionaries(st.text(max_size=6), finite_json, max_size=3))
        )
    return spec.to_dict()


def _assert_round_trips(spec: HydraSpec) -> None:
    again = HydraSpec.from_json(spec.to_json())
    assert again == spec and again.meta == spec.meta
    assert HydraSpec.from_dict(spec.to_dict()) == spec


@examples(4)
@given(
    st.one_of(
        st.text(),
        st.text().map(lambda s: "{" + s),
        st.text().map(lambda s: "[" + s),
        st.sampled_from(AWKWARD_TEXTS),
    )
)
def test_spec_from_json_takes_any_text(tmp_path, monkeypatch, text):
    # text not starting with { or [ is a path: resolve it in an empty folder
    monkeypatch.chdir(tmp_path)
    result = outcome(lambda: HydraSpec.from_json(text), SpecError)
    if isinstance(result, HydraSpec):
        _assert_round_trips(result)
    # the same text as bytes (not UTF-8 where it holds a lone surrogate)
    raw = text.encode("utf-8", "surrogatepass")
    as_bytes = outcome(lambda: HydraSpec.from_json(raw), SpecError)
    if isinstance(result, HydraSpec) and isinstance(as_bytes, HydraSpec):
        assert as_bytes == result


@examples(2)
@given(
    st.binary(max_size=64)
    | st.sampled_from([t.encode("utf-8", "surrogatepass") for t in AWKWARD_TEXTS])
)
def test_spec_from_json_takes_any_bytes(data):
    result = outcome(lambda: HydraSpec.from_json(data), SpecError)
    assert isinstance(result, SpecError)  # no byte string this short is a spec


SPEC_KEYS = (
    "backbone",
    "num_layers",
    "num_heads",
    "head_dim",
    "members",
    "mlp_merge",
    "importance",
    "seed",
    "meta",
)


@examples(4)
@given(
    json_values
    | st.fixed_dictionaries(
        {"format": st.just(FORMAT) | json_values},
        optional={k: json_values for k in SPEC_KEYS},
    )
)
def test_spec_loader_takes_any_json_value(tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    from_dict = outcome(lambda: HydraSpec.from_dict(value), SpecError)
    text = json.dumps(value)
    from_text = outcome(lambda: HydraSpec.from_json(text), SpecError)
    from_bytes = outcome(lambda: HydraSpec.from_json(text.encode()), SpecError)
    if not isinstance(value, dict):
        assert isinstance(from_dict, SpecError) and isinstance(from_bytes, SpecError)
    assert type(from_dict) is type(from_bytes)  # the JSON text is the same document
    if isinstance(from_dict, HydraSpec):
        assert from_text == from_bytes == from_dict
        _assert_round_trips(from_dict)


@examples(8)
@given(st.data(), spec_documents())
def test_damaged_specs_load_or_raise_spec_error(tmp_path, data, document):
    original = HydraSpec.from_dict(document)
    assert HydraSpec.from_json(json.dumps(document)) == original
    doc = data.draw(damaged(document, ["hydra-spec/2", "hydra-spec/0", "hydra-spec", "", 1, None]))
    text = json.dumps(doc)
    path = tmp_path / "spec.json"
    path.write_text(text)
    results = [
        outcome(lambda: HydraSpec.from_dict(doc), SpecError),
        outcome(lambda: HydraSpec.from_json(text.encode()), SpecError),
        outcome(lambda: HydraSpec.from_json(path), SpecError),
    ]
    assert len({type(r) for r in results}) == 1, results  # all agree: loaded, or refused
    if isinstance(results[0], HydraSpec):
        assert results[0] == results[1] == results[2]
        _assert_round_trips(results[0])
    else:
        assert str(path) in str(results[2])  # a file's errors name the file
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        assert isinstance(results[0], SpecError)  # another version is never read as this one


# --- 2. hydra.json, as load_runner and load_export read it -------------------------------------
BATCH = 3


def pixels(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, 16, 16)).astype(np.float32)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    """One tiny ViT Hydra export (3 members, 5 classes, the ensemble head in the graph)."""
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=[2, 1, 3], seed=0)
    out = tmp_path_factory.mktemp("fuzz") / "export"
    export_onnx(
        fuse(backbone, spec),
        out,
        batch=(1, 2, 4),
        exporter="torchscript",
        validate=False,
        uq_outputs=True,
    )
    return out


class Reference(tuple):
    """(hydra.json as a dict, its text, the runner's outputs on ``pixels(BATCH)``)."""

    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example
        return "Reference(<the tiny export's hydra.json and outputs>)"


@pytest.fixture(scope="module")
def reference(export_dir):
    text = (export_dir / "hydra.json").read_text()
    with load_runner(export_dir, providers=["cpu"]) as runner:
        return Reference((json.loads(text), text, runner(pixels(BATCH))))


@pytest.fixture(scope="module")
def scratch(export_dir, tmp_path_factory):
    """A copy of the export whose hydra.json each example overwrites."""
    folder = tmp_path_factory.mktemp("fuzz-scratch") / "export"
    shutil.copytree(export_dir, folder)
    return folder


def hydra_json_contents(info: dict[str, Any], text: str, skip: tuple[str, ...] = ()):
    """Bytes for a damaged hydra.json: an edited copy (half the time), random JSON, the file cut
    short or with bytes that are not UTF-8, awkward texts, random bytes."""
    raw = text.encode()
    formats = ["hydra-export/2", "hydra-export/0", "hydra-spec/1", "", None, 1]
    edited = damaged(info, formats, skip).map(lambda d: json.dumps(d).encode())
    return edited | st.one_of(
        json_values.map(lambda v: json.dumps(v).encode()),
        st.integers(0, len(raw) - 1).map(lambda k: raw[:k]),
        st.tuples(
            st.integers(0, len(raw) - 1), st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"])
        ).map(lambda t: raw[: t[0]] + t[1] + raw[t[0] :]),
        st.sampled_from([t.encode("utf-8", "surrogatepass") for t in AWKWARD_TEXTS]),
        st.binary(max_size=32),
    )


@examples(3)
@given(st.data())
def test_load_runner_reads_any_hydra_json(reference, scratch, data):
    info, text, expected = reference
    content = data.draw(hydra_json_contents(info, text))
    (scratch / "hydra.json").write_bytes(content)
    x = pixels(BATCH)
    for target in (scratch, scratch / "model.onnx"):
        runner = outcome(lambda t=target: load_runner(t, providers=["cpu"]))
        if isinstance(runner, HydraError):
            assert isinstance(runner, RunnerError), runner
            continue
        # what the metadata says is readable, whatever it holds
        for name in ("spec", "class_names", "preprocessing", "precision", "family"):
            getattr(runner, name)
        assert runner.max_batch is None or runner.max_batch >= 1
        # a runner that loaded runs a valid input, and the metadata does not change the numbers
        outputs = runner(x)
        assert set(outputs) == set(expected)
        for name, value in expected.items():
            assert np.isfinite(outputs[name]).all(), name
            np.testing.assert_allclose(outputs[name], value, atol=1e-5, err_msg=name)


def test_load_runner_reads_its_own_hydra_json(reference, scratch):
    """The fuzz above is not vacuous: the undamaged file loads, with its batch profile."""
    info, text, _ = reference
    (scratch / "hydra.json").write_text(text)
    runner = load_runner(scratch, providers=["cpu"])
    assert runner.info == info and runner.max_batch == 4


@examples(1)
@given(st.data())
def test_load_export_reads_any_hydra_json(reference, scratch, data):
    info, text, expected = reference
    # the backbone's constructor arguments are replaced or deleted whole, not edited inside:
    # depth=10**30 would be a request for memory, not a malformed file
    content = data.draw(hydra_json_contents(info, text, skip=("backbone_kwargs",)))
    (scratch / "hydra.json").write_bytes(content)
    hydra = outcome(lambda: load_export(scratch))
    if isinstance(hydra, HydraError):
        return
    # loaded (and checked against model.onnx): it computes what the export computes
    with torch.no_grad():
        logits = hydra(torch.from_numpy(pixels(BATCH))).numpy()
    np.testing.assert_allclose(logits, expected["member_logits"], atol=1e-4)


def test_load_export_refuses_damaged_top_level(reference, scratch):
    info, text, _ = reference
    cases = {
        "[1, 2]": "holds list, not a JSON object",
        json.dumps({**info, "family": ["vit"]}): "family \\['vit'\\]",
        json.dumps({**info, "backbone_kwargs": [1]}): "constructor arguments",
        json.dumps({**info, "backbone_kwargs": {"depth": 1}}): "backbone_kwargs do not rebuild",
        json.dumps({k: v for k, v in info.items() if k != "merge"}): "no 'merge' record",
        json.dumps({**info, "tokenizer": {"max_length": 8}}): "malformed 'tokenizer'",
    }
    for content, message in cases.items():
        (scratch / "hydra.json").write_text(content)
        with pytest.raises(ExportError, match=message):
            load_export(scratch, check=False)
    (scratch / "hydra.json").write_text(text)
    assert load_export(scratch, check=False).spec.num_members == 3


@examples(2)
@given(st.data())
def test_engine_builds_read_any_hydra_json(reference, scratch, data):
    """hydra-build's reader (build_source.load_source and the profile it derives): no TensorRT needed."""
    info, text, _ = reference
    (scratch / "hydra.json").write_bytes(data.draw(hydra_json_contents(info, text)))
    source = outcome(lambda: load_source(scratch))
    if isinstance(source, HydraError):
        assert isinstance(source, EngineError), source
        return
    assert isinstance(source, ExportSource)
    for name in ("sha256", "spec", "graph_precision"):
        outcome(lambda n=name: getattr(source, n), EngineError)
    batch = outcome(lambda: source.batch_profile(None, None, None), EngineError)
    if isinstance(batch, HydraError):
        return
    assert 1 <= batch[0] <= batch[1] <= batch[2]
    shapes = outcome(lambda: source.profile_shapes(batch), EngineError)
    if not isinstance(shapes, HydraError):
        for profile in shapes.values():
            assert [profile[k][0] for k in ("min", "opt", "max")] == list(batch)
            assert all(type(d) is int and d > 0 for k in profile for d in profile[k][1:]), profile


def test_engine_build_reader_refuses_damaged_fields(reference, scratch):
    info, text, _ = reference
    shape = info["inputs"][0]["shape"]
    # a malformed batch profile is refused on reading, by every consumer (export_folder)
    for profile in ([1, 2, 4], {"min": 1, "opt": 2, "max": "4"}):
        (scratch / "hydra.json").write_text(json.dumps({**info, "batch_profile": profile}))
        with pytest.raises(EngineError, match="malformed batch_profile"):
            load_source(scratch)
    cases = [
        ("inputs", "pixel_values", "malformed inputs"),
        (
            "inputs",
            [{"name": "pixel_values", "shape": [shape[0], True, *shape[2:]]}],
            "only the batch and a text model's sequence axis may be dynamic",
        ),  # True is not 1
    ]
    for key, value, message in cases:
        (scratch / "hydra.json").write_text(json.dumps({**info, key: value}))
        source = load_source(scratch)
        with pytest.raises(EngineError, match=message):
            source.profile_shapes(source.batch_profile(None, None, None))
    sequence = [{"name": "input_ids", "shape": ["batch", "sequence"]}]
    (scratch / "hydra.json").write_text(json.dumps({**info, "inputs": sequence, "tokenizer": [1]}))
    with pytest.raises(EngineError, match="records no maximum length"):
        load_source(scratch).profile_shapes((1, 2, 4))
    (scratch / "hydra.json").write_text(text)
    source = load_source(scratch)
    assert source.profile_shapes(source.batch_profile(None, None, None)) == {
        "pixel_values": {"min": [1, 3, 16, 16], "opt": [2, 3, 16, 16], "max": [4, 3, 16, 16]}
    }


# --- 3. the runner's input checks ------------------------------------------------------------------
DTYPES = [
    np.float16,
    np.float32,
    np.float64,
    np.longdouble,
    np.int8,
    np.int32,
    np.int64,
    np.uint8,
    np.bool_,
    np.complex64,
    np.complex128,
    object,
    np.str_,
]
SPECIALS = [np.nan, np.inf, -np.inf]


@pytest.fixture(scope="module")
def runner(export_dir):
    with load_runner(export_dir, providers=["cpu"]) as r:
        yield r


@st.composite
def runner_inputs(draw):
    """Arrays of random shapes (the model's [B, 3, 16, 16] half the time), dtypes and magnitudes,
    with NaN / inf sprinkled in."""
    if draw(st.booleans()):
        shape = (draw(st.integers(1, 6)), 3, 16, 16)
    else:
        shape = draw(array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=4))
    dtype = draw(st.sampled_from(DTYPES))
    scale = 10.0 ** draw(st.sampled_from([-3, 0, 2, 4, 6, 39, 300]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    values = np.asarray(rng.standard_normal(shape) * scale)
    if values.size and draw(st.booleans()):
        flat = values.reshape(-1)
        for _ in range(draw(st.integers(1, 3))):
            flat[draw(st.integers(0, flat.size - 1))] = draw(st.sampled_from(SPECIALS))
    with np.errstate(all="ignore"):
        if np.dtype(dtype).kind in "iub":
            values = np.nan_to_num(values, nan=0, posinf=100, neginf=-100).clip(-100, 100)
        return np.asarray(values.astype(dtype))


def _expected_to_run(array: np.ndarray, allow_nonfinite: bool) -> bool:
    """The documented rule: the model's shape, a float dtype (cast to float32), finite values."""
    if array.ndim != 4 or array.shape[0] < 1 or array.shape[1:] != (3, 16, 16):
        return False
    if array.dtype.kind != "f":
        return False  # integer pixels, bools, complex, objects and strings are refused
    with np.errstate(over="ignore"):
        return allow_nonfinite or bool(np.isfinite(array.astype(np.float32)).all())


@examples(4)
@given(runner_inputs(), st.booleans(), st.booleans())
def test_runner_checks_any_array(runner, array, allow_nonfinite, as_list):
    value = array.tolist() if as_list and array.dtype != np.longdouble else array
    result = outcome(lambda: runner(value, allow_nonfinite=allow_nonfinite))
    if not _expected_to_run(np.asarray(value), allow_nonfinite):
        assert isinstance(result, RunnerError), (array.dtype, array.shape)
        return
    assert not isinstance(result, HydraError), result
    batch = array.shape[0]
    assert result["member_logits"].shape == (batch, 3, 5)
    assert result["probs"].shape == (batch, 5) and result["msp"].shape == (batch,)
    as_float = np.asarray(value, dtype=np.float64)
    if np.isfinite(as_float).all() and np.abs(as_float).max() <= 1e6:
        for name, output in result.items():  # finite inputs of any sane magnitude: finite outputs
            assert np.isfinite(output).all(), name


@examples(2)
@given(
    st.dictionaries(
        st.sampled_from(
            ["pixel_values", "pixel_value", "input_ids", "", 0, 1, None, b"pixel_values"]
        ),
        st.sampled_from(["ok", "scalar", "ragged", "none"]),
        max_size=4,
    )
)
def test_runner_checks_any_dict_of_inputs(runner, named):
    values = {"ok": pixels(2), "scalar": 1.0, "ragged": [[1.0, 2.0], [3.0]], "none": None}
    feed = {key: values[kind] for key, kind in named.items()}
    result = outcome(lambda: runner(feed))
    if set(feed) == {"pixel_values"} and named["pixel_values"] == "ok":
        assert result["member_logits"].shape == (2, 3, 5)
    else:
        assert isinstance(result, RunnerError), feed.keys()


@examples(1)
@given(
    st.one_of(
        st.integers(-3, 8),
        st.floats(allow_nan=True),
        st.booleans(),
        st.text(max_size=3),
        st.just([2]),
        st.just(np.int64(2)),
        st.just(10**30),
    )
)
def test_runner_checks_any_batch_size(runner, batch_size):
    x = pixels(5)
    result = outcome(lambda: runner(x, batch_size=batch_size))
    if type(batch_size) in (int, np.int64) and 1 <= batch_size <= runner.max_batch:
        assert result["member_logits"].shape == (5, 3, 5)
    else:
        assert isinstance(result, RunnerError), batch_size


def test_runner_names_float32_overflow(runner):
    """Finite float64 pixels beyond float32's range are named as such, not as NaN/inf."""
    x = pixels(2).astype(np.float64)
    x[1, 0, 0, 0] = 1e300
    with pytest.raises(
        RunnerError, match=r"holds values up to 1e\+300, beyond the range of float32"
    ):
        runner(x)
    with pytest.raises(RunnerError, match="is not an array numpy can hold"):
        runner([pixels(1)[0], pixels(1)[0, :2]])


# --- 4. scores and metrics -------------------------------------------------------------------------
LOGIT_LIMITS = {np.float16: 65504.0, np.float32: 1e30, np.float64: float(np.finfo(np.float64).max)}


@st.composite
def finite_logits(draw) -> np.ndarray:
    """[B, M, C] (B, M >= 1, C >= 2) finite logits of any magnitude: the dtype's whole range,
    mostly large values of both signs, ties and exact extremes."""
    dtype = draw(st.sampled_from(sorted(LOGIT_LIMITS, key=str)))
    limit = LOGIT_LIMITS[dtype]
    shape = (draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(2, 7)))
    scale = draw(st.sampled_from([1.0, 1e2, 1e4, 1e8, 1e15, 1e30, limit]))
    scale = min(scale, limit)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    values = rng.uniform(-1.0, 1.0, shape) * scale
    if draw(st.booleans()):  # exact extremes and ties
        flat = values.reshape(-1)
        for _ in range(draw(st.integers(1, 6))):
            flat[draw(st.integers(0, flat.size - 1))] = draw(st.sampled_from([limit, -limit, 0.0]))
    return values.astype(dtype)


@examples(8)
@given(finite_logits())
def test_scores_of_any_finite_logits_are_finite(logits):
    with np.errstate(over="raise", invalid="raise"):  # and no overflow or 0 * inf on the way
        scores = ensemble_scores(logits)
    _, M, C = logits.shape
    for name, value in scores.items():
        assert np.isfinite(value).all(), (name, logits)
    tol = 1e-5
    np.testing.assert_allclose(scores["probs"].sum(-1), 1.0, atol=tol)
    np.testing.assert_allclose(scores["member_probs"].sum(-1), 1.0, atol=tol)
    assert (scores["mutual_information"] >= -tol).all()
    assert (scores["mutual_information"] <= np.log(M) + tol).all()  # MI <= H[member index]
    for name in ("predictive_entropy", "expected_entropy"):
        assert (scores[name] >= -tol).all() and (scores[name] <= np.log(C) + tol).all(), name
    assert ((scores["prediction"] >= 0) & (scores["prediction"] < C)).all()
    # the float32 scores are what the metrics take: they never refuse them
    labels = np.arange(len(logits)) % C
    metrics = classification_metrics(
        scores["probs"], labels, confidence=-scores["predictive_entropy"]
    )
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    assert 0 <= metrics["ece"] <= 1 and 0 <= metrics["brier"] <= 2 + tol
    assert 0 <= metrics["aurc"] <= 1 and metrics["eaurc"] >= -1e-12


MALFORMED_LOGITS = st.one_of(
    st.builds(np.zeros, array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=3)).filter(
        lambda a: a.ndim != 3 or 0 in a.shape
    ),  # wrong rank or an empty axis
    st.sampled_from([np.bool_, np.complex128, object, np.str_, "datetime64[s]"]).map(
        lambda d: np.zeros((2, 3, 4), dtype=d)
    ),  # not numbers
    st.sampled_from([None, 1.0, "logits", [[[1.0, 2.0], [3.0]]], [[[1.0, 2.0]], [[3.0]]], {}]),
)


@examples(2)
@given(MALFORMED_LOGITS)
def test_scores_refuse_malformed_logits(logits):
    result = outcome(lambda: ensemble_scores(logits))
    assert isinstance(result, HydraError), np.shape(logits)


@examples(2)
@given(finite_logits(), st.data())
def test_nonfinite_logits_are_refused_or_scored_as_nan(logits, data):
    logits = logits.copy()
    flat = logits.reshape(-1)
    for _ in range(data.draw(st.integers(1, 4))):
        flat[data.draw(st.integers(0, flat.size - 1))] = data.draw(st.sampled_from(SPECIALS))
    bad = ~np.isfinite(logits).all(axis=(1, 2))
    assert isinstance(outcome(lambda: ensemble_scores(logits)), HydraError)
    scores = ensemble_scores(logits, allow_nonfinite=True)
    assert (scores["prediction"][bad] == -1).all() and (scores["prediction"][~bad] >= 0).all()
    for name, value in scores.items():
        if name != "prediction":
            assert np.isnan(value[bad]).all() and np.isfinite(value[~bad]).all(), name


def _side(dtype) -> st.SearchStrategy:
    """1-D score arrays of a dtype over its whole finite range (with ties)."""
    if dtype == np.bool_:
        elements = st.booleans()
    elif np.dtype(dtype).kind == "i":
        elements = st.integers(np.iinfo(dtype).min, np.iinfo(dtype).max)
    else:
        elements = st.floats(width=np.finfo(dtype).bits, allow_nan=False, allow_infinity=False)
    return st.lists(elements | st.just(0), min_size=1, max_size=12).map(
        lambda v: np.array(v, dtype)
    )


@examples(4)
@given(
    st.sampled_from([np.float16, np.float32, np.float64, np.int64, np.bool_]).flatmap(
        lambda d: st.tuples(_side(d), _side(d))
    ),
    st.sampled_from(["ood", "id"]),
)
def test_ood_metrics_of_extreme_scores_are_rates(sides, positive):
    scores_id, scores_ood = sides
    got = ood_metrics(scores_id, scores_ood, positive=positive)
    for name, value in got.items():
        assert 0.0 <= value <= 1.0, (name, value)
    flipped = ood_metrics(-scores_id.astype(np.float64), -scores_ood.astype(np.float64), positive)
    assert got["auroc"] + flipped["auroc"] == pytest.approx(1.0, abs=1e-12)  # ties count half


JUNK = st.sampled_from(
    [
        None,
        "x",
        1.5,
        True,
        [],
        [[0.5, 0.5], [1.0]],
        [["a", "b"]],
        {"a": 1},
        np.zeros((2, 2), complex),
        np.array([[0.5, 0.5]], dtype=object),
        np.array([0.5, np.nan]),
        np.zeros((0, 2)),
        [1, None],
    ]
)


@examples(2)
@given(
    JUNK,
    JUNK,
    st.sampled_from(["classification", "ece", "nll", "ood", "fpr", "aurc", "eaurc", "ood_score"]),
)
def test_metrics_refuse_junk(a, b, metric):
    good_probs, good_labels = np.array([[0.25, 0.75], [0.5, 0.5]]), np.array([1, 0])
    calls = {
        "classification": lambda: classification_metrics(a, good_labels, confidence=b),
        "ece": lambda: ece(good_probs, a, bins=b if isinstance(b, int) else 3),
        "nll": lambda: nll(good_probs, good_labels, eps=a),
        "ood": lambda: ood_metrics(a, b),
        "fpr": lambda: fpr_at_tpr([0.1, 0.2], [0.3], tpr=a),
        "aurc": lambda: aurc(a, b),
        "eaurc": lambda: excess_aurc([0.1, 0.2], a),
        "ood_score": lambda: ood_score(a, b if isinstance(b, str) else "msp"),
    }
    result = outcome(calls[metric])
    if metric == "ood_score":  # it signs any array (a 0-d one too); junk it cannot read is refused
        assert isinstance(result, (HydraError, np.ndarray, np.floating)), result
    else:  # every junk value is refused in these places
        assert isinstance(result, HydraError), (metric, a, b)


@examples(2)
@given(st.integers() | st.sampled_from([10**12, 10_000, 10_001, 2**63, -(2**63)]), st.booleans())
def test_ece_and_reliability_bins_take_any_bin_count(bins, table):
    """A bin count of any size is used (1..MAX_BINS) or refused with its range, never a
    MemoryError from allocating ``bins`` empty bins (``bins=10**12`` did)."""
    probs, labels = np.array([[0.25, 0.75], [0.5, 0.5]]), np.array([1, 0])
    result = outcome(lambda: (reliability_bins if table else ece)(probs, labels, bins=bins))
    if 1 <= bins <= 10_000:
        assert not isinstance(result, HydraError), result
    else:
        assert isinstance(result, HydraError)
        assert "bins must be" in str(result) and (bins < 1 or "1..10000" in str(result))
