//! The log of `DENIED` answers: COMMITs and DELETEs refused because the
//! block belongs to a tenant bound to other users or groups (the store's
//! rule, `Store::may_change`). Each one is counted (`denied` in stats,
//! `kachedb_ops_total{status="denied"}`); the log gets one line per
//! [`LOG_EVERY`] at most, so a client that retries in a loop cannot flood it.

use crate::store::{SessionId, Store};
use kachedb_shm::control::DEFAULT_TENANT;
use kachedb_shm::{Request, TensorBlockDescriptor};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most one log line about denied requests per this interval.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// When the last line was written, and the denials not logged since.
static LAST: Mutex<(Option<Instant>, u64)> = Mutex::new((None, 0));

/// Session `session` (a client of `pid`, `uid`) was answered `DENIED` to
/// `frame`: logs it, unless a line was written within [`LOG_EVERY`].
pub(super) fn denied(store: &Store, session: SessionId, pid: i32, uid: u32, frame: &TensorBlockDescriptor) {
    let Ok(mut last) = LAST.lock() else { return };
    let now = Instant::now();
    if last.0.is_some_and(|t| now.duration_since(t) < LOG_EVERY) {
        last.1 += 1;
        return;
    }
    let suppressed = std::mem::take(&mut last.1);
    last.0 = Some(now);
    drop(last);
    // After the refusal: the block and the reservation are as they were.
    let (what, key) = match Request::decode(frame) {
        Ok(Request::Delete { key }) => ("DELETE", Some(key)),
        Ok(Request::CommitAs { key, .. }) => ("COMMIT", Some(key)),
        Ok(Request::Commit { handle, .. } | Request::CommitPin { handle, .. }) => {
            ("COMMIT", store.reservation_key(session, handle))
        }
        _ => ("request", None),
    };
    let owner = key.and_then(|k| store.block_tenant(k)).unwrap_or("?");
    let tenant = store.session_tenant(session).unwrap_or(DEFAULT_TENANT);
    tracing::warn!(
        event = "block_change_denied",
        pid,
        uid,
        tenant,
        owner,
        key = format_args!("{:032x}", key.unwrap_or(0)),
        suppressed,
        "denied a {what} of a block of tenant {owner:?}, which is bound to other users or groups, to a client of tenant {tenant:?}"
    );
}
