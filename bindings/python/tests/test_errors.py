"""Exception classes, and the Rust side raising them (bindings/python/src/errors.rs)."""

import pickle

import pytest

import kachedb
from kachedb import _kachedb_rust as rust

BUILTIN_BASES = {
    "NotFound": KeyError,
    "OutOfMemory": MemoryError,
    "Disconnected": ConnectionError,
    "InvalidArgument": ValueError,
    "TooLarge": ValueError,
    "BadHandle": None,
    "TimedOut": TimeoutError,
    "Denied": PermissionError,
    "NotDurable": OSError,
}


@pytest.mark.parametrize("name,builtin", sorted(BUILTIN_BASES.items()))
def test_hierarchy(name, builtin):
    cls = getattr(kachedb, name)
    assert issubclass(cls, kachedb.KacheDBError)
    assert issubclass(cls, Exception)
    if builtin is not None:
        assert issubclass(cls, builtin)


def test_messages_are_plain_and_pickle():
    e = kachedb.NotFound("no block under key 0x12: put it first")
    assert str(e) == "no block under key 0x12: put it first"  # not quoted like KeyError
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is kachedb.NotFound and str(e2) == str(e)


@pytest.mark.parametrize("kind", ["KacheDBError", *sorted(BUILTIN_BASES)])
def test_rust_raises_the_python_classes(kind):
    with pytest.raises(getattr(kachedb, kind)) as info:
        rust._raise_error(kind, f"boom {kind}")
    assert type(info.value) is getattr(kachedb, kind)
    assert str(info.value) == f"boom {kind}"


def test_unknown_kind_is_the_base_class():
    with pytest.raises(kachedb.KacheDBError) as info:
        rust._raise_error("NoSuchKind", "msg")
    assert type(info.value) is kachedb.KacheDBError


@pytest.mark.parametrize(
    "status,cls",
    [
        (1, kachedb.NotFound),
        (2, kachedb.OutOfMemory),
        (3, kachedb.InvalidArgument),
        (4, kachedb.BadHandle),
        (5, kachedb.TooLarge),
        (6, kachedb.KacheDBError),  # INTERNAL
        (7, kachedb.TimedOut),
        (8, kachedb.Denied),
        (9, kachedb.NotDurable),
        (77, kachedb.KacheDBError),  # unknown
    ],
)
def test_status_codes(status, cls):
    with pytest.raises(cls) as info:
        rust._raise_status(status, "m")
    assert type(info.value) is cls
    assert str(info.value) == "m"


def test_status_ok_is_an_internal_error():
    with pytest.raises(kachedb.KacheDBError, match="internal error"):
        rust._raise_status(0, "m")


def test_not_found_is_caught_as_key_error():
    with pytest.raises(KeyError):
        rust._raise_error("NotFound", "missing")
