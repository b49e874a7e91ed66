//! Why an operation failed: [`ClientError`], and how a completion's status
//! maps to it.

use kachedb_shm::{Completion, OutOfMemoryCause, Status};

/// Why an operation failed. Messages say what to do.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No committed block has that key.
    #[error("key not found")]
    NotFound,
    /// The store is full of pinned blocks and reservations.
    #[error("out of memory: the store cannot make room (everything left is pinned or reserved); release views or start the daemon with a larger --size")]
    OutOfMemory,
    /// This client, or the clients of its uid together, hold as many bytes
    /// (reserved and pinned) as the daemon's per-client or per-uid limit
    /// allows; other clients are not affected.
    #[error("out of memory: this client (or all clients of its user together) already holds up to the daemon's limit of {0} bytes reserved and pinned (kachedb serve --max-client-bytes, --max-uid-bytes); release views and commit or abort reservations, or ask for a larger limit")]
    ClientLimit(u64),
    /// The block cannot fit within the limit of this client's tenant, even
    /// after the tenant's own evictable blocks went; nothing was evicted.
    #[error("out of memory: the block does not fit within this client's tenant limit of {0} bytes (kachedb serve --tenant-limit), even after evicting the tenant's own unpinned blocks; release the tenant's views and reservations, store less, or ask for a larger limit")]
    TenantLimit(u64),
    /// The block is larger than the whole megaslab.
    #[error("the block ({0} bytes) is larger than the daemon's megaslab: start the daemon with a larger --size")]
    TooLarge(u64),
    /// The request is malformed (checked here, or rejected by the daemon).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The handle is not one of this client's.
    #[error("bad handle: the reservation or pin is not this client's, or is already gone")]
    BadHandle,
    /// The daemon is gone or the client is closed.
    #[error("disconnected: {0}")]
    Disconnected(String),
    /// `wait_for`: the key was not committed before the timeout.
    #[error("timed out: no block was committed under the key within {0:?}")]
    TimedOut(std::time::Duration),
    /// The block belongs to a tenant bound to another identity: this client
    /// may read it, not replace or delete it.
    #[error("denied: the block belongs to a tenant bound to another user or group (kachedb serve --tenant-uid/--tenant-gid); this client may read it, not replace or delete it")]
    Denied,
    /// The operation took effect in the megaslab, but a tier behind it could
    /// not confirm that the key's older copy is gone.
    #[error("not durable: the operation took effect in memory, but the disk tier could not confirm in time that the key's older copy is gone (the daemon's log says why; it keeps retrying, and serves no copy meanwhile); after a crash the older copy may come back: retry the operation once the disk is healthy")]
    NotDurable,
    /// The daemon broke an invariant (a bug in the daemon).
    #[error("the daemon reported an internal error; please report it with the daemon's log")]
    Internal,
    /// The daemon spoke nonsense.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The socket (its directory or the process serving it) is not one this
    /// client trusts with its data; or it never answered.
    #[error("refusing the daemon: {0}")]
    Untrusted(String),
    /// The region could not be mapped.
    #[error(transparent)]
    Region(#[from] kachedb_shm::RegionError),
}

/// Result alias.
pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// The error for a completion `status` other than OK; `len` is the block's
/// bytes (for `TooLarge`).
pub(crate) fn status_error(status: Status, len: u64) -> ClientError {
    match status {
        Status::Ok => ClientError::Protocol("OK is not an error".into()),
        Status::NotFound => ClientError::NotFound,
        Status::OutOfMemory => ClientError::OutOfMemory,
        Status::TooLarge => ClientError::TooLarge(len),
        Status::Invalid => ClientError::Invalid("the daemon rejected the frame (bad dtype, shape or offset)".into()),
        Status::BadHandle => ClientError::BadHandle,
        Status::Internal => ClientError::Internal,
        Status::TimedOut => ClientError::TimedOut(std::time::Duration::ZERO),
        Status::Denied => ClientError::Denied,
        Status::NotDurable => ClientError::NotDurable,
    }
}

/// `c` if its status is OK, else its error.
pub(crate) fn ok_or(c: Completion, len: u64) -> Result<Completion> {
    match c.status {
        Status::Ok => Ok(c),
        // The daemon names the limit in `handle` and `offset` when that is why.
        Status::OutOfMemory => Err(match OutOfMemoryCause::of(c.handle, c.offset) {
            OutOfMemoryCause::NoRoom => ClientError::OutOfMemory,
            OutOfMemoryCause::ClientLimit(limit) => ClientError::ClientLimit(limit),
            OutOfMemoryCause::TenantLimit(limit) => ClientError::TenantLimit(limit),
        }),
        s => Err(status_error(s, len)),
    }
}

/// A request refused before it was sent.
pub(crate) fn invalid(e: impl std::fmt::Display) -> ClientError {
    ClientError::Invalid(e.to_string())
}
