//! The native client classes behind `kachedb.Client`: thin wrappers over
//! `kachedb_client` that release the GIL while waiting on the ring and hand
//! blocks out as DLPack exporters whose owner keeps the pin.

use crate::dlpack::{tensor_capsule, DLPackBuffer, DlDtype, DlOwner, DlpackFormat, Reader};
use crate::errors::{client_err, InvalidArgument, KacheDBError};
use kachedb_client::{BlockMeta, BlockView, ConnectOptions, DType, Key, Reservation, Shape, Value};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyDict, PyInt, PyMemoryView, PyString};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// `2**128`, for Python ints outside `i128` (`key % 2**128`).
static KEY_MODULUS: GILOnceCell<Py<PyAny>> = GILOnceCell::new();

/// The 128-bit key of a Python key (`docs/PROTOCOL.md`, "Keys"; the reference
/// is `kachedb._keys.key_of`, tested against this on the same vectors): `bytes`
/// and `bytearray` hashed in place, a `memoryview` by its raw bytes (C order),
/// a `str` by its UTF-8 bytes, an `int` (not `bool`) modulo 2**128. Anything
/// else is a `TypeError`, a `str` with lone surrogates a `ValueError`.
fn key_of(obj: &Bound<'_, PyAny>) -> PyResult<Key> {
    if let Ok(b) = obj.downcast::<PyBytes>() {
        return Ok(Key::from_bytes(b.as_bytes()));
    }
    if let Ok(st) = obj.downcast::<PyString>() {
        return match st.to_cow() {
            Ok(st) => Ok(Key::from_str(&st)),
            Err(e) => Err(PyValueError::new_err(format!(
                "a str key must be encodable as UTF-8 (lone surrogates are not): {e}"
            ))),
        };
    }
    if obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>() {
        if let Ok(v) = obj.extract::<u128>() {
            return Ok(Key(v));
        }
        if let Ok(v) = obj.extract::<i128>() {
            return Ok(Key::from_i128_wrapping(v));
        }
        let py = obj.py();
        let m = KEY_MODULUS
            .get_or_try_init(py, || -> PyResult<Py<PyAny>> { Ok(PyInt::new(py, 1u8).lshift(128)?.unbind()) })?;
        // Python's % with a positive modulus is in [0, 2**128).
        return Ok(Key(obj.rem(m.bind(py))?.extract::<u128>()?));
    }
    if let Ok(b) = obj.downcast::<PyByteArray>() {
        // SAFETY: the GIL is held and no Python code runs while the bytes are
        // hashed, so nothing can resize or free the bytearray's buffer meanwhile.
        return Ok(Key::from_bytes(unsafe { b.as_bytes() }));
    }
    if obj.is_instance_of::<PyMemoryView>() {
        // The limited API has no buffer protocol: `tobytes()` gives the raw
        // bytes in C order, whatever the view's format and strides.
        let raw = obj.call_method0(pyo3::intern!(obj.py(), "tobytes"))?;
        return Ok(Key::from_bytes(raw.downcast::<PyBytes>()?.as_bytes()));
    }
    Err(PyTypeError::new_err(format!(
        "a KacheDB key must be bytes, bytearray, memoryview, str or int, not {} (hash other objects to bytes first)",
        obj.get_type().name()?
    )))
}

/// [`key_of`] of an optional key (`None`: none).
fn opt_key_of(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Key>> {
    match obj {
        Some(k) if !k.is_none() => key_of(k).map(Some),
        _ => Ok(None),
    }
}

/// [`key_of`] of every key of an iterable.
fn keys_of(keys: &Bound<'_, PyAny>) -> PyResult<Vec<Key>> {
    keys.try_iter()?.map(|k| key_of(&k?)).collect()
}

/// The parents of a batch (`None`, or an iterable of keys and `None`s, one per
/// block), as the Rust client takes them (empty: no parents).
fn parents_of(parents: Option<&Bound<'_, PyAny>>, count: usize) -> PyResult<Vec<Option<Key>>> {
    let Some(parents) = parents else { return Ok(Vec::new()) };
    let v: Vec<Option<Key>> = parents
        .try_iter()?
        .map(|p| p.and_then(|p| if p.is_none() { Ok(None) } else { key_of(&p).map(Some) }))
        .collect::<PyResult<_>>()?;
    if v.len() != count {
        return Err(InvalidArgument::new_err(format!("{} parents for {count} keys: give one per key", v.len())));
    }
    Ok(v)
}

/// A source block of `put_many`: its dtype, shape and bytes.
struct SrcBlock {
    key: Key,
    dtype: DType,
    shape: Shape,
    src: Src,
}

fn dtype(code: u8) -> PyResult<DType> {
    DType::from_code(code).ok_or_else(|| InvalidArgument::new_err(format!("unknown dtype code {code}")))
}

fn shape(dims: &[u64]) -> PyResult<Shape> {
    Shape::new(dims)
        .ok_or_else(|| InvalidArgument::new_err(format!("shape {dims:?}: at most 6 dims, each below 2**32")))
}

/// An exported block: a DLPack capsule and the block's dtype code.
type Exported<'py> = (Bound<'py, PyAny>, u8);

/// A pinned block as a legacy DLPack capsule of its dtype (as torch reads it:
/// [`DlDtype::of`]) and shape, whose deleter releases the pin; with the block's
/// dtype code.
fn block_capsule(py: Python<'_>, v: BlockView) -> PyResult<Exported<'_>> {
    let code = v.dtype() as u8;
    let dt = DlDtype::of(v.dtype(), Reader::Torch);
    let dims: Vec<u64> = v.shape().dims().iter().map(|&d| u64::from(d)).collect();
    let (len, ptr) = (v.len(), v.as_ptr() as *mut u8);
    let ptr = NonNull::new(ptr).ok_or_else(|| KacheDBError::new_err("null view"))?;
    // SAFETY: the view is pinned (never evicted, moved or reused) and its mapping
    // kept alive for as long as it lives; the capsule's owner is the view itself.
    // Consumers may write through the tensor: readers must not (blocks are
    // immutable by contract).
    let cap = unsafe { tensor_capsule(py, ptr, len, dt, &dims, DlOwner::Rust(Box::new(v)), DlpackFormat::Legacy)? };
    Ok((cap, code))
}

/// What turns an exported block into a `kachedb._views.KVView` without a
/// Python frame: `kachedb._views._view_factory()`, read once.
struct ViewFactory {
    /// torch's DLPack import (`torch._C._from_dlpack`).
    from_dlpack: Py<PyAny>,
    /// `KVView`, assigned as the imported tensor's `__class__`.
    view_class: Py<PyAny>,
    /// `_as_torch_dtype(t, code)`: views an export that arrived as unsigned
    /// ints as its dtype (float8).
    convert: Py<PyAny>,
    /// By dtype code: whether torch imports the export as the block's own dtype.
    direct: Vec<bool>,
}

static VIEW_FACTORY: GILOnceCell<ViewFactory> = GILOnceCell::new();

impl ViewFactory {
    fn get(py: Python<'_>) -> PyResult<&ViewFactory> {
        VIEW_FACTORY.get_or_try_init(py, || -> PyResult<ViewFactory> {
            let (from_dlpack, view_class, convert, direct) =
                py.import("kachedb._views")?.getattr("_view_factory")?.call0()?.extract()?;
            Ok(ViewFactory { from_dlpack, view_class, convert, direct })
        })
    }

    /// `t` re-typed as `KVView` (the fresh tensor object itself, or an alias
    /// of it where torch refuses the re-typing).
    fn retype<'py>(&self, py: Python<'py>, t: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let cls = self.view_class.bind(py);
        // Re-typing the fresh tensor object costs ~0.2 us, a subclass alias
        // (for a torch that refuses the re-typing) ~2 us; both share the
        // import's storage, so its deleter still runs with the last view.
        if t.setattr(pyo3::intern!(py, "__class__"), cls).is_err() {
            return cls.call_method1(pyo3::intern!(py, "_make_subclass"), (cls, t, false));
        }
        Ok(t)
    }

    /// The pinned blocks `views` as `KVView`s, in their order, sharing their
    /// pins: each view is its own DLPack export (of its own block, made as
    /// `view` makes it) whose owner is a reference to one `PinGroup` holding
    /// every block of the call. The last of the views (and of the tensors
    /// derived from them) to go releases all the pins, in one post.
    fn shared_views<'py>(&self, py: Python<'py>, views: Vec<BlockView>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        if views.len() <= 1 {
            return views.into_iter().map(|v| self.view(py, v)).collect();
        }
        let group = Arc::new(PinGroup(views));
        if let Some(out) = self.evenly_spaced_views(py, &group)? {
            return Ok(out);
        }
        let mut out = Vec::with_capacity(group.0.len());
        for v in &group.0 {
            let dims: Vec<u64> = v.shape().dims().iter().map(|&d| u64::from(d)).collect();
            let ptr = NonNull::new(v.as_ptr() as *mut u8).ok_or_else(|| KacheDBError::new_err("null view"))?;
            let owner = DlOwner::Rust(Box::new(Arc::clone(&group)));
            let dt = DlDtype::of(v.dtype(), Reader::Torch);
            // SAFETY: the block is pinned (never evicted, moved or reused) and
            // its mapping kept alive while `group` lives, which the capsule's
            // owner (a reference to it) keeps alive. Consumers may write through
            // the tensor: readers must not (blocks are immutable by contract).
            let cap = unsafe { tensor_capsule(py, ptr, v.len(), dt, &dims, owner, DlpackFormat::Legacy)? };
            let mut t = self.from_dlpack.bind(py).call1((cap,))?;
            let code = v.dtype() as u8;
            if !self.direct.get(usize::from(code)).copied().unwrap_or(false) {
                t = self.convert.bind(py).call1((t, code))?;
            }
            out.push(self.retype(py, t)?);
        }
        Ok(out)
    }

    /// `shared_views` of blocks laid out evenly — one dtype torch imports as
    /// its own, one shape, addresses a fixed stride apart in the call's order
    /// (the rows of one tensor put by one `put_many`, a reservation's blocks
    /// written in place; a block takes its source's offset in a page, so the
    /// blocks of separate tensors lie unevenly) — made from one
    /// export of their span: `as_strided` to `(n, *shape)`, then `unbind(0)`,
    /// so torch makes the n views in one call. They share the span's storage,
    /// whose owner holds `group`. `None` where the blocks are not so laid out.
    fn evenly_spaced_views<'py>(
        &self,
        py: Python<'py>,
        group: &Arc<PinGroup>,
    ) -> PyResult<Option<Vec<Bound<'py, PyAny>>>> {
        let blocks = &group.0;
        let (first, n) = (&blocks[0], blocks.len());
        let (dtype, len) = (first.dtype(), first.len());
        let item = dtype.itemsize() as usize;
        if !self.direct.get(usize::from(dtype as u8)).copied().unwrap_or(false) || len == 0 || len % item != 0 {
            return Ok(None);
        }
        let base = first.as_ptr() as usize;
        // A stride of at least a block: the views do not overlap.
        let stride = (blocks[1].as_ptr() as usize).wrapping_sub(base);
        if stride < len || stride % item != 0 || stride > isize::MAX as usize / n {
            return Ok(None);
        }
        let even = blocks.iter().enumerate().all(|(i, v)| {
            v.dtype() == dtype
                && v.len() == len
                && v.shape() == first.shape()
                && v.as_ptr() as usize == base + i * stride
        });
        if !even {
            return Ok(None);
        }
        let span = (n - 1) * stride + len;
        let ptr = NonNull::new(base as *mut u8).ok_or_else(|| KacheDBError::new_err("null view"))?;
        let owner = DlOwner::Rust(Box::new(Arc::clone(group)));
        let dt = DlDtype::of(dtype, Reader::Torch);
        // SAFETY: the span runs from the first block to the end of the last,
        // inside this client's mapping of the region, which `group` (the
        // capsule's owner) keeps mapped along with the blocks' pins. The
        // views made from it cover only the pinned blocks; the bytes between
        // them are part of the storage, not of any view.
        let cap = unsafe { tensor_capsule(py, ptr, span, dt, &[(span / item) as u64], owner, DlpackFormat::Legacy)? };
        let whole = self.from_dlpack.bind(py).call1((cap,))?;
        let dims: Vec<u64> = first.shape().dims().iter().map(|&d| u64::from(d)).collect();
        let mut size = Vec::with_capacity(dims.len() + 1);
        size.push(n as u64);
        size.extend_from_slice(&dims);
        // Row-major strides of one block, in elements, after the stride between blocks.
        let mut strides = vec![0u64; dims.len() + 1];
        strides[0] = (stride / item) as u64;
        let mut s = 1u64;
        for (i, &d) in dims.iter().enumerate().rev() {
            strides[i + 1] = s;
            s = s.saturating_mul(d.max(1));
        }
        let stacked = whole.call_method1(pyo3::intern!(py, "as_strided"), (size, strides))?;
        let parts = stacked.call_method1(pyo3::intern!(py, "unbind"), (0,))?;
        let mut out = Vec::with_capacity(n);
        for t in parts.try_iter()? {
            out.push(self.retype(py, t?)?);
        }
        Ok(Some(out))
    }

    /// The pinned block `v` as a `KVView` (as `kachedb._views.block_tensor`
    /// makes it): the import's deleter holds the pin.
    fn view<'py>(&self, py: Python<'py>, v: BlockView) -> PyResult<Bound<'py, PyAny>> {
        let (cap, code) = block_capsule(py, v)?;
        let mut t = self.from_dlpack.bind(py).call1((cap,))?;
        if !self.direct.get(usize::from(code)).copied().unwrap_or(false) {
            t = self.convert.bind(py).call1((t, code))?;
        }
        self.retype(py, t)
    }
}

/// The pins of the blocks of one `get_prefix` (`ViewFactory::shared_views`):
/// released together, in one post, when the last export holding it is freed.
struct PinGroup(Vec<BlockView>);

impl Drop for PinGroup {
    fn drop(&mut self) {
        BlockView::release_all(std::mem::take(&mut self.0));
    }
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

/// The ranges `(addresses[i], lengths[i])`, each inside the address space
/// (no wrap-around) and not at address 0 unless empty.
fn raw_ranges(addresses: &[usize], lengths: &[usize]) -> PyResult<Vec<Src>> {
    if addresses.len() != lengths.len() {
        return Err(InvalidArgument::new_err(format!(
            "{} addresses but {} lengths: give one length per range",
            addresses.len(),
            lengths.len()
        )));
    }
    addresses
        .iter()
        .zip(lengths)
        .map(|(&address, &nbytes)| {
            if nbytes > 0 && (address == 0 || address.checked_add(nbytes).is_none_or(|end| end > isize::MAX as usize)) {
                return Err(InvalidArgument::new_err(format!("no memory of {nbytes} bytes at {address:#x}")));
            }
            Ok(Src { address, nbytes })
        })
        .collect()
}

/// Refuses destination ranges that overlap one another or `region`
/// (`(address, bytes)`): writing them would alias.
fn check_disjoint(ranges: &[Src], region: (usize, usize)) -> PyResult<()> {
    let mut spans: Vec<(usize, usize)> =
        ranges.iter().filter(|r| r.nbytes > 0).map(|r| (r.address, r.address + r.nbytes)).collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(InvalidArgument::new_err(format!(
                "destination ranges overlap: {:#x}..{:#x} and {:#x}..{:#x}",
                w[0].0, w[0].1, w[1].0, w[1].1
            )));
        }
    }
    let (lo, hi) = (region.0, region.0 + region.1);
    if let Some(&(a, b)) = spans.iter().find(|&&(a, b)| a < hi && lo < b) {
        return Err(InvalidArgument::new_err(format!(
            "destination range {a:#x}..{b:#x} lies in KacheDB's shared memory: copy into private memory"
        )));
    }
    Ok(())
}

/// Refuses ranges that overlap one of `spans` (`(address, bytes)`, sorted
/// and disjoint: reservations being written).
fn check_apart(ranges: &[Src], spans: &[(usize, usize)]) -> PyResult<()> {
    for r in ranges.iter().filter(|r| r.nbytes > 0) {
        let end = r.address + r.nbytes;
        // The last span starting before `end` is the only one that can reach
        // past `r.address`: the spans are disjoint and sorted.
        let i = spans.partition_point(|&(a, _)| a < end);
        if let Some(&(a, n)) = i.checked_sub(1).map(|i| &spans[i]) {
            if a + n > r.address {
                return Err(InvalidArgument::new_err(format!(
                    "source range {:#x}..{end:#x} overlaps a reservation being written ({a:#x}..{:#x})",
                    r.address,
                    a + n
                )));
            }
        }
    }
    Ok(())
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
    /// Connects to the daemon at `socket` (default: the instance's socket),
    /// trusting a daemon of `trust_uid` besides this process's uid and root,
    /// as a client of `tenant` (default: the daemon's default tenant).
    #[staticmethod]
    #[pyo3(signature = (socket=None, instance=0, trust_uid=None, tenant=None))]
    fn connect(
        py: Python<'_>,
        socket: Option<PathBuf>,
        instance: u32,
        trust_uid: Option<u32>,
        tenant: Option<String>,
    ) -> PyResult<Self> {
        let opts = ConnectOptions { socket, instance, trust_uid, tenant, ..Default::default() };
        let path = opts.socket_path().display().to_string();
        let inner = py.allow_threads(|| kachedb_client::Client::connect(&opts)).map_err(client_err)?;
        Ok(NativeClient { inner, socket: path })
    }

    /// The control socket path.
    #[getter]
    fn socket(&self) -> &str {
        &self.socket
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

    /// Copies `nbytes` at `address` into a new block: one copy, GIL released,
    /// by several threads for large blocks (`kachedb_client::copy`).
    ///
    /// The caller must keep the source object alive and unmodified during the call.
    /// `parent`: the key of the block this one follows in a chain, or `None`.
    #[allow(clippy::too_many_arguments)] // the Python signature
    #[pyo3(signature = (key, code, dims, address, nbytes, parent=None))]
    fn put(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        code: u8,
        dims: Vec<u64>,
        address: usize,
        nbytes: usize,
        parent: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (k, parent) = (key_of(key)?, opt_key_of(parent)?);
        let (dt, sh) = (dtype(code)?, shape(&dims)?);
        let src = Src { address, nbytes };
        py.allow_threads(|| {
            // SAFETY: the Python caller holds the source for the whole call.
            let bytes = unsafe { src.slice() };
            self.inner.put(k, Value::tensor(dt, sh, bytes).parent(parent))
        })
        .map_err(client_err)
    }

    /// `put_many` in one native call: `keys` (any iterable of keys) and
    /// `values` (a list). A contiguous CPU torch tensor is read here
    /// (`data_ptr`, `dtype` through `codes`, a dict from torch dtypes to codes,
    /// `shape`, `nbytes`); any other value goes through `source(value)`, which
    /// returns `(code, shape, address, nbytes, keepalive)`. Then one RESERVE
    /// batch, the copies (GIL released, threads for large batches), one COMMIT
    /// batch; all or nothing. `parents`: one key (or `None`) per block.
    #[pyo3(signature = (keys, values, codes, source, parents=None))]
    fn put_many(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        codes: &Bound<'_, PyDict>,
        source: &Bound<'_, PyAny>,
        parents: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let keys = keys_of(keys)?;
        let parents = parents_of(parents, keys.len())?;
        let values: Vec<Bound<'_, PyAny>> = values.try_iter()?.collect::<PyResult<_>>()?;
        if keys.len() != values.len() {
            return Err(InvalidArgument::new_err(format!(
                "put_many got {} keys but {} values",
                keys.len(),
                values.len()
            )));
        }
        let mut blocks = Vec::with_capacity(values.len());
        // Temporaries made by `source` (contiguous copies...), alive until the copies are done.
        let mut keep = Vec::new();
        for (key, v) in keys.into_iter().zip(&values) {
            // A torch dtype in `codes` and a contiguous CPU tensor; anything else
            // (or any attribute missing) goes through `source`.
            let is = |name: &Bound<'_, PyString>, call: bool| -> bool {
                let r = if call { v.call_method0(name) } else { v.getattr(name) };
                r.and_then(|x| x.is_truthy()).unwrap_or(false)
            };
            let fast = match v.getattr(pyo3::intern!(py, "dtype")).and_then(|dt| codes.get_item(dt)) {
                Ok(Some(code))
                    if is(pyo3::intern!(py, "is_cpu"), false) && is(pyo3::intern!(py, "is_contiguous"), true) =>
                {
                    code.extract::<u8>().ok()
                }
                _ => None,
            };
            let (code, dims, address, nbytes): (u8, Vec<u64>, usize, usize) = match fast {
                Some(code) => (
                    code,
                    v.getattr(pyo3::intern!(py, "shape"))?.extract()?,
                    v.call_method0(pyo3::intern!(py, "data_ptr"))?.extract()?,
                    v.getattr(pyo3::intern!(py, "nbytes"))?.extract()?,
                ),
                None => {
                    let got = source.call1((v,))?;
                    let (code, dims, address, nbytes, ka): (u8, Vec<u64>, usize, usize, Bound<'_, PyAny>) =
                        got.extract()?;
                    keep.push(ka);
                    (code, dims, address, nbytes)
                }
            };
            blocks.push(SrcBlock { key, dtype: dtype(code)?, shape: shape(&dims)?, src: Src { address, nbytes } });
        }
        py.allow_threads(|| {
            let parent = |i: usize| parents.get(i).copied().flatten();
            let values: Vec<_> = blocks
                .iter()
                .enumerate()
                // SAFETY: the caller's `values` (and `keep`) hold every source for the whole call.
                .map(|(i, b)| (b.key, Value::tensor(b.dtype, b.shape, unsafe { b.src.slice() }).parent(parent(i))))
                .collect();
            self.inner.put_many(&values)
        })
        .map_err(client_err)?;
        drop(keep);
        Ok(())
    }

    /// Stores one block of dtype `code` and shape `dims` per key, each
    /// gathered from `len(addresses) / len(keys)` raw byte ranges
    /// (`addresses[i]`, `lengths[i]`) in order: one RESERVE batch, the copies
    /// (GIL released, threads for large batches), one COMMIT batch; all or
    /// nothing (`Client::put_ranges`). `parents`: one key (or `None`)
    /// per block.
    ///
    /// The caller vouches that every range is readable memory of this process
    /// that stays alive and unmodified during the call.
    #[allow(clippy::too_many_arguments)] // the Python signature
    #[pyo3(signature = (keys, code, dims, addresses, lengths, parents=None))]
    fn put_ranges(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        code: u8,
        dims: Vec<u64>,
        addresses: Vec<usize>,
        lengths: Vec<usize>,
        parents: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (dt, sh) = (dtype(code)?, shape(&dims)?);
        let keys = keys_of(keys)?;
        let parents = parents_of(parents, keys.len())?;
        let ranges = raw_ranges(&addresses, &lengths)?;
        py.allow_threads(|| {
            // SAFETY: the Python caller vouches for every range for the whole call.
            let sources: Vec<&[u8]> = ranges.iter().map(|r| unsafe { r.slice() }).collect();
            self.inner.put_ranges(&keys, dt, &sh, &sources, &parents)
        })
        .map_err(client_err)
    }

    /// Pins the leading present keys of `keys` and copies each block (GIL
    /// released, threads for large batches) into `len(addresses) / len(keys)`
    /// raw byte ranges in order, then releases the pins together; stops at the
    /// first missing key or block that is not of dtype `code` and
    /// `block_len` bytes. Returns how many blocks were copied
    /// (`Client::get_prefix_into`).
    ///
    /// The caller vouches that every range is writable memory of this process
    /// that nothing else touches during the call; ranges that overlap one
    /// another or the shared region are refused (`InvalidArgument`, nothing
    /// asked of the daemon).
    #[pyo3(signature = (keys, code, block_len, addresses, lengths))]
    fn get_prefix_into(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        code: u8,
        block_len: usize,
        addresses: Vec<usize>,
        lengths: Vec<usize>,
    ) -> PyResult<usize> {
        let dt = dtype(code)?;
        let keys = keys_of(keys)?;
        let ranges = raw_ranges(&addresses, &lengths)?;
        let (base, region_len) = self.region_span();
        check_disjoint(&ranges, (base, region_len as usize))?;
        py.allow_threads(|| {
            let mut dests: Vec<&mut [u8]> = ranges
                .iter()
                .map(|r| {
                    if r.nbytes == 0 {
                        return &mut [][..];
                    }
                    // SAFETY: the Python caller vouches that the range is writable
                    // and untouched by anyone else for the whole call; the ranges
                    // are disjoint from one another and from the shared region
                    // (`check_disjoint`), so no two slices alias, and none aliases
                    // a block the copies read.
                    unsafe { std::slice::from_raw_parts_mut(r.address as *mut u8, r.nbytes) }
                })
                .collect();
            self.inner.get_prefix_into(&keys, dt, block_len, &mut dests)
        })
        .map_err(client_err)
    }

    /// Reserves one block per key, each `dims` of dtype `code`, in one batch;
    /// all or nothing. Returns a `NativeReservations` to write and commit.
    /// `parents`: one key (or `None`) per block, sent with the COMMITs.
    #[pyo3(signature = (keys, code, dims, parents=None))]
    fn reserve_many(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        code: u8,
        dims: Vec<u64>,
        parents: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<NativeReservations> {
        let (dt, sh) = (dtype(code)?, shape(&dims)?);
        let keys = keys_of(keys)?;
        let parents = parents_of(parents, keys.len())?;
        let items: Vec<_> = keys.into_iter().map(|k| (k, dt, sh, 0)).collect();
        let rs = py.allow_threads(|| self.inner.reserve_many_with_parents(&items, &parents)).map_err(client_err)?;
        Ok(NativeReservations { extents: std::mem::ManuallyDrop::new(ReservedExtents::new(rs)), code, dims })
    }

    /// Reserves `count` blocks, each `dims` of dtype `code`, in one batch,
    /// all with key 0 (their keys are named when they are committed:
    /// `commit_reservations`); all or nothing. Each is a `NativeReservation`
    /// of its own, finished on its own.
    fn reserve_each(&self, py: Python<'_>, count: usize, code: u8, dims: Vec<u64>) -> PyResult<Vec<NativeReservation>> {
        let (dt, sh) = (dtype(code)?, shape(&dims)?);
        let items: Vec<_> = (0..count).map(|_| (Key(0), dt, sh, 0)).collect();
        let rs = py.allow_threads(|| self.inner.reserve_many_with_parents(&items, &[])).map_err(client_err)?;
        rs.into_iter()
            .map(|mut r| {
                let ptr = NonNull::new(r.as_mut_ptr()).ok_or_else(|| KacheDBError::new_err("null reservation"))?;
                let len = r.len();
                Ok(NativeReservation {
                    extents: std::mem::ManuallyDrop::new(ReservedExtents::new(vec![r])),
                    ptr: ptr.as_ptr() as usize,
                    len,
                })
            })
            .collect()
    }

    /// Waits (GIL released) until `key` is committed, then returns it as
    /// `get_view` does. `timeout` in seconds (`None`: no deadline);
    /// `TimedOut` when it passes.
    #[pyo3(signature = (key, timeout=None))]
    fn wait_for_view<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let k = key_of(key)?;
        let timeout = match timeout {
            None => None,
            Some(t) if t.is_finite() && t >= 0.0 => Some(Duration::try_from_secs_f64(t).unwrap_or(Duration::MAX)),
            Some(t) if t == f64::INFINITY => None,
            Some(t) => return Err(InvalidArgument::new_err(format!("timeout must be >= 0 seconds or None, got {t}"))),
        };
        let factory = ViewFactory::get(py)?;
        let v = py.allow_threads(|| self.inner.wait_for(k, timeout)).map_err(client_err)?;
        factory.view(py, v)
    }

    /// Unlinks many keys in one batch; how many were present.
    fn delete_many(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys = keys_of(keys)?;
        py.allow_threads(|| self.inner.delete_many(&keys)).map_err(client_err)
    }

    /// Reserves a block; returns a `NativeReservation` to write and commit
    /// (naming `parent`, a key or `None`, as the block it follows).
    #[pyo3(signature = (key, code, dims, parent=None))]
    fn reserve(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        code: u8,
        dims: Vec<u64>,
        parent: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<NativeReservation> {
        let (k, parent) = (key_of(key)?, opt_key_of(parent)?);
        let (dt, sh) = (dtype(code)?, shape(&dims)?);
        let mut r = py.allow_threads(|| self.inner.reserve(k, dt, &sh, 0)).map_err(client_err)?;
        r.set_parent(parent);
        let ptr = NonNull::new(r.as_mut_ptr()).ok_or_else(|| KacheDBError::new_err("null reservation"))?;
        let len = r.len();
        Ok(NativeReservation {
            extents: std::mem::ManuallyDrop::new(ReservedExtents::new(vec![r])),
            ptr: ptr.as_ptr() as usize,
            len,
        })
    }

    /// Pins `key`; `None` if absent. (`get_numpy`'s path: the block's bytes
    /// without torch.)
    fn get(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Option<NativeBlock>> {
        let k = key_of(key)?;
        let v = py.allow_threads(|| self.inner.get(k)).map_err(client_err)?;
        Ok(v.map(NativeBlock::new))
    }

    /// `kc.get(key)` in one call: maps `key` (as `key_of`), pins the block
    /// (GIL released while waiting) and returns it as a `kachedb._views.KVView`
    /// whose last view releases the pin; `None` if absent.
    fn get_view<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let k = key_of(key)?;
        let factory = ViewFactory::get(py)?;
        let v = py.allow_threads(|| self.inner.get(k)).map_err(client_err)?;
        v.map(|v| factory.view(py, v)).transpose()
    }

    /// `get_view` of many keys (any iterable of keys) in one batch: a list with
    /// `None` for each absent key.
    fn get_many_views<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<Option<Bound<'py, PyAny>>>> {
        let keys = keys_of(keys)?;
        let factory = ViewFactory::get(py)?;
        let v = py.allow_threads(|| self.inner.get_many(&keys)).map_err(client_err)?;
        v.into_iter().map(|b| b.map(|v| factory.view(py, v)).transpose()).collect()
    }

    /// Pins the leading present keys of `keys` in one round trip; each a
    /// `KVView`. With `pin_each`, each made as `get_view` makes it (holding
    /// its own pin); else (`ViewFactory::shared_views`) the views share their
    /// pins, released together when the last of them goes.
    #[pyo3(signature = (keys, pin_each=false))]
    fn get_prefix_views<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        pin_each: bool,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let keys = keys_of(keys)?;
        let factory = ViewFactory::get(py)?;
        let v = py.allow_threads(|| self.inner.get_prefix(&keys)).map_err(client_err)?;
        if pin_each {
            v.into_iter().map(|v| factory.view(py, v)).collect()
        } else {
            factory.shared_views(py, v)
        }
    }

    /// How many leading keys (any iterable of keys) are present.
    fn lookup(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys = keys_of(keys)?;
        py.allow_threads(|| self.inner.lookup(&keys)).map_err(client_err)
    }

    /// Unlinks `key`; whether it was present.
    fn delete(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let k = key_of(key)?;
        py.allow_threads(|| self.inner.delete(k)).map_err(client_err)
    }

    /// The daemon's stats as a JSON string.
    fn stats_json(&self, py: Python<'_>) -> PyResult<String> {
        py.allow_threads(|| self.inner.stats()).map(|s| s.to_json()).map_err(client_err)
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
    /// Dropped by hand, with the GIL released (see `Drop`).
    view: std::mem::ManuallyDrop<Arc<BlockView>>,
}

impl NativeBlock {
    fn new(v: BlockView) -> Self {
        NativeBlock { view: std::mem::ManuallyDrop::new(Arc::new(v)) }
    }
}

impl Drop for NativeBlock {
    fn drop(&mut self) {
        // SAFETY: `view` is taken exactly once, here, and `self` is not used after.
        let view = unsafe { std::mem::ManuallyDrop::take(&mut self.view) };
        // Dropping the last Arc releases the pin, which may wait for room on
        // the submission ring: never with the GIL held.
        crate::dlpack::drop_without_gil(view);
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
    /// A read-only DLPack exporter of the block's bytes, owning the pin
    /// (`typed(dtype_code, shape)` exports it as the block).
    fn buffer(&self) -> PyResult<DLPackBuffer> {
        let ptr = NonNull::new(self.view.as_ptr() as *mut u8).ok_or_else(|| KacheDBError::new_err("null view"))?;
        let view: Arc<BlockView> = Arc::clone(&self.view);
        let owner: Arc<dyn std::any::Any + Send + Sync> = view;
        // SAFETY: the view is pinned (never evicted, moved or reused) and its
        // mapping kept alive for as long as `owner` (an Arc of the view) lives.
        Ok(unsafe { DLPackBuffer::new(ptr, self.view.len(), owner, true) })
    }
}

/// What a reservation's exported tensors keep alive: its extent, out of
/// eviction and reuse for as long as the reservation object or any tensor made
/// from it lives. Shared (an `Arc`) by the native reservation object and every
/// DLPack export; dropping the last one drops what it holds (an open
/// reservation sends its ABORT, a pinned view its RELEASE), with the GIL
/// released ([`drop_without_gil`](crate::dlpack::drop_without_gil)).
#[derive(Debug, Default)]
pub(crate) struct ReservedExtents {
    state: Mutex<Extents>,
}

/// A block metadata record as the package passes it: `(block_hash,
/// parent_hash, block_size, token_ids, lora_id, lora_name)`
/// (`kachedb.BlockMeta`).
type MetaTuple = (u64, Option<u64>, u32, Vec<u32>, Option<u32>, Option<String>);

fn meta_of_tuple((block_hash, parent_hash, block_size, token_ids, lora_id, lora_name): MetaTuple) -> BlockMeta {
    BlockMeta { block_hash, parent_hash, block_size, token_ids, lora_id, lora_name }
}

/// The state of the reservations of one `reserve` / `reserve_many` call.
#[derive(Debug, Default)]
enum Extents {
    /// Reserved, writable.
    Open(Vec<Reservation>),
    /// Aborted while tensors of them lived: still reserved (so never reused),
    /// and their ABORTs go when the last tensor does.
    Aborting(#[allow(dead_code)] Vec<Reservation>), // held for its Drop (the ABORTs)
    /// Committed while tensors of them lived: COMMIT_PIN's pins, released
    /// when the last tensor goes.
    Pinned(#[allow(dead_code)] Vec<BlockView>), // held for its Drop (the RELEASEs)
    /// Committed in part while tensors of them lived (the daemon refused some
    /// COMMIT_PINs): the pins of the committed and the refused reservations,
    /// released and aborted when the last tensor goes.
    PartlyPinned(#[allow(dead_code)] Vec<BlockView>, #[allow(dead_code)] Vec<Reservation>),
    /// Being committed or aborted, or finished with nothing left to hold.
    #[default]
    Finished,
}

impl ReservedExtents {
    fn new(rs: Vec<Reservation>) -> Arc<Self> {
        Arc::new(ReservedExtents { state: Mutex::new(Extents::Open(rs)) })
    }

    /// Takes the open reservations out (the state becomes `Finished`), or
    /// `InvalidArgument` if they were already committed or aborted.
    fn take(&self, what: &str) -> PyResult<Vec<Reservation>> {
        let mut g = self.state.lock().map_err(|_| KacheDBError::new_err("poisoned"))?;
        match std::mem::take(&mut *g) {
            Extents::Open(rs) => Ok(rs),
            other => {
                *g = other;
                Err(InvalidArgument::new_err(format!("{what} already committed or aborted")))
            }
        }
    }

    /// Whether tensors exported from these reservations may still be alive:
    /// someone besides `this` (the reservation object's own reference)
    /// holds the extents.
    fn exported(this: &Arc<Self>) -> bool {
        Arc::strong_count(this) > 1
    }

    /// Commits, pinning the blocks (COMMIT_PIN) if tensors of them may live:
    /// then the pins go with the last tensor. `keys`: the key of each block
    /// to commit under (`COMMIT_NAMES_KEY`), in place of its reserved key;
    /// empty: the reserved keys.
    fn commit(this: &Arc<Self>, py: Python<'_>, what: &str, keys: &[Key]) -> PyResult<()> {
        let mut rs = this.take(what)?;
        if !keys.is_empty() {
            if keys.len() != rs.len() {
                let n = rs.len();
                if let Ok(mut g) = this.state.lock() {
                    *g = Extents::Open(rs);
                }
                return Err(InvalidArgument::new_err(format!("{} keys to commit {n} reservations under", keys.len())));
            }
            for (r, k) in rs.iter_mut().zip(keys) {
                r.commit_as(Some(*k));
            }
        }
        if !Self::exported(this) {
            return py.allow_threads(|| Reservation::commit_all(rs)).map_err(client_err);
        }
        let (done, first_err) = py.allow_threads(|| Reservation::commit_each_pinned(rs));
        let (mut views, mut open) = (Vec::with_capacity(done.len()), Vec::new());
        for d in done {
            match d {
                Ok(view) => views.push(view),
                Err(r) => open.push(r),
            }
        }
        // Tensors of them live: whatever the outcome, the committed blocks
        // keep their pins and the refused reservations stay reserved until
        // the last tensor goes.
        if let Ok(mut g) = this.state.lock() {
            *g = if open.is_empty() { Extents::Pinned(views) } else { Extents::PartlyPinned(views, open) };
        }
        match first_err {
            Some(e) => Err(client_err(e)),
            None => Ok(()),
        }
    }

    /// Attaches block metadata to the open reservations, one record (or
    /// `None`) each (`Reservation::attach_meta_all`).
    fn attach_meta(this: &Arc<Self>, py: Python<'_>, what: &str, metas: Vec<Option<MetaTuple>>) -> PyResult<()> {
        let metas: Vec<Option<BlockMeta>> = metas.into_iter().map(|m| m.map(meta_of_tuple)).collect();
        let state = &this.state;
        py.allow_threads(|| {
            // Held through the round trips: a commit from another thread
            // waits for the records to be attached.
            let g = state.lock().map_err(|_| KacheDBError::new_err("poisoned"))?;
            let Extents::Open(rs) = &*g else {
                return Err(InvalidArgument::new_err(format!("{what} already committed or aborted")));
            };
            Reservation::attach_meta_all(rs, &metas).map_err(client_err)
        })
    }

    /// Aborts now if no tensor of the reservations may live; else leaves them
    /// reserved (refusing a later commit) until the last tensor goes, whose
    /// drop sends the ABORTs.
    fn abort(this: &Arc<Self>, py: Python<'_>, what: &str) -> PyResult<()> {
        let rs = this.take(what)?;
        if !Self::exported(this) {
            return py.allow_threads(|| Reservation::abort_all(rs)).map_err(client_err);
        }
        if let Ok(mut g) = this.state.lock() {
            *g = Extents::Aborting(rs);
        }
        Ok(())
    }
}

impl Drop for ReservedExtents {
    fn drop(&mut self) {
        // The ABORTs of open reservations are round trips to the daemon:
        // never with the GIL held.
        if let Ok(state) = self.state.get_mut() {
            crate::dlpack::drop_without_gil(std::mem::take(state));
        }
    }
}
/// An open reservation (private API). Tensors made from `buffer()` keep its
/// extent out of eviction and reuse for as long as they live
/// ([`ReservedExtents`]): a commit then pins the block (COMMIT_PIN) until
/// the last of them goes, and an abort is carried out when it goes.
#[derive(Debug)]
#[pyclass(frozen, module = "kachedb._kachedb_rust", name = "NativeReservation")]
pub struct NativeReservation {
    /// Dropped by hand, with the GIL released (see `Drop`).
    extents: std::mem::ManuallyDrop<Arc<ReservedExtents>>,
    ptr: usize,
    len: usize,
}

#[pymethods]
impl NativeReservation {
    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }
    /// A writable DLPack exporter of the reserved bytes (`typed(code, shape)`
    /// exports them as the block); every tensor made from it keeps the
    /// extent out of reuse while it lives. Write before commit: after commit
    /// the block is immutable (readers may hold it).
    fn buffer(&self) -> PyResult<DLPackBuffer> {
        let ptr = NonNull::new(self.ptr as *mut u8).ok_or_else(|| KacheDBError::new_err("null reservation"))?;
        match self.extents.state.lock() {
            Ok(g) if matches!(*g, Extents::Open(_)) => {}
            _ => return Err(InvalidArgument::new_err("the reservation was already committed or aborted")),
        }
        let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::clone(&self.extents) as _;
        // SAFETY: the range is the reservation's extent in the region's
        // mapping; `owner` holds the reservation (then its pin, or its
        // deferred abort), which keeps the extent allocated to it and the
        // region mapped for as long as any tensor made from it lives.
        Ok(unsafe { DLPackBuffer::new(ptr, self.len, owner, false) })
    }
    /// Commits (under `key` instead of the reserved key, if given: see
    /// `commit_reservations`).
    #[pyo3(signature = (key=None))]
    fn commit(&self, py: Python<'_>, key: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let keys: Vec<Key> = opt_key_of(key)?.into_iter().collect();
        ReservedExtents::commit(&self.extents, py, "the reservation was", &keys)
    }
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        ReservedExtents::abort(&self.extents, py, "the reservation was")
    }
    /// Attaches a block metadata record (a `MetaTuple`), before the commit.
    fn attach_meta(&self, py: Python<'_>, meta: MetaTuple) -> PyResult<()> {
        ReservedExtents::attach_meta(&self.extents, py, "the reservation was", vec![Some(meta)])
    }
}

impl Drop for NativeReservation {
    fn drop(&mut self) {
        // SAFETY: `extents` is taken exactly once, here, and `self` is not used after.
        let extents = unsafe { std::mem::ManuallyDrop::take(&mut self.extents) };
        // The last reference to an open reservation aborts it: a round trip
        // to the daemon, never with the GIL held.
        crate::dlpack::drop_without_gil(extents);
    }
}

/// Reservations of one `reserve_many` batch (private API): `capsules()`
/// exports each as a writable DLPack capsule of its dtype and shape;
/// `commit()` / `abort()` finish all of them in one batch. The exported
/// tensors keep every extent of the batch out of reuse while any of them
/// lives, as [`NativeReservation`]'s do.
#[pyclass(frozen, module = "kachedb._kachedb_rust", name = "NativeReservations")]
pub struct NativeReservations {
    /// Dropped by hand, with the GIL released (see `Drop`).
    extents: std::mem::ManuallyDrop<Arc<ReservedExtents>>,
    code: u8,
    dims: Vec<u64>,
}

impl std::fmt::Debug for NativeReservations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeReservations").field("code", &self.code).field("dims", &self.dims).finish()
    }
}

impl Drop for NativeReservations {
    fn drop(&mut self) {
        // SAFETY: `extents` is taken exactly once, here, and `self` is not used after.
        let extents = unsafe { std::mem::ManuallyDrop::take(&mut self.extents) };
        crate::dlpack::drop_without_gil(extents);
    }
}

#[pymethods]
impl NativeReservations {
    fn __len__(&self) -> usize {
        match self.extents.state.lock().as_deref() {
            Ok(Extents::Open(rs)) => rs.len(),
            _ => 0,
        }
    }

    /// One legacy DLPack capsule per reservation, of the batch's dtype (as
    /// torch reads it) and shape; each keeps the batch's extents out of reuse
    /// while it lives. Write before commit: after commit the blocks are
    /// immutable (readers may hold them).
    fn capsules<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let mut g = self.extents.state.lock().map_err(|_| KacheDBError::new_err("poisoned"))?;
        let Extents::Open(rs) = &mut *g else {
            return Err(InvalidArgument::new_err("the reservations were already committed or aborted"));
        };
        let dt = DlDtype::of(dtype(self.code)?, Reader::Torch);
        rs.iter_mut()
            .map(|r| {
                let (ptr, len) = (r.as_mut_ptr(), r.len());
                let ptr = NonNull::new(ptr).ok_or_else(|| KacheDBError::new_err("null reservation"))?;
                // SAFETY: the range is a reservation's extent in the region's
                // mapping; the owner (the batch's extents) keeps it allocated to
                // this client (reserved, then pinned, or its abort deferred) and
                // the region mapped while any tensor made from it lives.
                unsafe {
                    tensor_capsule(
                        py,
                        ptr,
                        len,
                        dt,
                        &self.dims,
                        DlOwner::Rust(Box::new(Arc::clone(&self.extents))),
                        DlpackFormat::Legacy,
                    )
                }
            })
            .collect()
    }

    /// Copies raw byte ranges into the reservations (GIL released):
    /// reservation `i` gets ranges `i * per` to `(i + 1) * per - 1` in order,
    /// `per` being `len(addresses) / len(self)`, on at most `threads` threads
    /// (`0`: by size, up to one per core; `1`: the calling thread alone,
    /// `kachedb_client::fill_gathered`). `InvalidArgument` (nothing copied)
    /// for ranges that do not divide evenly or add up to a reservation's
    /// bytes, a range overlapping a reservation, or reservations already
    /// committed or aborted.
    ///
    /// The caller vouches that every range is readable memory of this process
    /// that stays alive and unmodified during the call.
    #[pyo3(signature = (addresses, lengths, threads=0))]
    fn fill_gathered(
        &self,
        py: Python<'_>,
        addresses: Vec<usize>,
        lengths: Vec<usize>,
        threads: usize,
    ) -> PyResult<()> {
        let ranges = raw_ranges(&addresses, &lengths)?;
        let extents: &ReservedExtents = &self.extents;
        py.allow_threads(|| {
            // Held through the copy: a commit or abort from another thread waits for it.
            let mut g = extents.state.lock().map_err(|_| KacheDBError::new_err("poisoned"))?;
            let Extents::Open(rs) = &mut *g else {
                return Err(InvalidArgument::new_err("the reservations were already committed or aborted"));
            };
            let mut spans: Vec<(usize, usize)> = rs.iter_mut().map(|r| (r.as_mut_ptr() as usize, r.len())).collect();
            spans.sort_unstable();
            check_apart(&ranges, &spans)?;
            // SAFETY: the Python caller vouches for every range for the whole
            // call, and none overlaps a reservation (`check_apart`), so no
            // source aliases the slices written.
            let sources: Vec<&[u8]> = ranges.iter().map(|r| unsafe { r.slice() }).collect();
            let threads = if threads == 0 { usize::MAX } else { threads };
            kachedb_client::fill_gathered(rs, &sources, threads).map_err(client_err)
        })
    }

    /// Commits every reservation in one batch (COMMIT_PINs while tensors of
    /// them live).
    fn commit(&self, py: Python<'_>) -> PyResult<()> {
        ReservedExtents::commit(&self.extents, py, "the reservations were", &[])
    }

    /// Aborts every reservation in one batch, or, while tensors of them live,
    /// when the last of them goes.
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        ReservedExtents::abort(&self.extents, py, "the reservations were")
    }

    /// Attaches block metadata records (`MetaTuple`s or `None`), one per
    /// reservation, before the commit.
    fn attach_meta(&self, py: Python<'_>, metas: Vec<Option<MetaTuple>>) -> PyResult<()> {
        ReservedExtents::attach_meta(&self.extents, py, "the reservations were", metas)
    }
}

/// commit_reservations(reservations, keys, metas=None, parents=None)
/// --
///
/// Commits open reservations of one client (``NativeReservation``s, from
/// separate ``reserve`` calls) in one batch, each under its key in ``keys``
/// (``COMMIT_NAMES_KEY``: the key it was reserved with set aside), pinning
/// each (COMMIT_PIN): the pin goes with the reservation's last tensor, as for
/// a ``commit`` while tensors live. Returns one bool per reservation:
/// committed, or not (the daemon refused its COMMIT_PIN: it stays reserved,
/// its extent kept from reuse, until its last tensor goes, which aborts it).
/// ``Disconnected`` once every reservation is so if the daemon is gone.
/// ``InvalidArgument`` (nothing sent) if one of them is not open, or the
/// counts differ.
///
/// ``metas`` (optional): one block metadata record (a ``MetaTuple``) or
/// ``None`` per reservation, attached before the commits in one batch (one
/// scratch block, one batch of META frames); a record the daemon refuses
/// leaves its block without one (published by key), the commit goes on.
///
/// ``parents`` (optional): the key of the block each one follows in a prefix
/// chain, or ``None``, per reservation (the daemon's chain-aware eviction,
/// docs/eviction.md); replaces a parent named at ``reserve``.
#[pyfunction]
#[pyo3(signature = (reservations, keys, metas=None, parents=None))]
pub fn commit_reservations(
    py: Python<'_>,
    reservations: Vec<PyRef<'_, NativeReservation>>,
    keys: &Bound<'_, PyAny>,
    metas: Option<Vec<Option<MetaTuple>>>,
    parents: Option<Vec<Bound<'_, PyAny>>>,
) -> PyResult<Vec<bool>> {
    let keys = keys_of(keys)?;
    if keys.len() != reservations.len() {
        return Err(InvalidArgument::new_err(format!(
            "{} keys to commit {} reservations under",
            keys.len(),
            reservations.len()
        )));
    }
    let parents: Option<Vec<Option<Key>>> =
        parents.map(|ps| ps.iter().map(|p| opt_key_of(Some(p))).collect::<PyResult<_>>()).transpose()?;
    if parents.as_ref().is_some_and(|ps| ps.len() != reservations.len()) {
        return Err(InvalidArgument::new_err(format!(
            "{} parents for {} reservations",
            parents.as_ref().map_or(0, Vec::len),
            reservations.len()
        )));
    }
    let metas: Option<Vec<Option<BlockMeta>>> = metas.map(|ms| ms.into_iter().map(|m| m.map(meta_of_tuple)).collect());
    if metas.as_ref().is_some_and(|ms| ms.len() != reservations.len()) {
        return Err(InvalidArgument::new_err(format!(
            "{} block metadata records for {} reservations",
            metas.as_ref().map_or(0, Vec::len),
            reservations.len()
        )));
    }
    for r in &reservations {
        if !matches!(r.extents.state.lock().as_deref(), Ok(Extents::Open(rs)) if rs.len() == 1) {
            return Err(InvalidArgument::new_err("a reservation was already committed or aborted"));
        }
    }
    // The GIL is held from the check above to here: only this call finishes them.
    let mut batch = Vec::with_capacity(reservations.len());
    for (i, (r, k)) in reservations.iter().zip(&keys).enumerate() {
        let mut taken = r.extents.take("a reservation was")?;
        let Some(mut x) = taken.pop() else {
            return Err(KacheDBError::new_err("internal: an empty reservation"));
        };
        x.commit_as(Some(*k));
        if let Some(ps) = &parents {
            x.set_parent(ps[i]);
        }
        batch.push(x);
    }
    let (done, first_err) = py.allow_threads(|| {
        if let Some(ms) = &metas {
            // Best effort: a refused record leaves its block published by key;
            // a daemon that is gone fails the commits below as well.
            let _ = Reservation::attach_meta_all(&batch, ms);
        }
        Reservation::commit_each_pinned(batch)
    });
    let mut ok = Vec::with_capacity(done.len());
    for (r, d) in reservations.iter().zip(done) {
        let Ok(mut g) = r.extents.state.lock() else {
            ok.push(false);
            continue;
        };
        match d {
            Ok(view) => {
                *g = Extents::Pinned(vec![view]);
                ok.push(true);
            }
            Err(open) => {
                // Aborted when its last tensor (or this object) goes.
                *g = Extents::Aborting(vec![open]);
                ok.push(false);
            }
        }
    }
    match first_err {
        Some(e @ kachedb_client::ClientError::Disconnected(_)) => Err(client_err(e)),
        _ => Ok(ok),
    }
}

/// The default control socket path of `instance`.
/// key_of(key)
/// --
///
/// The 128-bit key (an int in ``[0, 2**128)``) that ``key`` is stored under
/// (docs/PROTOCOL.md, "Keys"), as every operation maps it:
///
/// * ``bytes``, ``bytearray``, ``memoryview`` (of any format, by its raw bytes in
///   C order): BLAKE2b with a 16-byte digest and personalisation
///   ``b"kachedb-key-v1\0\0"``, the digest read as a little-endian integer.
/// * ``str``: its UTF-8 bytes, as above (``ValueError`` for lone surrogates).
/// * ``int`` (``bool`` excluded): taken modulo 2**128, so negative values
///   (Python's ``hash()``) are valid keys.
///
/// Anything else raises ``TypeError``.
#[pyfunction(name = "key_of")]
pub fn key_of_py(key: &Bound<'_, PyAny>) -> PyResult<u128> {
    key_of(key).map(|k| k.0)
}

#[pyfunction]
#[pyo3(signature = (instance=0))]
pub fn default_socket_path(instance: u32) -> String {
    kachedb_shm::naming::default_socket_path(instance).display().to_string()
}
