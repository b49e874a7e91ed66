//! Rust -> Python errors. The exception classes are defined in Python
//! (`kachedb/_errors.py`, so that they pickle, subclass and document like any
//! Python class) and looked up here by name.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyModule, PyType};

/// Python module that defines the exception classes.
const ERRORS_MODULE: &str = "kachedb._errors";

/// `kachedb._errors`, imported once.
static ERRORS: GILOnceCell<Py<PyModule>> = GILOnceCell::new();

/// The exception classes of `kachedb._errors`, by name (`kind` in [`to_py_err`]).
pub const KINDS: [&str; 7] =
    ["KacheDBError", "NotFound", "OutOfMemory", "Disconnected", "InvalidArgument", "BadHandle", "TooLarge"];

/// The class `kachedb._errors.<kind>`; an unknown `kind` gives the base class
/// `KacheDBError`.
fn error_class<'py>(py: Python<'py>, kind: &str) -> PyResult<Bound<'py, PyType>> {
    let module = ERRORS.get_or_try_init(py, || py.import(ERRORS_MODULE).map(Bound::unbind))?;
    let name = if KINDS.contains(&kind) { kind } else { "KacheDBError" };
    Ok(module.bind(py).getattr(name)?.downcast_into::<PyType>()?)
}

/// A Python exception of class `kachedb.<kind>` (one of [`KINDS`]; anything else
/// becomes the base `kachedb.KacheDBError`) with message `msg`.
///
/// Takes the GIL if the caller does not hold it. If `kachedb._errors` cannot be
/// imported (a broken install), the result is a `RuntimeError` that says so and
/// carries `msg`.
pub fn to_py_err(kind: &str, msg: String) -> PyErr {
    Python::with_gil(|py| match error_class(py, kind) {
        Ok(class) => PyErr::from_type(class, msg),
        Err(import_err) => PyRuntimeError::new_err(format!(
            "{msg} (and the exception class kachedb.{kind} could not be loaded from {ERRORS_MODULE}: \
             {import_err}; reinstall the kachedb package)"
        )),
    })
}

/// Exception kind of a completion status code (`docs/PROTOCOL.md`, "Status codes").
/// `None` for `OK` (0).
pub const fn status_kind(status: u8) -> Option<&'static str> {
    match status {
        0 => None,
        1 => Some("NotFound"),
        2 => Some("OutOfMemory"),
        3 => Some("InvalidArgument"),
        4 => Some("BadHandle"),
        5 => Some("TooLarge"),
        // 6 = INTERNAL, and any code this build does not know.
        _ => Some("KacheDBError"),
    }
}

/// The Python exception for a non-OK completion `status`, with message `msg`
/// (status 0 is a caller bug and becomes `KacheDBError` too, saying so).
pub fn status_to_py_err(status: u8, msg: String) -> PyErr {
    match status_kind(status) {
        Some(kind) => to_py_err(kind, msg),
        None => to_py_err("KacheDBError", format!("{msg} (internal error: status OK reported as a failure)")),
    }
}
