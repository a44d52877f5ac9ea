"""The export folder contract (hydra_deploy.export_folder): one reader, one writer, one answer.

Every consumer of an export folder (the runners, the TensorRT build planner, reload, hydra-compare,
Triton repositories, hydra-score-dataset's driver) reads hydra.json through ``read_info``, so a
damaged record gets the same error, word for word, from each of them.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_deploy.distributed.ray_score import DriverExport
from hydra_deploy.engines.build_source import load_source
from hydra_deploy.engines.runner import load_runner
from hydra_deploy.errors import EngineError, ExportError, RunnerError, ServeError
from hydra_deploy.evaluation.compare import compare_export
from hydra_deploy.export import load_export
from hydra_deploy.export_folder import (
    CROP_MODES,
    DECISIVE_PREPROCESSING,
    FORMAT,
    INFO_FILE,
    INTERPOLATIONS,
    MODEL_FILE,
    TOKENIZER_DIR,
    TOKENIZER_FILES,
    ExportFolderError,
    ExportInfo,
    MergeRecord,
    Preprocessing,
    TensorInfo,
    TokenizerEntry,
    file_sha256,
    parse_batch_profile,
    read_info,
    write_info,
)
from hydra_deploy.serve.triton_repo import _read_export


@pytest.fixture
def export_dir(tiny_export):
    return tiny_export


@pytest.fixture
def damaged(export_dir, tmp_path):
    """A copy of the export and a function that overwrites its hydra.json."""
    folder = tmp_path / "export"
    shutil.copytree(export_dir, folder)
    record = json.loads((folder / INFO_FILE).read_text())

    def write(content: bytes | str | dict) -> None:
        if isinstance(content, dict):
            content = json.dumps(content)
        if isinstance(content, str):
            content = content.encode()
        (folder / INFO_FILE).write_bytes(content)

    return folder, record, write


def test_the_exporter_writes_what_the_reader_reads(export_dir):
    info = read_info(export_dir)
    record = json.loads((export_dir / INFO_FILE).read_text())
    assert isinstance(info, ExportInfo) and dict(info.record) == record
    assert info.path == export_dir / INFO_FILE and info.onnx_path == export_dir / MODEL_FILE
    assert record["format"] == FORMAT and info.family == "vit" and info.precision == "fp32"
    assert info.batch_profile == (1, 2, 4) and info.uq_outputs is False
    digest = hashlib.sha256((export_dir / MODEL_FILE).read_bytes()).hexdigest()
    assert info.onnx_sha256 == digest == file_sha256(export_dir / MODEL_FILE)
    assert read_info(export_dir / INFO_FILE) == info  # the folder or the file
    with load_runner(export_dir, providers=["cpu"]) as runner:
        assert runner.export_info == info and runner.info == record and runner.max_batch == 4


def test_write_info_refuses_what_read_info_would_refuse(tmp_path, export_dir):
    record = json.loads((export_dir / INFO_FILE).read_text())
    with pytest.raises(ExportFolderError, match="malformed batch_profile"):
        write_info(tmp_path, {**record, "batch_profile": {"min": 4, "opt": 2, "max": 1}})
    assert not (tmp_path / INFO_FILE).exists()
    written = write_info(tmp_path, record)
    assert read_info(tmp_path) == ExportInfo.from_record(record, tmp_path / INFO_FILE) == written


def test_one_error_for_every_stage():
    for kind in (RunnerError, EngineError, ExportError, ServeError):
        assert issubclass(ExportFolderError, kind)


@pytest.mark.parametrize(
    ("profile", "parsed"),
    [
        (None, None),
        ({"min": 1, "opt": 1, "max": 1}, (1, 1, 1)),
        ({"min": 2, "opt": 8, "max": 32, "note": "x"}, (2, 8, 32)),
    ],
)
def test_batch_profile_parses(profile, parsed):
    assert parse_batch_profile(profile, "hydra.json") == parsed


@pytest.mark.parametrize(
    "profile",
    [
        [1, 2, 4],
        {"min": 1, "opt": 2},
        {"min": 1, "opt": 2, "max": "4"},
        {"min": 0, "opt": 1, "max": 1},
        {"min": 1, "opt": 8, "max": 4},
        {"min": True, "opt": 1, "max": 1},
        {"min": 1.0, "opt": 2, "max": 4},
        "1,8,32",
        {},
    ],
)
def test_batch_profile_refuses(profile):
    with pytest.raises(ExportFolderError, match="malformed batch_profile") as caught:
        parse_batch_profile(profile, "engine.json", "rebuild it with hydra-build")
    assert str(caught.value).startswith("engine.json has") and "rebuild it" in str(caught.value)


# every consumer of an export folder, as its command reads it
CONSUMERS = {
    "load_runner(folder)": lambda folder: load_runner(folder, providers=["cpu"]),
    "load_runner(model.onnx)": lambda folder: load_runner(folder / MODEL_FILE, providers=["cpu"]),
    "load_source (hydra-build)": load_source,
    "load_export (hydra-export --from)": lambda folder: load_export(folder, check=False),
    "compare_export (hydra-compare)": lambda folder: compare_export(folder, batch=1),
    "Triton repository (--triton)": _read_export,
    "hydra-score-dataset driver": DriverExport.read,
}
DAMAGE = {
    "not UTF-8": lambda r: b'{"format": "hydra-export/1", "family": "\xff"}',
    "truncated JSON": lambda r: json.dumps(r)[:40],
    "not an object": lambda r: "[1, 2]",
    "nested too deeply": lambda r: "[" * 100_000 + "]" * 100_000,
    "no format": lambda r: {k: v for k, v in r.items() if k != "format"},
    "future format": lambda r: {**r, "format": "hydra-export/99"},
    "format not a string": lambda r: {**r, "format": 1},
    "batch profile a list": lambda r: {**r, "batch_profile": [1, 2, 4]},
    "batch profile unordered": lambda r: {**r, "batch_profile": {"min": 4, "opt": 2, "max": 1}},
    "batch profile a string max": lambda r: {
        **r,
        "batch_profile": {"min": 1, "opt": 2, "max": "4"},
    },
    "hash not hex": lambda r: {**r, "onnx_sha256": "z" * 64},
    "unknown precision": lambda r: {**r, "precision": "int4"},
    "class names a string": lambda r: {**r, "class_names": "cat"},
    "class names not strings": lambda r: {**r, "class_names": [1, 2, 3, 4, 5]},
    "family a list": lambda r: {**r, "family": ["vit"]},
    "family not registered": lambda r: {**r, "family": "siglip"},
    "uq_outputs a string": lambda r: {**r, "uq_outputs": "yes"},
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_every_consumer_gives_the_same_answer(damaged, damage):
    folder, record, write = damaged
    write(DAMAGE[damage](record))
    with pytest.raises(ExportFolderError) as expected:
        read_info(folder)
    message = str(expected.value)
    assert str(folder / INFO_FILE) in message
    assert "re-export" in message or "upgrade hydra-deploy" in message
    for name, consume in CONSUMERS.items():
        with pytest.raises(ExportFolderError) as caught:
            consume(folder)
        assert str(caught.value) == message, name


def test_every_consumer_reads_the_undamaged_record(damaged):
    """The matrix above is not vacuous: the same copy, restored, passes every reader."""
    folder, record, write = damaged
    write(record)
    for name, consume in CONSUMERS.items():
        if name == "Triton repository (--triton)":
            with pytest.raises(ServeError, match="no uncertainty outputs"):  # Triton needs them
                consume(folder)
            continue
        assert consume(folder) is not None, name


# --- the decisions record names the numbers it was fitted on (issue 34) --------------------------
_SHA_MODEL, _SHA_DATA, _SHA_ENGINE = "a" * 64, "b" * 64, "e" * 64


def _decision_record(**numbers):
    from hydra_deploy.export_folder import DecisionRecord, OodRule, SetRule

    return DecisionRecord(
        temperature=1.5,
        num_classes=5,
        onnx_sha256=_SHA_MODEL,
        data_sha256=_SHA_DATA,
        n_temperature=50,
        n_quantile=50,
        holdout=0.5,
        seed=0,
        sets=SetRule("lac", 0.1, (0.8,)),
        ood=OodRule("msp", 0.05, -0.3),
        **numbers,
    )


@pytest.mark.parametrize(
    "numbers",
    [
        {},  # a record from before records named their numbers
        {"backend": "onnxruntime", "precision": "fp16"},
        {"backend": "tensorrt", "precision": "int8", "engine_sha256": _SHA_ENGINE},
        {"backend": "tensorrt", "precision": None, "engine_sha256": _SHA_ENGINE},  # trtexec's
        {"backend": "openvino", "precision": "fp16"},  # a registered backend's record_name
    ],
)
def test_a_decision_record_round_trips_with_the_numbers_it_was_fitted_on(numbers):
    from hydra_deploy.export_folder import DecisionRecord

    record = _decision_record(**numbers)
    written = json.loads(json.dumps(record.to_dict()))
    assert DecisionRecord.from_dict(written) == record
    assert DecisionRecord.from_dict(written).to_dict() == written
    assert ("backend" in written) == bool(numbers)


def test_an_old_record_loads_as_onnx_runtime_on_the_folders_graph_and_says_so(export_dir, tmp_path):
    from hydra_deploy.export_folder import DecisionRecord

    old = _decision_record().to_dict()  # as hydra-calibrate wrote it before the numbers
    assert not {"backend", "precision", "engine_sha256"} & set(old)
    folder = tmp_path / "export"
    shutil.copytree(export_dir, folder)
    info = json.loads((folder / INFO_FILE).read_text())
    (folder / INFO_FILE).write_text(json.dumps({**info, "decisions": old}))
    record = read_info(folder).decisions
    assert record == DecisionRecord.from_dict(old) and record.backend is None
    assert record.to_dict() == old  # written back as it was
    assert record.fitted_numbers("fp16") == ("onnxruntime", "fp16")
    assert record.numbers_mismatch("onnxruntime", "fp16", folder_precision="fp16") == []
    with pytest.raises(ExportFolderError) as caught:
        record.check_numbers(
            "tensorrt",
            "fp16",
            _SHA_ENGINE,
            folder="EXP",
            engine="m.engine",
            folder_precision="fp32",
        )
    text = str(caught.value)
    assert (
        "fitted on ONNX Runtime outputs of the fp32 model.onnx (the record names no backend" in text
    )
    assert "hydra-calibrate EXP --data LABELLED --engine m.engine --overwrite" in text


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"backend": "Open VINO", "precision": "fp32"}, "backend"),
        ({"precision": "fp16"}, "backend"),  # numbers without a backend
        ({"backend": "tensorrt", "precision": "fp16"}, "engine_sha256"),
        ({"backend": "tensorrt", "precision": "fp16", "engine_sha256": "E" * 64}, "engine_sha256"),
        (
            {"backend": "onnxruntime", "precision": "fp32", "engine_sha256": _SHA_ENGINE},
            "engine_sha256",
        ),
        ({"backend": "onnxruntime", "precision": "fp8"}, "precision"),
        ({"backend": "tensorrt", "precision": 16, "engine_sha256": _SHA_ENGINE}, "precision"),
    ],
)
def test_malformed_numbers_of_a_decision_record_are_refused(change, field):
    from hydra_deploy.export_folder import DecisionRecord

    with pytest.raises(ExportFolderError, match=rf"malformed {field} .*hydra-calibrate"):
        DecisionRecord.from_dict({**_decision_record().to_dict(), **change})


def test_a_hydra_json_left_mid_switch_reads_as_the_record_of_the_model_it_finds(
    export_dir, tmp_path
):
    """write_decisions(model=...) writes hydra.json with the record it replaces before the one
    rename that switches model.onnx: until it is written again, the reader takes the record of
    the model.onnx it finds (the old record for the old file, the new one for the new)."""
    folder = tmp_path / "export"
    shutil.copytree(export_dir, folder)
    old = json.loads((folder / INFO_FILE).read_text())
    new = {**old, "onnx_sha256": "c" * 64, "decisions": _decision_record().to_dict()}
    (folder / INFO_FILE).write_text(json.dumps({**new, "replacing": old}))
    assert dict(read_info(folder).record) == old  # model.onnx is still the old file
    (folder / MODEL_FILE).write_bytes(b"the new model")
    new["onnx_sha256"] = file_sha256(folder / MODEL_FILE)
    (folder / INFO_FILE).write_text(json.dumps({**new, "replacing": old}))
    assert dict(read_info(folder).record) == new  # switched: the new record
    with pytest.raises(ExportFolderError, match="'replacing' entry is written by write_decisions"):
        write_info(folder, {**new, "replacing": old})
    (folder / INFO_FILE).write_text(json.dumps({**new, "replacing": [1]}))
    with pytest.raises(ExportFolderError, match="malformed 'replacing' entry"):
        read_info(folder)


# --- typed entries: written as read, the same JSON ------------------------------------------------
names = st.text(st.characters(codec="ascii", categories=("L", "N")), min_size=1, max_size=8)
dims = st.one_of(st.integers(0, 4096), names)
tensors = st.builds(
    TensorInfo,
    names,
    st.lists(dims, max_size=4).map(tuple),
    st.one_of(st.none(), st.sampled_from(["float32", "float16", "int64"])),
)
tokenizers = st.builds(
    TokenizerEntry,
    dir=st.just(TOKENIZER_DIR),
    max_length=st.integers(1, 4096),
    vocab_size=st.one_of(st.none(), st.integers(1, 250_000)),
    files=st.one_of(st.none(), st.lists(st.sampled_from(TOKENIZER_FILES), unique=True).map(tuple)),
)


@st.composite
def preprocessings(draw):
    channels = draw(st.sampled_from([1, 3]))
    numbers = st.lists(
        st.floats(0.01, 1, allow_nan=False), min_size=channels, max_size=channels
    ).map(tuple)
    maybe = lambda strategy: draw(st.one_of(st.none(), strategy))  # noqa: E731
    return Preprocessing(
        input_size=(channels, draw(st.integers(1, 512)), draw(st.integers(1, 512))),
        mean=draw(numbers),
        std=draw(numbers),
        interpolation=maybe(st.sampled_from(INTERPOLATIONS)),
        crop_pct=maybe(st.floats(0.1, 1.5)),
        crop_mode=maybe(st.sampled_from(CROP_MODES)),
        defaulted=tuple(draw(st.lists(st.sampled_from(DECISIVE_PREPROCESSING), unique=True))),
    )


merges = st.dictionaries(
    names, st.one_of(st.sampled_from(["shared", "per-member", "grouped"]), st.integers(0, 9)),
    min_size=1, max_size=6,
).map(lambda parts: MergeRecord(tuple(parts.items())))  # fmt: skip


@settings(deadline=None, max_examples=60)
@given(
    inputs=st.lists(tensors, min_size=1, max_size=3),
    outputs=st.lists(tensors, min_size=1, max_size=3),
    tokenizer=st.one_of(st.none(), tokenizers),
    preprocessing=st.one_of(st.none(), preprocessings()),
    merge=merges,
)
def test_typed_entries_are_written_as_read_and_rewritten_as_the_same_json(
    export_dir, tmp_path_factory, inputs, outputs, tokenizer, preprocessing, merge
):
    """A record made from typed entries reads back as those entries, and a record read and
    written again is the same file, byte for byte."""
    made = read_info(export_dir).replace(
        inputs=inputs,
        outputs=outputs,
        tokenizer=tokenizer,
        preprocessing=preprocessing,
        merge=merge,
    )
    folder = tmp_path_factory.mktemp("typed")
    written = write_info(folder, made)
    read = read_info(folder)
    assert read == written == ExportInfo.from_record(made.record, folder / INFO_FILE)
    assert read.input_tensors == tuple(inputs) and read.output_tensors == tuple(outputs)
    assert read.tokenizer_entry == tokenizer and read.merge_record == merge
    assert read.preprocessing_config == preprocessing
    text = (folder / INFO_FILE).read_bytes()
    again = tmp_path_factory.mktemp("again")
    write_info(again, read)
    assert (again / INFO_FILE).read_bytes() == text


def test_an_export_read_and_written_again_is_the_same_file(export_dir, tmp_path):
    write_info(tmp_path, read_info(export_dir))
    assert (tmp_path / INFO_FILE).read_bytes() == (export_dir / INFO_FILE).read_bytes()
    info = read_info(export_dir)
    assert [t.to_dict() for t in info.input_tensors] == list(info.inputs)
    assert info.preprocessing_config.to_dict() == info.preprocessing
    assert info.merge_record.to_dict() == info.merge


@pytest.mark.parametrize(
    ("entry", "value", "said"),
    [
        ("inputs", [{"name": "x", "shape": "batch"}], "malformed inputs"),
        ("tokenizer", {"dir": "", "max_length": 8}, "malformed 'tokenizer' entry.*dir"),
        (
            "tokenizer",
            {"dir": "tokenizer", "max_length": 0},
            "malformed 'tokenizer' entry.*max_length",
        ),
        ("preprocessing", {"input_size": [3, 8], "mean": [0], "std": [1]}, "malformed input_size"),
        (
            "preprocessing",
            {"input_size": [3, 8, 8], "mean": [0], "std": [1, 1, 1]},
            "malformed mean",
        ),
        ("merge", {"mlp": True}, "malformed merge"),
    ],
)
def test_a_typed_entry_is_checked_on_write_as_on_read(export_dir, tmp_path, entry, value, said):
    info = read_info(export_dir)
    with pytest.raises(ExportFolderError, match=said):
        info.replace(**{entry: value})
    record = {**info.record, entry: value}
    (tmp_path / INFO_FILE).write_text(json.dumps(record))
    read = read_info(tmp_path)  # the record is readable: the entry's reader refuses it
    view = {
        "inputs": "input_tensors",
        "tokenizer": "tokenizer_entry",
        "preprocessing": "preprocessing_config",
        "merge": "merge_record",
    }[entry]
    with pytest.raises(ExportFolderError, match=said):
        getattr(read, view)


def test_replace_names_the_entries_a_record_has(export_dir):
    with pytest.raises(TypeError, match="no entries \\['colour'\\]"):
        read_info(export_dir).replace(colour="blue")
    fp16 = read_info(export_dir).replace(precision="fp16")
    assert fp16.precision == "fp16" and fp16.strongly_typed
    assert list(fp16.record) == list(read_info(export_dir).record)  # each entry in its place
