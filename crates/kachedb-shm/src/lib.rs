//! KacheDB shared-memory core.
//!
//! One contract per module, no I/O policy:
//! * [`region`] — the sealed memfd region, its header and layout;
//! * [`ring`] — the single-producer single-consumer ring with its 192-byte header;
//! * [`descriptor`] — the 64-byte `TensorBlockDescriptor`, its encoders and checked decoders;
//! * [`wait`] — the cross-process spin-then-park wait cell and wait policy;
//! * [`fork`] — what a forked child may touch of its parent's regions (nothing);
//! * [`control`] — the control socket's messages as types, and its line framing;
//! * [`naming`] — the socket path and region name both sides agree on;
//! * [`units`] — byte counts as people write them (`8GiB`), parsed and printed.
//!
//! See `docs/PROTOCOL.md` for the wire contract.
#![warn(missing_docs)]

pub mod control;
pub mod descriptor;
pub mod fork;
pub mod naming;
pub mod region;
pub mod ring;
pub mod sync;
pub mod trust;
pub mod units;
pub mod wait;

pub use control::Stats;
pub use descriptor::{
    page_offset_is_valid, page_offset_of, Completion, DType, DecodeError, LenError, Op, Request, Shape, Status,
    TensorBlockDescriptor, COMMIT_HAS_PARENT, MAX_DIMS, PAGE_LEN, PAGE_OFFSET_ALIGN, WAIT_FOREVER,
};
pub use region::{CreateOptions, Layout, Region, RegionError};
pub use ring::{Consumer, HeapRing, Producer, RingError, RingHeader};
pub use wait::{SpinThenPark, Tick, WaitCell, WaitState};
