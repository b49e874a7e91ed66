//! `kachedb._kachedb_rust`: the native half of the `kachedb` Python package.
//!
//! The Python half (`python/kachedb/`) re-exports what users need; this module is
//! private API: the client classes (`client`), the one typed DLPack export of
//! blocks (`dlpack`), the client's errors as the
//! Python exception classes (`errors`), the dtype table and block limits (module
//! attributes), the default socket path, the key mapping (`key_of`), and, with the `testing` feature, test hooks (`_test_*`, `_raise_*`).

mod client;
mod dlpack;
mod errors;
#[cfg(feature = "testing")]
mod testing;

use dlpack::Reader;
use kachedb_shm::{DType, MAX_DIMS};
use pyo3::prelude::*;

#[pymodule]
fn _kachedb_rust(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The dtype table (docs/PROTOCOL.md, "DType codes"): (code, name, itemsize).
    let dtypes: Vec<(u8, &str, u64)> = DType::ALL.iter().map(|&d| (d as u8, d.name(), d.itemsize())).collect();
    m.add("DTYPES", dtypes)?;
    // The codes exported to torch as unsigned ints of their width (`DlDtype::of`).
    let torch_as_uint: Vec<u8> = DType::ALL.iter().filter(|&&d| !Reader::Torch.reads(d)).map(|&d| d as u8).collect();
    m.add("TORCH_AS_UINT", torch_as_uint)?;
    m.add("MAX_NDIM", MAX_DIMS)?;
    m.add("MAX_DIM", u32::MAX)?;
    // A DLPack shape is i64: no block export describes more bytes.
    m.add("MAX_NBYTES", i64::MAX)?;
    m.add_class::<dlpack::DLPackBuffer>()?;
    m.add_class::<client::NativeClient>()?;
    m.add_class::<client::NativeBlock>()?;
    m.add_class::<client::NativeReservation>()?;
    m.add_class::<client::NativeReservations>()?;
    m.add_function(wrap_pyfunction!(client::default_socket_path, m)?)?;
    m.add_function(wrap_pyfunction!(client::key_of_py, m)?)?;
    m.add_function(wrap_pyfunction!(client::commit_reservations, m)?)?;
    #[cfg(feature = "testing")]
    {
        m.add_function(wrap_pyfunction!(testing::_test_buffer, m)?)?;
        m.add_function(wrap_pyfunction!(testing::_live_test_buffers, m)?)?;
        m.add_function(wrap_pyfunction!(testing::_raise_error, m)?)?;
        m.add_function(wrap_pyfunction!(testing::_raise_status, m)?)?;
    }
    Ok(())
}
