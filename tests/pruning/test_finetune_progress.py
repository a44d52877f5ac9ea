"""Fine-tuning's and head importance's progress through hydra_deploy.progress: a log gets lines
per member and step (not only a summary after minutes), --quiet (progress=False) and a library
user who has not turned our logs on get none, a terminal gets a bar."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
import torch
from helpers.members import random_spec
from helpers.progress import every_update, progress_lines
from helpers.vit import tiny_vit

from hydra_deploy import progress as progress_module
from hydra_deploy.pruning import head_importance
from hydra_deploy.pruning.finetune import finetune_members

STEPS = dict(max_steps=3, batch_size=8, lr=1e-3)


@pytest.fixture(scope="module")
def setup():
    backbone = tiny_vit("token")
    spec = random_spec(backbone, members=2, heads_per_member=2, seed=0)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((16, 3, 16, 16)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 5, 16))
    return backbone, spec, (x, y)


@pytest.fixture()
def our_logs(monkeypatch, caplog):
    with every_update(monkeypatch, caplog) as captured:
        yield captured


def test_a_log_gets_lines_per_member_and_step(setup, our_logs, capsys):
    backbone, spec, data = setup
    finetune_members(backbone, spec, data, eval_examples=8, progress=True, **STEPS)
    said = progress_lines(our_logs)
    for member in ("0 (1 of 2)", "1 (2 of 2)"):
        assert f"fine-tuning member {member}: loss before: 8/8 examples (100%)" in " ".join(said)
        steps = [s for s in said if s.startswith(f"fine-tuning member {member}, loss ")]
        assert [s.split(": ")[1].split(" (")[0] for s in steps] == [
            "1/3 steps",
            "2/3 steps",
            "3/3 steps",
        ]
        assert any(s.startswith(f"fine-tuning member {member}: loss after") for s in said)
    assert capsys.readouterr().out == ""  # never stdout


def test_progress_false_and_a_quiet_logger_say_nothing(setup, our_logs, capsys):
    backbone, spec, data = setup
    finetune_members(backbone, spec, data, eval_examples=8, progress=False, **STEPS)
    assert not progress_lines(our_logs)
    logging.getLogger("hydra_deploy").setLevel(logging.ERROR)  # --quiet, or logs not turned on
    finetune_members(backbone, spec, data, eval_examples=8, progress=True, **STEPS)
    assert not progress_lines(our_logs)
    assert capsys.readouterr() == ("", "")


def test_a_terminal_gets_a_bar_named_after_the_member(setup, our_logs, monkeypatch):
    pytest.importorskip("tqdm", reason="the bar needs tqdm (the [build] extra)")
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    monkeypatch.setattr(progress_module, "_is_terminal", lambda: True)
    backbone, spec, data = setup
    finetune_members(backbone, spec, data, eval_examples=8, progress=True, **STEPS)
    assert "fine-tuning member 1 (2 of 2), loss" in stderr.getvalue()
    assert not progress_lines(our_logs)


@pytest.mark.parametrize(
    ("method", "first", "last"),
    [
        ("taylor", "head importance (taylor): 8/16 examples", "16/16 examples (100%)"),
        ("circuit", "head importance (circuit search): 1/3 layers", "3/3 layers (100%)"),
    ],
)
def test_head_importance_shows_its_pass_in_a_log(setup, our_logs, method, first, last):
    backbone, _, data = setup
    head_importance(backbone, data, method, batch_size=8)
    said = progress_lines(our_logs)
    assert said[0].startswith(first) and last in said[-1]
    our_logs.clear()
    logging.getLogger("hydra_deploy").setLevel(logging.ERROR)  # --quiet
    head_importance(backbone, data, method, batch_size=8)
    assert not progress_lines(our_logs)
