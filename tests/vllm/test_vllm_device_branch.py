"""The vLLM worker's asynchronous-device branch (what CUDA KV caches take), driven
on the CPU through the worker's device seam (``kachedb.vllm.copies``) with a
stand-in device whose copies run only when the test completes their event, the
way a CUDA side stream runs them after the call that queued them.

What the branch must do, and what these tests hold it to (each fails if the
branch's logic breaks, e.g. a commit before the copies ran, a view dropped
before its copy read it, the forward pass not waiting for a load):

* a store reserves, queues one copy per block after the engine's work so far,
  and commits only once its event completed: before that the daemon holds the
  reservations and none of the blocks, ``get_finished`` reports nothing;
* a load pins the blocks, queues the copies, makes the engine's next work wait
  for their event, and keeps the pins until the event completed; the KV cache
  is written only by the copies;
* ``wait`` (vLLM's flush before it reuses a block) runs the job's copies and
  commits; a failed batch waits for its queued copies before aborting.

What only a GPU can check (``benchmarks/gpu_check.py``): ``CudaCopies`` itself —
that the side stream, ``non_blocking`` copies from the registered region and the
events do what the stand-in does here.
"""

import os
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec

import kachedb
from kachedb.vllm.copies import HostCopies, copies_for
from kachedb.vllm.manager import KacheDBLoadStoreSpec
from kachedb.vllm.worker import KacheDBOffloadingWorker
from vllm_support import Daemon

LAYERS, BLOCKS, PAGE = 3, 32, 4096


class StandInEvent:
    def __init__(self, device, copies):
        self.device = device
        self.copies = copies  # (dst, src) pairs, run in order at completion
        self.ran = 0
        self.completed = False

    def complete(self):
        if not self.completed:
            for dst, src in self.copies:
                dst.copy_(src)  # reads src now, as a DMA would when it runs
            self.completed = True
            self.device.log.append(("completed", len(self.copies)))
            # A finished copy holds nothing (a CUDA event keeps no tensor alive).
            self.ran, self.copies = len(self.copies), []


class StandInCopies:
    """A device whose copies are queued and run only at their event's
    completion (``complete``, or the worker's ``wait``)."""

    asynchronous = True

    def __init__(self):
        self.queued = []
        self.events = []
        self.log = []
        self.registered = 0
        self.compute_waits = []

    def register(self, client):
        self.registered += 1

    def begin(self):
        self.log.append(("begin",))

    def stream(self):
        import contextlib

        return contextlib.nullcontext()

    def copy(self, dst, src):
        self.queued.append((dst, src))

    def record(self):
        ev = StandInEvent(self, self.queued)
        self.queued = []
        self.events.append(ev)
        self.log.append(("record", len(ev.copies)))
        return ev

    def before_compute(self, event):
        self.compute_waits.append(event)

    def done(self, event):
        return event.completed

    def wait(self, event):
        event.complete()

    def abandon(self):
        for ev in [self.record()]:
            ev.complete()


def caches():
    g = torch.Generator().manual_seed(1)
    buf = torch.randint(-128, 127, (LAYERS, BLOCKS, PAGE), dtype=torch.int8, generator=g)
    layers = [buf[l] for l in range(LAYERS)]
    c = CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in layers],
                          [[CanonicalKVCacheRef(l, PAGE) for l in range(LAYERS)]])
    return c, layers


def worker(sock, c, copies):
    ns = os.urandom(16)
    spec = SimpleNamespace(socket=sock, rank=0, retry_s=0.2, store_mode="batched", stats_file=None,
                           store_thread="auto", daemon_key=lambda k, rank=None: ns + bytes(k))
    return KacheDBOffloadingWorker(spec, c, copies=copies), spec


def keys(n, start=0):
    return [i.to_bytes(32, "big") + b"\0\0\0\0" for i in range(start, start + n)]


@pytest.fixture(scope="module")
def daemon(workdir):
    d = Daemon(str(workdir / "device.sock"), size="64MiB").start()
    yield d
    d.stop()


def test_the_seam_picks_the_device_s_copies():
    assert isinstance(copies_for(torch.device("cpu")), HostCopies)
    assert HostCopies.asynchronous is False
    if torch.cuda.is_available():  # only on a GPU machine
        from kachedb.vllm.copies import CudaCopies

        assert isinstance(copies_for(torch.device("cuda", 0)), CudaCopies)


@pytest.mark.parametrize("mode", ["batched", "reserve"])
def test_a_store_commits_only_after_its_copies_ran(daemon, mode):
    c, layers = caches()
    dev = StandInCopies()
    w, spec = worker(daemon.socket, c, dev)
    spec.store_mode = mode
    assert w.asynchronous and w._stores is None  # no store thread: the device runs the copies
    n = 6
    src = list(range(n))
    dkeys = [spec.daemon_key(k) for k in keys(n, 100)]
    before = daemon.stats()
    w.submit_store(1, GPULoadStoreSpec(src, [n], [0]), KacheDBLoadStoreSpec(keys(n, 100)))
    assert dev.registered == 1  # the region is prepared for the device once
    assert dev.log[0] == ("begin",), "the copies must be ordered after the engine's work (the forward pass)"
    assert len(dev.events) == 1 and len(dev.events[0].copies) == n
    # The copies have not run: nothing is committed, the reservations are held.
    assert w.get_finished() == []
    with kachedb.connect(daemon.socket) as kc:
        assert kc.lookup(dkeys) == 0
    assert daemon.stats()["reserved"] - before["reserved"] == n
    dev.events[0].complete()
    assert [r.job_id for r in w.get_finished()] == [1]
    with kachedb.connect(daemon.socket) as kc:
        assert kc.lookup(dkeys) == n
        for k, b in zip(dkeys, src):
            with kc.get(k) as v:
                assert torch.equal(v, torch.stack([t[b] for t in layers]).view(torch.uint8))
        kc.delete_many(dkeys)
    assert daemon.stats()["reserved"] == before["reserved"]
    w.shutdown()


def test_a_load_keeps_its_pins_until_its_copies_ran_and_the_engine_waits_for_it(daemon):
    c, layers = caches()
    dev = StandInCopies()
    w, spec = worker(daemon.socket, c, dev)
    n = 5
    w.submit_store(1, GPULoadStoreSpec(list(range(n)), [n], [0]), KacheDBLoadStoreSpec(keys(n, 200)))
    w.wait({1})  # runs the store's copies and commits (vLLM's flush)
    assert [r.job_id for r in w.get_finished()] == [1]
    dst = list(range(20, 20 + n))
    snapshot = [t[dst].clone() for t in layers]
    pins = daemon.stats()["pins"]
    w.submit_load(2, KacheDBLoadStoreSpec(keys(n, 200)), GPULoadStoreSpec(dst, [n], [0]))
    ev = dev.events[-1]
    assert dev.compute_waits == [ev], "the forward pass must wait for the load's copies"
    assert not ev.completed and w.get_finished() == []
    assert daemon.stats()["pins"] - pins == n, "the views must stay pinned until their copies ran"
    for t, s in zip(layers, snapshot):
        assert torch.equal(t[dst], s)  # nothing written yet: the copies are queued
    # A DELETE now cannot take the bytes from under the queued copies (they are pinned).
    with kachedb.connect(daemon.socket) as kc:
        kc.delete_many([spec.daemon_key(k) for k in keys(n, 200)])
        kc.put(b"other", torch.full((LAYERS, PAGE), 7, dtype=torch.uint8))
    ev.complete()
    assert [r.job_id for r in w.get_finished()] == [2]
    for t in layers:
        assert torch.equal(t[dst], t[:n])
    assert daemon.stats()["pins"] == pins
    with kachedb.connect(daemon.socket) as kc:
        kc.delete(b"other")
    w.shutdown()


def test_a_load_that_misses_queues_nothing_and_reports_the_failed_blocks(daemon):
    c, layers = caches()
    dev = StandInCopies()
    w, spec = worker(daemon.socket, c, dev)
    w.submit_store(1, GPULoadStoreSpec([0, 1, 2], [3], [0]), KacheDBLoadStoreSpec(keys(3, 300)))
    w.wait({1})
    w.get_finished()
    with kachedb.connect(daemon.socket) as kc:
        assert kc.delete(spec.daemon_key(keys(3, 300)[1]))
    w.submit_load(2, KacheDBLoadStoreSpec(keys(3, 300)), GPULoadStoreSpec([10, 11, 12], [3], [0]))
    assert w.take_invalid_block_ids() == {11, 12}
    assert len(dev.events[-1].copies) == 1  # only the leading present block is copied
    dev.events[-1].complete()
    assert [r.job_id for r in w.get_finished()] == [2]
    for t in layers:
        assert torch.equal(t[10], t[0])
    with kachedb.connect(daemon.socket) as kc:
        kc.delete_many([spec.daemon_key(k) for k in keys(3, 300)])
    w.shutdown()


def test_a_failed_store_batch_waits_for_its_copies_then_aborts(daemon, monkeypatch):
    c, layers = caches()
    dev = StandInCopies()
    w, spec = worker(daemon.socket, c, dev)
    n = 4
    calls = {"n": 0}
    copy = dev.copy

    def failing_copy(dst, src):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("copy engine error")
        copy(dst, src)

    monkeypatch.setattr(dev, "copy", failing_copy)
    before = daemon.stats()
    with pytest.raises(RuntimeError):
        w._store_blocks(w._client(), w.groups[0], list(range(n)), [spec.daemon_key(k) for k in keys(n, 400)],
                        [None] * n)
    # The queued copies ran (abandon) before the reservations were aborted.
    assert dev.events and dev.events[-1].completed and dev.events[-1].ran == 2
    assert daemon.stats()["reserved"] == before["reserved"]
    with kachedb.connect(daemon.socket) as kc:
        assert kc.lookup([spec.daemon_key(k) for k in keys(n, 400)]) == 0
    w.shutdown()


def test_reaping_follows_the_events_not_the_submission_order(daemon):
    c, layers = caches()
    dev = StandInCopies()
    w, spec = worker(daemon.socket, c, dev)
    w.submit_store(1, GPULoadStoreSpec([0, 1], [2], [0]), KacheDBLoadStoreSpec(keys(2, 500)))
    w.submit_store(2, GPULoadStoreSpec([2, 3], [2], [0]), KacheDBLoadStoreSpec(keys(2, 502)))
    first, second = dev.events
    second.complete()
    assert [r.job_id for r in w.get_finished()] == [2]
    first.complete()
    assert [r.job_id for r in w.get_finished()] == [1]
    with kachedb.connect(daemon.socket) as kc:
        dk = [spec.daemon_key(k) for k in keys(4, 500)]
        assert kc.lookup(dk) == 4
        kc.delete_many(dk)
    w.shutdown()
