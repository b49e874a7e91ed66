"""Copies of KacheDB views to a CUDA device that keep the source's pin until
the copy has run.

``view.to("cuda", non_blocking=True)`` from a region registered with CUDA
(``Client.register_cuda``) returns as soon as the copy is queued; if the view
(and with it its pin) goes before the DMA has read it, the daemon may evict the
block and reuse its extent, and the GPU copy gets another key's bytes.
``to_device`` queues the same copy, records a CUDA event after it on the
current stream, and holds the view until that event has completed (a
background thread waits on the events, with the GIL released).
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Optional

from ._dtypes import _torch

__all__ = ["to_device"]

#: ``(event, source)`` pairs: the source is dropped once the event has completed.
_held: "Optional[queue.SimpleQueue[Any]]" = None
_start_lock = threading.Lock()


def _wait_and_drop(q: "queue.SimpleQueue[Any]") -> None:
    while True:
        event, source = q.get()
        event.synchronize()  # releases the GIL while it waits
        del event, source  # the source's pin may go now


def _hold_until(event: Any, source: Any) -> None:
    """Keeps ``source`` alive until ``event.synchronize()`` returns."""
    global _held
    q = _held
    if q is None:
        with _start_lock:
            if _held is None:
                q = queue.SimpleQueue()
                threading.Thread(target=_wait_and_drop, args=(q,), name="kachedb-copy-pins", daemon=True).start()
                _held = q
            q = _held
    q.put((event, source))


def _forget_in_child() -> None:
    # A forked child has no waiting thread (and holds none of the parent's
    # pins): start over. A plain assignment, no lock.
    global _held
    _held = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def to_device(tensor: Any, device: Any, *, non_blocking: bool = True) -> Any:
    """``tensor.to(device, non_blocking=...)`` for a KacheDB view (or any tensor
    sharing its memory) that is safe with ``non_blocking=True``: the view, and
    so its pin, is kept until the copy has run on the device (a CUDA event
    recorded after it on the current stream), so the block cannot be evicted
    or its extent reused while the DMA reads it. Returns a plain tensor on
    ``device``. Drop the view as soon as you like after the call."""
    torch = _torch()
    dev = torch.device(device)
    src = tensor.as_subclass(torch.Tensor) if isinstance(tensor, torch.Tensor) else tensor
    out = src.to(dev, non_blocking=non_blocking)
    if non_blocking and dev.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(dev))
        _hold_until(event, tensor)
    return out
