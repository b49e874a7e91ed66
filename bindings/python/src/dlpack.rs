//! DLPack export of raw byte ranges as zero-copy `uint8` CPU tensors.
//!
//! The contract with consumers (torch, numpy, any array-API library) is the
//! *legacy* DLPack one (DLPack 0.x `DLManagedTensor`, capsule name `"dltensor"`),
//! which every consumer still accepts, even one that asked for `max_version=(1, 0)`:
//!
//! * [`u8_capsule`] wraps `len` bytes at `data` in a `DLManagedTensor` describing a
//!   1-D `uint8` tensor on `kDLCPU` (shape `[len]`, strides NULL = compact,
//!   byte_offset 0) and puts it in a `PyCapsule` named `"dltensor"`.
//! * The memory is kept valid by an [`DlOwner`] that travels with the tensor. A
//!   consumer that takes the tensor renames the capsule `"used_dltensor"` and calls
//!   the tensor's deleter when its last view goes away; the deleter drops the owner.
//!   A capsule that is never consumed frees the tensor (and drops the owner) in its
//!   own destructor, which checks the name first, as the DLPack spec says.
//! * [`DLPackBuffer`] is the Python-visible exporter (`__dlpack__`,
//!   `__dlpack_device__`): each export clones its shared owner, so the owner is
//!   dropped only when the buffer object *and* every tensor made from it (slices,
//!   `.view(dtype)`, `as_strided`, …, which all share the consumer's one deleter)
//!   are gone.
//!
//! Typing the bytes (`t.view(torch.bfloat16).view(shape)`) is left to Python
//! (`kachedb._views`), which works for dtypes that DLPack cannot describe (float8).

use std::any::Any;
use std::ffi::{c_void, CStr};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::{self, NonNull};
use std::sync::Arc;

use pyo3::exceptions::{PyBufferError, PyOverflowError};
use pyo3::ffi;
use pyo3::prelude::*;

/// Capsule name of an unconsumed legacy DLPack tensor.
const DLTENSOR_NAME: &CStr = c"dltensor";
/// Capsule name a consumer gives the capsule once it owns the tensor.
const USED_DLTENSOR_NAME: &CStr = c"used_dltensor";

/// `DLDeviceType::kDLCPU`.
pub const KDLCPU: i32 = 1;
/// `DLDataTypeCode::kDLUInt`.
const KDLUINT: u8 = 1;

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

#[repr(C)]
#[derive(Debug)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// What keeps exported memory valid. It is dropped exactly once, when the last
/// consumer view is gone (or when an unconsumed capsule is destroyed).
pub enum DlOwner {
    /// A Rust value (e.g. a pin guard). Dropped on whatever thread frees the
    /// tensor, without the GIL: its `Drop` must not need Python and should not block.
    Rust(Box<dyn Any + Send>),
    /// A Python object. Its reference is dropped with the GIL taken (the deleter
    /// may run on a thread that does not hold it).
    Py(Py<PyAny>),
}

impl fmt::Debug for DlOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DlOwner::Rust(_) => f.write_str("DlOwner::Rust(..)"),
            DlOwner::Py(obj) => write!(f, "DlOwner::Py({:p})", obj.as_ptr()),
        }
    }
}

impl DlOwner {
    /// Drops the owner from a deleter: never unwinds, takes the GIL for Python owners.
    fn release(self) {
        match self {
            DlOwner::Rust(owner) => {
                // A panicking Drop must not unwind into the consumer's C frames;
                // the payload is dropped here as well (it cannot panic again in a
                // way that matters: if it does, the process aborts, as for any
                // panic in a destructor during unwinding).
                let _ = catch_unwind(AssertUnwindSafe(move || drop(owner)));
            }
            DlOwner::Py(obj) => {
                // SAFETY: Py_IsInitialized may be called at any time, with or
                // without the GIL.
                if unsafe { ffi::Py_IsInitialized() } == 0 {
                    // The interpreter is gone (a tensor freed after finalisation):
                    // there is no one to decref for, leak the reference.
                    std::mem::forget(obj);
                    return;
                }
                let _ = catch_unwind(AssertUnwindSafe(move || Python::with_gil(move |_py| drop(obj))));
            }
        }
    }
}

/// One exported tensor: the DLPack struct, its shape array and its owner, in a
/// single heap allocation that the deleter frees. `managed` is first and the struct
/// is `repr(C)`, but the deleter finds the allocation through `manager_ctx`, not by
/// casting the `DLManagedTensor` pointer.
#[repr(C)]
struct ManagerCtx {
    managed: DLManagedTensor,
    shape: [i64; 1],
    owner: DlOwner,
}

/// `DLManagedTensor::deleter`: frees the [`ManagerCtx`] and drops its owner.
///
/// # Safety
/// `managed` is null, or a pointer produced by [`u8_capsule`] whose tensor has not
/// been deleted yet (DLPack: the deleter is called once, by the tensor's one owner).
unsafe extern "C" fn managed_deleter(managed: *mut DLManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: per this function's contract `managed` points to the `managed` field of
    // a live `ManagerCtx`, whose `manager_ctx` was set to the `Box::into_raw` pointer
    // of that allocation; it is reconstructed once, here, because DLPack calls the
    // deleter exactly once.
    let ctx = unsafe { Box::from_raw((*managed).manager_ctx.cast::<ManagerCtx>()) };
    let ManagerCtx { owner, .. } = *ctx;
    owner.release();
}

/// The capsule's destructor: frees the tensor only if no consumer took it.
///
/// # Safety
/// Called by CPython, with the GIL held, on a capsule created by [`u8_capsule`].
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: `capsule` is a live capsule (CPython is destroying it) and the GIL is
    // held; PyCapsule_IsValid does not set an exception on a name mismatch.
    if unsafe { ffi::PyCapsule_IsValid(capsule, USED_DLTENSOR_NAME.as_ptr()) } == 1 {
        // A consumer owns the tensor now and will call the deleter itself.
        return;
    }
    let mut ptype = ptr::null_mut();
    let mut pvalue = ptr::null_mut();
    let mut ptraceback = ptr::null_mut();
    // SAFETY: GIL held; the exception in flight (if any: a destructor may run while
    // one propagates) is stashed here and restored below, so that
    // PyCapsule_GetPointer's own error reporting cannot clobber it.
    #[allow(deprecated)] // PyErr_GetRaisedException is 3.12+, we target the 3.9 abi3
    unsafe {
        ffi::PyErr_Fetch(&mut ptype, &mut pvalue, &mut ptraceback)
    };
    // SAFETY: GIL held, `capsule` live; a wrong name returns NULL with an exception set.
    let managed = unsafe { ffi::PyCapsule_GetPointer(capsule, DLTENSOR_NAME.as_ptr()) }
        .cast::<DLManagedTensor>();
    if managed.is_null() {
        // Neither "dltensor" nor "used_dltensor": someone renamed it; leaking is the
        // only safe choice. Report it without raising from a destructor.
        // SAFETY: GIL held, an exception is set (by PyCapsule_GetPointer).
        unsafe { ffi::PyErr_WriteUnraisable(capsule) };
    } else {
        // SAFETY: the capsule still has its original name, so no consumer took the
        // tensor and nobody else will call its deleter: it is ours to delete, once.
        unsafe {
            if let Some(deleter) = (*managed).deleter {
                deleter(managed);
            }
        }
    }
    // SAFETY: GIL held; hands back the references taken by PyErr_Fetch above.
    #[allow(deprecated)]
    unsafe {
        ffi::PyErr_Restore(ptype, pvalue, ptraceback)
    };
}

/// Wraps `len` bytes at `data` in a legacy DLPack capsule (`"dltensor"`) describing
/// a 1-D `uint8` CPU tensor, whose deleter drops `owner`.
///
/// `len` may be 0 (`data` is still non-null, as DLPack consumers expect).
///
/// # Errors
/// `OverflowError` if `len` does not fit an `i64`; a Python error if the capsule
/// cannot be created (then `owner` has already been dropped).
///
/// # Safety
/// `data .. data + len` must be valid for reads and writes, and not be freed or
/// unmapped, for as long as `owner` is alive. Consumers may write through the
/// tensor: if other code reads the range, that is the caller's protocol to uphold
/// (blocks handed to readers are immutable by contract, not by the MMU).
pub unsafe fn u8_capsule<'py>(
    py: Python<'py>,
    data: NonNull<u8>,
    len: usize,
    owner: DlOwner,
) -> PyResult<Bound<'py, PyAny>> {
    let Ok(len_i64) = i64::try_from(len) else {
        return Err(PyOverflowError::new_err(format!(
            "a DLPack tensor holds at most {} bytes, this one has {len}",
            i64::MAX
        )));
    };
    let ctx = Box::into_raw(Box::new(ManagerCtx {
        managed: DLManagedTensor {
            dl_tensor: DLTensor {
                data: data.as_ptr().cast(),
                device: DLDevice { device_type: KDLCPU, device_id: 0 },
                ndim: 1,
                dtype: DLDataType { code: KDLUINT, bits: 8, lanes: 1 },
                shape: ptr::null_mut(), // set below, once the allocation has its address
                strides: ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: ptr::null_mut(),
            deleter: Some(managed_deleter),
        },
        shape: [len_i64],
        owner,
    }));
    // SAFETY: `ctx` comes from Box::into_raw just above: valid, aligned, unaliased.
    // The pointers stored point into that same allocation, which stays put until the
    // deleter frees it.
    let managed = unsafe {
        (*ctx).managed.dl_tensor.shape = ptr::addr_of_mut!((*ctx).shape).cast::<i64>();
        (*ctx).managed.manager_ctx = ctx.cast::<c_void>();
        ptr::addr_of_mut!((*ctx).managed)
    };
    // SAFETY: the GIL is held (`py`); the name is a 'static C string, as capsules
    // keep the pointer; the destructor matches the capsule's contents.
    let capsule = unsafe {
        ffi::PyCapsule_New(managed.cast::<c_void>(), DLTENSOR_NAME.as_ptr(), Some(capsule_destructor))
    };
    if capsule.is_null() {
        // SAFETY: the capsule does not exist, so nothing else refers to `managed`;
        // delete it ourselves (drops the owner) before reporting the error.
        unsafe { managed_deleter(managed) };
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

/// How a [`DLPackBuffer`] keeps its memory alive in the capsules it exports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OwnerMode {
    /// Each capsule holds a clone of the buffer's `Arc` owner (no GIL to drop it).
    Shared,
    /// Each capsule holds a reference to the buffer object itself (a Python owner,
    /// dropped with the GIL); used to test that path.
    PyObject,
}

/// A byte range exportable as DLPack: `torch.from_dlpack(buf)`, `numpy.from_dlpack(buf)`.
///
/// The range stays valid for as long as this object or any tensor made from it lives.
#[pyclass(frozen, module = "kachedb._kachedb_rust", name = "DLPackBuffer")]
pub struct DLPackBuffer {
    data: RawBytes,
    len: usize,
    owner: Arc<dyn Any + Send + Sync>,
    mode: OwnerMode,
}

impl fmt::Debug for DLPackBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DLPackBuffer")
            .field("data", &self.data.0)
            .field("len", &self.len)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl DLPackBuffer {
    /// An exporter for `len` bytes at `data`, kept valid by `owner`.
    ///
    /// # Safety
    /// `data .. data + len` must stay valid for reads and writes for as long as
    /// `owner` (or any clone of the `Arc`) is alive.
    pub unsafe fn new(data: NonNull<u8>, len: usize, owner: Arc<dyn Any + Send + Sync>) -> Self {
        DLPackBuffer { data: RawBytes(data), len, owner, mode: OwnerMode::Shared }
    }

    /// Like [`DLPackBuffer::new`], but capsules hold the Python buffer object itself.
    ///
    /// # Safety
    /// As for [`DLPackBuffer::new`].
    pub(crate) unsafe fn new_py_owned(data: NonNull<u8>, len: usize, owner: Arc<dyn Any + Send + Sync>) -> Self {
        DLPackBuffer { data: RawBytes(data), len, owner, mode: OwnerMode::PyObject }
    }
}

#[pymethods]
impl DLPackBuffer {
    /// Exports the bytes as a legacy DLPack capsule (1-D `uint8`, CPU).
    ///
    /// `stream` and `max_version` are accepted and ignored (CPU memory needs no
    /// stream; a legacy capsule is valid whatever version the consumer can read).
    /// `dl_device` other than CPU, or `copy=True`, raise `BufferError`.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<&Bound<'py, PyAny>>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = (stream, max_version);
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
                "a KacheDB block is exported without copying; call .clone() / .copy() on the result instead of copy=True",
            ));
        }
        let this = slf.get();
        let owner = match this.mode {
            OwnerMode::Shared => DlOwner::Rust(Box::new(Arc::clone(&this.owner))),
            OwnerMode::PyObject => DlOwner::Py(slf.clone().into_any().unbind()),
        };
        // SAFETY: `this.owner` keeps the range valid (DLPackBuffer::new's contract),
        // and the capsule's owner keeps `this.owner` alive: either a clone of the Arc,
        // or a reference to this buffer object, which holds the Arc.
        unsafe { u8_capsule(slf.py(), this.data.0, this.len, owner) }
    }

    /// `(kDLCPU, 0)`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (KDLCPU, 0)
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

    fn __len__(&self) -> usize {
        self.len
    }

    fn __repr__(&self) -> String {
        format!("<kachedb DLPackBuffer {} bytes at {:#x}>", self.len, self.data.0.as_ptr() as usize)
    }
}
