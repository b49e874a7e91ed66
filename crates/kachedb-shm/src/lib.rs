//! KacheDB shared-memory core.
//!
//! One contract per module, no I/O policy:
//! * [`region`] — the sealed memfd region, its header and layout;
//! * [`ring`] — the single-producer single-consumer ring with its 192-byte header;
//! * [`descriptor`] — the 64-byte `TensorBlockDescriptor` and its checked decoder;
//! * [`wait`] — the cross-process spin-then-park wait cell.
//!
//! See `docs/PROTOCOL.md` for the wire contract.
#![warn(missing_docs)]

pub mod descriptor;
pub mod naming;
pub mod region;
pub mod ring;
pub mod sync;
pub mod wait;

pub use descriptor::{Completion, DType, DecodeError, Op, Request, Shape, Status, TensorBlockDescriptor, MAX_DIMS};
pub use region::{CreateOptions, Layout, Region, RegionError};
pub use ring::{Consumer, HeapRing, Producer, RingError, RingHeader};
pub use wait::{SpinThenPark, Tick, WaitCell};
