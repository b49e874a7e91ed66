//! KacheDB daemon: the megaslab allocator ([`alloc`]), the block store
//! ([`store`]), the control socket ([`control`]) and the serve loop ([`serve`]).
#![warn(missing_docs)]

pub mod alloc;
pub mod control;
pub mod serve;
pub mod store;

pub use serve::{Daemon, ServeConfig, ServeError};
