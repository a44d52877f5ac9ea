"""--threads on every command that computes: one flag (RunnerOptions' ``threads``), applied to
torch (``torch.set_num_threads``) and to the ONNX Runtime sessions the command opens."""

from __future__ import annotations

import contextlib
import io
from importlib import import_module

import pytest
import torch
from helpers.vit import tiny_vit

from hydra_deploy import threads as threads_module
from hydra_deploy.engines import load_runner
from hydra_deploy.errors import HydraError
from hydra_deploy.export import export_onnx
from hydra_deploy.fusion import fuse
from hydra_deploy.specs import HydraSpec
from hydra_deploy.threads import ort_threads, use_threads

#: each command that computes, and the smallest argument list its parser takes
COMMANDS = {
    "export": [],
    "fuse": ["--backbone", "vit_ti16"],
    "calibrate": ["export/m", "--data", "calib/"],
    "eval": ["export/m", "--id", "val/", "--ood", "noise=noise.npz", "--out", "report/"],
    "compare": ["export/m"],
    "run": ["export/m", "images/"],
    "score_dataset": ["export/m", "images/", "--out", "scores.parquet"],
}
#: the docs' tiny stand-in for ViT-B/16 (random weights): two layers of width 48 at 16x16 pixels
TINY = [
    a
    for arg in ("img_size=16", "patch_size=8", "embed_dim=48", "depth=2")
    for a in ("--model-arg", arg)
]


@pytest.fixture
def restored_threads():
    """The process's thread settings as they were before the test."""
    torch_threads, ort = torch.get_num_threads(), threads_module._ORT_THREADS[0]
    yield
    torch.set_num_threads(torch_threads)
    threads_module._ORT_THREADS[0] = ort


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_computing_command_takes_threads(command):
    parser = import_module(f"hydra_deploy.cli.{command}").build_parser()
    assert "--threads N" in parser.format_help()
    assert parser.parse_args([*COMMANDS[command], "--threads", "3"]).threads == 3
    assert parser.parse_args(COMMANDS[command]).threads is None  # default: the libraries'


def test_fuse_sets_torchs_threads_during_the_run(monkeypatch, restored_threads):
    fuse_cli = import_module("hydra_deploy.cli.fuse")
    seen = []
    build_hydra = fuse_cli.build.build_hydra

    def watched(args, progress=True):
        seen.append(torch.get_num_threads())
        return build_hydra(args, progress=progress)

    monkeypatch.setattr(fuse_cli.build, "build_hydra", watched)
    wanted = 3 if torch.get_num_threads() != 3 else 2
    argv = [
        "--backbone",
        "vit_b16",
        *TINY,
        "--members",
        "2",
        "--heads-per-member",
        "1",
        "--batch",
        "1",
    ]
    with contextlib.redirect_stdout(io.StringIO()):
        assert fuse_cli.main([*argv, "--quiet", "--threads", str(wanted)]) == 0
    assert seen == [wanted]
    assert ort_threads() == wanted  # and the ONNX Runtime sessions it would open


def test_onnx_runtime_sessions_take_the_commands_threads(tmp_path, restored_threads):
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=2, seed=1)
    export_onnx(fuse(backbone, spec), tmp_path / "export", batch=(1, 2, 2), validate=False)
    use_threads(2)
    with load_runner(tmp_path / "export") as runner:
        assert runner.session.get_session_options().intra_op_num_threads == 2
    with load_runner(tmp_path / "export", threads=1) as runner:  # a call's own count wins
        assert runner.session.get_session_options().intra_op_num_threads == 1


def test_use_threads_none_changes_nothing_and_bad_counts_are_refused(restored_threads):
    before = torch.get_num_threads(), ort_threads()
    use_threads(None, torch=True)
    assert (torch.get_num_threads(), ort_threads()) == before
    for bad in (0, -1, 1.5, True):
        with pytest.raises(HydraError, match="threads must be an integer of at least 1"):
            use_threads(bad)


def test_export_sets_torchs_threads_during_the_build(monkeypatch, tmp_path, restored_threads):
    export_cli = import_module("hydra_deploy.cli.export")
    seen = []
    build_hydra = export_cli.build.build_hydra

    def watched(args, progress=True):
        seen.append((torch.get_num_threads(), ort_threads()))
        return build_hydra(args, progress=progress)

    monkeypatch.setattr(export_cli.build, "build_hydra", watched)
    wanted = 3 if torch.get_num_threads() != 3 else 2
    argv = ["--backbone", "vit_b16", *TINY]
    argv += ["--members", "2", "--heads-per-member", "2", "--max-batch", "2", "--opt-batch", "2"]
    with contextlib.redirect_stdout(io.StringIO()):
        code = export_cli.main(
            [*argv, "--out", str(tmp_path / "e"), "--quiet", "--threads", str(wanted)]
        )
    assert code == 0
    assert seen == [(wanted, wanted)]
