//! DLPack export of KacheDB blocks as zero-copy CPU tensors.
//!
//! * [`DlDtype::of`] is the one mapping from a block's [`DType`] to a DLPack element
//!   type. A dtype the reader cannot import (float8 for torch, bfloat16 and float8
//!   for numpy) goes out as the unsigned integer of the same width, same shape;
//!   `kachedb._views` views it as its dtype (same itemsize, no copy).
//! * [`tensor_capsule`] wraps a compact (row-major, strides NULL, byte_offset 0)
//!   tensor of a dtype and shape in a `PyCapsule`: legacy DLPack 0.x
//!   (`DLManagedTensor`, `"dltensor"`), or DLPack 1.0 (`DLManagedTensorVersioned`,
//!   `"dltensor_versioned"`, which can carry the read-only flag) for consumers that
//!   pass `max_version >= (1, 0)` (torch and numpy 2 do). numpy imports every legacy
//!   capsule read-only, so writable numpy views need the versioned format.
//! * The memory is kept valid by a [`DlOwner`] that travels with the tensor. A
//!   consumer that takes the tensor renames the capsule `"used_dltensor"`
//!   (`"used_dltensor_versioned"`) and calls the tensor's deleter when its last view
//!   goes away; the deleter drops the owner. A capsule that is never consumed frees
//!   the tensor (and drops the owner) in its own destructor, which checks the name
//!   first, as the DLPack specification says.
//! * [`DLPackBuffer`] is the Python-visible exporter (`__dlpack__`,
//!   `__dlpack_device__`) of a byte range, as `uint8` bytes or, through
//!   [`DLPackBuffer::typed`], as a block of a dtype and shape. Each export clones its
//!   shared owner, so the owner is dropped only when the buffer object *and* every
//!   tensor made from it (slices, `.view(dtype)`, `as_strided`, …, which all share
//!   the consumer's one deleter) are gone.

use std::any::Any;
use std::ffi::{c_void, CStr};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::{self, NonNull};
use std::sync::Arc;

use kachedb_shm::{DType, Shape};
use pyo3::exceptions::{PyBufferError, PyOverflowError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;

use crate::errors::{InvalidArgument, TooLarge};

/// `DLDeviceType::kDLCPU`.
pub const KDLCPU: i32 = 1;
/// `DLDataTypeCode::kDLInt`.
const KDLINT: u8 = 0;
/// `DLDataTypeCode::kDLUInt`.
const KDLUINT: u8 = 1;
/// `DLDataTypeCode::kDLFloat`.
const KDLFLOAT: u8 = 2;
/// `DLDataTypeCode::kDLBfloat`.
const KDLBFLOAT: u8 = 4;
/// `DLDataTypeCode::kDLBool`.
const KDLBOOL: u8 = 6;
/// `DLPACK_FLAG_BITMASK_READ_ONLY` (DLPack >= 1.0).
const DLPACK_FLAG_BITMASK_READ_ONLY: u64 = 1 << 0;

/// Most dimensions [`tensor_capsule`] exports: what a descriptor holds.
pub const MAX_EXPORT_NDIM: usize = kachedb_shm::MAX_DIMS;

/// A DLPack element type: `DLDataType` with one lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DlDtype {
    /// `DLDataTypeCode` (`kDLInt` = 0, `kDLUInt` = 1, `kDLFloat` = 2,
    /// `kDLBfloat` = 4, `kDLBool` = 6, …).
    pub code: u8,
    /// Bits per element (a multiple of 8).
    pub bits: u8,
}

/// Who imports an export; decides how dtypes it cannot read go out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reader {
    /// `torch.from_dlpack`: reads every DLPack element type of a block but float8
    /// (DLPack 1.0 has no float8 codes).
    Torch,
    /// `numpy.from_dlpack`: reads ints, floats and bool; not bfloat16 nor float8.
    Numpy,
}

impl Reader {
    /// Whether this reader imports a DLPack tensor of `dtype`'s own element type.
    pub fn reads(self, dtype: DType) -> bool {
        match dl_code(dtype) {
            None => false,
            Some(code) => !(self == Reader::Numpy && code == KDLBFLOAT),
        }
    }
}

/// `dtype`'s DLPack type code (1.0), if DLPack has one.
fn dl_code(dtype: DType) -> Option<u8> {
    match dtype {
        DType::U8 => Some(KDLUINT),
        DType::I8 | DType::I16 | DType::I32 | DType::I64 => Some(KDLINT),
        DType::F16 | DType::F32 | DType::F64 => Some(KDLFLOAT),
        DType::BF16 => Some(KDLBFLOAT),
        DType::Bool => Some(KDLBOOL),
        DType::F8E4M3FN | DType::F8E5M2 => None,
    }
}

impl DlDtype {
    /// `uint8`.
    pub const U8: DlDtype = DlDtype { code: KDLUINT, bits: 8 };

    /// The DLPack element type a block of `dtype` is exported as to `reader`: its
    /// own where the reader [reads](Reader::reads) it, else the unsigned integer of
    /// the same width (which `kachedb._views` views as `dtype`).
    pub fn of(dtype: DType, reader: Reader) -> DlDtype {
        let bits = (dtype.itemsize() * 8) as u8; // itemsize <= 8
        match dl_code(dtype) {
            Some(code) if reader.reads(dtype) => DlDtype { code, bits },
            _ => DlDtype { code: KDLUINT, bits },
        }
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
#[derive(Debug)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// DLPack 0.x (legacy) managed tensor; capsule name `"dltensor"`.
#[repr(C)]
#[derive(Debug)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

/// DLPack 1.x managed tensor; capsule name `"dltensor_versioned"`. Unlike the
/// legacy one it can say "read-only" (numpy honours it; numpy imports every legacy
/// capsule read-only, so a *writable* numpy view needs this format).
#[repr(C)]
#[derive(Debug)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// The capsule format of one export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DlpackFormat {
    /// DLPack 0.x, `"dltensor"`: what a consumer that gave no `max_version` gets.
    Legacy,
    /// DLPack 1.0, `"dltensor_versioned"`, with the read-only flag set or not.
    Versioned {
        /// Sets `DLPACK_FLAG_BITMASK_READ_ONLY`.
        read_only: bool,
    },
}

/// What keeps exported memory valid. It is dropped exactly once, when the last
/// consumer view is gone (or when an unconsumed capsule is destroyed).
pub enum DlOwner {
    /// A Rust value (e.g. a pin guard). Dropped on whatever thread frees the
    /// tensor, which may or may not hold the GIL: its `Drop` must not need Python,
    /// and should not block (while it runs with the GIL, every Python thread waits).
    Rust(Box<dyn Any + Send>),
}

impl fmt::Debug for DlOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DlOwner::Rust(_) => f.write_str("DlOwner::Rust(..)"),
        }
    }
}

impl DlOwner {
    /// Drops the owner from a deleter: never unwinds, takes the GIL for Python owners.
    fn release(self) {
        match self {
            DlOwner::Rust(owner) => {
                // A panicking Drop must not unwind into the consumer's C frames.
                let _ = catch_unwind(AssertUnwindSafe(move || drop_without_gil(owner)));
            }
        }
    }
}

/// Drops `value` with the GIL released, if this thread holds it: a pin's or a
/// reservation's drop may block (a full submission ring, a round trip to the
/// daemon), and while it blocks with the GIL every Python thread would wait —
/// a stopped daemon would hang the whole process. Without a live interpreter
/// it is dropped as is.
pub(crate) fn drop_without_gil<T: Send>(value: T) {
    // SAFETY: Py_IsInitialized may be called at any time, with or without the GIL.
    if unsafe { ffi::Py_IsInitialized() } == 0 {
        drop(value);
        return;
    }
    // Re-entrant: cheap when this thread holds the GIL (a deleter run by
    // Python's garbage collection, a pyclass's dealloc); taken then given up
    // at once otherwise.
    Python::with_gil(move |py| py.allow_threads(move || drop(value)));
}

/// The two DLPack managed-tensor layouts, for code generic over them.
///
/// # Safety
/// `NAME`/`USED_NAME` must be the capsule names DLPack assigns to `Self`; `new`
/// must install `managed_deleter::<Self>` as the deleter, and `link` must store its
/// arguments as `dl_tensor.shape` and `manager_ctx`.
unsafe trait ManagedTensor: Sized {
    /// Name of a capsule holding an unconsumed tensor.
    const NAME: &'static CStr;
    /// Name a consumer gives the capsule once it owns the tensor.
    const USED_NAME: &'static CStr;
    /// A managed tensor with our deleter (`manager_ctx` null until [`Self::link`]).
    fn new(dl_tensor: DLTensor, read_only: bool) -> Self;
    /// Sets `dl_tensor.shape` and `manager_ctx` through raw pointers.
    ///
    /// # Safety
    /// `managed` points to a live `Self` that no reference aliases.
    unsafe fn link(managed: *mut Self, shape: *mut i64, manager_ctx: *mut c_void);
    /// `manager_ctx` of `managed`.
    ///
    /// # Safety
    /// `managed` points to a live `Self`.
    unsafe fn manager_ctx(managed: *mut Self) -> *mut c_void;
    /// Calls `managed`'s deleter, if it has one.
    ///
    /// # Safety
    /// `managed` points to a live `Self` that nobody else will delete.
    unsafe fn delete(managed: *mut Self);
}

// SAFETY: names from dlpack.h / the Python specification; `new` installs
// `managed_deleter::<DLManagedTensor>` and the given context.
unsafe impl ManagedTensor for DLManagedTensor {
    const NAME: &'static CStr = c"dltensor";
    const USED_NAME: &'static CStr = c"used_dltensor";

    fn new(dl_tensor: DLTensor, _read_only: bool) -> Self {
        DLManagedTensor { dl_tensor, manager_ctx: ptr::null_mut(), deleter: Some(managed_deleter::<Self>) }
    }

    unsafe fn link(managed: *mut Self, shape: *mut i64, manager_ctx: *mut c_void) {
        // SAFETY: `managed` is live and unaliased (caller's contract).
        unsafe {
            (*managed).dl_tensor.shape = shape;
            (*managed).manager_ctx = manager_ctx;
        }
    }

    unsafe fn manager_ctx(managed: *mut Self) -> *mut c_void {
        // SAFETY: `managed` is live (caller's contract).
        unsafe { (*managed).manager_ctx }
    }

    unsafe fn delete(managed: *mut Self) {
        // SAFETY: `managed` is live and ours to delete (caller's contract).
        unsafe {
            if let Some(deleter) = (*managed).deleter {
                deleter(managed);
            }
        }
    }
}

// SAFETY: names from dlpack.h (>= 1.0) / the Python specification; `new` installs
// `managed_deleter::<DLManagedTensorVersioned>` and the given context.
unsafe impl ManagedTensor for DLManagedTensorVersioned {
    const NAME: &'static CStr = c"dltensor_versioned";
    const USED_NAME: &'static CStr = c"used_dltensor_versioned";

    fn new(dl_tensor: DLTensor, read_only: bool) -> Self {
        DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 0 },
            manager_ctx: ptr::null_mut(),
            deleter: Some(managed_deleter::<Self>),
            flags: if read_only { DLPACK_FLAG_BITMASK_READ_ONLY } else { 0 },
            dl_tensor,
        }
    }

    unsafe fn link(managed: *mut Self, shape: *mut i64, manager_ctx: *mut c_void) {
        // SAFETY: `managed` is live and unaliased (caller's contract).
        unsafe {
            (*managed).dl_tensor.shape = shape;
            (*managed).manager_ctx = manager_ctx;
        }
    }

    unsafe fn manager_ctx(managed: *mut Self) -> *mut c_void {
        // SAFETY: `managed` is live (caller's contract).
        unsafe { (*managed).manager_ctx }
    }

    unsafe fn delete(managed: *mut Self) {
        // SAFETY: `managed` is live and ours to delete (caller's contract).
        unsafe {
            if let Some(deleter) = (*managed).deleter {
                deleter(managed);
            }
        }
    }
}

/// One exported tensor: the DLPack struct, its shape array and its owner, in a
/// single heap allocation that the deleter frees. The deleter finds the allocation
/// through `manager_ctx`, not by casting the managed-tensor pointer.
#[repr(C)]
struct ManagerCtx<M> {
    managed: M,
    shape: [i64; MAX_EXPORT_NDIM],
    owner: DlOwner,
}

/// The managed tensor's deleter: frees the [`ManagerCtx`] and drops its owner.
///
/// # Safety
/// `managed` is null, or a pointer produced by [`tensor_capsule`] whose tensor has not
/// been deleted yet (DLPack: the deleter is called once, by the tensor's one owner).
unsafe extern "C" fn managed_deleter<M: ManagedTensor>(managed: *mut M) {
    if managed.is_null() {
        return;
    }
    // SAFETY: per this function's contract `managed` points to the `managed` field of
    // a live `ManagerCtx<M>`, whose `manager_ctx` was set to the `Box::into_raw`
    // pointer of that allocation; it is reconstructed once, here, because DLPack
    // calls the deleter exactly once.
    let ctx = unsafe { Box::from_raw(M::manager_ctx(managed).cast::<ManagerCtx<M>>()) };
    let ManagerCtx { owner, .. } = *ctx;
    owner.release();
}

/// The capsule's destructor: frees the tensor only if no consumer took it.
///
/// # Safety
/// Called by CPython, with the GIL held, on a capsule created by [`tensor_capsule`]
/// holding an `M`.
#[allow(deprecated)] // PyErr_Fetch/Restore: their successors are 3.12+, we target the 3.9 abi3
unsafe extern "C" fn capsule_destructor<M: ManagedTensor>(capsule: *mut ffi::PyObject) {
    // SAFETY: `capsule` is a live capsule (CPython is destroying it) and the GIL is
    // held; PyCapsule_IsValid does not set an exception on a name mismatch.
    if unsafe { ffi::PyCapsule_IsValid(capsule, M::USED_NAME.as_ptr()) } == 1 {
        // A consumer owns the tensor now and will call the deleter itself.
        return;
    }
    let mut ptype = ptr::null_mut();
    let mut pvalue = ptr::null_mut();
    let mut ptraceback = ptr::null_mut();
    // SAFETY: GIL held; the exception in flight (if any: a destructor may run while
    // one propagates) is stashed here and restored below, so that
    // PyCapsule_GetPointer's own error reporting cannot clobber it.
    unsafe { ffi::PyErr_Fetch(&mut ptype, &mut pvalue, &mut ptraceback) };
    // SAFETY: GIL held, `capsule` live; a wrong name returns NULL with an exception set.
    let managed = unsafe { ffi::PyCapsule_GetPointer(capsule, M::NAME.as_ptr()) }.cast::<M>();
    if managed.is_null() {
        // Neither our name nor the "used" one: someone renamed it; leaking is the
        // only safe choice. Report it without raising from a destructor.
        // SAFETY: GIL held, an exception is set (by PyCapsule_GetPointer).
        unsafe { ffi::PyErr_WriteUnraisable(capsule) };
    } else {
        // SAFETY: the capsule still has its original name, so no consumer took the
        // tensor and nobody else will call its deleter: it is ours to delete, once.
        unsafe { M::delete(managed) };
    }
    // SAFETY: GIL held; hands back the references taken by PyErr_Fetch above.
    unsafe { ffi::PyErr_Restore(ptype, pvalue, ptraceback) };
}

/// Wraps the compact (row-major, strides NULL, byte_offset 0) CPU tensor of
/// element type `dtype` and shape `shape` at `data` (`len` bytes) in a DLPack
/// capsule (`"dltensor"`, or `"dltensor_versioned"` for
/// [`DlpackFormat::Versioned`]) whose deleter drops `owner`.
///
/// `len` may be 0 (`data` is still non-null, as DLPack consumers expect).
///
/// # Errors
/// `OverflowError` if `len` or a dimension does not fit an `i64`; `ValueError` if
/// `shape` has more than [`MAX_EXPORT_NDIM`] dimensions or its elements do not
/// take exactly `len` bytes; a Python error if the capsule cannot be created.
/// `owner` has been dropped when an error is returned.
///
/// # Safety
/// `data .. data + len` must be valid for reads and writes, and not be freed or
/// unmapped, for as long as `owner` is alive. Consumers may write through the
/// tensor (torch has no read-only tensors): if other code reads the range, that is
/// the caller's protocol to uphold (blocks handed to readers are immutable by
/// contract, not by the MMU).
pub unsafe fn tensor_capsule<'py>(
    py: Python<'py>,
    data: NonNull<u8>,
    len: usize,
    dtype: DlDtype,
    shape: &[u64],
    owner: DlOwner,
    format: DlpackFormat,
) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: forwarded contract.
    unsafe {
        match format {
            DlpackFormat::Legacy => capsule_as::<DLManagedTensor>(py, data, len, dtype, shape, owner, false),
            DlpackFormat::Versioned { read_only } => {
                capsule_as::<DLManagedTensorVersioned>(py, data, len, dtype, shape, owner, read_only)
            }
        }
    }
}

/// [`tensor_capsule`] for one managed-tensor layout.
///
/// # Safety
/// As for [`tensor_capsule`].
unsafe fn capsule_as<'py, M: ManagedTensor>(
    py: Python<'py>,
    data: NonNull<u8>,
    len: usize,
    dtype: DlDtype,
    dims: &[u64],
    owner: DlOwner,
    read_only: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let Ok(len_i64) = i64::try_from(len) else {
        return Err(PyOverflowError::new_err(format!(
            "a DLPack tensor holds at most {} bytes, this one has {len}",
            i64::MAX
        )));
    };
    if dims.len() > MAX_EXPORT_NDIM {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "at most {MAX_EXPORT_NDIM} dimensions can be exported, not {}",
            dims.len()
        )));
    }
    let mut shape = [0i64; MAX_EXPORT_NDIM];
    let mut elems: u128 = 1;
    for (slot, &d) in shape.iter_mut().zip(dims) {
        *slot = i64::try_from(d)
            .map_err(|_| PyOverflowError::new_err(format!("dimension {d} does not fit a DLPack shape (i64)")))?;
        elems = elems.saturating_mul(u128::from(d));
    }
    if elems.saturating_mul(u128::from(dtype.bits / 8)) != len_i64 as u128
        || !dtype.bits.is_multiple_of(8)
        || dtype.bits == 0
    {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "shape {dims:?} of {}-bit elements does not take exactly {len} bytes",
            dtype.bits
        )));
    }
    let dl_tensor = DLTensor {
        data: data.as_ptr().cast(),
        device: DLDevice { device_type: KDLCPU, device_id: 0 },
        ndim: dims.len() as i32, // <= MAX_EXPORT_NDIM, checked above
        dtype: DLDataType { code: dtype.code, bits: dtype.bits, lanes: 1 },
        shape: ptr::null_mut(), // set below, once the allocation has its address
        strides: ptr::null_mut(),
        byte_offset: 0,
    };
    let ctx = Box::into_raw(Box::new(ManagerCtx { managed: M::new(dl_tensor, read_only), shape, owner }));
    // SAFETY: `ctx` comes from Box::into_raw just above: valid, aligned, unaliased.
    // The pointers stored point into that same allocation, which stays put until the
    // deleter frees it.
    // Only raw pointers are taken (no references), so `managed` and `shape` stay
    // valid for the capsule and its consumer until the deleter's Box::from_raw.
    let managed = unsafe {
        let managed = ptr::addr_of_mut!((*ctx).managed);
        M::link(managed, ptr::addr_of_mut!((*ctx).shape).cast::<i64>(), ctx.cast::<c_void>());
        managed
    };
    // SAFETY: the GIL is held (`py`); the name is a 'static C string, as capsules
    // keep the pointer; the destructor matches the capsule's contents.
    let capsule =
        unsafe { ffi::PyCapsule_New(managed.cast::<c_void>(), M::NAME.as_ptr(), Some(capsule_destructor::<M>)) };
    if capsule.is_null() {
        // SAFETY: the capsule does not exist, so nothing else refers to `managed`;
        // delete it ourselves (drops the owner) before reporting the error.
        unsafe { M::delete(managed) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `capsule` is a new, non-null reference that we own.
    Ok(unsafe { Bound::from_owned_ptr(py, capsule) })
}

/// Base address of an exported range. Only an address: what keeps the memory
/// alive is the owner stored beside it.
#[derive(Debug, Clone, Copy)]
struct RawBytes(NonNull<u8>);

// SAFETY: `RawBytes` is only dereferenced by DLPack consumers, which rely on the
// owner held next to it (an `Arc<dyn Any + Send + Sync>`) for validity; the address
// itself can be moved and shared between threads freely.
unsafe impl Send for RawBytes {}
// SAFETY: as for Send: sharing the address gives no access by itself.
unsafe impl Sync for RawBytes {}

/// A byte range exportable as DLPack: `torch.from_dlpack(buf)`, `numpy.from_dlpack(buf)`.
/// It exports a 1-D `uint8` tensor of its bytes, or, once [`typed`](Self::typed),
/// a block's dtype (as [`DlDtype::of`] maps it) and shape.
///
/// The range stays valid for as long as this object or any tensor made from it lives.
#[pyclass(frozen, module = "kachedb._kachedb_rust", name = "DLPackBuffer")]
pub struct DLPackBuffer {
    data: RawBytes,
    len: usize,
    owner: Arc<dyn Any + Send + Sync>,
    read_only: bool,
    /// Element type of the export.
    dtype: DlDtype,
    /// The export's shape: the first `ndim` entries.
    shape: [u64; MAX_EXPORT_NDIM],
    ndim: usize,
}

impl fmt::Debug for DLPackBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DLPackBuffer")
            .field("data", &self.data.0)
            .field("len", &self.len)
            .field("read_only", &self.read_only)
            .field("dtype", &self.dtype)
            .field("shape", &&self.shape[..self.ndim])
            .finish_non_exhaustive()
    }
}

impl DLPackBuffer {
    /// An exporter for `len` bytes at `data` (a 1-D `uint8` tensor), kept valid by
    /// `owner`. `read_only` is what versioned (DLPack 1.0) capsules tell consumers
    /// (numpy honours it; torch has no read-only tensors: see `__dlpack__`).
    ///
    /// # Safety
    /// `data .. data + len` must stay valid for reads and writes for as long as
    /// `owner` (or any clone of the `Arc`) is alive.
    pub unsafe fn new(data: NonNull<u8>, len: usize, owner: Arc<dyn Any + Send + Sync>, read_only: bool) -> Self {
        let mut shape = [0; MAX_EXPORT_NDIM];
        shape[0] = len as u64;
        DLPackBuffer { data: RawBytes(data), len, owner, read_only, dtype: DlDtype::U8, shape, ndim: 1 }
    }
}

/// The capsule format for a consumer's `max_version`: legacy unless it reads 1.x.
fn format_for(max_version: Option<&Bound<'_, PyAny>>, read_only: bool) -> PyResult<DlpackFormat> {
    let Some(max_version) = max_version else {
        return Ok(DlpackFormat::Legacy);
    };
    let (major, _minor): (i64, i64) = max_version
        .extract()
        .map_err(|_| PyTypeError::new_err("max_version must be None or a tuple (major, minor) of two ints"))?;
    Ok(if major >= 1 { DlpackFormat::Versioned { read_only } } else { DlpackFormat::Legacy })
}

#[pymethods]
impl DLPackBuffer {
    /// Exports the range as a DLPack capsule (CPU; 1-D `uint8`, or the dtype and
    /// shape given to `typed`): DLPack 1.0 (`"dltensor_versioned"`, flagged
    /// read-only if this buffer is) when the consumer passes `max_version >= (1, 0)`,
    /// else legacy (`"dltensor"`, which cannot say read-only).
    ///
    /// `stream` is accepted and ignored (host memory needs no stream).
    /// `dl_device` other than CPU, or `copy=True`, raise `BufferError`.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<&Bound<'py, PyAny>>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = stream;
        let this = slf.get();
        let format = format_for(max_version, this.read_only)?;
        if let Some((device_type, device_id)) = dl_device {
            if (device_type, device_id) != (KDLCPU, 0) {
                return Err(PyBufferError::new_err(format!(
                    "a KacheDB block lives in host memory (DLPack device ({KDLCPU}, 0)); \
                     it cannot be exported to device ({device_type}, {device_id}): \
                     export it on the CPU and copy it with .to(device)"
                )));
            }
        }
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "a KacheDB block is exported without copying; copy the result (.clone() / .copy()) instead of copy=True",
            ));
        }
        let owner = DlOwner::Rust(Box::new(Arc::clone(&this.owner)));
        // SAFETY: `this.owner` keeps the range valid (DLPackBuffer::new's contract),
        // and the capsule's owner, a clone of that Arc, keeps it alive.
        unsafe { tensor_capsule(slf.py(), this.data.0, this.len, this.dtype, &this.shape[..this.ndim], owner, format) }
    }

    /// `(kDLCPU, 0)`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (KDLCPU, 0)
    }

    /// The same range, kept alive by the same owner, exported as a block of dtype
    /// `code` and `shape` for `numpy.from_dlpack` (`numpy=True`) or
    /// `torch.from_dlpack`. `InvalidArgument` for an unknown code, a shape a block
    /// cannot have, or one whose elements do not take exactly this range's bytes.
    #[pyo3(signature = (code, shape, *, numpy=false))]
    fn typed(&self, code: u8, shape: Vec<u64>, numpy: bool) -> PyResult<DLPackBuffer> {
        let this = self;
        let dtype = DType::from_code(code).ok_or_else(|| {
            InvalidArgument::new_err(format!("unknown dtype code {code}; known codes are 1..{}", DType::ALL.len()))
        })?;
        let block = Shape::new(&shape).ok_or_else(|| {
            InvalidArgument::new_err(format!(
                "shape {shape:?}: a block has at most {MAX_EXPORT_NDIM} dimensions, each below 2**32"
            ))
        })?;
        let need = block.len_bytes(dtype).ok_or_else(|| {
            TooLarge::new_err(format!("a {} block of shape {shape:?} overflows 64 bits", dtype.name()))
        })?;
        if need != this.len as u64 {
            return Err(InvalidArgument::new_err(format!(
                "the buffer has {} bytes, but a {} block of shape {shape:?} needs {need}",
                this.len,
                dtype.name()
            )));
        }
        let mut dims = [0; MAX_EXPORT_NDIM];
        dims[..shape.len()].copy_from_slice(&shape);
        let reader = if numpy { Reader::Numpy } else { Reader::Torch };
        Ok(DLPackBuffer {
            data: this.data,
            len: this.len,
            owner: Arc::clone(&this.owner),
            read_only: this.read_only,
            dtype: DlDtype::of(dtype, reader),
            shape: dims,
            ndim: shape.len(),
        })
    }

    /// Length of the range in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }

    /// Base address of the range (for tests and diagnostics: compare with
    /// `tensor.data_ptr()` / `array.ctypes.data`).
    #[getter]
    fn address(&self) -> usize {
        self.data.0.as_ptr() as usize
    }

    /// Whether versioned exports are flagged read-only.
    #[getter]
    fn readonly(&self) -> bool {
        self.read_only
    }

    fn __len__(&self) -> usize {
        self.len
    }

    fn __repr__(&self) -> String {
        format!(
            "<kachedb DLPackBuffer {} bytes at {:#x}{}>",
            self.len,
            self.data.0.as_ptr() as usize,
            if self.read_only { ", read-only" } else { "" }
        )
    }
}
