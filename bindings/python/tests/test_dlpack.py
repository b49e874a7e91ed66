"""DLPack export (bindings/python/src/dlpack.rs): shared memory, and the owner
dropped exactly when the last view of it is gone."""

import ctypes
import gc
import threading

import numpy as np
import pytest

from kachedb import _kachedb_rust as rust

from kdb_support import live_buffers

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("no_leak")


def test_device_and_attributes():
    b = rust._test_buffer(10, 3)
    assert b.__dlpack_device__() == (1, 0)
    assert b.nbytes == len(b) == 10
    assert b.address != 0 and b.address % 64 == 0
    assert not b.readonly
    assert "10 bytes" in repr(b)


def test_not_constructible_from_python():
    b = rust._test_buffer(1)
    with pytest.raises(TypeError):
        type(b)()


@pytest.mark.parametrize("bad", [{"n": -1}, {"n": 4, "fill": 256}, {"n": 4, "fill": -1}])
def test_test_buffer_bad_values(bad):
    with pytest.raises(ValueError):
        rust._test_buffer(**bad)


@pytest.mark.parametrize("bad", [{"n": "4"}, {"n": 4.0}, {"n": 4, "fill": "x"}])
def test_test_buffer_bad_types(bad):
    with pytest.raises(TypeError):
        rust._test_buffer(**bad)


def test_torch_and_numpy_share_the_memory():
    b = rust._test_buffer(64, 5)
    t = torch.from_dlpack(b)
    a = np.from_dlpack(b)
    assert t.dtype == torch.uint8 and t.shape == (64,) and t.is_contiguous()
    assert a.dtype == np.uint8 and a.shape == (64,)
    assert t.data_ptr() == b.address == a.ctypes.data
    assert bool((t == 5).all()) and bool((a == 5).all())
    t[3] = 200
    assert a[3] == 200
    a[4] = 17  # writable: numpy got a DLPack 1.0 capsule without the read-only flag
    assert int(t[4]) == 17


def test_torch_lifetime_through_derived_views():
    b = rust._test_buffer(4096, 1)
    base = live_buffers()
    t = torch.from_dlpack(b)
    del b
    assert live_buffers() == base  # the tensor keeps it
    s = t[100:200]
    v = t.view(torch.float32).view(16, 64)
    st = torch.as_strided(t, (8, 8), (16, 2), 7)
    r = t.reshape(64, 64).t()
    del t
    assert live_buffers() == base
    del s, v
    assert live_buffers() == base
    del r
    assert live_buffers() == base
    assert int(st[0, 0]) == 1
    del st
    assert live_buffers() == base - 1


def test_numpy_lifetime_through_derived_views():
    b = rust._test_buffer(4096, 2)
    base = live_buffers()
    a = np.from_dlpack(b)
    del b
    s = a[::3]
    v = a.view(np.int32).reshape(32, 32)
    del a
    assert live_buffers() == base
    del s
    assert live_buffers() == base
    assert v[0, 0] == 0x02020202
    del v
    assert live_buffers() == base - 1


def test_owner_outlives_buffer_and_all_consumers():
    b = rust._test_buffer(128)
    base = live_buffers()
    t = torch.from_dlpack(b)
    a = np.from_dlpack(b)
    t2 = torch.from_dlpack(b)
    del b
    del t
    assert live_buffers() == base
    del a
    assert live_buffers() == base
    del t2
    assert live_buffers() == base - 1


def test_buffer_alone_keeps_the_memory():
    b = rust._test_buffer(8)
    base = live_buffers()
    t = torch.from_dlpack(b)
    del t
    assert live_buffers() == base  # b is still alive
    del b
    assert live_buffers() == base - 1


@pytest.mark.parametrize("max_version", [None, (1, 0), (0, 8)])
def test_unconsumed_capsule_frees_in_its_destructor(max_version):
    b = rust._test_buffer(32)
    base = live_buffers()
    cap = b.__dlpack__(max_version=max_version)
    assert ("dltensor_versioned" if max_version == (1, 0) else '"dltensor"') in repr(cap)
    del b
    assert live_buffers() == base  # the capsule's tensor owns it
    del cap
    assert live_buffers() == base - 1


def test_consumed_legacy_capsule_is_renamed_and_not_freed_twice():
    b = rust._test_buffer(32, 9)
    base = live_buffers()
    cap = b.__dlpack__()
    t = torch.utils.dlpack.from_dlpack(cap)
    assert "used_dltensor" in repr(cap)
    del b, cap
    assert live_buffers() == base
    assert bool((t == 9).all())
    del t
    assert live_buffers() == base - 1


def test_consumed_versioned_capsule():
    b = rust._test_buffer(32, 9)
    base = live_buffers()
    cap = b.__dlpack__(max_version=(1, 0))
    t = torch.utils.dlpack.from_dlpack(cap)
    assert "used_dltensor_versioned" in repr(cap)
    del b, cap
    assert live_buffers() == base
    del t
    assert live_buffers() == base - 1


def test_capsule_destroyed_while_an_exception_propagates():
    b = rust._test_buffer(16)
    base = live_buffers()

    def f(buf):
        cap = buf.__dlpack__()  # noqa: F841 - destroyed while the frame unwinds
        raise RuntimeError("in flight")

    with pytest.raises(RuntimeError, match="in flight"):
        f(b)
    del b
    assert live_buffers() == base - 1


def test_zero_length():
    b = rust._test_buffer(0)
    base = live_buffers()
    assert b.address != 0
    t = torch.from_dlpack(b)
    a = np.from_dlpack(b)
    assert t.numel() == 0 and a.size == 0
    f = t.view(torch.float32).view(0, 4)
    g = a.view(np.float64).reshape(3, 0)
    assert f.shape == (0, 4) and g.shape == (3, 0)
    del b, t, a
    assert live_buffers() == base
    del f, g
    assert live_buffers() == base - 1


def test_last_view_dropped_on_another_thread():
    b = rust._test_buffer(1024, 6)
    base = live_buffers()
    views = [torch.from_dlpack(b)[i:] for i in range(8)]
    del b
    th = threading.Thread(target=views.clear)
    th.start()
    th.join()
    assert live_buffers() == base - 1


def test_readonly_buffer():
    b = rust._test_buffer(16, 1, readonly=True)
    assert b.readonly
    a = np.from_dlpack(b)
    assert not a.flags.writeable
    with pytest.raises(ValueError):
        a[0] = 2
    with pytest.raises(ValueError):
        a.flags.writeable = True
    t = torch.from_dlpack(b)  # torch has no read-only tensors; it still imports
    assert t.data_ptr() == b.address


def test_legacy_numpy_import_is_readonly():
    # numpy marks every legacy ("dltensor") import read-only: why writable numpy
    # views need the versioned capsule, which numpy asks for with max_version=(1, 0).
    b = rust._test_buffer(16)
    assert np.from_dlpack(b).flags.writeable
    assert not np.from_dlpack(_LegacyOnly(b)).flags.writeable


class _LegacyOnly:
    """An exporter that does not accept max_version, as DLPack 0.x producers."""

    def __init__(self, buf):
        self.buf = buf

    def __dlpack__(self, stream=None):
        return self.buf.__dlpack__()

    def __dlpack_device__(self):
        return self.buf.__dlpack_device__()


# Kept alive for as long as any capsule renamed to it (capsules keep the pointer).
_USED_NAME = ctypes.create_string_buffer(b"used_dltensor")
# Offset of DLManagedTensor.deleter: DLTensor is 48 bytes on 64-bit, then manager_ctx.
_DELETER_OFFSET = 56


@pytest.mark.skipif(ctypes.sizeof(ctypes.c_void_p) != 8, reason="struct offsets are for 64-bit")
def test_deleter_runs_without_the_gil():
    # Act as a C consumer: take the tensor out of the capsule, rename the capsule,
    # and call the deleter through ctypes, which releases the GIL around the call.
    api = ctypes.pythonapi
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api.PyCapsule_SetName.restype = ctypes.c_int
    api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]

    b = rust._test_buffer(64, 1)
    base = live_buffers()
    cap = b.__dlpack__()
    managed = api.PyCapsule_GetPointer(cap, b"dltensor")
    assert api.PyCapsule_SetName(cap, _USED_NAME) == 0
    deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(
        ctypes.c_void_p.from_address(managed + _DELETER_OFFSET).value
    )
    del b
    assert live_buffers() == base
    th = threading.Thread(target=deleter, args=(managed,))
    th.start()
    th.join()
    assert live_buffers() == base - 1
    del cap  # renamed: its destructor must not delete again
    assert live_buffers() == base - 1


def test_dlpack_keyword_arguments():
    b = rust._test_buffer(8)
    cap = b.__dlpack__(stream=None, max_version=(1, 0), dl_device=(1, 0), copy=False)
    assert "dltensor_versioned" in repr(cap)
    cap = b.__dlpack__(stream=-1, max_version=(2, 3), copy=None)
    assert "dltensor_versioned" in repr(cap)
    with pytest.raises(BufferError, match="without copying"):
        b.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="host memory"):
        b.__dlpack__(dl_device=(2, 0))
    with pytest.raises(TypeError, match="max_version"):
        b.__dlpack__(max_version="1.0")
    with pytest.raises(TypeError):
        b.__dlpack__(None)  # keyword-only
    t = torch.from_dlpack(b, device="cpu")
    assert t.data_ptr() == b.address
    del cap, t
    gc.collect()


def test_many_exports_do_not_leak():
    b = rust._test_buffer(256)
    base = live_buffers()
    for _ in range(2000):
        t = torch.from_dlpack(b)
        a = np.from_dlpack(b)
        c = b.__dlpack__()
        del t, a, c
    assert live_buffers() == base
    del b
    assert live_buffers() == base - 1
