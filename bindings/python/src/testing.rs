//! Test hooks (`_kachedb_rust._test_*`): heap byte buffers exported through the
//! same DLPack path as daemon blocks, with a live count, so pytest can prove that
//! memory is shared and that its owner goes away exactly when the last view does.
//! Not public API.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use kachedb_client::ClientError;
use kachedb_shm::Status;

use crate::dlpack::DLPackBuffer;
use crate::errors::{
    self, BadHandle, Denied, Disconnected, InvalidArgument, KacheDBError, NotDurable, NotFound, OutOfMemory, TimedOut,
    TooLarge,
};

/// Number of [`TestStorage`] values alive. Relaxed is enough: it orders nothing
/// else, and the tests read it after the drops they check for (same thread, or
/// another thread joined or synchronised through the GIL).
static LIVE_TEST_BUFFERS: AtomicUsize = AtomicUsize::new(0);

/// Alignment of test allocations: the daemon's blocks are at least 64-byte aligned.
const ALIGN: usize = 64;

/// `n` heap bytes, 64-byte aligned, freed on drop. Stands in for a pinned block.
#[derive(Debug)]
struct TestStorage {
    data: NonNull<u8>,
    len: usize,
}

// SAFETY: TestStorage owns its allocation exclusively (like a Box<[u8]>); the bytes
// are only touched through DLPack consumers, never through `&TestStorage`.
unsafe impl Send for TestStorage {}
// SAFETY: `&TestStorage` gives no access to the bytes (see Send).
unsafe impl Sync for TestStorage {}

impl TestStorage {
    fn new(len: usize, fill: u8) -> PyResult<Self> {
        let data = if len == 0 {
            // No allocation, but a non-null, aligned address, as DLPack consumers want.
            NonNull::<[u8; ALIGN]>::dangling().cast::<u8>()
        } else {
            let layout = Layout::from_size_align(len, ALIGN)
                .map_err(|_| PyValueError::new_err(format!("{len} bytes is too large a test buffer")))?;
            // SAFETY: `layout` has a non-zero size.
            let ptr = unsafe { alloc::alloc(layout) };
            let Some(data) = NonNull::new(ptr) else {
                return Err(OutOfMemory::new_err(format!("cannot allocate a {len}-byte test buffer")));
            };
            // SAFETY: `data` was just allocated with room for `len` bytes.
            unsafe { data.as_ptr().write_bytes(fill, len) };
            data
        };
        LIVE_TEST_BUFFERS.fetch_add(1, Ordering::Relaxed);
        Ok(TestStorage { data, len })
    }
}

impl Drop for TestStorage {
    fn drop(&mut self) {
        if self.len != 0 {
            let layout = Layout::from_size_align(self.len, ALIGN).expect("validated in TestStorage::new");
            // SAFETY: allocated in TestStorage::new with this very layout, freed once.
            unsafe { alloc::dealloc(self.data.as_ptr(), layout) };
        }
        LIVE_TEST_BUFFERS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// `_test_buffer(n, fill=0, *, readonly=False)`: `n` bytes set to `fill`, as a
/// [`DLPackBuffer`] (exported as the daemon's blocks are: each capsule holds a
/// clone of the storage's `Arc`).
#[pyfunction]
#[pyo3(signature = (n, fill=0, *, readonly=false))]
pub fn _test_buffer(n: i64, fill: i64, readonly: bool) -> PyResult<DLPackBuffer> {
    let len = usize::try_from(n).map_err(|_| PyValueError::new_err(format!("n must be >= 0, got {n}")))?;
    let fill =
        u8::try_from(fill).map_err(|_| PyValueError::new_err(format!("fill must be a byte (0..=255), got {fill}")))?;
    let storage = Arc::new(TestStorage::new(len, fill)?);
    let data = storage.data;
    // SAFETY: the storage's allocation is valid for `len` bytes until the storage is
    // dropped, which happens only when the last clone of this Arc goes.
    Ok(unsafe { DLPackBuffer::new(data, len, storage, readonly) })
}

/// `_live_test_buffers()`: how many test buffers' memory is still allocated.
#[pyfunction]
pub fn _live_test_buffers() -> usize {
    LIVE_TEST_BUFFERS.load(Ordering::Relaxed)
}

/// `_raise_error(kind, msg)`: raises the `kachedb` exception class named `kind`
/// (the base `KacheDBError` for any other name) with message `msg`.
#[pyfunction]
pub fn _raise_error(kind: &str, msg: String) -> PyResult<()> {
    Err(match kind {
        "NotFound" => NotFound::new_err(msg),
        "OutOfMemory" => OutOfMemory::new_err(msg),
        "Disconnected" => Disconnected::new_err(msg),
        "InvalidArgument" => InvalidArgument::new_err(msg),
        "BadHandle" => BadHandle::new_err(msg),
        "TooLarge" => TooLarge::new_err(msg),
        "TimedOut" => TimedOut::new_err(msg),
        "Denied" => Denied::new_err(msg),
        "NotDurable" => NotDurable::new_err(msg),
        _ => KacheDBError::new_err(msg),
    })
}

/// `_raise_status(status, msg)`: raises what an operation answered with
/// completion `status` raises (the client's error for it, mapped by
/// [`errors::exception`]), with message `msg`. Status `OK` is not an error: it
/// raises `KacheDBError` saying so.
#[pyfunction]
pub fn _raise_status(status: u8, msg: String) -> PyResult<()> {
    let e = match Status::from_code(status) {
        Some(Status::Ok) => {
            return Err(KacheDBError::new_err(format!("{msg} (internal error: status OK reported as a failure)")))
        }
        Some(Status::NotFound) => ClientError::NotFound,
        Some(Status::OutOfMemory) => ClientError::OutOfMemory,
        Some(Status::Invalid) => ClientError::Invalid(String::new()),
        Some(Status::BadHandle) => ClientError::BadHandle,
        Some(Status::TooLarge) => ClientError::TooLarge(0),
        Some(Status::TimedOut) => ClientError::TimedOut(std::time::Duration::ZERO),
        Some(Status::Denied) => ClientError::Denied,
        Some(Status::NotDurable) => ClientError::NotDurable,
        Some(Status::Internal) | None => ClientError::Internal,
    };
    Err(errors::exception(&e, msg))
}
