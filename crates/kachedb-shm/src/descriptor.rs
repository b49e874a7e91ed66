//! `TensorBlockDescriptor`: the 64-byte frame every ring slot holds, the
//! encoders that build frames ([`Request::encode`] on the client side,
//! [`Completion::encode`] on the daemon side) and the checked decoders that
//! turn a frame copied out of shared memory back into a [`Request`] (daemon
//! side) or a [`Completion`] (client side).
//!
//! The layout is the wire contract of `docs/PROTOCOL.md`, and each of its
//! rules is written here once: the RESERVE page offset
//! ([`page_offset_is_valid`], [`page_offset_of`]), a tensor's byte length
//! ([`Shape::len_bytes`], [`Shape::check_len`]), what a COMMIT's key fields
//! name ([`COMMIT_HAS_PARENT`], [`COMMIT_NAMES_KEY`], in `commit_request`),
//! which RESERVEs form one reservation unit ([`RESERVE_CONTINUES`],
//! [`continues_unit`], [`unit_len`], [`mark_unit`]).
//! Everything read from shared
//! memory is untrusted: decoding never panics and never indexes with an
//! unchecked value.

use crate::block_meta::{MAX_META_LEN, META_HEADER_LEN};
use bytemuck::{Pod, Zeroable};

/// Most dimensions a descriptor carries.
pub const MAX_DIMS: usize = 6;

/// The page: the unit of the region's layout and of the megaslab's extents,
/// and what RESERVE page offsets are within. Defined here, the ground floor
/// of the crate (the region and the ring import this module, not the reverse).
pub const PAGE_LEN: u64 = 4096;
const _: () = assert!(PAGE_LEN.is_power_of_two());

/// RESERVE page offsets are multiples of this many bytes.
pub const PAGE_OFFSET_ALIGN: u64 = 64;
const _: () = assert!(PAGE_OFFSET_ALIGN.is_power_of_two() && PAGE_OFFSET_ALIGN < PAGE_LEN);

/// Whether `page_offset` is a valid RESERVE page offset: a multiple of
/// [`PAGE_OFFSET_ALIGN`] below [`PAGE_LEN`] (0 asks for no particular offset).
pub const fn page_offset_is_valid(page_offset: u64) -> bool {
    page_offset < PAGE_LEN && page_offset & (PAGE_OFFSET_ALIGN - 1) == 0
}

/// The RESERVE page offset that gives a block the alignment within a page of
/// the source at `addr` (rounded down to [`PAGE_OFFSET_ALIGN`]), so a copy
/// from that source into the block runs at full speed. Always valid.
pub fn page_offset_of(addr: *const u8) -> u64 {
    (addr as u64 % PAGE_LEN) & !(PAGE_OFFSET_ALIGN - 1)
}

/// COMMIT flag (the frame's `offset` field): the key fields carry the
/// committed block's **parent**, the block that precedes it in a prefix chain
/// (`docs/PROTOCOL.md`, "COMMIT and the parent"; `docs/eviction.md`). Without
/// it (and without [`COMMIT_NAMES_KEY`]) the key fields of a COMMIT are
/// ignored (old clients send zero there). Any other bit of a COMMIT's `offset`,
/// or both flags at once, makes the frame invalid.
pub const COMMIT_HAS_PARENT: u64 = 1;

/// COMMIT flag (the frame's `offset` field): the key fields carry the key the
/// block is committed under, in place of the key it was reserved with
/// (`docs/PROTOCOL.md`, "COMMIT and the key"): a writer that must place its
/// bytes before it knows their key reserves with any key and names the real
/// one here. Decoded as [`Request::CommitAs`]. Its parent, if it has one,
/// rides in the shape words ([`COMMIT_AS_PARENT_NDIM`]).
pub const COMMIT_NAMES_KEY: u64 = 2;

/// The `ndim` of a COMMIT with [`COMMIT_NAMES_KEY`] whose shape words carry
/// the block's parent: `shape[0]`, `shape[1]` its key's low 64 bits and
/// `shape[2]`, `shape[3]` its high 64 bits, low word first. `ndim` 0 (every
/// shape word 0): no parent; any other `ndim`, or a word past the parent
/// that is not 0, makes the frame invalid. A daemon that predates the parent
/// here reads no shape word of a COMMIT and commits such a block without one.
pub const COMMIT_AS_PARENT_NDIM: u8 = 4;

/// RESERVE flag (the frame's `handle` field, unused by RESERVE otherwise):
/// the next RESERVE on this ring belongs to the same **reservation unit**
/// (`docs/PROTOCOL.md`, "Reservation units"). A unit is a run of RESERVEs
/// each flagged but the last, at most the ring's capacity long; the daemon
/// admits a unit whole or not at all: if one of its RESERVEs is refused,
/// every RESERVE of the unit is answered with that refusal and nothing is
/// left reserved or evicted. A RESERVE without the flag whose predecessor
/// has none is a unit of its own (every RESERVE of a client that does not
/// know the flag). Any other bit of a RESERVE's `handle` makes the frame
/// invalid.
pub const RESERVE_CONTINUES: u64 = 1;

/// Whether frame `d` is a RESERVE that continues a reservation unit
/// ([`RESERVE_CONTINUES`]): the next RESERVE on its ring belongs to the same
/// unit. Read on the raw frame, so that a unit is known before any of it is
/// decoded.
pub fn continues_unit(d: &TensorBlockDescriptor) -> bool {
    d.op == Op::Reserve as u8 && d.handle & RESERVE_CONTINUES != 0
}

/// How many frames of `frames`, from the first, form its reservation unit:
/// the run of RESERVEs that [continue](continues_unit) a unit, then the
/// RESERVE that ends it (if it is there), at most `max_len` (the ring's
/// capacity) frames. 1 for a first frame that continues no unit, 0 for no
/// frames. A unit cut short (the frames end, or a frame that is not a
/// RESERVE follows a flagged one) is the frames that are there.
pub fn unit_len(frames: &[TensorBlockDescriptor], max_len: usize) -> usize {
    let mut n = 0;
    for f in frames.iter().take(max_len.max(1)) {
        if n > 0 && f.op != Op::Reserve as u8 {
            break;
        }
        n += 1;
        if !continues_unit(f) {
            break;
        }
    }
    n
}

/// Marks `frames` (encoded RESERVEs, at most the ring's capacity) as one
/// reservation unit: [`RESERVE_CONTINUES`] on every frame but the last,
/// which ends it. The frames must be published in one push (the daemon
/// admits the unit it finds on the ring).
pub fn mark_unit(frames: &mut [TensorBlockDescriptor]) {
    let n = frames.len();
    for (i, f) in frames.iter_mut().enumerate() {
        if f.op == Op::Reserve as u8 {
            if i + 1 < n {
                f.handle |= RESERVE_CONTINUES;
            } else {
                f.handle &= !RESERVE_CONTINUES;
            }
        }
    }
}

/// One ring slot: 64 bytes, plain old data, every bit pattern valid.
#[repr(C)]
#[derive(Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct TensorBlockDescriptor {
    /// [`Op`] code.
    pub op: u8,
    /// [`Status`] code; 0 in requests.
    pub status: u8,
    /// [`DType`] code.
    pub dtype: u8,
    /// Number of meaningful entries in `shape` (0..=6).
    pub ndim: u8,
    /// Chosen by the client, echoed by the daemon.
    pub request_id: u32,
    /// Low 64 bits of the 128-bit key.
    pub key_lo: u64,
    /// High 64 bits of the 128-bit key.
    pub key_hi: u64,
    /// Reservation or pin handle, opaque to clients.
    pub handle: u64,
    /// Bytes from the region base (RESERVE request: wanted offset within a 4 KiB page).
    pub offset: u64,
    /// Dimensions; entries past `ndim` must be 0.
    pub shape: [u32; MAX_DIMS],
}

const _: () = assert!(core::mem::size_of::<TensorBlockDescriptor>() == 64);
const _: () = assert!(core::mem::align_of::<TensorBlockDescriptor>() == 8);
const _: () = assert!(core::mem::offset_of!(TensorBlockDescriptor, request_id) == 4);
const _: () = assert!(core::mem::offset_of!(TensorBlockDescriptor, key_lo) == 8);
const _: () = assert!(core::mem::offset_of!(TensorBlockDescriptor, handle) == 24);
const _: () = assert!(core::mem::offset_of!(TensorBlockDescriptor, offset) == 32);
const _: () = assert!(core::mem::offset_of!(TensorBlockDescriptor, shape) == 40);

impl core::fmt::Debug for TensorBlockDescriptor {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("TensorBlockDescriptor")
            .field("op", &self.op)
            .field("status", &self.status)
            .field("dtype", &self.dtype)
            .field("ndim", &self.ndim)
            .field("request_id", &self.request_id)
            .field("key", &format_args!("{:#034x}", self.key()))
            .field("handle", &self.handle)
            .field("offset", &self.offset)
            .field("shape", &self.shape)
            .finish()
    }
}

impl TensorBlockDescriptor {
    /// The 128-bit key.
    pub fn key(&self) -> u128 {
        (u128::from(self.key_hi) << 64) | u128::from(self.key_lo)
    }

    /// Sets the 128-bit key.
    pub fn set_key(&mut self, key: u128) {
        self.key_lo = key as u64;
        self.key_hi = (key >> 64) as u64;
    }

    /// A request frame with only `op`, `request_id` and `key` set.
    pub fn request(op: Op, request_id: u32, key: u128) -> Self {
        let mut d = Self { op: op as u8, request_id, ..Self::default() };
        d.set_key(key);
        d
    }

    /// Sets dtype, ndim and shape from a checked [`Shape`].
    pub fn set_shape(&mut self, dtype: DType, shape: &Shape) {
        self.dtype = dtype as u8;
        self.ndim = shape.ndim;
        self.shape = shape.dims;
    }

    /// The frame as bytes.
    pub fn as_bytes(&self) -> &[u8; 64] {
        bytemuck::cast_ref(self)
    }

    /// A frame from 64 arbitrary bytes (every bit pattern is a valid frame).
    pub fn from_bytes(bytes: &[u8; 64]) -> Self {
        bytemuck::cast(*bytes)
    }
}

macro_rules! code_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident = $c:expr),+ $(,)? }) => {
        $(#[$m])*
        #[repr(u8)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name { $($(#[$vm])* $v = $c),+ }
        impl $name {
            /// Every variant, in code order.
            pub const ALL: &'static [$name] = &[$($name::$v),+];
            /// The variant for a wire code, if any.
            pub fn from_code(code: u8) -> Option<Self> {
                match code { $($c => Some($name::$v),)+ _ => None }
            }
        }
    };
}

code_enum! {
    /// Operation codes (`docs/PROTOCOL.md`).
    Op {
        /// Round trip, no effect.
        Ping = 1,
        /// Allocate an extent for a key; invisible until COMMIT.
        Reserve = 2,
        /// Seal a reservation: it becomes visible under its key.
        Commit = 3,
        /// Drop a reservation.
        Abort = 4,
        /// Pin a committed block and return where it is.
        Get = 5,
        /// Drop one pin.
        Release = 6,
        /// Is the key present (marks it recently used).
        Lookup = 7,
        /// Unlink a key.
        Delete = 8,
        /// Block count and bytes used.
        Stats = 9,
        /// GET that, if the key is absent, waits in the daemon until it is
        /// committed or the timeout the frame carries passes.
        Wait = 10,
        /// COMMIT that also pins the committed block, answered as a GET: for a
        /// writer that keeps a pointer into the block after committing it.
        CommitPin = 11,
        /// Attach a block metadata record (`block_meta`) to an open
        /// reservation, read from another reservation's bytes: the engine's
        /// hash, parent, tokens of the block, for the KV events.
        Meta = 12,
    }
}

code_enum! {
    /// Completion status codes.
    Status {
        /// Success.
        Ok = 0,
        /// No committed block has that key.
        NotFound = 1,
        /// Nothing more can be evicted to make room.
        OutOfMemory = 2,
        /// The frame failed validation.
        Invalid = 3,
        /// The handle is not one of this client's live reservations or pins.
        BadHandle = 4,
        /// The block is larger than the whole megaslab.
        TooLarge = 5,
        /// The daemon broke an invariant of its own (a bug; reported, never a panic).
        Internal = 6,
        /// WAIT: the key was not committed before the timeout passed.
        TimedOut = 7,
        /// The block belongs to a tenant bound to an identity (`kachedb serve
        /// --tenant-uid` / `--tenant-gid`) that this client is not: it may
        /// read the block, not replace or delete it. Nothing changed.
        Denied = 8,
        /// A DELETE, or a COMMIT that replaced a block, took effect in the
        /// megaslab, but a tier behind it (the disk) could not confirm in
        /// time that its older copy is gone: until it does (retried), the
        /// tier serves no copy of the key, but after a crash the older copy
        /// may come back.
        NotDurable = 9,
    }
}

code_enum! {
    /// Element types.
    DType {
        /// Raw bytes.
        U8 = 1,
        /// Signed 8-bit integer.
        I8 = 2,
        /// Signed 32-bit integer.
        I32 = 3,
        /// Signed 64-bit integer.
        I64 = 4,
        /// IEEE half.
        F16 = 5,
        /// bfloat16.
        BF16 = 6,
        /// IEEE single.
        F32 = 7,
        /// IEEE double.
        F64 = 8,
        /// float8 e4m3fn.
        F8E4M3FN = 9,
        /// float8 e5m2.
        F8E5M2 = 10,
        /// Boolean, one byte.
        Bool = 11,
        /// Signed 16-bit integer.
        I16 = 12,
    }
}

impl DType {
    /// Bytes per element.
    pub fn itemsize(self) -> u64 {
        match self {
            DType::U8 | DType::I8 | DType::F8E4M3FN | DType::F8E5M2 | DType::Bool => 1,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// Short lower-case name (`"f16"`, `"bf16"`, …).
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F8E4M3FN => "f8e4m3fn",
            DType::F8E5M2 => "f8e5m2",
            DType::Bool => "bool",
            DType::I16 => "i16",
        }
    }
}

/// A checked shape: `ndim <= 6`, unused dims zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Shape {
    ndim: u8,
    dims: [u32; MAX_DIMS],
}

impl Shape {
    /// A shape from dims; `None` if more than [`MAX_DIMS`] or a dim exceeds `u32`.
    pub fn new(dims: &[u64]) -> Option<Self> {
        if dims.len() > MAX_DIMS {
            return None;
        }
        let mut out = [0u32; MAX_DIMS];
        for (o, &d) in out.iter_mut().zip(dims) {
            *o = u32::try_from(d).ok()?;
        }
        Some(Self { ndim: dims.len() as u8, dims: out })
    }

    /// A flat byte shape `[len]`; for lengths above `u32::MAX` a 2-D shape
    /// `[len / 4096, 4096]` (rows of one [`PAGE_LEN`]) when `len` is a multiple of 4096.
    pub fn for_bytes(len: u64) -> Option<Self> {
        if len <= u64::from(u32::MAX) {
            Self::new(&[len])
        } else if len.is_multiple_of(PAGE_LEN) {
            Self::new(&[len / PAGE_LEN, PAGE_LEN])
        } else {
            None
        }
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        usize::from(self.ndim)
    }

    /// The meaningful dims.
    pub fn dims(&self) -> &[u32] {
        &self.dims[..usize::from(self.ndim)]
    }

    /// Element count, `None` on overflow.
    pub fn numel(&self) -> Option<u64> {
        self.dims().iter().try_fold(1u64, |acc, &d| acc.checked_mul(u64::from(d)))
    }

    /// Byte length for `dtype`, `None` on overflow.
    pub fn len_bytes(&self, dtype: DType) -> Option<u64> {
        self.numel()?.checked_mul(dtype.itemsize())
    }

    /// Checks that `given` bytes are exactly this shape of `dtype`; returns the length.
    pub fn check_len(&self, dtype: DType, given: u64) -> Result<u64, LenError> {
        match self.len_bytes(dtype) {
            None => Err(LenError::Overflow),
            Some(len) if len != given => Err(LenError::Mismatch { expected: len, given }),
            Some(len) => Ok(len),
        }
    }
}

/// Why bytes do not fit a shape and dtype ([`Shape::check_len`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LenError {
    /// `numel * itemsize` does not fit in 64 bits.
    #[error("shape times itemsize overflows 64 bits")]
    Overflow,
    /// The shape and dtype make another length than the bytes given.
    #[error("shape and dtype make {expected} bytes but {given} were given")]
    Mismatch {
        /// `numel * itemsize`.
        expected: u64,
        /// Bytes given.
        given: u64,
    },
}

/// Why a frame was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// `op` is not a known code.
    #[error("unknown op code {0}")]
    UnknownOp(u8),
    /// `status` is not a known code.
    #[error("unknown status code {0}")]
    UnknownStatus(u8),
    /// `dtype` is not a known code.
    #[error("unknown dtype code {0}")]
    UnknownDType(u8),
    /// `ndim` is larger than [`MAX_DIMS`].
    #[error("ndim {0} is larger than {MAX_DIMS}")]
    TooManyDims(u8),
    /// A dim past `ndim` is not zero.
    #[error("shape entry {0} is past ndim but not zero")]
    UnusedDimNotZero(usize),
    /// `numel * itemsize` does not fit in 64 bits.
    #[error("shape times itemsize overflows 64 bits")]
    LengthOverflow,
    /// RESERVE: the wanted page offset fails [`page_offset_is_valid`].
    #[error("page offset {0} is not a multiple of {PAGE_OFFSET_ALIGN} below {PAGE_LEN}")]
    BadPageOffset(u64),
    /// COMMIT: the `offset` field is neither 0, [`COMMIT_HAS_PARENT`] nor
    /// [`COMMIT_NAMES_KEY`].
    #[error("COMMIT flags {0:#x} are not 0, COMMIT_HAS_PARENT (1) or COMMIT_NAMES_KEY (2)")]
    BadCommitFlags(u64),
    /// COMMIT with [`COMMIT_NAMES_KEY`]: `ndim` is neither 0 nor
    /// [`COMMIT_AS_PARENT_NDIM`], or a shape word it does not use is not 0.
    #[error("COMMIT naming its key with ndim {0}: the shape words carry a parent (ndim 4) or are all 0")]
    BadCommitParent(u8),
    /// RESERVE: the `handle` field is neither 0 nor [`RESERVE_CONTINUES`].
    #[error("RESERVE flags {0:#x} are not 0 or RESERVE_CONTINUES (1)")]
    BadReserveFlags(u64),
    /// META: the record is longer than [`MAX_META_LEN`] or shorter than
    /// its header.
    #[error("META of {0} bytes: a block metadata record is {META_HEADER_LEN} to {MAX_META_LEN} bytes")]
    BadMetaLen(u64),
    /// A request carried a non-zero status.
    #[error("request frames must carry status 0, got {0}")]
    StatusInRequest(u8),
}

/// A validated request, as the daemon acts on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    /// PING.
    Ping,
    /// RESERVE of `len` bytes for `key`.
    Reserve {
        /// Key.
        key: u128,
        /// Element type.
        dtype: DType,
        /// Dims.
        shape: Shape,
        /// Bytes (`numel * itemsize`), may be 0.
        len: u64,
        /// Wanted data offset modulo [`PAGE_LEN`] ([`page_offset_is_valid`]).
        page_offset: u64,
    },
    /// COMMIT a reservation.
    Commit {
        /// Reservation handle.
        handle: u64,
        /// The key of the block this one follows in a prefix chain, if any
        /// (carried in the key fields with [`COMMIT_HAS_PARENT`]).
        parent: Option<u128>,
    },
    /// COMMIT a reservation and pin the block it becomes, in one step (no
    /// other request can evict, replace-and-free or reuse it in between).
    CommitPin {
        /// Reservation handle.
        handle: u64,
        /// As for [`Request::Commit`].
        parent: Option<u128>,
    },
    /// COMMIT (`pin`: COMMIT_PIN) a reservation under `key`, whatever key it
    /// was reserved with ([`COMMIT_NAMES_KEY`]).
    CommitAs {
        /// Reservation handle.
        handle: u64,
        /// The key the block becomes visible under.
        key: u128,
        /// As for [`Request::Commit`] (carried in the shape words,
        /// [`COMMIT_AS_PARENT_NDIM`]).
        parent: Option<u128>,
        /// COMMIT_PIN (the answer carries a pin) rather than COMMIT.
        pin: bool,
    },
    /// META: attach the block metadata record at `offset` bytes into the
    /// data of reservation `scratch`, `len` bytes long, to reservation
    /// `handle` (both this client's, open), which keeps it when committed.
    Meta {
        /// The reservation the record describes.
        handle: u64,
        /// The reservation whose bytes hold the record (carried in `key_lo`).
        scratch: u64,
        /// Where the record starts in `scratch`'s data, bytes.
        offset: u64,
        /// The record's length, bytes (carried in `key_hi`).
        len: u64,
    },
    /// ABORT a reservation.
    Abort {
        /// Reservation handle.
        handle: u64,
    },
    /// GET (pin) a block.
    Get {
        /// Key.
        key: u128,
    },
    /// RELEASE a pin.
    Release {
        /// Pin handle.
        handle: u64,
    },
    /// LOOKUP a key.
    Lookup {
        /// Key.
        key: u128,
    },
    /// DELETE a key.
    Delete {
        /// Key.
        key: u128,
    },
    /// STATS.
    Stats,
    /// WAIT for a key: a GET answered once the key is committed, or
    /// `TIMED_OUT` after `timeout_us` microseconds.
    Wait {
        /// Key.
        key: u128,
        /// Microseconds to wait from when the daemon reads the frame; 0 = do not
        /// wait, [`WAIT_FOREVER`] = no deadline.
        timeout_us: u64,
    },
}

/// The WAIT timeout that means "no deadline".
pub const WAIT_FOREVER: u64 = u64::MAX;

/// Dtype and shape of a frame, checked: a known dtype, `ndim <= 6`, unused dims zero.
fn checked_dims(d: &TensorBlockDescriptor) -> Result<(DType, Shape), DecodeError> {
    let dtype = DType::from_code(d.dtype).ok_or(DecodeError::UnknownDType(d.dtype))?;
    if usize::from(d.ndim) > MAX_DIMS {
        return Err(DecodeError::TooManyDims(d.ndim));
    }
    if let Some(i) = (usize::from(d.ndim)..MAX_DIMS).find(|&i| d.shape[i] != 0) {
        return Err(DecodeError::UnusedDimNotZero(i));
    }
    Ok((dtype, Shape { ndim: d.ndim, dims: d.shape }))
}

/// [`checked_dims`] and the byte length.
fn checked_shape(d: &TensorBlockDescriptor) -> Result<(DType, Shape, u64), DecodeError> {
    let (dtype, shape) = checked_dims(d)?;
    let len = shape.len_bytes(dtype).ok_or(DecodeError::LengthOverflow)?;
    Ok((dtype, shape, len))
}

impl Op {
    /// Whether an OK completion of this op carries a pin (`handle`) and the
    /// block's dtype and shape: GET, WAIT and COMMIT_PIN.
    pub fn pins(self) -> bool {
        matches!(self, Op::Get | Op::Wait | Op::CommitPin)
    }
}

/// A COMMIT or COMMIT_PIN frame (`pin`) as the request it is: the one place
/// its flags are read. `offset` 0: the key fields are ignored;
/// [`COMMIT_HAS_PARENT`]: they name the parent; [`COMMIT_NAMES_KEY`]: the
/// key to commit under ([`Request::CommitAs`]), its parent in the shape
/// words ([`COMMIT_AS_PARENT_NDIM`]); anything else is invalid.
fn commit_request(d: &TensorBlockDescriptor, pin: bool) -> Result<Request, DecodeError> {
    let handle = d.handle;
    let parent = match d.offset {
        0 => None,
        COMMIT_HAS_PARENT => Some(d.key()),
        COMMIT_NAMES_KEY => return Ok(Request::CommitAs { handle, key: d.key(), parent: commit_as_parent(d)?, pin }),
        flags => return Err(DecodeError::BadCommitFlags(flags)),
    };
    Ok(if pin { Request::CommitPin { handle, parent } } else { Request::Commit { handle, parent } })
}

/// The parent a COMMIT with [`COMMIT_NAMES_KEY`] carries in its shape words
/// ([`COMMIT_AS_PARENT_NDIM`]).
fn commit_as_parent(d: &TensorBlockDescriptor) -> Result<Option<u128>, DecodeError> {
    let w = d.shape.map(u128::from);
    match d.ndim {
        0 if w.iter().all(|&x| x == 0) => Ok(None),
        COMMIT_AS_PARENT_NDIM if w[4..].iter().all(|&x| x == 0) => {
            Ok(Some(w[0] | w[1] << 32 | w[2] << 64 | w[3] << 96))
        }
        n => Err(DecodeError::BadCommitParent(n)),
    }
}

impl Request {
    /// A RESERVE, checked as [`decode`](Self::decode) checks a RESERVE frame:
    /// the length must fit in 64 bits and the page offset must be valid.
    pub fn reserve(key: u128, dtype: DType, shape: Shape, page_offset: u64) -> Result<Self, DecodeError> {
        let len = shape.len_bytes(dtype).ok_or(DecodeError::LengthOverflow)?;
        if !page_offset_is_valid(page_offset) {
            return Err(DecodeError::BadPageOffset(page_offset));
        }
        Ok(Request::Reserve { key, dtype, shape, len, page_offset })
    }

    /// Bytes a RESERVE asks for (`numel * itemsize`); 0 for the other ops.
    pub fn reserve_len(&self) -> u64 {
        match self {
            Request::Reserve { len, .. } => *len,
            _ => 0,
        }
    }

    /// The operation.
    pub fn op(&self) -> Op {
        match self {
            Request::Ping => Op::Ping,
            Request::Reserve { .. } => Op::Reserve,
            Request::Commit { .. } => Op::Commit,
            Request::CommitPin { .. } | Request::CommitAs { pin: true, .. } => Op::CommitPin,
            Request::CommitAs { pin: false, .. } => Op::Commit,
            Request::Abort { .. } => Op::Abort,
            Request::Meta { .. } => Op::Meta,
            Request::Get { .. } => Op::Get,
            Request::Release { .. } => Op::Release,
            Request::Lookup { .. } => Op::Lookup,
            Request::Delete { .. } => Op::Delete,
            Request::Stats => Op::Stats,
            Request::Wait { .. } => Op::Wait,
        }
    }

    /// Decodes a request frame copied out of shared memory.
    pub fn decode(d: &TensorBlockDescriptor) -> Result<Self, DecodeError> {
        if d.status != 0 {
            return Err(DecodeError::StatusInRequest(d.status));
        }
        let op = Op::from_code(d.op).ok_or(DecodeError::UnknownOp(d.op))?;
        let key = d.key();
        Ok(match op {
            Op::Ping => Request::Ping,
            Op::Reserve => {
                if d.handle & !RESERVE_CONTINUES != 0 {
                    return Err(DecodeError::BadReserveFlags(d.handle));
                }
                let (dtype, shape) = checked_dims(d)?;
                Request::reserve(key, dtype, shape, d.offset)?
            }
            Op::Commit => commit_request(d, false)?,
            Op::CommitPin => commit_request(d, true)?,
            Op::Abort => Request::Abort { handle: d.handle },
            Op::Meta => {
                if d.key_hi < META_HEADER_LEN as u64 || d.key_hi > MAX_META_LEN as u64 {
                    return Err(DecodeError::BadMetaLen(d.key_hi));
                }
                Request::Meta { handle: d.handle, scratch: d.key_lo, offset: d.offset, len: d.key_hi }
            }
            Op::Get => Request::Get { key },
            Op::Release => Request::Release { handle: d.handle },
            Op::Lookup => Request::Lookup { key },
            Op::Delete => Request::Delete { key },
            Op::Stats => Request::Stats,
            Op::Wait => Request::Wait { key, timeout_us: d.handle },
        })
    }

    /// The frame a client sends for this request, carrying `request_id`; the
    /// fields the op does not use are zero. For every request that
    /// [`decode`](Self::decode) returns (and every one [`reserve`](Self::reserve)
    /// builds), `decode(&r.encode(id)) == Ok(r)`.
    pub fn encode(&self, request_id: u32) -> TensorBlockDescriptor {
        let mut d = TensorBlockDescriptor { op: self.op() as u8, request_id, ..TensorBlockDescriptor::default() };
        match *self {
            Request::Ping | Request::Stats => {}
            Request::Reserve { key, dtype, shape, len: _, page_offset } => {
                d.set_key(key);
                d.set_shape(dtype, &shape);
                d.offset = page_offset;
            }
            Request::Commit { handle, parent } | Request::CommitPin { handle, parent } => {
                d.handle = handle;
                if let Some(parent) = parent {
                    d.set_key(parent);
                    d.offset = COMMIT_HAS_PARENT;
                }
            }
            Request::CommitAs { handle, key, parent, pin: _ } => {
                d.handle = handle;
                d.set_key(key);
                d.offset = COMMIT_NAMES_KEY;
                if let Some(p) = parent {
                    d.ndim = COMMIT_AS_PARENT_NDIM;
                    d.shape[..4].copy_from_slice(&[p as u32, (p >> 32) as u32, (p >> 64) as u32, (p >> 96) as u32]);
                }
            }
            Request::Abort { handle } | Request::Release { handle } => d.handle = handle,
            Request::Meta { handle, scratch, offset, len } => {
                d.handle = handle;
                d.key_lo = scratch;
                d.key_hi = len;
                d.offset = offset;
            }
            Request::Get { key } | Request::Lookup { key } | Request::Delete { key } => d.set_key(key),
            Request::Wait { key, timeout_us } => {
                d.set_key(key);
                d.handle = timeout_us;
            }
        }
        d
    }
}

/// A validated completion, as a client acts on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// Echoed request id.
    pub request_id: u32,
    /// Operation it answers.
    pub op: Op,
    /// Outcome.
    pub status: Status,
    /// Handle (RESERVE, GET), block count (STATS).
    pub handle: u64,
    /// Data offset from the region base (RESERVE, GET), bytes used (STATS).
    pub offset: u64,
    /// Block element type and shape (GET, WAIT, COMMIT_PIN), when present.
    pub tensor: Option<(DType, Shape, u64)>,
}

/// Why an answer is `OUT_OF_MEMORY`, as its `handle` and `offset` say
/// (docs/PROTOCOL.md, "Statuses"): the one place this rule is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutOfMemoryCause {
    /// The megaslab has no room (`offset` 0).
    NoRoom,
    /// This client, or the clients of its uid, hold the per-client or
    /// per-uid limit (`--max-client-bytes`, `--max-uid-bytes`): `offset` is
    /// the limit, `handle` 0.
    ClientLimit(u64),
    /// The block cannot fit within the limit of this client's tenant
    /// (`--tenant-limit`) even after evicting the tenant's own evictable
    /// blocks; nothing was evicted: `offset` is the limit, `handle`
    /// [`OutOfMemoryCause::TENANT_LIMIT_HANDLE`]. A client that does not know
    /// this reads it as a client limit of that many bytes.
    TenantLimit(u64),
}

impl OutOfMemoryCause {
    /// `handle` of an OUT_OF_MEMORY answer refused by the tenant limit.
    pub const TENANT_LIMIT_HANDLE: u64 = 1;

    /// The cause an OUT_OF_MEMORY completion's `handle` and `offset` name.
    pub fn of(handle: u64, offset: u64) -> Self {
        match (handle, offset) {
            (_, 0) => OutOfMemoryCause::NoRoom,
            (Self::TENANT_LIMIT_HANDLE, limit) => OutOfMemoryCause::TenantLimit(limit),
            (_, limit) => OutOfMemoryCause::ClientLimit(limit),
        }
    }

    /// The `(handle, offset)` that name this cause.
    pub fn fields(self) -> (u64, u64) {
        match self {
            OutOfMemoryCause::NoRoom => (0, 0),
            OutOfMemoryCause::ClientLimit(limit) => (0, limit),
            OutOfMemoryCause::TenantLimit(limit) => (Self::TENANT_LIMIT_HANDLE, limit),
        }
    }
}

impl Completion {
    /// Decodes a completion frame copied out of shared memory.
    pub fn decode(d: &TensorBlockDescriptor) -> Result<Self, DecodeError> {
        let op = Op::from_code(d.op).ok_or(DecodeError::UnknownOp(d.op))?;
        let status = Status::from_code(d.status).ok_or(DecodeError::UnknownStatus(d.status))?;
        let pins = op.pins();
        let tensor = if pins && status == Status::Ok { Some(checked_shape(d)?) } else { None };
        Ok(Self { request_id: d.request_id, op, status, handle: d.handle, offset: d.offset, tensor })
    }

    /// The frame the daemon writes for this completion.
    pub fn encode(&self) -> TensorBlockDescriptor {
        let mut d = TensorBlockDescriptor {
            op: self.op as u8,
            status: self.status as u8,
            request_id: self.request_id,
            handle: self.handle,
            offset: self.offset,
            ..TensorBlockDescriptor::default()
        };
        if let Some((dtype, shape, _)) = self.tensor {
            d.set_shape(dtype, &shape);
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_causes_round_trip() {
        for cause in
            [OutOfMemoryCause::NoRoom, OutOfMemoryCause::ClientLimit(1 << 30), OutOfMemoryCause::TenantLimit(3 << 30)]
        {
            let (handle, offset) = cause.fields();
            assert_eq!(OutOfMemoryCause::of(handle, offset), cause);
        }
        // What the daemon answered before tenants existed reads as before.
        assert_eq!(OutOfMemoryCause::of(0, 4096), OutOfMemoryCause::ClientLimit(4096));
    }

    #[test]
    fn reserve_round_trip() {
        let shape = Shape::new(&[2, 16, 8, 128]).unwrap();
        let mut d = TensorBlockDescriptor::request(Op::Reserve, 7, 0xdead_beef_u128 << 70 | 5);
        d.set_shape(DType::F16, &shape);
        d.offset = 128;
        let r = Request::decode(&d).unwrap();
        assert_eq!(
            r,
            Request::Reserve {
                key: 0xdead_beef_u128 << 70 | 5,
                dtype: DType::F16,
                shape,
                len: 2 * 16 * 8 * 128 * 2,
                page_offset: 128
            }
        );
    }

    #[test]
    fn rejects_bad_frames() {
        let mut d = TensorBlockDescriptor::request(Op::Reserve, 1, 1);
        d.dtype = 99;
        assert_eq!(Request::decode(&d), Err(DecodeError::UnknownDType(99)));
        d.dtype = DType::F32 as u8;
        d.ndim = 7;
        assert_eq!(Request::decode(&d), Err(DecodeError::TooManyDims(7)));
        d.ndim = 1;
        d.shape = [4, 0, 0, 0, 0, 9];
        assert_eq!(Request::decode(&d), Err(DecodeError::UnusedDimNotZero(5)));
        d.ndim = 6;
        d.shape = [u32::MAX; 6];
        assert_eq!(Request::decode(&d), Err(DecodeError::LengthOverflow));
        d.ndim = 1;
        d.shape = [4, 0, 0, 0, 0, 0];
        d.offset = 65;
        assert_eq!(Request::decode(&d), Err(DecodeError::BadPageOffset(65)));
        d.op = 0;
        assert_eq!(Request::decode(&d), Err(DecodeError::UnknownOp(0)));
    }

    #[test]
    fn completion_round_trip() {
        let shape = Shape::new(&[3, 5]).unwrap();
        let c = Completion {
            request_id: 9,
            op: Op::Get,
            status: Status::Ok,
            handle: 77,
            offset: 1 << 21,
            tensor: Some((DType::BF16, shape, 30)),
        };
        assert_eq!(Completion::decode(&c.encode()).unwrap(), c);
        let w = Completion { op: Op::Wait, ..c };
        assert_eq!(Completion::decode(&w.encode()).unwrap(), w);
        let p = Completion { op: Op::CommitPin, ..c };
        assert_eq!(Completion::decode(&p.encode()).unwrap(), p);
        let t = Completion { op: Op::Wait, status: Status::TimedOut, handle: 0, offset: 0, tensor: None, ..c };
        assert_eq!(Completion::decode(&t.encode()).unwrap(), t);
    }

    #[test]
    fn requests_round_trip() {
        let shape = Shape::new(&[2, 16, 8, 128]).unwrap();
        let key = 0xdead_beef_u128 << 70 | 5;
        let all = [
            Request::Ping,
            Request::reserve(key, DType::F16, shape, 128).unwrap(),
            Request::Commit { handle: 1 << 62 | 7, parent: None },
            Request::Commit { handle: 1 << 62 | 8, parent: Some(0) },
            Request::Commit { handle: 1 << 62 | 9, parent: Some(u128::MAX) },
            Request::CommitPin { handle: 1 << 62 | 10, parent: None },
            Request::CommitPin { handle: 1 << 62 | 11, parent: Some(5) },
            Request::CommitAs { handle: 1 << 62 | 12, key, parent: None, pin: false },
            Request::CommitAs { handle: 1 << 62 | 13, key: 0, parent: None, pin: true },
            Request::CommitAs { handle: 1 << 62 | 14, key, parent: Some(key ^ u128::MAX), pin: false },
            Request::CommitAs { handle: 1 << 62 | 15, key, parent: Some(0), pin: true },
            Request::Abort { handle: u64::MAX },
            Request::Get { key },
            Request::Release { handle: 2 << 62 },
            Request::Lookup { key: u128::MAX },
            Request::Delete { key: 0 },
            Request::Stats,
            Request::Wait { key, timeout_us: 1500 },
            Request::Wait { key: 3, timeout_us: WAIT_FOREVER },
        ];
        for (i, r) in all.iter().enumerate() {
            let d = r.encode(i as u32 + 10);
            assert_eq!((d.request_id, d.op, d.status), (i as u32 + 10, r.op() as u8, 0));
            assert_eq!(Request::decode(&d), Ok(*r));
        }
    }

    #[test]
    fn commit_parent_rule() {
        let mut d = TensorBlockDescriptor::request(Op::Commit, 1, 77);
        d.handle = 5;
        // An old client's COMMIT: no flag, key fields ignored.
        assert_eq!(Request::decode(&d), Ok(Request::Commit { handle: 5, parent: None }));
        d.offset = COMMIT_HAS_PARENT;
        assert_eq!(Request::decode(&d), Ok(Request::Commit { handle: 5, parent: Some(77) }));
        d.offset = COMMIT_NAMES_KEY;
        assert_eq!(Request::decode(&d), Ok(Request::CommitAs { handle: 5, key: 77, parent: None, pin: false }));
        d.op = Op::CommitPin as u8;
        assert_eq!(Request::decode(&d), Ok(Request::CommitAs { handle: 5, key: 77, parent: None, pin: true }));
        // Its parent in the shape words, low word first.
        d.ndim = COMMIT_AS_PARENT_NDIM;
        d.shape = [1, 2, 3, 4, 0, 0];
        let parent = 1 | 2 << 32 | 3 << 64 | 4 << 96;
        assert_eq!(Request::decode(&d), Ok(Request::CommitAs { handle: 5, key: 77, parent: Some(parent), pin: true }));
        // Another ndim, or a word past the parent, or words without ndim 4: invalid.
        for (ndim, shape) in [(3, [1, 2, 3, 4, 0, 0]), (4, [1, 2, 3, 4, 5, 0]), (0, [0, 0, 0, 0, 0, 9]), (6, [0; 6])] {
            (d.ndim, d.shape) = (ndim, shape);
            assert_eq!(Request::decode(&d), Err(DecodeError::BadCommitParent(ndim)));
        }
        (d.ndim, d.shape) = (0, [0; 6]);
        // Both flags (a parent and a key: one key field) or an unknown bit: invalid.
        for flags in [3, 4, 6, 1 << 63] {
            d.offset = flags;
            assert_eq!(Request::decode(&d), Err(DecodeError::BadCommitFlags(flags)));
        }
    }

    fn reserve(key: u128) -> TensorBlockDescriptor {
        Request::reserve(key, DType::U8, Shape::new(&[4]).unwrap(), 0).unwrap().encode(key as u32)
    }

    #[test]
    fn reservation_unit_rule() {
        // A client's batch: every RESERVE but the last continues the unit.
        let mut unit: Vec<TensorBlockDescriptor> = (0..4).map(reserve).collect();
        mark_unit(&mut unit);
        assert_eq!(unit.iter().map(continues_unit).collect::<Vec<_>>(), [true, true, true, false]);
        // The flag does not change what the frame asks for.
        for (i, f) in unit.iter().enumerate() {
            assert_eq!(Request::decode(f), Request::decode(&reserve(i as u128)));
        }
        assert_eq!(unit_len(&unit, 1024), 4);
        assert_eq!(unit_len(&unit[1..], 1024), 3);
        assert_eq!(unit_len(&unit[3..], 1024), 1);
        // Capped at the ring's capacity; cut short where the frames end.
        assert_eq!(unit_len(&unit, 2), 2);
        assert_eq!(unit_len(&unit[..2], 1024), 2);
        assert_eq!(unit_len(&[], 1024), 0);
        // A frame that is not a RESERVE ends a unit before it.
        let mut mixed = vec![unit[0], TensorBlockDescriptor::request(Op::Get, 9, 9), unit[1]];
        assert_eq!(unit_len(&mixed, 1024), 1);
        assert_eq!(unit_len(&mixed[1..], 1024), 1);
        // A RESERVE without the flag (an old client's) is a unit of its own.
        mixed[0].handle = 0;
        assert!(!continues_unit(&mixed[0]));
        assert_eq!(unit_len(&[reserve(1), reserve(2)], 1024), 1);
        // The flag means nothing on other ops; other bits of a RESERVE's handle are invalid.
        let mut g = TensorBlockDescriptor::request(Op::Abort, 1, 0);
        g.handle = RESERVE_CONTINUES;
        assert!(!continues_unit(&g));
        let mut bad = reserve(1);
        bad.handle = 2;
        assert_eq!(Request::decode(&bad), Err(DecodeError::BadReserveFlags(2)));
    }

    #[test]
    fn one_page_offset_rule() {
        assert!(page_offset_is_valid(0) && page_offset_is_valid(64) && page_offset_is_valid(4032));
        assert!(!page_offset_is_valid(65) && !page_offset_is_valid(4096) && !page_offset_is_valid(u64::MAX));
        let shape = Shape::new(&[4]).unwrap();
        assert_eq!(Request::reserve(1, DType::U8, shape, 4096), Err(DecodeError::BadPageOffset(4096)));
        let buf = [0u8; 8192];
        for i in [0, 1, 63, 64, 100, 4095] {
            let p = buf[i..].as_ptr();
            let off = page_offset_of(p);
            assert!(page_offset_is_valid(off));
            assert_eq!(off, (p as u64 % PAGE_LEN) / 64 * 64);
        }
    }

    #[test]
    fn check_len() {
        let shape = Shape::new(&[3, 5]).unwrap();
        assert_eq!(shape.check_len(DType::F32, 60), Ok(60));
        assert_eq!(shape.check_len(DType::F32, 59), Err(LenError::Mismatch { expected: 60, given: 59 }));
        let huge = Shape::new(&[u64::from(u32::MAX); 3]).unwrap();
        assert_eq!(huge.check_len(DType::F64, 0), Err(LenError::Overflow));
    }

    #[test]
    fn byte_shapes() {
        assert_eq!(Shape::for_bytes(10).unwrap().dims(), &[10]);
        let big = Shape::for_bytes(8 << 30).unwrap();
        assert_eq!(big.len_bytes(DType::U8), Some(8 << 30));
        assert!(Shape::for_bytes((8 << 30) + 1).is_none());
    }
}
