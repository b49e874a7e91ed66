"""The one-call read path against a real daemon: ``NativeClient.get_view``,
``get_many_views`` and ``get_prefix_views`` (behind ``Client.get``,
``get_many`` and ``get_prefix``) map keys as ``key_of`` does, make a
``KVView``, and tie each pin to the views' lifetime."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch

import kachedb
from kdb_support import Daemon, poll_until

DAEMON_SIZE = "32MiB"


def collected_pins(c: kachedb.Client) -> int:
    gc.collect()
    return c.stats()["pins"]


KEY_FORMS = [
    b"nv/bytes",
    "nv/str/\u00e9",
    12345,
    -7,
    2**130 + 3,
    bytearray(b"nv/bytearray"),
    memoryview(b"nv/memoryview"),
    memoryview(b"xnv/strided")[::2],
]


@pytest.mark.parametrize("key", KEY_FORMS, ids=lambda k: type(k).__name__)
def test_get_view_maps_every_key_form_as_key_of(kc, key):
    # Stored under the int the hashlib reference computes (an int maps to
    # itself); read back through the native mapping of the key itself.
    from test_keys import reference_key_of

    src = torch.arange(24, dtype=torch.int32).reshape(2, 3, 4)
    kc._native.put(reference_key_of(key), 3, [2, 3, 4], src.data_ptr(), src.nbytes)
    t = kc._native.get_view(key)
    assert type(t).__name__ == "KVView" and isinstance(t, torch.Tensor)
    assert t.dtype == torch.int32 and t.shape == (2, 3, 4)
    assert torch.equal(t, src)
    del t
    assert kc._native.delete(key)


def test_get_view_of_a_missing_key_is_none_and_get_raises(kc):
    assert kc._native.get_view("nv/missing") is None
    with pytest.raises(kachedb.NotFound, match="nv/missing"):
        kc.get("nv/missing")
    assert collected_pins(kc) == 0


@pytest.mark.parametrize("bad", [1.5, None, True, object(), ("a",)])
def test_get_view_of_a_bad_key_raises_and_pins_nothing(kc, bad):
    with pytest.raises(TypeError):
        kc._native.get_view(bad)
    with pytest.raises(TypeError):
        kc.get(bad)
    with pytest.raises(TypeError):
        kc.get_many(["nv/ok", bad])
    with pytest.raises(TypeError):
        kc.get_prefix(["nv/ok", bad])
    assert collected_pins(kc) == 0


def test_views_hold_their_pins_until_the_last_derived_tensor_goes(kc):
    kc.put_many([f"nv/p{i}" for i in range(3)], [torch.full((64,), float(i)) for i in range(3)])
    assert collected_pins(kc) == 0
    one = kc.get("nv/p0")
    many = kc.get_many(["nv/p1", "nv/missing", "nv/p2"])
    # pin_each: each prefix view holds its own pin only (the shared pins of
    # the default are tested in test_batch.py).
    prefix = kc.get_prefix(["nv/p0", "nv/p1", "nv/missing", "nv/p2"], pin_each=True)
    assert many[1] is None and len(prefix) == 2
    assert [float(t[0]) for t in (one, many[0], many[2], *prefix)] == [0.0, 1.0, 2.0, 0.0, 1.0]
    assert all(type(t).__name__ == "KVView" for t in (one, many[0], many[2], *prefix))
    assert collected_pins(kc) == 5
    # A slice, a reshaped view and a dtype view outlive their source views.
    derived = [one[10:20], many[0].view(8, 8), prefix[1].view(torch.int32)]
    del one, many, prefix
    assert collected_pins(kc) == 3
    assert float(derived[0][0]) == 0.0 and float(derived[1][0, 0]) == 1.0
    while derived:
        derived.pop()
        assert collected_pins(kc) == len(derived)
    assert kc.delete_many([f"nv/p{i}" for i in range(3)]) == 3


def test_a_prefix_of_evenly_laid_out_blocks_is_one_export_and_still_each_blocks_own_view():
    """Equal blocks stored by one ``put_many`` from equally aligned sources lie a fixed
    stride apart: ``get_prefix`` makes
    their views from one export of the span (one ``as_strided`` and ``unbind`` in torch).
    Each view is still its own block — its address, dtype, shape and bytes — a
    ``KVView``; the call's pins go with the last of the views and of the tensors derived
    from them. Blocks laid out otherwise (another shape in the batch) take the view-per-
    block path, with the same result. (A daemon of its own: the megaslab empty, the
    put_many's blocks lie one after another.)"""
    d = Daemon(DAEMON_SIZE)
    try:
        kc = d.connect()
        _evenly_laid_out(kc)
        kc.close()
    finally:
        d.stop()


def _evenly_laid_out(kc) -> None:
    keys = [f"nv/even{i}" for i in range(6)]
    # Rows of one tensor: the same offset in a page each (a block's place in its page
    # follows its source's), so the blocks lie a fixed stride apart.
    whole = torch.empty(6, 8, 2048, dtype=torch.float16)
    vals = [whole[i].fill_(float(i)) for i in range(6)]
    kc.put_many(keys, vals)
    own = [kc.get(k) for k in keys]
    addrs = [t.data_ptr() for t in own]
    steps = {b - a for a, b in zip(addrs, addrs[1:])}
    del own
    assert collected_pins(kc) == 0
    views = kc.get_prefix(keys)
    assert [v.data_ptr() for v in views] == addrs
    assert all(type(v).__name__ == "KVView" and v.shape == (8, 2048) and v.dtype == torch.float16 for v in views)
    assert all(torch.equal(v, x) for v, x in zip(views, vals))
    # Laid out evenly (equal blocks of one put_many): one storage, the span of the six.
    assert len(steps) == 1, (steps, [a - addrs[0] for a in addrs])
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    assert views[0].untyped_storage().nbytes() >= 6 * vals[0].nbytes
    assert collected_pins(kc) == 6
    derived = views[4][3:5].view(torch.int16)
    del views
    assert collected_pins(kc) == 6 and int(derived[0, 0]) == int(vals[4].view(torch.int16)[0, 0])
    del derived
    assert collected_pins(kc) == 0
    # Another shape in the batch: one export per block.
    kc.put("nv/even-other", torch.zeros(4, 4, dtype=torch.float16))
    mixed = kc.get_prefix([keys[0], "nv/even-other", keys[1]])
    assert [tuple(v.shape) for v in mixed] == [(8, 2048), (4, 4), (8, 2048)]
    assert [v.data_ptr() for v in (mixed[0], mixed[2])] == addrs[:2]
    assert len({v.untyped_storage().data_ptr() for v in mixed}) == 3
    del mixed
    assert collected_pins(kc) == 0
    assert kc.delete_many([*keys, "nv/even-other"]) == 7


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8 dtypes")
def test_get_view_of_a_float8_block_views_it_as_its_dtype(kc):
    src = torch.linspace(-2, 2, 32).to(torch.float8_e4m3fn).reshape(4, 8)
    kc.put("nv/f8", src)
    t = kc.get("nv/f8")
    assert type(t).__name__ == "KVView" and t.dtype == torch.float8_e4m3fn and t.shape == (4, 8)
    assert torch.equal(t.view(torch.uint8), src.view(torch.uint8))
    assert collected_pins(kc) == 1
    del t
    assert collected_pins(kc) == 0
    kc.delete("nv/f8")


def test_views_of_a_closed_client_stay_valid_and_new_gets_raise(daemon):
    c = daemon.connect()
    c.put("nv/closed", torch.ones(4))
    t = c.get("nv/closed")
    c.close()
    for op in (lambda: c.get("nv/closed"), lambda: c.get_many(["nv/closed"]), lambda: c.get_prefix(["nv/closed"])):
        with pytest.raises(kachedb.Disconnected):
            op()
    assert float(t.sum()) == 4.0
    with daemon.connect() as other:
        assert collected_pins(other) == 1
        del t
        poll_until(lambda: other.stats()["pins"] == 0, what="the closed client's view released its pin")
        assert other.delete("nv/closed")


REFUSED_CLASS_CHILD = r"""
import gc, sys
import torch
import kachedb
from kachedb import _views

class Refused(torch.Tensor):
    # Another layout than torch.Tensor's: assigning it as __class__ raises TypeError.
    __slots__ = ("extra",)
    __torch_function__ = torch._C._disabled_torch_function_impl

probe = torch.zeros(1)
try:
    probe.__class__ = Refused
    sys.exit("this torch accepts the re-typing: the fallback is not exercised")
except TypeError:
    pass
made = _views._view_factory()
_views._view_factory = lambda: (made[0], Refused, made[2], made[3])

kc = kachedb.connect(sys.argv[1])
kc.put("nv/refused", torch.arange(8, dtype=torch.float32))
t = kc.get("nv/refused")
assert type(t) is Refused, type(t)
assert torch.equal(t, torch.arange(8, dtype=torch.float32))
part = t[2:4]
del t
gc.collect()
assert kc.stats()["pins"] == 1, kc.stats()["pins"]
assert float(part.sum()) == 5.0
del part
gc.collect()
assert kc.stats()["pins"] == 0, kc.stats()["pins"]
kc.delete("nv/refused")
# The views of a get_prefix, made from one shared export, get aliases too.
kc.put_many(["nv/r0", "nv/r1"], [torch.full((4,), 1.0), torch.full((4,), 2.0)])
views = kc.get_prefix(["nv/r0", "nv/r1"])
assert [type(v) for v in views] == [Refused, Refused], views
assert [float(v.sum()) for v in views] == [4.0, 8.0]
part = views[1][1:3]
del views
gc.collect()
assert kc.stats()["pins"] == 2, kc.stats()["pins"]
assert float(part.sum()) == 4.0
del part
gc.collect()
assert kc.stats()["pins"] == 0, kc.stats()["pins"]
kc.delete_many(["nv/r0", "nv/r1"])
print("ok")
"""


def test_a_view_class_torch_refuses_to_assign_gets_an_alias_holding_the_pin(daemon):
    # A fresh interpreter: the native layer reads the view factory once per process.
    r = subprocess.run(
        [sys.executable, "-c", REFUSED_CLASS_CHILD, daemon.socket], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
