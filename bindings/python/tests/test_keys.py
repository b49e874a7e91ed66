"""kachedb.key_of (the native mapping every operation uses): fixed vectors
shared with crates/kachedb-client/src/key.rs, and a hashlib reference."""

import hashlib

import pytest

import kachedb

#: BLAKE2b personalisation of key hashing, version 1 (docs/PROTOCOL.md, "Keys").
KEY_PERSONALIZATION = b"kachedb-key-v1\0\0"


def reference_key_of(key):
    """docs/PROTOCOL.md's mapping written with hashlib: what the native one must give."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key % 2**128
    if isinstance(key, str):
        key = key.encode("utf-8")
    if isinstance(key, memoryview):
        key = key.tobytes()
    return int.from_bytes(hashlib.blake2b(key, digest_size=16, person=KEY_PERSONALIZATION).digest(), "little")

# The same vectors are in the Rust unit tests of kachedb_client::Key; they were
# produced once with
# int.from_bytes(hashlib.blake2b(b, digest_size=16, person=b"kachedb-key-v1\0\0").digest(), "little").
BYTE_VECTORS = [
    (b"", 0x2CCE3AD782E0344A1613FDE51073C736),
    (b"prefix-hash-0", 0x94084CCE0AA7C1D500B9BD01869F5BC9),
    ("h\u00e9llo".encode("utf-8"), 0x4FA4808AA8B5421CB149D0917030966D),
    (bytes(128), 0x3C8FC69CBF39C751B9D3CD3BD28E6DE7),
    (bytes(129), 0x228364ACF748D6F506DAF50DF9649A47),
    (bytes(range(256)), 0x1741F5AE23177CBC8ED2E64F58D49F4D),
    (b"a" * 1000, 0x8AD8B1F306FBF8E81817298FE5C2B041),
]

INT_VECTORS = [
    (0, 0),
    (1, 1),
    (-1, 2**128 - 1),
    (2**128 + 5, 5),
    (2**128, 0),
    (-(2**127), 2**127),
    (2**64, 2**64),
    (-(2**200) - 3, (-(2**200) - 3) % 2**128),
]


@pytest.mark.parametrize("data,want", BYTE_VECTORS)
def test_bytes_vectors(data, want):
    assert kachedb.key_of(data) == want
    assert kachedb.key_of(bytearray(data)) == want
    assert kachedb.key_of(memoryview(data)) == want


def test_vectors_match_hashlib_definition():
    for data, want in BYTE_VECTORS:
        digest = hashlib.blake2b(data, digest_size=16, person=KEY_PERSONALIZATION).digest()
        assert int.from_bytes(digest, "little") == want


def test_str_is_its_utf8_bytes():
    assert kachedb.key_of("h\u00e9llo") == 0x4FA4808AA8B5421CB149D0917030966D
    assert kachedb.key_of("prefix-hash-0") == kachedb.key_of(b"prefix-hash-0")
    assert kachedb.key_of("") == kachedb.key_of(b"")


@pytest.mark.parametrize("value,want", INT_VECTORS)
def test_int_vectors(value, want):
    assert kachedb.key_of(value) == want


def test_ints_are_not_hashed():
    # An int key is the key itself: hash chains computed elsewhere map 1:1.
    assert kachedb.key_of(0x1234) == 0x1234
    assert kachedb.key_of(hash("x")) == hash("x") % 2**128


def test_digest_is_read_little_endian():
    # hashlib digest of b"" is 36c77310e5fd1316 4a34e082d73ace2c in byte order.
    k = kachedb.key_of(b"")
    assert k & (2**64 - 1) == int.from_bytes(bytes.fromhex("36c77310e5fd1316"), "little")
    assert k >> 64 == int.from_bytes(bytes.fromhex("4a34e082d73ace2c"), "little")


def test_subclasses_map_as_their_base_type():
    class S(str):
        pass

    class B(bytes):
        pass

    class I(int):
        pass

    assert kachedb.key_of(S("abc")) == kachedb.key_of("abc")
    assert kachedb.key_of(B(b"abc")) == kachedb.key_of(b"abc")
    assert kachedb.key_of(I(-5)) == 2**128 - 5


def test_memoryview_of_any_format_hashes_its_bytes():
    np = pytest.importorskip("numpy")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert kachedb.key_of(memoryview(a)) == kachedb.key_of(a.tobytes())
    strided = memoryview(b"abcdef")[::2]
    assert not strided.c_contiguous
    assert kachedb.key_of(strided) == kachedb.key_of(b"ace")


@pytest.mark.parametrize("bad", [None, 1.5, True, False, [1, 2], (b"a",), object(), {b"k": 1}])
def test_other_types_are_type_errors(bad):
    with pytest.raises(TypeError, match="bytes, bytearray, memoryview, str or int"):
        kachedb.key_of(bad)


def test_unencodable_str_is_value_error():
    with pytest.raises(ValueError, match="UTF-8"):
        kachedb.key_of("\ud800")


def test_keys_are_in_range():
    hypothesis = pytest.importorskip("hypothesis")
    st = pytest.importorskip("hypothesis.strategies")

    @hypothesis.given(st.one_of(st.binary(), st.text(), st.integers()))
    def check(key):
        k = kachedb.key_of(key)
        assert 0 <= k < 2**128
        if isinstance(key, str):
            assert k == kachedb.key_of(key.encode("utf-8"))

    check()


def test_native_mapping_agrees_with_the_reference():
    hypothesis = pytest.importorskip("hypothesis")
    st = pytest.importorskip("hypothesis.strategies")

    @hypothesis.given(
        st.one_of(
            st.binary(),
            st.text(),
            st.integers(),
            st.integers(min_value=-(2**300), max_value=2**300),
            st.binary().map(bytearray),
            st.binary().map(memoryview),
            st.binary(min_size=1).map(lambda b: memoryview(b)[::2]),
        )
    )
    def check(key):
        assert kachedb.key_of(key) == reference_key_of(key)

    check()
