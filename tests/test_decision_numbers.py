"""Issue 34: a decisions record fitted on other numbers than a runner's (here: a TensorRT engine's,
while hydra-serve and hydra-score-dataset run ONNX Runtime) is refused by every consumer that
applies it, and applied with a warning when ``allow_decisions_mismatch`` is passed through."""

from __future__ import annotations

import contextlib
import logging
import socket
from dataclasses import replace

import pytest

from hydra_deploy.errors import RunnerError
from hydra_deploy.export_folder import read_info, write_decisions


@pytest.fixture(scope="module")
def engine_fitted(tmp_path_factory):
    """A calibrated tiny export whose record says it was fitted on a TensorRT engine."""
    from helpers.decisions import calibrated_export

    folder, _ = calibrated_export(tmp_path_factory.mktemp("numbers") / "export", risk=None)
    record = replace(
        read_info(folder).decisions, backend="tensorrt", precision="fp16", engine_sha256="e" * 64
    )
    write_decisions(folder, record)
    return folder, record


def test_score_dataset_s_driver_refuses_an_engine_s_record_unless_asked(engine_fitted, caplog):
    from hydra_deploy.distributed.ray_score import DriverExport

    folder, record = engine_fitted
    with pytest.raises(RunnerError, match=r"not on ONNX Runtime outputs of the fp32 model\.onnx"):
        DriverExport.read(folder)
    assert DriverExport.read(folder, decisions=False).decisions is None
    caplog.set_level(logging.WARNING, logger="hydra_deploy")
    assert DriverExport.read(folder, allow_decisions_mismatch=True).decisions == record
    assert "are not guaranteed for these" in caplog.text


def test_hydra_serve_s_runners_refuse_an_engine_s_record_unless_asked(engine_fitted, caplog):
    pytest.importorskip("pytriton", reason="hydra-serve needs nvidia-pytriton")
    from hydra_deploy.serve.pytriton_app import HydraServer, ServeConfig

    folder, record = engine_fitted
    ports = _free_ports(3)
    settings = dict(http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2])
    with pytest.raises(RunnerError, match="allow_decisions_mismatch=True"):
        HydraServer(ServeConfig(folder, **settings))
    caplog.set_level(logging.WARNING, logger="hydra_deploy")
    server = HydraServer(ServeConfig(folder, allow_decisions_mismatch=True, **settings))
    try:
        assert server.runners[0].decisions == record
        assert server.describe()["decisions"]["temperature"] == record.temperature
    finally:
        server.close()
    assert "are not guaranteed for these" in caplog.text


def _free_ports(count: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
