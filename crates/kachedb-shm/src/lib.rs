//! KacheDB shared-memory core, and the OS edges both sides of it share.
//!
//! What the daemon and every client must agree on, one contract per module.
//! The memory both map:
//! * [`region`] — the sealed memfd region, its header and layout;
//! * [`ring`] — the single-producer single-consumer ring with its 192-byte header;
//! * [`block_meta`] — the block metadata record a META frame points at;
//! * [`descriptor`] — the 64-byte `TensorBlockDescriptor`, its encoders and checked decoders;
//! * [`wait`] — the cross-process spin-then-park wait cell and wait policy;
//! * [`sync`] — where the atomics come from (std, or loom under the model checker);
//! * [`fork`] — what a forked child may touch of its parent's regions (nothing).
//!
//! The control socket beside it:
//! * [`control`] — its messages as types, and its line framing;
//! * [`fdpass`] — file descriptors passed over it (`SCM_RIGHTS`), for the
//!   daemon, the takeover and the client alike;
//! * [`trust`] — who trusts whom on it: peer credentials, the socket directory rule;
//! * [`naming`] — the socket path and region name both sides agree on;
//! * [`units`] — byte counts as people write them (`8GiB`), parsed and printed.
//!
//! The socket calls here are single calls (one `sendmsg`, one `getsockopt`);
//! timeouts, retries and what to do on failure stay with the callers.
//! See `docs/PROTOCOL.md` for the wire contract.
#![warn(missing_docs)]

pub mod block_meta;
pub mod control;
pub mod descriptor;
pub mod fdpass;
pub mod fork;
pub mod naming;
pub mod region;
pub mod ring;
pub mod sync;
pub mod trust;
pub mod units;
pub mod wait;

pub use block_meta::{BlockMeta, MetaError, MAX_META_LEN};
pub use control::Stats;
pub use descriptor::{
    continues_unit, mark_unit, page_offset_is_valid, page_offset_of, unit_len, Completion, DType, DecodeError,
    LenError, Op, OutOfMemoryCause, Request, Shape, Status, TensorBlockDescriptor, COMMIT_AS_PARENT_NDIM,
    COMMIT_HAS_PARENT, COMMIT_NAMES_KEY, MAX_DIMS, PAGE_LEN, PAGE_OFFSET_ALIGN, RESERVE_CONTINUES, WAIT_FOREVER,
};
pub use region::{CreateOptions, Layout, Region, RegionError};
pub use ring::{Consumer, HeapRing, Producer, RingError, RingHeader};
pub use wait::{SpinThenPark, Tick, WaitCell, WaitState};
