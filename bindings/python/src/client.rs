//! The native client classes behind `kachedb.Client`: thin wrappers over
//! `kachedb_client` that release the GIL while waiting on the ring and hand
//! blocks out as DLPack exporters whose owner keeps the pin.

use crate::dlpack::{tensor_capsule, DLPackBuffer, DlDtype, DlOwner, DlpackFormat};
use crate::errors::to_py_err;
use kachedb_client::{BlockView, ClientError, ConnectOptions, DType, Key, Shape};
use pyo3::prelude::*;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// Maps a client error to the `kachedb` exception that names it.
pub fn client_err(e: ClientError) -> PyErr {
    let kind = match &e {
        ClientError::NotFound => "NotFound",
        ClientError::OutOfMemory => "OutOfMemory",
        ClientError::TooLarge(_) => "TooLarge",
        ClientError::Invalid(_) => "InvalidArgument",
        ClientError::BadHandle => "BadHandle",
        ClientError::Disconnected(_) => "Disconnected",
        ClientError::Internal | ClientError::Protocol(_) | ClientError::Region(_) => "KacheDBError",
    };
    to_py_err(kind, e.to_string())
}

fn key(lo: u64, hi: u64) -> Key {
    Key::from_parts(lo, hi)
}

fn dtype(code: u8) -> PyResult<DType> {
    DType::from_code(code).ok_or_else(|| to_py_err("InvalidArgument", format!("unknown dtype code {code}")))
}

fn shape(dims: &[u64]) -> PyResult<Shape> {
    Shape::new(dims)
        .ok_or_else(|| to_py_err("InvalidArgument", format!("shape {dims:?}: at most 6 dims, each below 2**32")))
}

/// The DLPack element type a block is exported as to torch. float8 blocks go
/// out as `uint8` of the same shape (itemsize 1; DLPack before 1.1 has no
/// float8, and torch 2.1 reads none): Python views them as their dtype.
fn dl_dtype(dt: DType) -> DlDtype {
    const INT: u8 = 0;
    const UINT: u8 = 1;
    const FLOAT: u8 = 2;
    const BFLOAT: u8 = 4;
    const BOOL: u8 = 6;
    let (code, bits) = match dt {
        DType::U8 | DType::F8E4M3FN | DType::F8E5M2 => (UINT, 8),
        DType::I8 => (INT, 8),
        DType::I16 => (INT, 16),
        DType::I32 => (INT, 32),
        DType::I64 => (INT, 64),
        DType::F16 => (FLOAT, 16),
        DType::BF16 => (BFLOAT, 16),
        DType::F32 => (FLOAT, 32),
        DType::F64 => (FLOAT, 64),
        DType::Bool => (BOOL, 8),
    };
    DlDtype { code, bits }
}

/// An exported block: a DLPack capsule and the block's dtype code.
type Exported<'py> = (Bound<'py, PyAny>, u8);

/// A pinned block as a legacy DLPack capsule of its dtype and shape, whose
/// deleter releases the pin; with the block's dtype code.
fn block_capsule(py: Python<'_>, v: BlockView) -> PyResult<Exported<'_>> {
    let code = v.dtype() as u8;
    let dt = dl_dtype(v.dtype());
    let dims: Vec<u64> = v.shape().dims().iter().map(|&d| u64::from(d)).collect();
    let (len, ptr) = (v.len(), v.as_ptr() as *mut u8);
    let ptr = NonNull::new(ptr).ok_or_else(|| to_py_err("KacheDBError", "null view".into()))?;
    // SAFETY: the view is pinned (never evicted, moved or reused) and its mapping
    // kept alive for as long as it lives; the capsule's owner is the view itself.
    // Consumers may write through the tensor: readers must not (blocks are
    // immutable by contract).
    let cap = unsafe { tensor_capsule(py, ptr, len, dt, &dims, DlOwner::Rust(Box::new(v)), DlpackFormat::Legacy)? };
    Ok((cap, code))
}

/// Copies of at least this many bytes are split between threads.
const PARALLEL_COPY_MIN: usize = 32 << 20;
/// Each copying thread gets at least this many bytes.
const PARALLEL_COPY_CHUNK: usize = 16 << 20;
/// At most this many threads copy one block (a few saturate a socket's memory
/// bandwidth; torch's own `copy_` is multi-threaded, and a single `memcpy` reaches
/// about half of it).
const PARALLEL_COPY_MAX_THREADS: usize = 8;

/// How many threads copy `n` bytes: 1 below [`PARALLEL_COPY_MIN`], else up to one
/// per [`PARALLEL_COPY_CHUNK`], per available core, and [`PARALLEL_COPY_MAX_THREADS`].
fn copy_threads(n: usize) -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    if n < PARALLEL_COPY_MIN {
        return 1;
    }
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |c| c.get()));
    cores.min(PARALLEL_COPY_MAX_THREADS).min(n / PARALLEL_COPY_CHUNK).max(1)
}

/// `dst.copy_from_slice(src)`, split into page-aligned chunks that
/// [`copy_threads`] threads (this one included) take in turn. If a thread cannot
/// be started, the others copy its share.
fn parallel_copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "parallel_copy of slices of different lengths");
    let threads = copy_threads(src.len());
    if threads <= 1 {
        dst.copy_from_slice(src);
        return;
    }
    let chunk = src.len().div_ceil(threads).next_multiple_of(4096);
    let work = Mutex::new(dst.chunks_mut(chunk).zip(src.chunks(chunk)));
    let run = || loop {
        let next = work.lock().unwrap_or_else(std::sync::PoisonError::into_inner).next();
        match next {
            Some((d, s)) => d.copy_from_slice(s),
            None => break,
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..threads {
            if std::thread::Builder::new().name("kachedb-copy".into()).spawn_scoped(scope, run).is_err() {
                break;
            }
        }
        run();
    });
}

/// A raw readable byte range handed in from Python (a tensor's or array's data).
struct Src {
    address: usize,
    nbytes: usize,
}

impl Src {
    /// # Safety
    /// `address .. address + nbytes` is readable for the duration of the call
    /// that uses the slice (the Python caller holds the source object).
    unsafe fn slice(&self) -> &[u8] {
        if self.nbytes == 0 {
            return &[];
        }
        // SAFETY: the function's contract.
        unsafe { std::slice::from_raw_parts(self.address as *const u8, self.nbytes) }
    }
}

/// A connection to the daemon (private API: use `kachedb.connect`).
#[derive(Debug)]
#[pyclass(frozen, module = "kachedb._kachedb_rust", name = "NativeClient")]
pub struct NativeClient {
    inner: kachedb_client::Client,
    socket: String,
}

#[pymethods]
impl NativeClient {
    /// Connects to the daemon at `socket` (default: the instance's socket).
    #[staticmethod]
    #[pyo3(signature = (socket=None, instance=0))]
    fn connect(py: Python<'_>, socket: Option<PathBuf>, instance: u32) -> PyResult<Self> {
        let opts = ConnectOptions { socket, instance, ..Default::default() };
        let path = opts.socket_path().display().to_string();
        let inner = py.allow_threads(|| kachedb_client::Client::connect(&opts)).map_err(client_err)?;
        Ok(NativeClient { inner, socket: path })
    }

    /// The control socket path.
    #[getter]
    fn socket(&self) -> &str {
        &self.socket
    }

    /// The channel this client holds.
    #[getter]
    fn channel(&self) -> u32 {
        self.inner.channel()
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// (address, bytes) of the whole mapped region in this process.
    fn region_span(&self) -> (usize, u64) {
        (self.inner.region().base() as usize, self.inner.region().layout().region_len)
    }

    fn ping(&self, py: Python<'_>) -> PyResult<()> {
        py.allow_threads(|| self.inner.ping()).map_err(client_err)
    }

    /// Copies `nbytes` at `address` into a new block (one copy, GIL released;
    /// blocks of 32 MiB and more are copied by several threads).
    ///
    /// The caller must keep the source object alive and unmodified during the call.
    #[allow(clippy::too_many_arguments)] // the Python signature
    fn put_raw(
        &self,
        py: Python<'_>,
        lo: u64,
        hi: u64,
        code: u8,
        dims: Vec<u64>,
        address: usize,
        nbytes: usize,
    ) -> PyResult<()> {
        let (dt, sh) = (dtype(code)?, shape(&dims)?);
        let src = Src { address, nbytes };
        py.allow_threads(|| {
            // SAFETY: the Python caller holds the source for the whole call.
            let bytes = unsafe { src.slice() };
            if copy_threads(bytes.len()) <= 1 {
                return self.inner.put_tensor(key(lo, hi), dt, &sh, bytes);
            }
            let len = sh.len_bytes(dt).ok_or_else(|| ClientError::Invalid("shape times itemsize overflows".into()))?;
            if len != bytes.len() as u64 {
                return Err(ClientError::Invalid(format!(
                    "shape and dtype make {len} bytes but {} were given",
                    bytes.len()
                )));
            }
            // Same page offset as the source, as `put_tensor` asks for.
            let page_offset = (bytes.as_ptr() as u64 % 4096) & !63;
            let mut r = self.inner.reserve(key(lo, hi), dt, &sh, page_offset)?;
            parallel_copy(r.as_mut_slice(), bytes);
            r.commit()
        })
        .map_err(client_err)
    }

    /// Many `put_raw`s with one RESERVE batch and one COMMIT batch.
    fn put_many_raw(&self, py: Python<'_>, items: Vec<(u64, u64, u8, Vec<u64>, usize, usize)>) -> PyResult<()> {
        let mut parsed = Vec::with_capacity(items.len());
        for (lo, hi, code, dims, address, nbytes) in &items {
            parsed.push((key(*lo, *hi), dtype(*code)?, shape(dims)?, Src { address: *address, nbytes: *nbytes }));
        }
        py.allow_threads(|| {
            let tensors: Vec<_> = parsed
                .iter()
                // SAFETY: the Python caller holds every source for the whole call.
                .map(|(k, d, s, src)| (*k, *d, *s, unsafe { src.slice() }))
                .collect();
            self.inner.put_many_tensors(&tensors)
        })
        .map_err(client_err)
    }

    /// Reserves a block; returns a `NativeReservation` to write and commit.
    fn reserve(&self, py: Python<'_>, lo: u64, hi: u64, code: u8, dims: Vec<u64>) -> PyResult<NativeReservation> {
        let (dt, sh) = (dtype(code)?, shape(&dims)?);
        let r = py.allow_threads(|| self.inner.reserve(key(lo, hi), dt, &sh, 0)).map_err(client_err)?;
        let mut r = r;
        let ptr = NonNull::new(r.as_mut_ptr()).ok_or_else(|| to_py_err("KacheDBError", "null reservation".into()))?;
        let len = r.len();
        Ok(NativeReservation {
            inner: Mutex::new(Some(r)),
            region: self.inner.region().clone(),
            ptr: ptr.as_ptr() as usize,
            len,
        })
    }

    /// Pins `key`; `None` if absent.
    fn get(&self, py: Python<'_>, lo: u64, hi: u64) -> PyResult<Option<NativeBlock>> {
        let v = py.allow_threads(|| self.inner.get(key(lo, hi))).map_err(client_err)?;
        Ok(v.map(NativeBlock::new))
    }

    /// Pins `key` and exports it as a DLPack capsule (legacy `"dltensor"`, as
    /// torch reads it) of the block's dtype and shape, whose deleter releases the
    /// pin: `(capsule, dtype_code)`, or `None` if absent. float8 blocks come as
    /// `uint8` of the same shape (view them as their dtype). The fast path of
    /// `Client.get`.
    fn get_dlpack<'py>(&self, py: Python<'py>, lo: u64, hi: u64) -> PyResult<Option<Exported<'py>>> {
        let v = py.allow_threads(|| self.inner.get(key(lo, hi))).map_err(client_err)?;
        v.map(|v| block_capsule(py, v)).transpose()
    }

    /// `get_dlpack` of many keys in one batch.
    fn get_many_dlpack<'py>(&self, py: Python<'py>, keys: Vec<(u64, u64)>) -> PyResult<Vec<Option<Exported<'py>>>> {
        let keys: Vec<Key> = keys.iter().map(|&(lo, hi)| key(lo, hi)).collect();
        let v = py.allow_threads(|| self.inner.get_many(&keys)).map_err(client_err)?;
        v.into_iter().map(|b| b.map(|v| block_capsule(py, v)).transpose()).collect()
    }

    /// Pins many keys in one batch.
    fn get_many(&self, py: Python<'_>, keys: Vec<(u64, u64)>) -> PyResult<Vec<Option<NativeBlock>>> {
        let keys: Vec<Key> = keys.iter().map(|&(lo, hi)| key(lo, hi)).collect();
        let v = py.allow_threads(|| self.inner.get_many(&keys)).map_err(client_err)?;
        Ok(v.into_iter().map(|b| b.map(NativeBlock::new)).collect())
    }

    /// How many leading keys are present.
    fn lookup(&self, py: Python<'_>, keys: Vec<(u64, u64)>) -> PyResult<usize> {
        let keys: Vec<Key> = keys.iter().map(|&(lo, hi)| key(lo, hi)).collect();
        py.allow_threads(|| self.inner.lookup(&keys)).map_err(client_err)
    }

    fn delete(&self, py: Python<'_>, lo: u64, hi: u64) -> PyResult<bool> {
        py.allow_threads(|| self.inner.delete(key(lo, hi))).map_err(client_err)
    }

    /// The daemon's stats as a JSON string.
    fn stats_json(&self, py: Python<'_>) -> PyResult<String> {
        py.allow_threads(|| self.inner.stats()).map(|v| v.to_string()).map_err(client_err)
    }

    /// No new operations; the connection stays open while views live.
    fn close(&self) {
        self.inner.close();
    }

    /// In a forked child: drop the inherited connection without touching the
    /// parent's rings.
    fn forget_after_fork(&self) {
        self.inner.forget_after_fork();
    }
}

/// A pinned block (private API). `buffer()` exports it; the pin lives as long
/// as this object or any tensor made from the buffer.
#[derive(Debug)]
#[pyclass(frozen, module = "kachedb._kachedb_rust", name = "NativeBlock")]
pub struct NativeBlock {
    view: Arc<BlockView>,
}

impl NativeBlock {
    fn new(v: BlockView) -> Self {
        NativeBlock { view: Arc::new(v) }
    }
}

#[pymethods]
impl NativeBlock {
    #[getter]
    fn dtype_code(&self) -> u8 {
        self.view.dtype() as u8
    }
    #[getter]
    fn shape(&self) -> Vec<u64> {
        self.view.shape().dims().iter().map(|&d| u64::from(d)).collect()
    }
    #[getter]
    fn nbytes(&self) -> usize {
        self.view.len()
    }
    #[getter]
    fn address(&self) -> usize {
        self.view.as_ptr() as usize
    }
    /// A read-only DLPack exporter of the block's bytes, owning the pin.
    fn buffer(&self) -> PyResult<DLPackBuffer> {
        let ptr =
            NonNull::new(self.view.as_ptr() as *mut u8).ok_or_else(|| to_py_err("KacheDBError", "null view".into()))?;
        let owner: Arc<dyn std::any::Any + Send + Sync> = self.view.clone();
        // SAFETY: the view is pinned (never evicted, moved or reused) and its
        // mapping kept alive for as long as `owner` (an Arc of the view) lives.
        Ok(unsafe { DLPackBuffer::new(ptr, self.view.len(), owner, true) })
    }
}

/// An open reservation (private API).
#[derive(Debug)]
#[pyclass(frozen, module = "kachedb._kachedb_rust", name = "NativeReservation")]
pub struct NativeReservation {
    inner: Mutex<Option<kachedb_client::Reservation>>,
    region: Arc<kachedb_shm::Region>,
    ptr: usize,
    len: usize,
}

#[pymethods]
impl NativeReservation {
    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }
    /// A writable DLPack exporter of the reserved bytes. Write before commit:
    /// after commit the block is immutable and may be evicted, so tensors made
    /// from this buffer must not be written (the mapping stays valid).
    fn buffer(&self) -> PyResult<DLPackBuffer> {
        let ptr =
            NonNull::new(self.ptr as *mut u8).ok_or_else(|| to_py_err("KacheDBError", "null reservation".into()))?;
        let owner: Arc<dyn std::any::Any + Send + Sync> = self.region.clone();
        // SAFETY: the range lies in the region's mapping, which `owner` (an Arc of
        // the region) keeps mapped for as long as any tensor made from it lives.
        Ok(unsafe { DLPackBuffer::new(ptr, self.len, owner, false) })
    }
    fn commit(&self, py: Python<'_>) -> PyResult<()> {
        let r = self.take()?;
        py.allow_threads(|| r.commit()).map_err(client_err)
    }
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        let r = self.take()?;
        py.allow_threads(|| r.abort()).map_err(client_err)
    }
}

impl NativeReservation {
    fn take(&self) -> PyResult<kachedb_client::Reservation> {
        self.inner
            .lock()
            .ok()
            .and_then(|mut g| g.take())
            .ok_or_else(|| to_py_err("InvalidArgument", "the reservation was already committed or aborted".into()))
    }
}

/// Runs the `kachedb` command line (program name first) in this process.
#[pyfunction]
pub fn cli_main(py: Python<'_>, argv: Vec<String>) -> i32 {
    i32::from(py.allow_threads(|| kachedb_cli::main_with_args(argv)))
}

/// The default control socket path of `instance`.
#[pyfunction]
#[pyo3(signature = (instance=0))]
pub fn default_socket_path(instance: u32) -> String {
    kachedb_shm::naming::default_socket_path(instance).display().to_string()
}
