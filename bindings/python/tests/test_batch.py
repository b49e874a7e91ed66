"""The batch calls and ``wait_for``: ``get_prefix``, ``reserve_many``,
``delete_many``, ``put_many`` (native), ``wait_for`` across real processes
(committed before, during, never). No assertion on timings: the timeouts below
are upper bounds that only a broken wait would reach."""

import gc
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import kachedb
from kdb_support import assert_no_pins

torch = pytest.importorskip("torch")

DAEMON_SIZE = "64MiB"

# A waiter process: waits for KEY (timeout argv[2], "none" for none) and prints
# what it got, or TIMEDOUT; "WAITING" first.
WAITER = textwrap.dedent(
    """
    import sys, kachedb
    kc = kachedb.connect(sys.argv[1])
    timeout = None if sys.argv[2] == "none" else float(sys.argv[2])
    print("WAITING", flush=True)
    try:
        t = kc.wait_for("wait-key", timeout=timeout)
        print("GOT", float(t.float().sum()), tuple(t.shape), flush=True)
    except kachedb.TimedOut as e:
        assert isinstance(e, TimeoutError) and isinstance(e, kachedb.KacheDBError)
        print("TIMEDOUT", flush=True)
    """
)


def start_waiter(socket, timeout):
    p = subprocess.Popen([sys.executable, "-c", WAITER, socket, timeout], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "WAITING"
    return p


# --- get_prefix ---------------------------------------------------------------------


def test_get_prefix_returns_the_leading_present_views(kc, daemon):
    keys = [f"gp-{i}" for i in range(8)]
    kc.put_many(keys[:5], [torch.full((4, 16), i, dtype=torch.bfloat16) for i in range(5)])
    kc.put(keys[6], torch.ones(3))  # present, but past the gap at 5
    views = kc.get_prefix(keys)
    assert len(views) == 5
    for i, v in enumerate(views):
        assert v.dtype == torch.bfloat16 and tuple(v.shape) == (4, 16)
        assert torch.equal(v, torch.full((4, 16), i, dtype=torch.bfloat16))
    # Exactly the prefix is pinned: the pin taken on key 6 went at once.
    assert daemon.stats()["pins"] == 5
    assert kc.get_prefix([]) == []
    assert kc.get_prefix(["absent", keys[0]]) == []
    del views
    gc.collect()
    kc.delete_many(keys)


@pytest.mark.parametrize("pin_each", [False, True], ids=["shared", "pin_each"])
def test_get_prefix_views_keep_their_pins(kc, daemon, pin_each):
    keys = [f"pin-{i}" for i in range(3)]
    kc.put_many(keys, [torch.full((1024,), i + 1.0) for i in range(3)])
    views = kc.get_prefix(keys, pin_each=pin_each)
    part = views[1][10:20] * 1  # a copy: holds nothing
    sl = views[2][100:200]  # a view of a view: holds the pin
    assert kc.delete_many(keys) == 3
    assert kc.get_prefix(keys) == []
    del views
    gc.collect()
    # The slice still pins its block (shared: with the call's other blocks);
    # its bytes are intact after the delete.
    assert daemon.stats()["pins"] == (1 if pin_each else 3)
    assert torch.equal(sl, torch.full((100,), 3.0)) and torch.equal(part, torch.full((10,), 2.0))
    del sl
    gc.collect()
    assert_no_pins(daemon)


def test_get_prefix_views_share_their_pins_until_the_last_derived_tensor_goes(kc, daemon):
    keys = [f"share-{i}" for i in range(16)]
    kc.put_many(keys, [torch.full((8, 128), float(i), dtype=torch.float16) for i in range(16)])
    views = kc.get_prefix(keys)
    assert len(views) == 16 and daemon.stats()["pins"] == 16
    for i, v in enumerate(views):
        assert type(v).__name__ == "KVView" and v.is_contiguous() and tuple(v.shape) == (8, 128)
        assert torch.equal(v, torch.full((8, 128), float(i), dtype=torch.float16))
    del v
    # Each view is at its block's address (the one a lone get gives).
    singles = [kc.get(k) for k in keys]
    assert [v.data_ptr() for v in views] == [s.data_ptr() for s in singles]
    del singles
    derived = [views[3].view(torch.int16)[2:4], views[15].t()]
    del views
    gc.collect()
    assert daemon.stats()["pins"] == 16, "a derived tensor holds the call's pins"
    assert kc.delete_many(keys) == 16
    derived.pop()
    gc.collect()
    assert daemon.stats()["pins"] == 16
    # The bytes of a deleted block stay intact while a tensor holds its pin.
    assert torch.equal(derived[0], torch.full((2, 128), 3.0, dtype=torch.float16).view(torch.int16))
    derived.pop()
    gc.collect()
    assert_no_pins(daemon)


def test_get_prefix_views_of_mixed_dtypes_and_shapes(kc, daemon):
    srcs = [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.arange(5, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.full((2, 3), 1.5, dtype=torch.bfloat16),
        torch.full((2, 3), -2.5, dtype=torch.bfloat16),
        torch.arange(7, dtype=torch.uint8),
        torch.zeros((0, 4), dtype=torch.float16),
        torch.tensor(4.25, dtype=torch.float64),
        torch.arange(6, dtype=torch.int16).reshape(1, 2, 3),
    ]
    if hasattr(torch, "float8_e4m3fn"):
        srcs.append(torch.linspace(-2, 2, 16).to(torch.float8_e4m3fn).reshape(4, 4))
        srcs.append(torch.linspace(-1, 1, 8).to(torch.float8_e5m2))
    keys = [f"mixed-{i}" for i in range(len(srcs))]
    kc.put_many(keys, srcs)
    for pin_each in (False, True):
        views = kc.get_prefix(keys, pin_each=pin_each)
        assert len(views) == len(srcs)
        for v, src in zip(views, srcs):
            assert type(v).__name__ == "KVView"
            assert v.dtype == src.dtype and v.shape == src.shape and v.is_contiguous()
            if src.dtype.itemsize == 1 and src.dtype not in (torch.bool, torch.uint8):  # float8: compare the bytes
                assert torch.equal(v.view(torch.uint8), src.view(torch.uint8))
            else:
                assert torch.equal(v, src)
        assert daemon.stats()["pins"] == len(srcs)
        del views, v
        gc.collect()
        assert_no_pins(daemon)
    assert kc.delete_many(keys) == len(srcs)


def test_get_prefix_of_repeated_keys_pins_each_occurrence(kc, daemon):
    kc.put_many(["rep-0", "rep-1"], [torch.full((64,), 1.0), torch.full((64,), 2.0)])
    views = kc.get_prefix(["rep-0", "rep-1", "rep-0", "rep-0"])
    assert [float(v[0]) for v in views] == [1.0, 2.0, 1.0, 1.0]
    assert views[0].data_ptr() == views[2].data_ptr() == views[3].data_ptr()
    assert daemon.stats()["pins"] == 4
    del views
    gc.collect()
    assert_no_pins(daemon)
    assert kc.delete_many(["rep-0", "rep-1"]) == 2


def test_get_prefix_device_copy_and_bad_keys(kc):
    kc.put("dev-0", torch.arange(6.0))
    (t,) = kc.get_prefix(["dev-0", "dev-1"], device="cpu")
    assert torch.equal(t, torch.arange(6.0))
    del t
    with pytest.raises(TypeError):
        kc.get_prefix([1.5])
    with pytest.raises(TypeError):
        kc.get_prefix(None)
    kc.delete("dev-0")


def test_keys_mapped_natively_match_key_of(kc):
    """The batch calls map keys in Rust; every key kind lands where ``put`` puts it."""
    keys = [b"bytes", "str", "ünïcode", 7, -1, 2**127 + 5, 2**200, bytearray(b"ba"), memoryview(b"mv")]
    for i, k in enumerate(keys):
        kc.put(k, torch.tensor([float(i)]))
    views = kc.get_prefix(keys)
    assert [float(v[0]) for v in views] == [float(i) for i in range(len(keys))]
    del views
    assert kc.lookup(keys) == len(keys)
    with pytest.raises(ValueError):
        kc.get_prefix(["\ud800"])  # a lone surrogate is not UTF-8
    assert kc.delete_many(keys) == len(keys)


# --- reserve_many -------------------------------------------------------------------


def test_reserve_many_commits_all_at_exit(kc):
    keys = [f"rm-{i}" for i in range(4)]
    with kc.reserve_many(keys, (2, 8), torch.float16) as outs:
        assert len(outs) == 4
        for i, o in enumerate(outs):
            assert o.dtype == torch.float16 and tuple(o.shape) == (2, 8)
            o.copy_(torch.full((2, 8), i))
        assert kc.lookup(keys) == 0, "invisible before the commit"
    assert kc.lookup(keys) == 4
    for i, v in enumerate(kc.get_prefix(keys)):
        assert torch.equal(v, torch.full((2, 8), i, dtype=torch.float16))
    assert kc.delete_many(keys) == 4


def test_reserve_many_dtype_names_and_float8(kc):
    with kc.reserve_many(["n-0", "n-1"], 16, "bfloat16") as outs:
        for o in outs:
            o.fill_(2)
    assert kc.get("n-1").dtype == torch.bfloat16
    if hasattr(torch, "float8_e4m3fn"):
        with kc.reserve_many(["f8-0"], (4,), torch.float8_e4m3fn) as (o,):
            assert o.dtype == torch.float8_e4m3fn
            o.copy_(torch.ones(4).to(torch.float8_e4m3fn))
        assert kc.get("f8-0").float().sum() == 4
        kc.delete("f8-0")
    kc.delete_many(["n-0", "n-1"])


def test_reserve_many_aborts_all_on_error(kc, daemon):
    keys = [f"ab-{i}" for i in range(3)]
    with pytest.raises(RuntimeError, match="boom"):
        with kc.reserve_many(keys, (8,), torch.float32) as outs:
            outs[0].fill_(1)
            raise RuntimeError("boom")
    assert kc.lookup(keys[:1]) == 0 and kc.lookup(keys[2:]) == 0
    # The kept `outs` hold the aborted extents out of reuse until they go.
    assert daemon.stats()["reserved"] == 3
    del outs
    gc.collect()
    assert daemon.stats()["reserved"] == 0
    # Explicit abort, and a second finish refused.
    r = kc.reserve_many(keys, (8,), torch.float32)
    assert len(r) == 3
    r.abort()
    with pytest.raises(kachedb.InvalidArgument):
        r.commit()
    # Garbage-collected without exit: aborted.
    r = kc.reserve_many(keys, (8,), torch.float32)
    del r
    gc.collect()
    assert daemon.stats()["reserved"] == 0 and kc.lookup(keys) == 0


def test_reserve_many_is_all_or_nothing_when_one_does_not_fit(make_daemon):
    d = make_daemon("16MiB")
    kc = d.connect()
    # Three 6 MiB blocks cannot all be reserved in 16 MiB: none stays reserved.
    with pytest.raises(kachedb.OutOfMemory):
        kc.reserve_many(["big-0", "big-1", "big-2"], (6 << 20,), torch.uint8)
    st = d.stats()
    assert st["reserved"] == 0 and st["blocks"] == 0
    # put_many too: nothing committed.
    with pytest.raises(kachedb.OutOfMemory):
        kc.put_many(["p-0", "p-1", "p-2"], [torch.zeros(6 << 20, dtype=torch.uint8)] * 3)
    assert kc.lookup(["p-0"]) == 0 and d.stats()["reserved"] == 0
    kc.close()


def test_reserve_many_bad_arguments(kc):
    with pytest.raises(TypeError):
        kc.reserve_many(["x"], (4,), np.float32)  # a numpy dtype: torch tensors only
    with pytest.raises(kachedb.InvalidArgument):
        kc.reserve_many(["x"], (1,) * 7, torch.float32)
    with pytest.raises(TypeError):
        kc.reserve_many(["x"], (4,), "no-such-dtype")
    with pytest.raises(TypeError):
        kc.reserve_many([3.5], (4,), torch.float32)
    with kc.reserve_many([], (4,), torch.float32) as outs:
        assert outs == []


# --- delete_many, put_many -------------------------------------------------------------


def test_delete_many_counts_present_keys(kc):
    kc.put_many(["d-0", "d-2"], [b"a", b"b"])
    assert kc.delete_many(["d-0", "d-1", "d-2"]) == 2
    assert kc.delete_many(["d-0"]) == 0
    assert kc.delete_many([]) == 0
    with pytest.raises(TypeError):
        kc.delete_many([object()])


def test_put_many_mixed_values_and_errors(kc):
    t = torch.arange(12.0).reshape(3, 4)
    vals = [t, t.t(), np.arange(5, dtype=np.int16), b"raw", torch.zeros(0), t.to(torch.bfloat16)]
    keys = [f"pm-{i}" for i in range(len(vals))]
    kc.put_many(keys, vals)
    got = kc.get_prefix(keys)
    assert torch.equal(got[0], t) and torch.equal(got[1], t.t())
    assert got[2].dtype == torch.int16 and got[2].tolist() == list(range(5))
    assert bytes(got[3].numpy()) == b"raw" and got[4].numel() == 0
    assert got[5].dtype == torch.bfloat16
    del got
    with pytest.raises(kachedb.InvalidArgument):
        kc.put_many(["a", "b"], [t])
    with pytest.raises(TypeError):
        kc.put_many(["a"], [object()])
    assert kc.lookup(["a"]) == 0
    kc.delete_many(keys)


# --- put_ranges, get_prefix_into --------------------------------------------------------


def _ranges(pool, blocks, per, nbytes):
    """(addresses, lengths) of block-major ranges strided through ``pool``
    (range j of block i at slot j * blocks + i, as one layer of a layer-first
    KV pool per range), and the slots in that order."""
    slots = [j * blocks + i for i in range(blocks) for j in range(per)]
    base = pool.data_ptr()
    return [base + c * nbytes for c in slots], [nbytes] * len(slots), slots


@pytest.mark.parametrize("range_kib", [4, 1024], ids=["small", "parallel-copy"])
def test_put_ranges_and_get_prefix_into_move_strided_pages(kc, daemon, range_kib):
    blocks, per, nbytes = 6, 8, range_kib << 10
    src = torch.randint(0, 256, (blocks * per * nbytes,), dtype=torch.uint8)
    keys = [f"rng-{range_kib}-{i}" for i in range(blocks)]
    addrs, lens, slots = _ranges(src, blocks, per, nbytes)
    kc.put_ranges(keys, addrs, lens, chain=True)
    views = kc.get_prefix(keys)
    assert len(views) == blocks
    for i, v in enumerate(views):
        assert v.dtype == torch.uint8 and v.numel() == per * nbytes
        want = torch.cat([src[c * nbytes : (c + 1) * nbytes] for c in slots[i * per : (i + 1) * per]])
        assert torch.equal(v, want), f"block {i}"
    del views, v
    dst = torch.zeros_like(src)
    daddrs, dlens, _ = _ranges(dst, blocks, per, nbytes)
    # one key past the prefix: absent, so only the stored blocks are copied
    spare = torch.zeros(per * nbytes, dtype=torch.uint8)
    saddrs = [spare.data_ptr() + j * nbytes for j in range(per)]
    assert kc.get_prefix_into(keys + ["rng-absent"], daddrs + saddrs, dlens + [nbytes] * per) == blocks
    assert torch.equal(dst, src) and not spare.any()
    assert_no_pins(daemon)
    kc.delete_many(keys)


def test_put_ranges_and_get_prefix_into_refuse_bad_ranges(kc, daemon):
    src = torch.arange(4096, dtype=torch.uint8)
    a = src.data_ptr()
    before = daemon.stats()["blocks"]
    with pytest.raises(kachedb.InvalidArgument, match="3 byte ranges for 2 blocks"):
        kc.put_ranges(["bad-0", "bad-1"], [a, a + 10, a + 20], [10, 10, 10])
    with pytest.raises(kachedb.InvalidArgument, match="different sizes"):
        kc.put_ranges(["bad-0", "bad-1"], [a, a + 10], [10, 20])
    with pytest.raises(kachedb.InvalidArgument, match="no memory"):
        kc.put_ranges(["bad-0"], [0], [10])
    with pytest.raises(kachedb.InvalidArgument, match="-1 bytes"):
        kc.put_ranges(["bad-0"], [a], [-1])
    assert daemon.stats()["blocks"] == before
    kc.put_ranges(["good"], [a, a + 100], [100, 100])
    assert torch.equal(kc.get("good"), torch.cat([src[:100], src[100:200]]))
    dst = torch.zeros(400, dtype=torch.uint8)
    d = dst.data_ptr()
    with pytest.raises(kachedb.InvalidArgument, match="overlap"):
        kc.get_prefix_into(["good"], [d, d + 50], [100, 100])
    view = kc.get("good")
    with pytest.raises(kachedb.InvalidArgument, match="shared memory"):
        kc.get_prefix_into(["good"], [view.data_ptr(), d], [100, 100])
    del view
    assert not dst.any()
    # a block of another size ends the prefix: nothing copied
    kc.put("other", torch.ones(7, dtype=torch.uint8))
    assert kc.get_prefix_into(["other"], [d, d + 100], [100, 100]) == 0
    assert not dst.any()
    assert kc.get_prefix_into(["good", "other"], [d, d + 100, d + 200, d + 300], [100] * 4) == 1
    assert torch.equal(dst[:200], src[:200]) and not dst[200:].any()
    assert kc.get_prefix_into([], [], []) == 0
    kc.put_ranges([], [], [])
    assert_no_pins(daemon)
    kc.delete_many(["good", "other"])


@pytest.mark.parametrize("threads", [None, 1], ids=["by-size", "one-thread"])
@pytest.mark.parametrize("range_kib", [4, 1024], ids=["small", "parallel-copy"])
def test_reserve_many_write_ranges_fills_blocks_without_tensors(kc, daemon, range_kib, threads):
    blocks, per, nbytes = 6, 8, range_kib << 10
    src = torch.randint(0, 256, (blocks * per * nbytes,), dtype=torch.uint8)
    keys = [f"wr-{range_kib}-{threads}-{i}" for i in range(blocks)]
    addrs, lens, slots = _ranges(src, blocks, per, nbytes)
    res = kc.reserve_many(keys, (per, nbytes), torch.uint8, chain=True)
    assert len(res) == blocks
    res.write_ranges(addrs, lens, threads=threads)
    assert res._out is None  # no tensor was made
    assert kc.lookup(keys) == 0  # written, not yet visible
    res.commit()
    views = kc.get_prefix(keys)
    assert len(views) == blocks
    for i, v in enumerate(views):
        want = torch.cat([src[c * nbytes : (c + 1) * nbytes] for c in slots[i * per : (i + 1) * per]])
        assert torch.equal(v.reshape(-1), want), f"block {i}"
    del views, v
    assert_no_pins(daemon)
    kc.delete_many(keys)


def test_write_ranges_refuses_bad_ranges_and_finished_reservations(kc, daemon):
    src = torch.arange(256, dtype=torch.uint8).repeat(16)
    a = src.data_ptr()
    before = daemon.stats()["blocks"]
    res = kc.reserve_many(["wr-bad-0", "wr-bad-1"], (100,), torch.uint8)
    with pytest.raises(kachedb.InvalidArgument, match="3 byte ranges for 2 blocks"):
        res.write_ranges([a, a + 10, a + 20], [10, 10, 10])
    with pytest.raises(kachedb.InvalidArgument, match="block 1 add up to 60 bytes, not the block's 100"):
        res.write_ranges([a, a + 100], [100, 60])
    with pytest.raises(kachedb.InvalidArgument, match="no memory"):
        res.write_ranges([0, a], [100, 100])
    with pytest.raises(kachedb.InvalidArgument, match="-1 bytes"):
        res.write_ranges([a, a], [-1, 100])
    with pytest.raises(kachedb.InvalidArgument, match="threads=0"):
        res.write_ranges([a, a + 100], [100, 100], threads=0)
    # a source inside one of the reservations being written
    out = res.out[1]
    with pytest.raises(kachedb.InvalidArgument, match="overlaps a reservation"):
        res.write_ranges([a, out.data_ptr() + 50], [100, 100])
    del out
    res.write_ranges([a, a + 100], [100, 100])
    res.commit()
    assert torch.equal(kc.get("wr-bad-0"), src[:100]) and torch.equal(kc.get("wr-bad-1"), src[100:200])
    with pytest.raises(kachedb.InvalidArgument, match="already committed"):
        res.write_ranges([a, a + 100], [100, 100])
    aborted = kc.reserve_many(["wr-bad-2"], (100,), torch.uint8)
    aborted.abort()
    with pytest.raises(kachedb.InvalidArgument, match="already committed or aborted"):
        aborted.write_ranges([a], [100])
    del res, aborted
    gc.collect()
    assert daemon.stats()["blocks"] == before + 2
    assert_no_pins(daemon)
    kc.delete_many(["wr-bad-0", "wr-bad-1"])


# --- wait_for -------------------------------------------------------------------------


def test_wait_for_committed_before(kc, daemon):
    kc.put("wait-key", torch.full((5,), 2.0))
    p = start_waiter(daemon.socket, "none")
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and out.split() == ["GOT", "10.0", "(5,)"]
    t = kc.wait_for("wait-key", timeout=0)
    assert torch.equal(t, torch.full((5,), 2.0))
    del t
    kc.delete("wait-key")


def test_wait_for_committed_during_the_wait_by_another_process(kc, daemon):
    p = start_waiter(daemon.socket, "none")
    time.sleep(0.3)  # let the WAIT park (if not yet, this is "committed before")
    # The daemon serves other clients meanwhile.
    kc.put_many([f"busy-{i}" for i in range(50)], [b"x"] * 50)
    assert kc.lookup([f"busy-{i}" for i in range(50)]) == 50
    with kc.reserve("wait-key", (3,), torch.float32) as out:
        out.fill_(4.0)
    out_text, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and out_text.split() == ["GOT", "12.0", "(3,)"]
    kc.delete_many(["wait-key"] + [f"busy-{i}" for i in range(50)])


def test_wait_for_never_committed_times_out(kc, daemon):
    p = start_waiter(daemon.socket, "0.2")
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and out.split() == ["TIMEDOUT"]
    with pytest.raises(kachedb.TimedOut) as info:
        kc.wait_for("absent-key", timeout=0)
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, kachedb.KacheDBError)
    with pytest.raises(TimeoutError):
        kc.wait_for("absent-key", timeout=0.05)


def test_wait_for_from_another_thread_of_this_process(daemon):
    waiter, writer = daemon.connect(), daemon.connect()
    got = {}

    def wait():
        got["t"] = waiter.wait_for("threaded", timeout=30)

    th = threading.Thread(target=wait)
    th.start()
    time.sleep(0.1)
    writer.put("threaded", torch.tensor([1.0, 2.0]))
    th.join(60)
    assert not th.is_alive() and torch.equal(got.pop("t"), torch.tensor([1.0, 2.0]))
    writer.delete("threaded")
    waiter.close()
    writer.close()


def test_wait_for_bad_arguments(kc):
    for bad in (-1, float("nan"), "1"):
        with pytest.raises((kachedb.InvalidArgument, TypeError)):
            kc.wait_for("k", timeout=bad)
    with pytest.raises(TypeError):
        kc.wait_for("k", timeout=True)
    with pytest.raises(TypeError):
        kc.wait_for(object(), timeout=0)


def test_killed_waiter_is_forgotten(daemon):
    p = start_waiter(daemon.socket, "none")
    time.sleep(0.2)
    p.kill()
    p.wait()
    kc = daemon.connect()
    kc.put("wait-key", torch.ones(2))
    assert torch.equal(kc.wait_for("wait-key", timeout=5), torch.ones(2))
    kc.delete("wait-key")
    kc.close()
    gc.collect()
    assert_no_pins(daemon)
    assert daemon.stats()["invariants_ok"]


def test_batch_calls_on_a_closed_client_raise(daemon):
    c = daemon.connect()
    c.close()
    for call in (lambda: c.get_prefix(["a"]), lambda: c.delete_many(["a"]),
                 lambda: c.reserve_many(["a"], (1,), torch.float32), lambda: c.wait_for("a", timeout=0),
                 lambda: c.put_many(["a"], [b"x"])):
        with pytest.raises(kachedb.Disconnected):
            call()

