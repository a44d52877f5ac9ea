"""Atomic writes: a failure or an interrupt mid-write keeps the old file and leaves no temporary."""

from __future__ import annotations

import os
import stat

import pytest

from hydra_deploy.atomic import atomic_path, atomic_write_bytes, atomic_write_json


def test_write_replaces_and_keeps_the_mode(tmp_path):
    path = tmp_path / "model.engine"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new" and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.engine"]


@pytest.mark.parametrize("fault", [KeyboardInterrupt, OSError, ValueError])
def test_a_fault_mid_write_keeps_the_old_file_and_no_temporary(tmp_path, fault):
    path = tmp_path / "weights.safetensors"
    path.write_bytes(b"old")
    with pytest.raises(fault), atomic_path(path) as tmp:
        tmp.write_bytes(b"half")
        raise fault("stopped")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.safetensors"]


def test_a_new_file_appears_only_when_complete(tmp_path):
    path = tmp_path / "report.json"
    with atomic_path(path) as tmp:
        tmp.write_text("{}")
        assert not path.exists()  # only the temporary name exists while writing
    assert path.read_text() == "{}"
    with pytest.raises(ValueError, match="not JSON compliant"):
        atomic_write_json(tmp_path / "nan.json", {"x": float("nan")})
    assert not (tmp_path / "nan.json").exists()
