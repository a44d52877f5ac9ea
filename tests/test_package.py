"""Package-level promises: a cheap import (no torch for the edge runtime) and the public names."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    return set(result.stdout.split())


def test_top_level_specs_and_uncertainty_import_without_torch():
    modules = _imported_after(
        "import hydra_deploy, hydra_deploy.specs, hydra_deploy.uncertainty.metrics; "
        "hydra_deploy.HydraSpec; hydra_deploy.uncertainty.ensemble_scores"
    )
    assert {"hydra_deploy.specs", "hydra_deploy.uncertainty.scores"} <= modules
    assert not {"torch", "timm", "transformers"} & modules


def test_public_names_resolve_lazily():
    import hydra_deploy

    for name in hydra_deploy.__all__:
        assert getattr(hydra_deploy, name) is not None, name
    assert set(hydra_deploy.__all__) <= set(dir(hydra_deploy))
    with pytest.raises(AttributeError, match="no_such_name"):
        hydra_deploy.no_such_name  # noqa: B018
