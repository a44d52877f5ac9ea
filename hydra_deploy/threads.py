"""``--threads``: how many threads a command computes with, in torch and in ONNX Runtime.

Every command that computes takes ``--threads N`` (one declaration: the ``threads`` field of
:class:`hydra_deploy.options.RunnerOptions`) and calls :func:`use_threads` with it before any work:

- torch: ``torch.set_num_threads(N)`` (intra-op threads of fine-tuning, fusing, exporting and
  the PyTorch references), for the commands that run torch (``torch=True``); a command that runs
  ONNX Runtime only does not import torch for it;
- ONNX Runtime: N becomes the intra-op threads of every session this process opens afterwards
  without a thread count of its own (:func:`ort_threads`; the runners and the export check read
  it), so the sessions inside a command (hydra-export's check, hydra-calibrate's runner) follow
  the flag too.

Without the flag (None) nothing changes: each library uses its own default (all cores). On a
shared machine a small N keeps a job from slowing down under load: a fine-tune with as many
threads as cores waits for the slowest core at every operation.

Standard library only (edge-safe); torch is imported only by ``use_threads(N, torch=True)``.
"""

from __future__ import annotations

from hydra_deploy.errors import HydraError, said
from hydra_deploy.optional import lazy_module

__all__ = ["ort_threads", "use_threads"]

_torch = lazy_module("torch", purpose="--threads of a command that runs PyTorch", error=HydraError)

#: the process's ONNX Runtime intra-op threads (None: ONNX Runtime's default)
_ORT_THREADS: list[int | None] = [None]


def use_threads(threads: int | None, *, torch: bool = False) -> None:
    """Compute with ``threads`` threads from now on: ONNX Runtime sessions opened afterwards and,
    with ``torch``, torch's intra-op pool. None: leave every default as it is."""
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise HydraError(said(f"`threads` must be an integer of at least 1, got {threads!r}"))
    _ORT_THREADS[0] = threads
    if torch:
        _torch.set_num_threads(threads)


def ort_threads(threads: int | None = None) -> int | None:
    """The intra-op threads of an ONNX Runtime session: ``threads`` when given, else the
    process's (:func:`use_threads`), else None (ONNX Runtime's default)."""
    return threads if threads else _ORT_THREADS[0]
