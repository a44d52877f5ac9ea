"""A local Ray cluster for a test module (2 CPUs, quiet): in-process hydra-score-dataset calls
find Ray connected and keep it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def local_ray() -> Iterator[None]:
    import ray

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 * 1024**2,
        logging_level=logging.ERROR,
    )
    try:
        yield
    finally:
        ray.shutdown()
