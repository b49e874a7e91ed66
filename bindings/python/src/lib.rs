//! `kachedb._kachedb_rust`: the native half of the `kachedb` Python package.
//!
//! The Python half (`python/kachedb/`) re-exports what users need; this module is
//! private API. Today it holds the DLPack exporter and error mapping that the
//! client bindings will use, and test hooks (`_test_*`).

mod client;
mod dlpack;
mod errors;
mod testing;

use pyo3::prelude::*;

pub use dlpack::{u8_capsule, DLPackBuffer, DlOwner, DlpackFormat};
pub use errors::{status_kind, status_to_py_err, to_py_err};

#[pymodule]
fn _kachedb_rust(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<DLPackBuffer>()?;
    m.add_class::<client::NativeClient>()?;
    m.add_class::<client::NativeBlock>()?;
    m.add_class::<client::NativeReservation>()?;
    m.add_function(wrap_pyfunction!(client::cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(client::default_socket_path, m)?)?;
    m.add_function(wrap_pyfunction!(testing::_test_buffer, m)?)?;
    m.add_function(wrap_pyfunction!(testing::_live_test_buffers, m)?)?;
    m.add_function(wrap_pyfunction!(testing::_raise_error, m)?)?;
    m.add_function(wrap_pyfunction!(testing::_raise_status, m)?)?;
    Ok(())
}
