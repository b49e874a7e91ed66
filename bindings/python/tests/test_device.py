"""``kachedb.to_device``: a copy of a view that keeps the view's pin until the
copy has run (CUDA ``non_blocking=True`` copies; checked on a GPU by
``benchmarks/gpu_check.py``). Here, without a GPU: the copy's result, and the
holding of the source until its event completes."""

from __future__ import annotations

import gc
import threading

import torch

import kachedb
from kachedb import _device
from kdb_support import poll_until


def test_to_device_on_the_cpu_copies_the_view(kc):
    kc.put("dev/cpu", torch.arange(32, dtype=torch.float32))
    view = kc.get("dev/cpu")
    out = kachedb.to_device(view, "cpu", non_blocking=True)
    assert type(out) is torch.Tensor and torch.equal(out, torch.arange(32, dtype=torch.float32))
    del view, out


class _GatedEvent:
    """Stands in for a CUDA event whose copy is still running until ``gate`` is set."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def synchronize(self) -> None:
        self.gate.wait()


def test_source_is_held_until_its_copy_event_completes(kc):
    kc.put("dev/held", torch.ones(64))
    view = kc.get("dev/held")
    ev = _GatedEvent()
    _device._hold_until(ev, view)
    del view
    gc.collect()
    assert kc.stats()["pins"] == 1, "the view's pin went while its copy could still run"
    ev.gate.set()
    poll_until(lambda: kc.stats()["pins"] == 0, 10, "the pin to go once the copy event completed")
