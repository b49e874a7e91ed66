//! Rust -> Python errors.
//!
//! The exception classes are defined once, in Python (`kachedb/_errors.py`, so
//! that they pickle, subclass and document like any Python class), and imported
//! here as typed Rust exceptions. [`exception`] is the one mapping from the
//! client's errors to them; the client owns the mapping from completion status
//! codes to its errors.

use kachedb_client::ClientError;
use pyo3::PyErr;

pyo3::import_exception!(kachedb._errors, KacheDBError);
pyo3::import_exception!(kachedb._errors, NotFound);
pyo3::import_exception!(kachedb._errors, OutOfMemory);
pyo3::import_exception!(kachedb._errors, Disconnected);
pyo3::import_exception!(kachedb._errors, InvalidArgument);
pyo3::import_exception!(kachedb._errors, BadHandle);
pyo3::import_exception!(kachedb._errors, TooLarge);
pyo3::import_exception!(kachedb._errors, TimedOut);
pyo3::import_exception!(kachedb._errors, Denied);
pyo3::import_exception!(kachedb._errors, NotDurable);

/// The `kachedb` exception that names `e`, with message `msg`.
pub fn exception(e: &ClientError, msg: String) -> PyErr {
    match e {
        ClientError::NotFound => NotFound::new_err(msg),
        ClientError::OutOfMemory | ClientError::ClientLimit(_) | ClientError::TenantLimit(_) => {
            OutOfMemory::new_err(msg)
        }
        ClientError::TooLarge(_) => TooLarge::new_err(msg),
        ClientError::Invalid(_) => InvalidArgument::new_err(msg),
        ClientError::BadHandle => BadHandle::new_err(msg),
        ClientError::Disconnected(_) => Disconnected::new_err(msg),
        ClientError::TimedOut(_) => TimedOut::new_err(msg),
        ClientError::Denied => Denied::new_err(msg),
        ClientError::NotDurable => NotDurable::new_err(msg),
        ClientError::Internal | ClientError::Protocol(_) | ClientError::Region(_) | ClientError::Untrusted(_) => {
            KacheDBError::new_err(msg)
        }
    }
}

/// `e` as the `kachedb` exception that names it, with its message.
pub fn client_err(e: ClientError) -> PyErr {
    let msg = e.to_string();
    exception(&e, msg)
}
