"""How the vLLM worker's block copies run on each kind of device: the one seam
between the worker's per-block code and the device.

The worker (``worker.py``) reserves, copies, commits, pins and reaps the same
way on every device; what differs is only what this module's classes do:

* ``HostCopies`` — KV caches in host memory (vLLM's CPU engine): a copy is done
  when ``copy`` returns (``asynchronous`` is False), so the worker commits a
  store's reservations and drops a load's views at once.
* ``CudaCopies`` — KV caches on a CUDA device: ``begin`` makes a side stream
  wait for the compute stream's work so far (the forward pass that wrote the
  blocks), ``copy`` queues a ``non_blocking`` copy on it (a DMA from or to the
  region, which ``register`` pins with ``cudaHostRegister``), ``record``
  returns an event after the queued copies. The worker keeps a store's
  reservations uncommitted and a load's views (and their pins) alive until
  ``done(event)`` (or ``wait(event)``), and makes the compute stream wait for
  a load's event (``before_compute``) so the next forward pass reads the
  loaded blocks.

Only a GPU runs ``CudaCopies`` (``benchmarks/gpu_check.py``); the CPU test
suite drives the worker's asynchronous branch — ordering, pins, commits and
reaping — through the same interface with a stand-in device whose copies run
only when the test completes their event (``tests/vllm/test_vllm_device_branch.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch


class HostCopies:
    """Copies between host-memory KV caches and the region: synchronous."""

    #: Whether a copy may still be running when ``copy`` returns.
    asynchronous = False

    def register(self, client: Any) -> None:
        """Prepares the client's region for this device's copies (nothing here)."""

    def begin(self) -> None:
        """Orders the copies that follow after the engine's work so far."""

    def stream(self) -> ContextManager[Any]:
        """The context the copies are queued in."""
        return contextlib.nullcontext()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> Any:
        """A marker after the copies queued so far (``None``: nothing is queued)."""
        return None

    def before_compute(self, event: Any) -> None:
        """Makes the engine's next work wait for ``event``."""

    def done(self, event: Any) -> bool:
        return True

    def wait(self, event: Any) -> None:
        """Blocks until the copies before ``event`` have run."""

    def abandon(self) -> None:
        """Blocks until no queued copy reads or writes anything any more (after a
        failed batch, before its reservations are aborted)."""


class CudaCopies:
    """Copies between CUDA KV caches and the (registered) region, on a side
    stream, completed by CUDA events."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device=device)

    def register(self, client: Any) -> None:
        client.register_cuda()

    def begin(self) -> None:
        self.side.wait_stream(torch.cuda.current_stream(self.device))

    def stream(self) -> ContextManager[Any]:
        return torch.cuda.stream(self.side)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def record(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(self.side)
        return ev

    def before_compute(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def wait(self, event: Any) -> None:
        event.synchronize()

    def abandon(self) -> None:
        self.side.synchronize()


def copies_for(device: torch.device) -> Any:
    """The copies of KV caches on ``device``."""
    return CudaCopies(device) if device.type == "cuda" else HostCopies()
