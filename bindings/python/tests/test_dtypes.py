"""dtype tables (docs/PROTOCOL.md, "DType codes") and shape checks."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kachedb
from kachedb import _dtypes as d

PROTOCOL = {
    "uint8": (1, 1),
    "int8": (2, 1),
    "int32": (3, 4),
    "int64": (4, 8),
    "float16": (5, 2),
    "bfloat16": (6, 2),
    "float32": (7, 4),
    "float64": (8, 8),
    "float8_e4m3fn": (9, 1),
    "float8_e5m2": (10, 1),
    "bool": (11, 1),
    "int16": (12, 2),
}
NUMPY_NAMES = [n for n in PROTOCOL if n not in ("bfloat16", "float8_e4m3fn", "float8_e5m2")]


def _has_ml_dtypes():
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


def test_table_matches_protocol():
    assert d.DTYPE_CODES == {name: code for name, (code, _) in PROTOCOL.items()}
    for name, (code, size) in PROTOCOL.items():
        assert d.itemsize(code) == size
        assert d.dtype_name(code) == name
        assert d.dtype_code(name) == code


def test_short_names():
    assert d.dtype_code("bf16") == 6
    assert d.dtype_code("f8e4m3fn") == 9
    assert d.dtype_code("f32") == 7
    assert d.dtype_code("u8") == 1


@pytest.mark.parametrize("bad", [0, 13, 255, -1])
def test_unknown_codes(bad):
    with pytest.raises(ValueError, match="unknown dtype code"):
        d.itemsize(bad)


def test_code_must_be_int():
    with pytest.raises(TypeError):
        d.itemsize("7")
    with pytest.raises(TypeError):
        d.itemsize(True)


# --- torch ---


@pytest.mark.parametrize("name", list(PROTOCOL))
def test_torch_round_trip(name):
    torch = pytest.importorskip("torch")
    code, size = PROTOCOL[name]
    dt = getattr(torch, name)
    assert d.torch_code(dt) == code
    assert d.dtype_code(dt) == code
    assert d.torch_dtype(code) is dt
    assert torch.empty(0, dtype=dt).element_size() == size


@pytest.mark.parametrize("name", ["complex64", "float8_e4m3fnuz", "uint16", "qint8", "complex128"])
def test_torch_unsupported(name):
    torch = pytest.importorskip("torch")
    dt = getattr(torch, name, None)
    if dt is None:
        pytest.skip(f"this torch has no {name}")
    with pytest.raises(TypeError, match="cannot store torch dtype"):
        d.torch_code(dt)
    with pytest.raises(TypeError):
        d.dtype_code(dt)


def test_is_torch_dtype():
    torch = pytest.importorskip("torch")
    assert d.is_torch_dtype(torch.float16)
    assert not d.is_torch_dtype(np.float16)
    assert not d.is_torch_dtype("float16")


# --- numpy ---


@pytest.mark.parametrize("name", NUMPY_NAMES)
def test_numpy_round_trip(name):
    code, size = PROTOCOL[name]
    dt = np.dtype(name)
    assert d.numpy_code(dt) == code
    assert d.numpy_code(dt.type) == code
    assert d.dtype_code(dt) == code
    assert d.numpy_dtype(code) == dt
    assert dt.itemsize == size


@pytest.mark.parametrize(
    "alias,code",
    [
        (np.intc, 3),
        (np.longlong, 4),
        (np.int_, 4),
        (np.half, 5),
        (np.single, 7),
        (np.double, 8),
        (np.bool_, 11),
        (bool, 11),
        (float, 8),
        ("f4", 7),
        ("<f2", 5),
        ("=i8", 4),
        ("|u1", 1),
        ("?", 11),
    ],
)
def test_numpy_aliases(alias, code):
    assert d.numpy_code(alias) == code


UNSUPPORTED_NUMPY = [
    np.uint16,
    np.uint32,
    np.uint64,
    np.complex64,
    np.clongdouble,
    "V8",
    "S4",
    "U2",
    [("a", "f4"), ("b", "i4")],
    np.dtype(("f4", (2,))),
    "datetime64[ns]",
    object,
]


@pytest.mark.parametrize("bad", UNSUPPORTED_NUMPY)
def test_numpy_unsupported(bad):
    with pytest.raises(TypeError, match="cannot store numpy dtype|not in native byte order"):
        d.numpy_code(bad)


def test_numpy_non_native_byte_order():
    other = ">" if sys.byteorder == "little" else "<"
    with pytest.raises(TypeError, match="native byte order"):
        d.numpy_code(other + "f4")


@pytest.mark.parametrize("bad", [None, "no-such-dtype", 3.5])
def test_not_a_dtype(bad):
    with pytest.raises(TypeError):
        d.dtype_code(bad)


@pytest.mark.parametrize("code", [6, 9, 10])
def test_numpy_has_no_bf16_nor_fp8(code):
    if _has_ml_dtypes():
        import ml_dtypes

        assert d.numpy_dtype(code) == np.dtype(getattr(ml_dtypes, d.dtype_name(code)))
        assert d.numpy_code(d.numpy_dtype(code)) == code
    else:
        with pytest.raises(TypeError, match="torch"):
            d.numpy_dtype(code)


# --- shapes ---


@pytest.mark.parametrize(
    "shape,want",
    [
        ((), ()),
        ([], ()),
        ((2, 16, 8, 128), (2, 16, 8, 128)),
        ([1, 2, 3, 4, 5, 6], (1, 2, 3, 4, 5, 6)),
        (7, (7,)),
        ((np.int64(3), np.uint32(4)), (3, 4)),
        ((0, 5), (0, 5)),
        ((2**32 - 1,), (2**32 - 1,)),
        (range(3), (0, 1, 2)),
    ],
)
def test_check_shape(shape, want):
    assert d.check_shape(shape) == want


def test_torch_size_is_a_shape():
    torch = pytest.importorskip("torch")
    assert d.check_shape(torch.Size([2, 3])) == (2, 3)


@pytest.mark.parametrize("shape", [(1,) * 7, (-1,), (2, -3), (2**32,)])
def test_shape_values_out_of_range(shape):
    with pytest.raises(kachedb.InvalidArgument):
        d.check_shape(shape)
    with pytest.raises(ValueError):
        d.check_shape(shape)


@pytest.mark.parametrize("shape", ["abc", b"ab", (1.5,), None, 2.0, (1, "2"), [[1, 2]]])
def test_shape_types(shape):
    with pytest.raises(TypeError):
        d.check_shape(shape)


def test_block_nbytes():
    assert d.block_nbytes(5, (2, 16, 8, 128)) == 2 * 16 * 8 * 128 * 2
    assert d.block_nbytes(7, ()) == 4
    assert d.block_nbytes(8, (0, 9)) == 0
    with pytest.raises(kachedb.TooLarge):
        d.block_nbytes(8, (2**32 - 1,) * 3)


def test_package_imports_without_torch():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # makes `import torch` fail
        import numpy as np
        import kachedb
        from kachedb import _dtypes, _views
        assert kachedb.key_of(b"") == 0x2CCE3AD782E0344A1613FDE51073C736
        assert _dtypes.dtype_code("bfloat16") == 6
        assert _dtypes.dtype_code(np.float16) == 5
        assert not _dtypes.is_torch_dtype("float16")
        try:
            _dtypes.torch_dtype(5)
        except ImportError as e:
            assert "kachedb-shm[torch]" in str(e), e
        else:
            raise AssertionError("torch_dtype worked without torch")
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_import_kachedb_does_not_import_torch_or_numpy():
    code = "import sys, kachedb; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
