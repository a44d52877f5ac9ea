"""Image folders named by class index and ``--labels FILE`` (issue 36, item 1): the one rule of
:func:`hydra_deploy.labels.folder_class_indices`, read alike by ``hydra-eval``/``hydra-calibrate``
(``load_eval_data``) and fine-tuning/head selection (``load_data``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from hydra_deploy.cli import calibrate as calibrate_cli
from hydra_deploy.cli import eval as eval_cli
from hydra_deploy.engines.runner import TensorSpec
from hydra_deploy.errors import DataError
from hydra_deploy.evaluation.evaluate import load_eval_data
from hydra_deploy.labels import (
    NamedClasses,
    class_names_to_use,
    folder_class_indices,
    read_class_names,
    with_class_names,
)

BOTH_FIXES = (
    "name the sub-folders 0..{last} by class index, or pass --labels FILE with the model's class "
    "names, one per line"
)


class Model:
    """What load_eval_data reads of a runner: family, class names, the output's class count."""

    def __init__(self, class_names, classes=None):
        self.family, self.class_names = "vit", class_names
        count = len(class_names) if class_names else classes
        self.outputs = (TensorSpec("member_logits", ("batch", 2, count), "float32"),)


def image_folder(root, classes, per_class=1):
    for cls in classes:
        (root / cls).mkdir(parents=True)
        for index in range(per_class):
            Image.new("L", (4, 4), color=index).save(root / cls / f"{index}.png")
    return root


# --- the rule ------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 30).flatmap(
        lambda c: st.tuples(st.just(c), st.sets(st.integers(0, c - 1), min_size=1))
    )
)
def test_integer_folders_are_class_indices_whatever_their_sorted_order(case):
    classes, picked = case
    folders = sorted(str(i) for i in picked)  # "10" sorts before "2": the index is still 10
    indices, names = folder_class_indices(folders, None, classes, source="ID")
    assert indices == [int(f) for f in folders] and names is None
    model_names = [f"class {i}" for i in range(classes)]  # names these folders are not
    assert folder_class_indices(folders, model_names, classes, source="ID")[0] == indices


def test_the_model_s_names_win_when_every_folder_is_one():
    # a model whose names are integers in another order: the names decide
    names = ["2", "0", "1"]
    assert folder_class_indices(["0", "1", "2"], names, 3, source="ID") == ([1, 2, 0], names)
    assert folder_class_indices(["cat", "dog"], ["dog", "cat"], 2, source="ID")[0] == [1, 0]


def test_an_index_beyond_the_classes_and_unmappable_names_are_refused():
    with pytest.raises(
        DataError,
        match=r"ID: sub-folder '12' is no class index of the model, which has 10 classes \(0..9\)",
    ):
        folder_class_indices(["0", "12"], None, 10, source="ID")
    with pytest.raises(DataError) as caught:
        folder_class_indices(["ant", "bee"], None, 1000, source="--data: calib")
    assert str(caught.value).endswith(BOTH_FIXES.format(last=999))
    assert "names 2 classes (ant, bee) by its sub-folders but the model has 1000 classes" in str(
        caught.value
    )
    # as many names as classes: the sorted rule (warned), as before
    assert folder_class_indices(["b", "a"], None, 2, source="ID") == ([1, 0], ["a", "b"])
    # fine-tuning keeps torchvision's ImageFolder rule for names whatever their count
    assert folder_class_indices(["b", "a"], None, 5, source="ID", any_count=True)[0] == [1, 0]


# --- --labels FILE -------------------------------------------------------------------------------
def test_a_class_names_file(tmp_path):
    path = tmp_path / "names.txt"
    path.write_text(" ant \nbee\ncat\n\n\n")  # trailing blank lines are fine
    assert read_class_names(path) == ["ant", "bee", "cat"]
    path.write_text("ant\n\ncat\n")
    with pytest.raises(
        DataError, match=r"names.txt line 2 is blank; write one class name on every line"
    ):
        read_class_names(path)
    path.write_text("ant\nbee\nant\n")
    with pytest.raises(DataError, match=r"line 3 repeats 'ant' \(line 1\)"):
        read_class_names(path)
    path.write_text("\n")
    with pytest.raises(DataError, match=r"holds no class names"):
        read_class_names(path)
    with pytest.raises(DataError, match=r"--labels: cannot read class names from"):
        read_class_names(tmp_path / "missing.txt")
    assert with_class_names("calib", None) == "calib"


def test_labels_map_folder_names_and_must_agree_with_the_model(tmp_path):
    given_names = NamedClasses("calib", ("cat", "ant", "bee"), "--labels names.txt")
    indices, names = folder_class_indices(["ant", "cat"], None, 3, source="ID", given=given_names)
    assert (indices, names) == ([1, 0], ["cat", "ant", "bee"])
    with pytest.raises(DataError, match=r"--labels names.txt names 3 classes but the model has 4"):
        class_names_to_use(None, given_names, 4)
    with pytest.raises(
        DataError, match=r"--labels names.txt line 2 says 'ant' but the model names class 1 'dog'"
    ):
        class_names_to_use(["cat", "dog", "bee"], given_names, 3)
    assert class_names_to_use(["cat", "ant", "bee"], given_names, 3) == ["cat", "ant", "bee"]
    with pytest.raises(DataError, match=r"label 'emu' is not one of the model's classes"):
        folder_class_indices(["emu"], None, 3, source="ID", given=given_names)


# --- the readers ---------------------------------------------------------------------------------
def test_hydra_eval_and_calibrate_read_index_folders_and_labels(tmp_path):
    root = image_folder(tmp_path / "calib", [str(i) for i in range(12)])
    data = load_eval_data(root, Model(None, classes=12), name="--data", labelled=True)
    # images in sorted folder order 0, 1, 10, 11, 2, ...: each labelled by its folder's index
    assert data.labels.tolist() == [0, 1, 10, 11, 2, 3, 4, 5, 6, 7, 8, 9]
    named = image_folder(tmp_path / "named", ["cat", "ant"])
    (tmp_path / "names.txt").write_text("ant\nbee\ncat\n")
    data = load_eval_data(
        with_class_names(named, tmp_path / "names.txt"),
        Model(None, classes=3),
        name="--data",
        labelled=True,
    )
    assert data.labels.tolist() == [0, 2]  # ant, cat by the file's lines
    with pytest.raises(DataError, match=BOTH_FIXES.format(last=999).replace(".", r"\.")):
        load_eval_data(named, Model(None, classes=1000), name="--data", labelled=True)


def test_fine_tuning_reads_index_folders_as_indices(tmp_path):
    from helpers.vit import tiny_vit

    from hydra_deploy.pruning.data import load_data

    backbone = tiny_vit("token")  # 5 classes
    root = image_folder(tmp_path / "train", ["4", "0", "2"], per_class=2)
    data = load_data(root, backbone, name="--finetune")
    assert [int(y) for _, y in data.dataset] == [0, 0, 2, 2, 4, 4]
    with pytest.raises(DataError, match=r"sub-folder '7' is no class index of the model"):
        load_data(image_folder(tmp_path / "big", ["0", "7"]), backbone, name="--finetune")


def test_the_commands_take_labels_and_read_them_first(tmp_path, capsys):
    (tmp_path / "names.txt").write_text("ant\n\ncat\n")
    labels = ["--labels", str(tmp_path / "names.txt")]
    assert calibrate_cli.main([str(tmp_path / "export"), "--data", str(tmp_path), *labels]) != 0
    assert "names.txt line 2 is blank" in capsys.readouterr().err
    report = ["--ood", "n=x.npz", "--out", str(tmp_path / "report")]
    assert eval_cli.main([str(tmp_path / "export"), "--id", str(tmp_path), *labels, *report]) != 0
    assert "names.txt line 2 is blank" in capsys.readouterr().err


def test_hydra_run_reads_the_true_class_of_index_folders(tmp_path):
    """hydra-run's true_class follows the same rule: folders 0..C-1 are class indices, also
    beside the model's class names (which these folder names are not)."""
    import json

    from helpers.vit import tiny_vit

    from hydra_deploy.cli.run import main as run_main
    from hydra_deploy.export import export_onnx
    from hydra_deploy.fusion import fuse
    from hydra_deploy.specs import HydraSpec

    backbone = tiny_vit("token")  # 5 classes
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=2, seed=1)
    names = ["ant", "bee", "cat", "dog", "eel"]
    export_onnx(fuse(backbone, spec), tmp_path / "export", class_names=names, validate=False)
    images = image_folder(tmp_path / "images", ["4", "0"])
    code = run_main([str(tmp_path / "export"), str(images), "--json", str(tmp_path / "s.json")])
    assert code == 0
    results = json.loads((tmp_path / "s.json").read_text())["results"]
    assert [(r["true_class"], r["true_name"]) for r in results] == [(0, "0"), (4, "4")]
