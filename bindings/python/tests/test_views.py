"""Byte ranges exported as blocks of a dtype and shape (``DLPackBuffer.typed``)
-> torch / numpy views (kachedb._views)."""

import numpy as np
import pytest

from kachedb import InvalidArgument
from kachedb import _dtypes as d
from kachedb import _kachedb_rust as rust
from kachedb import _views as v

from kdb_support import live_buffers

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("no_leak")

ALL_CODES = sorted(d.ITEMSIZES)
NUMPY_CODES = [c for c in ALL_CODES if c not in (6, 9, 10)]


def _buffer(code, shape, fill=0):
    return rust._test_buffer(d.block_nbytes(code, shape), fill)


@pytest.mark.parametrize("code", ALL_CODES)
@pytest.mark.parametrize("shape", [(), (7,), (2, 16, 8, 128), (1, 2, 1, 3, 1, 2), (0, 4)])
def test_torch_view_shapes_and_dtypes(code, shape):
    b = _buffer(code, shape)
    t = v.torch_from_dlpack(b, code, shape)
    assert t.dtype == d.torch_dtype(code)
    assert tuple(t.shape) == shape
    assert t.is_contiguous()
    if t.numel():
        assert t.data_ptr() == b.address


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float16", "float32"])
def test_float_views_write_the_right_bytes(name):
    dt = getattr(torch, name)
    code = d.torch_code(dt)
    b = _buffer(code, (4, 8))
    base = live_buffers()
    t = v.torch_from_dlpack(b, code, (4, 8))
    t.fill_(1.5)
    t[1, 2] = -0.25
    raw = torch.from_dlpack(b)
    want = torch.full((4, 8), 1.5, dtype=dt)
    want[1, 2] = -0.25
    assert torch.equal(raw, want.view(torch.uint8).flatten())
    assert float(t[1, 2].float()) == -0.25
    # The typed view alone keeps the block alive.
    del b, raw
    assert live_buffers() == base
    half = t[2:]
    del t
    assert live_buffers() == base
    assert float(half[0, 0].float()) == 1.5
    del half
    assert live_buffers() == base - 1


def test_bfloat16_and_float8_known_encodings():
    for name, pattern in [("bfloat16", [0xC0, 0x3F]), ("float8_e4m3fn", [0x3C]), ("float8_e5m2", [0x3E])]:
        code = d.dtype_code(name)
        b = _buffer(code, (3,))
        t = v.torch_from_dlpack(b, code, (3,))
        t.fill_(1.5)
        assert list(np.from_dlpack(b)) == pattern * 3, name


@pytest.mark.parametrize("code", NUMPY_CODES)
def test_numpy_views(code):
    shape = (3, 5)
    b = _buffer(code, shape, fill=1)
    a = v.numpy_from_dlpack(b, code, shape)
    assert a.dtype == d.numpy_dtype(code)
    assert a.shape == shape
    assert a.ctypes.data == b.address
    assert not a.flags.writeable
    with pytest.raises(ValueError):
        a[0, 0] = 0
    with pytest.raises(ValueError):
        a.flags.writeable = True
    w = v.numpy_from_dlpack(b, code, shape, writeable=True)
    assert w.flags.writeable
    w[1, 1] = 1  # visible through the read-only view and through torch
    assert a[1, 1] == 1
    t = v.torch_from_dlpack(b, code, shape)
    assert t.numpy().tobytes() == a.tobytes()


def test_numpy_view_keeps_owner_alive():
    b = _buffer(7, (4, 4))
    base = live_buffers()
    a = v.numpy_from_dlpack(b, 7, (4, 4))
    del b
    row = a[2]
    del a
    assert live_buffers() == base
    del row
    assert live_buffers() == base - 1


@pytest.mark.parametrize("code", [6, 9, 10])
def test_numpy_view_of_bf16_fp8(code):
    b = _buffer(code, (2, 2))
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        with pytest.raises(TypeError, match="torch"):
            v.numpy_from_dlpack(b, code, (2, 2))
    else:
        assert v.numpy_from_dlpack(b, code, (2, 2)).shape == (2, 2)


def test_size_mismatch():
    b = rust._test_buffer(10)
    with pytest.raises(InvalidArgument, match="needs 16"):
        v.torch_from_dlpack(b, 7, (4,))
    with pytest.raises(ValueError):
        v.numpy_from_dlpack(b, 7, (4,))


@pytest.mark.parametrize(
    "name,torch_gets,numpy_gets",
    [
        ("float32", "float32", "float32"),
        ("int16", "int16", "int16"),
        ("bool", "bool", "bool"),
        ("bfloat16", "bfloat16", "uint16"),  # numpy reads no bfloat16
        ("float8_e4m3fn", "uint8", "uint8"),  # nor does either read float8
        ("float8_e5m2", "uint8", "uint8"),
    ],
)
def test_typed_exports_carry_the_dtype_the_reader_imports(name, torch_gets, numpy_gets):
    code = d.dtype_code(name)
    b = _buffer(code, (2, 3))
    t = torch.from_dlpack(b.typed(code, [2, 3]))
    assert t.dtype == getattr(torch, torch_gets) and tuple(t.shape) == (2, 3) and t.data_ptr() == b.address
    a = np.from_dlpack(b.typed(code, [2, 3], numpy=True))
    assert a.dtype == np.dtype(numpy_gets) and a.shape == (2, 3) and a.ctypes.data == b.address
    assert tuple(torch.from_dlpack(b).shape) == (b.nbytes,)  # the buffer itself stays bytes


def test_bad_shapes_and_codes():
    b = rust._test_buffer(8)
    with pytest.raises(TypeError):
        v.torch_from_dlpack(b, 1, "8")
    with pytest.raises(ValueError):
        v.torch_from_dlpack(b, 1, (1,) * 7 + (8,))
    with pytest.raises(ValueError):
        v.torch_from_dlpack(b, 99, (8,))
    with pytest.raises(ValueError):
        b.typed(1, [1] * 7 + [8])


def test_hypothesis_round_trips():
    hypothesis = pytest.importorskip("hypothesis")
    st = pytest.importorskip("hypothesis.strategies")

    shapes = st.lists(st.integers(0, 6), min_size=0, max_size=6).map(tuple)

    @hypothesis.given(code=st.sampled_from(ALL_CODES), shape=shapes, seed=st.integers(0, 255))
    def check(code, shape, seed):
        b = rust._test_buffer(d.block_nbytes(code, shape), seed)
        t = v.torch_from_dlpack(b, code, shape)
        assert tuple(t.shape) == shape and t.dtype == d.torch_dtype(code)
        raw = torch.from_dlpack(b)
        assert torch.equal(t.reshape(-1).view(torch.uint8), raw)
        if code in NUMPY_CODES:
            a = v.numpy_from_dlpack(b, code, shape)
            assert a.shape == shape
            assert a.tobytes() == raw.numpy().tobytes()

    before = live_buffers()
    check()
    assert live_buffers() == before
