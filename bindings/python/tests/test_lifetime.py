"""Lifetime safety against a real daemon: a view (and everything made from it)
keeps its block pinned exactly as long as it lives, through ``with``, ``close()``,
eviction pressure and a full store; reservations commit or abort as the
``with`` block ends."""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest
import torch

import kachedb
from kdb_support import pattern, poll_until

DAEMON_SIZE = "32MiB"
MiB = 1 << 20


def pins(c: kachedb.Client) -> int:
    return c.stats()["pins"]


def collected_pins(c: kachedb.Client) -> int:
    gc.collect()
    return pins(c)


@pytest.fixture
def observer(daemon):
    """A second client, to read stats while the first is closed."""
    with daemon.connect() as c:
        yield c


def test_view_outlives_with_only_by_keeping_its_pin(kc):
    kc.put("w", torch.arange(16, dtype=torch.float32))
    assert collected_pins(kc) == 0
    with kc.get("w") as t:
        assert isinstance(t, torch.Tensor)
        assert collected_pins(kc) == 1
    # Leaving `with` does not invalidate the view: it still holds the pin.
    assert collected_pins(kc) == 1
    assert t.sum().item() == sum(range(16))
    del t
    assert collected_pins(kc) == 0


def test_every_get_is_one_pin(kc):
    kc.put("p", torch.zeros(8))
    views = [kc.get("p") for _ in range(5)] + kc.get_many(["p", "p"]) + [kc.get_numpy("p")]
    assert collected_pins(kc) == 8
    while views:
        views.pop()
        assert collected_pins(kc) == len(views)


DERIVED_TORCH = {
    "slice": lambda t: t[3:9],
    "step": lambda t: t[::4],
    "index": lambda t: t.view(4, 4)[2],
    "view_dtype": lambda t: t.view(torch.uint8),
    "view_shape": lambda t: t.view(2, 8),
    "reshape": lambda t: t.reshape(4, 4),
    "as_strided": lambda t: t.as_strided((3, 2), (2, 1), 1),
    "transpose": lambda t: t.view(4, 4).T,
    "unsqueeze": lambda t: t.unsqueeze(0),
    "detach": lambda t: t.detach(),
    "as_subclass": lambda t: t.as_subclass(torch.Tensor),
    "narrow": lambda t: t.narrow(0, 2, 5),
    "expand": lambda t: t[:1].expand(100),
    "numpy": lambda t: t.numpy(),
    "unbind": lambda t: t.view(4, 4).unbind(0)[3],
    "chunk": lambda t: t.chunk(4)[1],
}


@pytest.mark.parametrize("name", list(DERIVED_TORCH))
def test_tensors_derived_from_a_view_keep_the_pin(kc, name):
    src = torch.arange(16, dtype=torch.float32)
    kc.put("derived", src)
    t = kc.get("derived")
    d = DERIVED_TORCH[name](t)
    expect = DERIVED_TORCH[name](src)
    ptr = t.data_ptr()
    del t
    assert collected_pins(kc) == 1, "the derived tensor lost the pin"
    # Still the shared memory, with the right bytes.
    if isinstance(d, np.ndarray):
        assert d.ctypes.data >= ptr and np.array_equal(d, expect)
    else:
        assert d.data_ptr() >= ptr and torch.equal(d, expect)
    del d
    assert collected_pins(kc) == 0


def _from_numpy(a):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The given NumPy array is not writable"
        return torch.from_numpy(a)


DERIVED_NUMPY = {
    "slice": lambda a: a[2:7],
    "view_dtype": lambda a: a.view(np.uint8),
    "reshape": lambda a: a.reshape(4, 4),
    "transpose": lambda a: a.reshape(4, 4).T,
    "asarray": lambda a: np.asarray(a),
    "memoryview": lambda a: memoryview(a),
    "as_strided": lambda a: np.lib.stride_tricks.as_strided(a, (3,), (8,)),
    "torch_from_numpy": _from_numpy,
    "frombuffer": lambda a: np.frombuffer(a, dtype=np.int8),
}


@pytest.mark.parametrize("name", list(DERIVED_NUMPY))
def test_arrays_derived_from_get_numpy_keep_the_pin(kc, name):
    src = np.arange(16, dtype=np.int32)
    kc.put("derived-np", src)
    a = kc.get_numpy("derived-np")
    d = DERIVED_NUMPY[name](a)
    expect = np.asarray(DERIVED_NUMPY[name](src))
    del a
    assert collected_pins(kc) == 1, "the derived array lost the pin"
    got = d.numpy() if isinstance(d, torch.Tensor) else np.asarray(d)
    assert np.array_equal(got, expect)
    del d, got
    assert collected_pins(kc) == 0


def test_numpy_views_are_read_only(kc):
    kc.put("ro", np.arange(4, dtype=np.int64))
    a = kc.get_numpy("ro")
    assert not a.flags.writeable
    with pytest.raises(ValueError):
        a[0] = 5
    with pytest.raises(ValueError):
        a.flags.writeable = True
    with pytest.raises(ValueError):
        a.view(np.uint8).flags.writeable = True
    assert a.tolist() == [0, 1, 2, 3]


def test_close_with_live_views(daemon, observer):
    kc = daemon.connect()
    src = torch.arange(1000, dtype=torch.int64)
    kc.put("closing", src)
    t = kc.get("closing")
    a = kc.get_numpy("closing")
    s = t[10:20]
    connected = observer.stats()["clients_connected"]
    kc.close()
    assert kc.closed
    # New operations fail...
    for op in (
        lambda: kc.get("closing"),
        lambda: kc.get_numpy("closing"),
        lambda: kc.get_many(["closing"]),
        lambda: kc.put("x", src),
        lambda: kc.put_many(["x"], [src]),
        lambda: kc.reserve("x", (1,), torch.uint8),
        lambda: kc.lookup(["closing"]),
        lambda: kc.contains("closing"),
        lambda: kc.delete("closing"),
        lambda: kc.ping(),
        lambda: kc.stats(),
    ):
        with pytest.raises(kachedb.Disconnected, match="closed"):
            op()
    # ...but the views are still valid memory, and still pinned.
    assert torch.equal(t, src) and np.array_equal(a, src.numpy()) and torch.equal(s, src[10:20])
    assert collected_pins(observer) == 2  # t and its slice s share one pin; a has one
    del t
    assert collected_pins(observer) == 2  # s keeps t's
    del a
    assert collected_pins(observer) == 1
    assert s.tolist() == list(range(10, 20))
    del s
    assert collected_pins(observer) == 0
    # The block is still there for others.
    assert torch.equal(observer.get("closing"), src)
    # Once the client object goes too, its connection closes.
    del kc
    poll_until(lambda: observer.stats()["clients_connected"] == connected - 1, what="the closed client to disconnect")


def test_view_outlives_the_client_object_and_with_block(daemon, observer):
    with daemon.connect() as c:
        c.put("outlive", torch.full((64,), 7, dtype=torch.int16))
        t = c.get("outlive")
    del c
    assert collected_pins(observer) == 1
    assert t.tolist() == [7] * 64
    # A view made after close() is impossible, but one made before still derives.
    u = t.view(8, 8)[1:3]
    del t
    assert collected_pins(observer) == 1
    assert u.sum().item() == 7 * 16
    del u
    assert collected_pins(observer) == 0


def test_delete_and_replace_do_not_move_live_views(kc):
    src = torch.arange(4096, dtype=torch.int32)
    kc.put("del", src)
    kc.put("rep", src)
    d, r = kc.get("del"), kc.get("rep")
    assert kc.delete("del")
    kc.put("rep", torch.zeros(4096, dtype=torch.int32))
    assert "del" not in kc
    assert kc.get("rep").sum().item() == 0
    # Fill freed space with other data: the unlinked blocks are still held.
    for i in range(8):
        kc.put(f"filler/{i}", torch.full((1 << 18,), -1, dtype=torch.int32))
    assert torch.equal(d, src) and torch.equal(r, src)
    s = kc.stats()
    assert s["unlinked_blocks"] == 2
    del d, r
    gc.collect()
    assert kc.stats()["unlinked_blocks"] == 0


def test_eviction_never_takes_a_pinned_block(make_daemon):
    d = make_daemon("8MiB")
    kc = d.connect()
    held_src = torch.randint(-128, 127, (MiB,), dtype=torch.int8)
    kc.put("held", held_src)
    held = kc.get("held")
    held_np_src = np.random.default_rng(1).integers(0, 255, MiB // 2, dtype=np.uint8)
    kc.put("held-np", held_np_src)
    held_np = kc.get_numpy("held-np")
    filler = torch.empty(MiB, dtype=torch.uint8)
    for i in range(96):  # 96 MiB through an 8 MiB store
        filler.fill_(i % 251)
        kc.put(f"fill/{i}", filler)
        if i % 16 == 0:
            assert torch.equal(held, held_src)
    s = kc.stats()
    assert s["evictions"] >= 80, s
    assert torch.equal(held, held_src)
    assert np.array_equal(held_np, held_np_src)
    # The pinned blocks were not even unlinked: a new get finds the same memory.
    assert kc.get("held").data_ptr() == held.data_ptr()
    assert kc.get_numpy("held-np").ctypes.data == held_np.ctypes.data
    # The oldest unpinned blocks went, the newest are there with their bytes.
    assert kc.lookup(["fill/0"]) == 0
    assert kc.get("fill/95").eq(95 % 251).all()
    assert s["invariants_ok"] is True
    del held, held_np
    assert collected_pins(kc) == 0
    kc.close()


def test_full_store_raises_out_of_memory_and_readers_keep_working(make_daemon):
    d = make_daemon("4MiB")
    kc = d.connect()
    views, srcs = [], []
    with pytest.raises(kachedb.OutOfMemory) as e:
        for i in range(16):
            src = torch.full((MiB // 4,), i, dtype=torch.int32)
            kc.put(f"full/{i}", src)
            views.append(kc.get(f"full/{i}"))
            srcs.append(src)
    assert isinstance(e.value, MemoryError)
    assert "--size" in str(e.value) and "release" in str(e.value)
    # 4 MiB of 1 MiB blocks, all pinned (a block may take one page more, to keep
    # its source's offset within a page).
    n = len(views)
    assert 3 <= n <= 4
    assert kc.stats()["largest_free_bytes"] < MiB + 4096
    assert kc.stats()["out_of_memory"] >= 1
    # Reserve fails the same way; nothing is left reserved.
    with pytest.raises(kachedb.OutOfMemory):
        kc.reserve("full/res", (MiB,), torch.uint8)
    with pytest.raises(kachedb.OutOfMemory):
        kc.put_many(["full/a", "full/b"], [torch.zeros(16), torch.zeros(MiB // 4)])
    assert kc.lookup(["full/a"]) == 0  # all or nothing
    # Readers keep working: old views, new gets of the pinned blocks, lookups.
    for v, s in zip(views, srcs):
        assert torch.equal(v, s)
    again = kc.get_many([f"full/{i}" for i in range(n)])
    for v, s in zip(again, srcs):
        assert torch.equal(v, s)
    assert kc.lookup([f"full/{i}" for i in range(n)]) == n
    st = kc.stats()
    assert st["pins"] == 2 * n and st["reserved"] == 0
    # Releasing one view makes room again (by evicting the unpinned block).
    del views[0], again, v
    gc.collect()
    # The new source keeps full/0's offset within a page, so it needs exactly the
    # extent full/0 held (a different offset may need one page more than any hole).
    buf = torch.empty(MiB // 4 + 1024, dtype=torch.int32)
    shift = (srcs[0].data_ptr() - buf.data_ptr()) % 4096 // 4
    after = buf[shift : shift + MiB // 4]
    assert after.data_ptr() % 4096 == srcs[0].data_ptr() % 4096
    after.fill_(1)
    kc.put("full/after", after)
    assert kc.get("full/after").sum().item() == MiB // 4
    del views
    assert collected_pins(kc) == 0
    kc.close()


# --- reservations --------------------------------------------------------------------------


def test_reserve_commits_on_normal_exit(kc):
    src = torch.randn(32, 8, dtype=torch.float16)
    before = kc.stats()
    with kc.reserve("res-ok", (32, 8), torch.float16) as out:
        assert kc.stats()["reserved"] == before["reserved"] + 1
        assert "res-ok" not in kc  # invisible until committed
        with pytest.raises(kachedb.NotFound):
            kc.get("res-ok")
        out.copy_(src)
    s = kc.stats()
    assert s["reserved"] == 0 and s["commits"] == before["commits"] + 1
    assert torch.equal(kc.get("res-ok"), src)


def test_reserve_aborts_when_the_block_raises(kc):
    kc.put("res-old", torch.ones(4))
    before = kc.stats()

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with kc.reserve("res-bad", (1024,), torch.float32) as out:
            out.fill_(3.0)
            raise Boom()
    with pytest.raises(Boom):
        with kc.reserve("res-old", (4,), torch.float32) as out:
            out.fill_(9.0)
            raise Boom()
    assert "res-bad" not in kc
    # The kept `out` holds the aborted extent out of reuse until it goes.
    assert kc.stats()["reserved"] == 1
    del out
    gc.collect()
    s = kc.stats()
    assert s["reserved"] == 0
    assert s["aborts"] == before["aborts"] + 2 and s["commits"] == before["commits"]
    assert kc.get("res-old").tolist() == [1, 1, 1, 1]  # the old block is untouched


def test_reservation_dropped_unused_is_aborted(kc):
    r = kc.reserve("res-dropped", (16,), torch.uint8)
    assert kc.stats()["reserved"] == 1
    del r
    gc.collect()
    assert kc.stats()["reserved"] == 0
    assert "res-dropped" not in kc


def test_reservation_explicit_commit_and_double_commit(kc):
    r = kc.reserve("res-explicit", (2,), np.int64)
    r.out[:] = [5, 6]
    r.commit()
    with pytest.raises(kachedb.InvalidArgument, match="already"):
        r._native.commit()
    with r as out:  # already committed: exit does nothing more
        assert out is r.out
    assert kc.get_numpy("res-explicit").tolist() == [5, 6]
    r2 = kc.reserve("res-explicit-abort", (2,), np.int64)
    r2.abort()
    assert "res-explicit-abort" not in kc
    assert kc.stats()["reserved"] == 0


def test_reserve_replacing_a_key_is_atomic_for_readers(kc):
    kc.put("res-swap", torch.zeros(256))
    old = kc.get("res-swap")
    with kc.reserve("res-swap", (256,), torch.float32) as out:
        out.fill_(1.0)
        assert kc.get("res-swap").sum().item() == 0  # readers still see the old one
    assert kc.get("res-swap").sum().item() == 256
    assert old.sum().item() == 0  # and a live view of the old one is unchanged


# --- the native fast path and copies out of a view -------------------------------------------


def test_pickle_save_and_deepcopy_of_a_view_copy_the_data(kc):
    import copy
    import io
    import pickle

    src = torch.randn(4, 8, dtype=torch.float32)
    kc.put("pickled", src)
    t = kc.get("pickled")
    for clone in (
        pickle.loads(pickle.dumps(t)),
        copy.deepcopy(t),
        torch.load(io.BytesIO(_saved(t)), weights_only=True),
        copy.deepcopy({"a": t, "b": t})["a"],
    ):
        assert type(clone) is torch.Tensor
        assert torch.equal(clone, src)
        assert clone.data_ptr() != t.data_ptr()
    d = copy.deepcopy({"a": t, "b": t})
    assert d["a"] is d["b"]  # the memo is honoured
    # A shallow copy shares the block's memory, so it keeps the pin.
    shallow = copy.copy(t)
    assert shallow.data_ptr() == t.data_ptr()
    del t, d
    assert collected_pins(kc) == 1
    assert torch.equal(shallow, src)
    del shallow
    assert collected_pins(kc) == 0


def _saved(t):
    import io

    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def test_get_to_another_device_drops_the_pin_at_once(kc):
    kc.put("dev", torch.arange(5, dtype=torch.float32))
    cpu = kc.get("dev", device="cpu")  # the view itself
    assert collected_pins(kc) == 1 and cpu.tolist() == [0, 1, 2, 3, 4]
    meta = kc.get("dev", device="meta")  # a copy elsewhere (here: no data at all)
    assert meta.device.type == "meta" and tuple(meta.shape) == (5,)
    assert collected_pins(kc) == 1  # only the cpu view's
    many = kc.get_many(["dev", "dev"], device="meta")
    assert all(m.device.type == "meta" for m in many)
    assert collected_pins(kc) == 1
    del cpu
    assert collected_pins(kc) == 0


# --- a reservation's tensors keep its extent out of reuse -------------------------

#: Blocks of 128 KiB through a 4 MiB megaslab: 128 puts fill it eight times over,
#: so every extent that can be evicted or freed is reused by a later block.
KEPT_N = 128 * 1024
KEPT_PUTS = 128


def _fill_and_write_through(kc: kachedb.Client, out: torch.Tensor) -> int:
    """Puts blocks until the megaslab was reused many times over, writes through
    the kept ``out``, and checks that every other block still present holds
    exactly its own bytes; returns how many were checked."""
    for i in range(KEPT_PUTS):
        kc.put(f"other-{i}", np.frombuffer(pattern(KEPT_N, i), dtype=np.uint8))
    out.fill_(0xEE)
    checked = 0
    for i in range(KEPT_PUTS):
        try:
            got = kc.get_numpy(f"other-{i}")
        except kachedb.NotFound:
            continue
        assert got.tobytes() == pattern(KEPT_N, i), f"other-{i} changed: a kept reservation tensor wrote into it"
        checked += 1
        del got
    return checked


@pytest.mark.parametrize("how", ["commit", "abort", "commit_many", "abort_many"])
def test_kept_reservation_tensor_never_writes_into_another_block(make_daemon, how):
    d = make_daemon("4MiB")
    kc = d.connect()
    if how.endswith("_many"):
        r = kc.reserve_many(["kept-0", "kept-1"], (KEPT_N,), torch.uint8)
        out = r.out[1]
    else:
        r = kc.reserve("kept", (KEPT_N,), torch.uint8)
        out = r.out
    out.fill_(1)
    if how.startswith("commit"):
        r.commit()
    else:
        r.abort()
    del r  # only the tensor is kept
    checked = _fill_and_write_through(kc, out)
    assert checked >= 8, f"only {checked} blocks left to check"
    st = d.stats()
    if how.startswith("commit"):
        assert st["pins"] >= 1, "the committed block is pinned while its tensor lives"
    else:
        assert st["reserved"] >= 1, "the aborted extent stays reserved while its tensor lives"
    del out
    gc.collect()
    poll_until(lambda: d.stats()["pins"] == 0 and d.stats()["reserved"] == 0, 10, "the kept extent to be let go")
    if how.startswith("abort"):
        assert not kc.contains("kept") and not kc.contains("kept-1")
    kc.close()


def test_reservation_lets_go_of_its_extent_with_its_last_tensor(make_daemon):
    d = make_daemon("4MiB")
    kc = d.connect()
    with kc.reserve("plain", (16,), torch.uint8) as out:
        out.fill_(3)
    del out
    gc.collect()
    assert d.stats()["pins"] == 0
    assert kc.get_numpy("plain").tolist() == [3] * 16
    r = kc.reserve("dropped", (16,), torch.uint8)
    r.abort()
    del r
    gc.collect()
    assert d.stats()["reserved"] == 0 and not kc.contains("dropped")
    # A deferred abort still refuses a later commit.
    r = kc.reserve("late", (16,), torch.uint8)
    out = r.out
    r.abort()
    with pytest.raises(kachedb.InvalidArgument):
        r.commit()
    del r, out
    gc.collect()
    poll_until(lambda: d.stats()["reserved"] == 0, 10, "the deferred abort")
    assert not kc.contains("late")
    kc.close()
