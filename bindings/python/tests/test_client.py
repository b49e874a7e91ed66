"""Round trips through a real daemon: every dtype, many shapes, torch and numpy,
through every write path (put, put_many, reserve) and read path (get, get_many,
get_numpy); bytes compared exactly. Plus zero-copy, the small ops and bad
arguments."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kachedb
from kachedb._dtypes import DTYPE_CODES

DAEMON_SIZE = "64MiB"

TORCH_DTYPES = [getattr(torch, name) for name in DTYPE_CODES]
assert len(TORCH_DTYPES) == 12
#: The dtypes numpy has natively (bfloat16 and float8 only through torch).
NUMPY_DTYPES = [np.dtype(n) for n in ("float32", "float16", "int8", "uint8", "int32", "int64", "float64", "bool", "int16")]

_counter = itertools.count()


def fresh_key(prefix: str = "k") -> str:
    return f"{prefix}/{os.getpid()}/{next(_counter)}"


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a (contiguous) tensor, as a 1-D uint8 tensor."""
    return t.reshape(-1).view(torch.uint8)


def random_tensor(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    """Random bytes seen as ``dtype``/``shape`` (bools kept 0/1, NaN payloads and
    all other bit patterns allowed for the others: compared as bytes)."""
    n = dtype.itemsize
    for d in shape:
        n *= d
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        b &= 1
    return b.view(dtype).reshape(shape)


def random_array(dtype: np.dtype, shape, seed: int) -> np.ndarray:
    n = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    b = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    if dtype == np.bool_:
        b &= 1
    return b.view(dtype).reshape(shape)


def assert_same_tensor(got, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert torch.equal(raw(got), raw(want))


def assert_same_array(got, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.tobytes() == want.tobytes()


#: 0-D .. 6-D, dims 0..4 (zero-size dims included), at most 4**6 elements.
shapes = st.integers(0, 6).flatmap(lambda nd: st.tuples(*[st.integers(0, 4)] * nd))
hyp = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# --- torch ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@hyp
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_torch_put_get(module_kc, dtype, shape, seed):
    src = random_tensor(dtype, shape, seed)
    key = fresh_key()
    module_kc.put(key, src)
    got = module_kc.get(key)
    assert_same_tensor(got, src)
    assert not isinstance(got, torch.nn.Parameter)
    with module_kc.get(key) as t:
        assert_same_tensor(t, src)
    module_kc.delete(key)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@hyp
@given(shapes=st.lists(shapes, min_size=1, max_size=5), seed=st.integers(0, 2**31))
def test_torch_put_many_get_many(module_kc, dtype, shapes, seed):
    srcs = [random_tensor(dtype, s, seed + i) for i, s in enumerate(shapes)]
    keys = [fresh_key() for _ in srcs]
    module_kc.put_many(keys, srcs)
    got = module_kc.get_many(keys + [fresh_key("missing")])
    assert got[-1] is None
    for g, s in zip(got, srcs):
        assert_same_tensor(g, s)
    # and one by one
    for k, s in zip(keys, srcs):
        assert_same_tensor(module_kc.get(k), s)
    for k in keys:
        assert module_kc.delete(k)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@hyp
@given(shapes=st.lists(shapes, min_size=1, max_size=6), seed=st.integers(0, 2**31))
def test_torch_put_many_get_prefix(module_kc, dtype, shapes, seed):
    # Views made together from shared exports (runs of like blocks, zero-size
    # and 0-D ones included) match the sources as one-by-one gets do.
    srcs = [random_tensor(dtype, s, seed + i) for i, s in enumerate(shapes)]
    keys = [fresh_key() for _ in srcs]
    module_kc.put_many(keys, srcs)
    got = module_kc.get_prefix(keys + [fresh_key("missing")] + keys)
    assert len(got) == len(srcs)
    for g, s in zip(got, srcs):
        assert type(g).__name__ == "KVView"
        assert_same_tensor(g, s)
    del got, g
    for k in keys:
        assert module_kc.delete(k)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@hyp
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_torch_reserve(module_kc, dtype, shape, seed):
    src = random_tensor(dtype, shape, seed)
    key = fresh_key()
    with module_kc.reserve(key, shape, dtype) as out:
        assert isinstance(out, torch.Tensor)
        assert out.dtype == dtype and tuple(out.shape) == tuple(shape)
        out.copy_(src)
    assert_same_tensor(module_kc.get(key), src)
    module_kc.delete(key)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_noncontiguous_and_strided_sources(kc, dtype):
    base = random_tensor(dtype, (6, 8, 4), 7)
    for src in (base.transpose(0, 2), base[:, ::2], base[1:5, 3], base.permute(2, 0, 1)[1:]):
        key = fresh_key()
        kc.put(key, src)
        assert_same_tensor(kc.get(key), src.contiguous())
        kc.delete(key)


def test_torch_requires_grad_and_views_as_source(kc):
    src = torch.randn(4, 5, requires_grad=True)
    kc.put("grad", src)
    assert torch.equal(kc.get("grad"), src.detach())
    kc.put("slice", src.detach()[2])
    assert torch.equal(kc.get("slice"), src.detach()[2])


# --- numpy ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=str)
@hyp
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_numpy_put_get_numpy(module_kc, dtype, shape, seed):
    src = random_array(dtype, shape, seed)
    key = fresh_key()
    module_kc.put(key, src)
    a = module_kc.get_numpy(key)
    assert_same_array(a, src)
    assert not a.flags.writeable
    # The same block through torch has the matching torch dtype.
    t = module_kc.get(key)
    assert t.dtype == getattr(torch, dtype.name)
    assert t.numpy().tobytes() == src.tobytes()
    module_kc.delete(key)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=str)
@hyp
@given(shapes=st.lists(shapes, min_size=1, max_size=5), seed=st.integers(0, 2**31))
def test_numpy_put_many(module_kc, dtype, shapes, seed):
    srcs = [random_array(dtype, s, seed + i) for i, s in enumerate(shapes)]
    keys = [fresh_key() for _ in srcs]
    module_kc.put_many(keys, srcs)
    for k, s in zip(keys, srcs):
        assert_same_array(module_kc.get_numpy(k), s)
    for g, s in zip(module_kc.get_many(keys), srcs):
        assert g.numpy().tobytes() == s.tobytes()
    for k in keys:
        module_kc.delete(k)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=str)
@hyp
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_numpy_reserve(module_kc, dtype, shape, seed):
    src = random_array(dtype, shape, seed)
    key = fresh_key()
    with module_kc.reserve(key, shape, dtype) as out:
        assert isinstance(out, np.ndarray)
        assert out.dtype == dtype and out.shape == tuple(shape)
        assert out.flags.writeable
        out[...] = src
    assert_same_array(module_kc.get_numpy(key), src)
    module_kc.delete(key)


def test_numpy_reserve_with_scalar_type_and_name(kc):
    # np.float16 (a scalar type, not a dtype instance) also gives numpy.
    with kc.reserve("np-type", (3,), np.float16) as out:
        assert isinstance(out, np.ndarray) and out.dtype == np.float16
        out[:] = [1, 2, 3]
    assert kc.get_numpy("np-type").tolist() == [1, 2, 3]
    # A dtype name gives torch.
    with kc.reserve("by-name", (2,), "bfloat16") as out:
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
        out.fill_(1.5)
    assert kc.get("by-name").tolist() == [1.5, 1.5]


def test_numpy_noncontiguous_and_bytes_sources(kc):
    base = random_array(np.dtype(np.int32), (5, 6, 7), 3)
    for src in (base.T, base[::2, 1], base[:, :, 3]):
        kc.put("nc", src)
        assert_same_array(kc.get_numpy("nc"), np.ascontiguousarray(src))
    kc.put("bytes", b"hello")
    assert kc.get_numpy("bytes").tobytes() == b"hello"
    assert kc.get("bytes").dtype == torch.uint8
    kc.put("bytearray", bytearray(b"\x00\x01"))
    assert kc.get_numpy("bytearray").tolist() == [0, 1]
    kc.put("empty", b"")
    assert kc.get_numpy("empty").shape == (0,)


def test_get_numpy_of_torch_only_dtypes(kc):
    """numpy has no bfloat16/float8: get_numpy says to use torch (or, with
    ml_dtypes installed, returns ml_dtypes' types); no pin is left behind."""
    for dt in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        src = random_tensor(dt, (3, 2), 1)
        kc.put("torch-only", src)
        try:
            import ml_dtypes  # noqa: F401
        except ImportError:
            with pytest.raises(TypeError, match="torch"):
                kc.get_numpy("torch-only")
        else:
            a = kc.get_numpy("torch-only")
            assert a.dtype.name == str(dt).split(".")[1] and a.tobytes() == raw(src).numpy().tobytes()


def test_replace_and_keys_of_every_kind(kc):
    for key in (b"bytes-key", "str-key", 12345, -1, 2**127 + 5, bytearray(b"ba"), memoryview(b"mv")):
        kc.put(key, torch.tensor([1, 2]))
        kc.put(key, torch.tensor([3, 4, 5]))  # replaces
        assert kc.get(key).tolist() == [3, 4, 5]
        assert key in kc
        assert kc.delete(key)
        assert key not in kc
        assert not kc.delete(key)
    # str and its UTF-8 bytes are the same key; an int is its own value mod 2**128.
    kc.put("same", torch.tensor([9]))
    assert kc.get(b"same").tolist() == [9]
    kc.put(-1, torch.tensor([8]))
    assert kc.get(2**128 - 1).tolist() == [8]


def test_lookup_contains_delete_stats(kc):
    keys = [fresh_key("chain") for _ in range(6)]
    for k in keys[:4]:
        kc.put(k, torch.zeros(2))
    assert kc.lookup(keys) == 4
    assert kc.lookup(keys[:2]) == 2
    assert kc.lookup([keys[5]] + keys[:4]) == 0
    assert kc.lookup([]) == 0
    assert kc.contains(keys[0]) and not kc.contains(keys[4])
    before = kc.stats()
    assert kc.delete(keys[1])
    assert kc.lookup(keys) == 1
    s = kc.stats()
    assert s["blocks"] == before["blocks"] - 1
    for field in ("blocks", "bytes_used", "bytes_free", "bytes_total", "pins", "reserved", "clients_connected", "evictions", "rejected_frames", "ops_per_s"):
        assert field in s, field
    assert s["bytes_total"] == 64 << 20
    kc.ping()


def test_zero_copy_same_memory_inside_region(kc):
    src = torch.arange(1024, dtype=torch.float32)
    kc.put("zc", src)
    a, b = kc.get("zc"), kc.get("zc")
    assert a.data_ptr() == b.data_ptr()
    base, length = kc._native.region_span()
    assert base <= a.data_ptr() and a.data_ptr() + a.nbytes <= base + length
    n = kc.get_numpy("zc")
    assert n.ctypes.data == a.data_ptr()
    m = kc.get_many(["zc", "zc"])
    assert m[0].data_ptr() == m[1].data_ptr() == a.data_ptr()
    # The source was copied, not aliased.
    assert a.data_ptr() != src.data_ptr()
    # A block is a 64-byte aligned region range, not a private copy.
    assert a.data_ptr() % 64 == 0


def test_put_many_length_mismatch_and_all_or_nothing(kc, daemon):
    with pytest.raises(kachedb.InvalidArgument):
        kc.put_many(["a", "b"], [torch.zeros(1)])
    # One block too large for the megaslab: nothing of the batch is committed.
    big = torch.empty(65 << 20, dtype=torch.uint8)
    with pytest.raises(kachedb.TooLarge):
        kc.put_many(["aon-1", "aon-2"], [torch.zeros(4), big])
    assert kc.lookup(["aon-1"]) == 0
    assert kc.stats()["reserved"] == 0


# --- bad arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16, "float128", "nonsense", np.complex128, np.dtype(">i4"), object, None])
def test_unknown_dtype(kc, dtype):
    with pytest.raises((TypeError, kachedb.InvalidArgument)):
        kc.reserve("bad-dtype", (2,), dtype)
    assert kc.lookup(["bad-dtype"]) == 0


def test_unstorable_sources(kc):
    with pytest.raises(TypeError, match="cannot store"):
        kc.put("c", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="cannot store"):
        kc.put("c", np.zeros(2, dtype=np.complex64))
    with pytest.raises(TypeError):
        kc.put("c", np.zeros(2, dtype=">f4"))
    with pytest.raises(TypeError):
        kc.put_many(["c"], [torch.zeros(2, dtype=torch.complex64)])
    assert kc.lookup(["c"]) == 0


def test_shape_errors(kc):
    with pytest.raises(ValueError, match="at most 6"):
        kc.reserve("d7", (1,) * 7, torch.float32)
    with pytest.raises(ValueError, match="at most 6"):
        kc.put("d7", torch.zeros((1,) * 7))
    with pytest.raises(ValueError, match="at most 6"):
        kc.put("d7", np.zeros((1,) * 7))
    with pytest.raises(kachedb.InvalidArgument):
        kc.reserve("neg", (2, -1), torch.float32)
    with pytest.raises(kachedb.InvalidArgument):
        kc.reserve("huge-dim", (2**32,), torch.uint8)
    with pytest.raises(TypeError):
        kc.reserve("float-dim", (2.5,), torch.float32)
    with pytest.raises(TypeError):
        kc.reserve("str-shape", "12", torch.float32)
    assert kc.lookup(["d7"]) == 0
    # an int shape means (n,)
    with kc.reserve("int-shape", 3, torch.int8) as out:
        assert tuple(out.shape) == (3,)
        out.fill_(1)


@pytest.mark.parametrize("key", [1.5, None, (1, 2), ["a"], True, object()])
def test_key_of_wrong_type(kc, key):
    with pytest.raises(TypeError):
        kc.get(key)
    with pytest.raises(TypeError):
        kc.put(key, torch.zeros(1))
    with pytest.raises(TypeError):
        kc.get_many(["ok", key])
    with pytest.raises(TypeError):
        kc.lookup([key])
    with pytest.raises(TypeError):
        kc.delete(key)
    if key is None:
        # None is a keyless reservation (its key named by commit_as); leaving
        # `with` without one aborts it.
        with kc.reserve(key, (1,), torch.uint8) as out:
            assert tuple(out.shape) == (1,)
    else:
        with pytest.raises(TypeError):
            kc.reserve(key, (1,), torch.uint8)
    with pytest.raises(TypeError):
        kc.put_many([key], [torch.zeros(1)])


def test_commit_as_names_each_blocks_parent(kc):
    """Blocks reserved before their keys were known (LMCache's chunks in the
    region), committed in one batch under their keys, each naming the block
    before it: the daemon chains them (docs/PROTOCOL.md, "COMMIT and the key")."""
    keys = [f"commit-as-parent-{i}" for i in range(3)]
    held = kc.reserve_each(3, (4096,), "uint8")
    for i, r in enumerate(held):
        r.out.fill_(i + 1)
    before = kc.stats()["chained_blocks"]
    with pytest.raises(kachedb.InvalidArgument):
        kc.commit_as(held, keys, parents=[None])  # one parent for three: nothing committed
    with pytest.raises(TypeError):
        kc.commit_as(held, keys, parents=[None, 2.5, None])  # not a key: nothing committed
    assert kc.stats()["reserved"] == 3
    assert kc.commit_as(held, keys, parents=[None, keys[0], keys[1]]) == [True, True, True]
    held = r = None
    assert kc.stats()["chained_blocks"] == before + 2
    for i, k in enumerate(keys):
        with kc.get(k) as t:
            assert t.unique().tolist() == [i + 1]
    # A keyless reservation may name its parent when it is made.
    r = kc.reserve(None, (4096,), "uint8", parent=keys[2])
    r.out.fill_(9)
    r.commit_as("commit-as-parent-3")
    r = None
    assert kc.stats()["chained_blocks"] == before + 3


@pytest.mark.parametrize("value", [[1, 2, 3], "text", 3, 2.0, None, {"a": 1}, torch.float32])
def test_put_of_a_non_tensor(kc, value):
    with pytest.raises(TypeError, match="torch.Tensor"):
        kc.put("not-a-tensor", value)
    with pytest.raises(TypeError):
        kc.put_many(["not-a-tensor"], [value])
    assert kc.lookup(["not-a-tensor"]) == 0


def test_get_of_a_missing_key(kc):
    with pytest.raises(kachedb.NotFound):
        kc.get("never-put")
    with pytest.raises(KeyError):
        kc.get("never-put")
    with pytest.raises(kachedb.NotFound):
        kc.get_numpy("never-put")
    try:
        kc.get("never-put")
    except kachedb.KacheDBError as e:
        assert "never-put" in str(e)
    assert kc.get_many(["never-put"]) == [None]


def test_reservation_larger_than_the_megaslab(kc):
    with pytest.raises(kachedb.TooLarge, match="--size"):
        kc.reserve("too-large", (65, 1 << 20), torch.uint8)
    with pytest.raises(ValueError):  # TooLarge is a ValueError too
        kc.put("too-large", torch.empty(64 * (1 << 20) + 1, dtype=torch.uint8))
    s = kc.stats()
    assert s["reserved"] == 0 and s["too_large"] >= 2


def test_connect_without_a_daemon_says_how_to_start_one(tmp_path):
    path = str(tmp_path / "nobody.sock")
    with pytest.raises(kachedb.Disconnected) as e:
        kachedb.connect(path)
    msg = str(e.value)
    assert path in msg
    assert "kachedb serve" in msg and "start=True" in msg
    assert isinstance(e.value, ConnectionError)
    # a stale socket file with no listener behind it: the same error
    import socket as _s

    s = _s.socket(_s.AF_UNIX)
    s.bind(path)
    s.close()
    with pytest.raises(kachedb.Disconnected, match="kachedb serve"):
        kachedb.connect(path)


def test_client_repr_socket_and_context_manager(daemon):
    with daemon.connect() as c:
        assert c.socket == daemon.socket
        assert not c.closed
        assert daemon.socket in repr(c)
        assert not c.started_daemon
        with pytest.raises(kachedb.KacheDBError, match="did not start"):
            c.stop_daemon()
    assert c.closed
    with pytest.raises(kachedb.Disconnected, match="closed"):
        c.get("x")
    c.close()  # idempotent


@pytest.mark.parametrize("nbytes", [32 << 20, (40 << 20) + 12345, (64 << 20) - 64])
def test_big_puts_copied_by_several_threads_are_exact(make_daemon, nbytes):
    """Blocks of 32 MiB and more are copied in page-aligned chunks by several
    threads: every byte must land, whatever the length and source alignment."""
    d = make_daemon("160MiB")
    with d.connect() as c:
        g = torch.Generator().manual_seed(nbytes)
        base = torch.randint(0, 256, (nbytes + 128,), dtype=torch.uint8, generator=g)
        for offset in (0, 64, 100):  # source page offsets (100: not 64-byte aligned)
            src = base[offset:offset + nbytes]
            c.put("big", src)
            got = c.get("big")
            assert torch.equal(got, src)
            del got
        # a typed big block through numpy too
        arr = np.frombuffer(base.numpy().tobytes()[: nbytes // 16 * 16], dtype=np.float32).reshape(-1, 4)
        c.put("big-np", arr)
        assert c.get_numpy("big-np").tobytes() == arr.tobytes()
