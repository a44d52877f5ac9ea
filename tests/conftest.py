"""Shared test set-up: hypothesis profiles, one torch thread, and the session-wide fixtures.

The builders the tests share live in the ``helpers`` package (``tests/helpers/``); this file holds
only fixtures and settings.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from helpers.vit import TINY_VIT, tiny_vit, train_digits_vit
from hypothesis import HealthCheck, settings

from hydra_deploy.specs import HydraSpec

# CI runs derandomized (reproducible); locally `HYPOTHESIS_PROFILE=dev` explores many more examples.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# One thread: tiny models are fastest so, and on a busy machine the barriers of multi-threaded
# kernels cost tiny forwards up to 100x (measured beside a running benchmark).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _restore_hydra_deploy_log_level():
    """Commands run in-process set the ``hydra_deploy`` logger's level (``--quiet``: ERROR); put it
    back after each test, so that what a test's ``caplog`` sees does not depend on the tests that
    ran before it."""
    logger = logging.getLogger("hydra_deploy")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.fixture(scope="session")
def tiny_vits():
    """One tiny adapter per configuration in TINY_VIT (built once per session)."""
    return {name: tiny_vit(name) for name in TINY_VIT}


@pytest.fixture(scope="session")
def digits_vit():
    """(adapter, train, val) of a tiny ViT trained on digits; built once per test session."""
    return train_digits_vit()


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """A tiny ViT Hydra export folder (2 members x 2 heads, batch profile 1/2/4), made once per
    session; tests that damage it work on a copy."""
    from hydra_deploy.export import export_onnx
    from hydra_deploy.fusion import fuse

    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=2, seed=0)
    out = tmp_path_factory.mktemp("tiny-export") / "export"
    export_onnx(fuse(backbone, spec), out, batch=(1, 2, 4), exporter="torchscript", validate=False)
    return out
