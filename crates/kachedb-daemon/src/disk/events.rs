//! The disk tier's index changes for the KV event publisher (medium
//! `DISK`, docs/events.md): a block written (indexed once durable), found
//! at start (the rebuild), or gone (evicted for room, deleted, replaced,
//! refused as torn).
//!
//! Off until the daemon publishes ([`Tier::publish_index`](crate::tier::Tier::publish_index)):
//! then every mutation of the index is logged here, under the index's
//! mutex, and the log is handed to the publisher's queue by whichever
//! thread made it ([`DiskLog::flush`], from `Shared::publish`), so the
//! publisher gets the changes in the order the index applied them. The
//! index rebuild's blocks go out as it finds them, a chunk at a time, and
//! the whole index once it is over (parents first: a router may drop a
//! block whose parent it has not seen). The first flush sends the whole index; so does the next one after changes
//! that did not fit the queue (lost, counted), and the remover thread
//! retries such a flush every [`RETRY`] until it goes through, so the
//! publisher's copy is whole again even if the tier goes quiet.
//!
//! The blocks' metadata records (the engine's hash, parent, tokens: META)
//! are kept here while publishing, ~100 bytes plus 4 per token a block
//! that has one; they come from the write (the block's record in the
//! megaslab) or from the block file's header area (the rebuild).

use super::index::Index;
use crate::kv_events::TierSink;
use crate::store::IndexChange;
use kachedb_shm::BlockMeta;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// How often a flush that found no room is retried.
pub(super) const RETRY: Duration = Duration::from_millis(100);

/// The log: off (no sink), or the changes not yet handed to the publisher.
#[derive(Debug, Default)]
pub(super) struct DiskLog {
    sink: Option<TierSink>,
    changes: Vec<IndexChange>,
    /// The records of the blocks that have one.
    metas: HashMap<u128, Arc<BlockMeta>>,
    /// The publisher is owed the whole index.
    snapshot_due: bool,
}

impl DiskLog {
    /// Starts logging for `sink`: the next flush sends the whole index.
    pub(super) fn attach(&mut self, sink: TierSink) {
        self.sink = Some(sink);
        self.changes.clear();
        self.snapshot_due = true;
    }

    /// Owes the publisher the whole index again (the rebuild is over: its
    /// blocks went out as found, a child maybe before its parent; the whole
    /// index goes out parents first).
    pub(super) fn resync(&mut self) {
        if self.sink.is_some() {
            self.changes.clear();
            self.snapshot_due = true;
        }
    }

    /// Whether the index's changes are logged (records are worth keeping).
    pub(super) fn is_on(&self) -> bool {
        self.sink.is_some()
    }

    /// Whether a flush waits for room in the publisher's queue.
    pub(super) fn snapshot_due(&self) -> bool {
        self.sink.is_some() && self.snapshot_due
    }

    /// `key` was indexed (written, or found at start) naming `parent`.
    pub(super) fn stored(&mut self, key: u128, parent: Option<u128>, meta: Option<Arc<BlockMeta>>) {
        if self.sink.is_none() {
            return;
        }
        match &meta {
            Some(m) => self.metas.insert(key, m.clone()),
            None => self.metas.remove(&key),
        };
        self.changes.push(IndexChange::Stored { key, parent, replaced: false, meta });
    }

    /// `key` left the index.
    pub(super) fn removed(&mut self, key: u128) {
        if self.sink.is_none() {
            return;
        }
        self.metas.remove(&key);
        self.changes.push(IndexChange::Removed { key });
    }

    /// Hands the logged changes to the publisher (`ix`: the index they
    /// were applied to, under the same lock), or the whole index when
    /// that is owed.
    pub(super) fn flush(&mut self, ix: &Index) {
        let Some(sink) = &self.sink else { return };
        if sink.is_closed() {
            // The publisher ended: nothing more is logged or kept.
            *self = DiskLog::default();
            return;
        }
        if self.snapshot_due {
            self.changes.clear();
            let all = ix
                .entries()
                .into_iter()
                .map(|(key, parent)| IndexChange::Stored {
                    key,
                    parent,
                    replaced: false,
                    meta: self.metas.get(&key).cloned(),
                })
                .collect();
            if sink.send_all(all) {
                self.snapshot_due = false;
            }
            return;
        }
        if self.changes.is_empty() {
            return;
        }
        if !sink.send(std::mem::take(&mut self.changes)) {
            self.snapshot_due = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::index::Limits;
    use crate::kv_events::Msg;
    use std::sync::atomic::Ordering::Relaxed;

    fn keys(changes: &[IndexChange]) -> Vec<String> {
        changes
            .iter()
            .map(|c| match c {
                IndexChange::Stored { key, parent, meta, .. } => {
                    format!("+{key}<{parent:?}{}", if meta.is_some() { "m" } else { "" })
                }
                IndexChange::Removed { key } => format!("-{key}"),
            })
            .collect()
    }

    #[test]
    fn the_whole_index_first_then_each_change_in_order_and_the_whole_index_after_a_loss() {
        let mut ix = Index::new(1 << 30, &Limits::default());
        let t = ix.tenant("default");
        ix.insert(1, None, 4096, t);
        let (sink, mut rx, in_flight) = TierSink::for_tests(3, 16);
        let mut log = DiskLog::default();
        // Off: nothing logged, nothing sent.
        log.stored(9, None, None);
        log.flush(&ix);
        assert!(rx.try_recv().is_err() && !log.snapshot_due());
        log.attach(sink);
        log.flush(&ix);
        let Ok(Msg::DiskSnapshot(all)) = rx.try_recv() else { panic!("the whole index first") };
        assert_eq!(keys(&all), ["+1<None"]);
        in_flight.fetch_sub(1, Relaxed);
        // Changes, with their records, in the order they were logged.
        let meta = Arc::new(BlockMeta { block_hash: 7, block_size: 16, ..BlockMeta::default() });
        ix.insert(2, Some(1), 4096, t);
        log.stored(2, Some(1), Some(meta));
        ix.remove(1);
        log.removed(1);
        log.flush(&ix);
        let Ok(Msg::Disk(changes)) = rx.try_recv() else { panic!("the changes") };
        assert_eq!(keys(&changes), ["+2<Some(1)m", "-1"]);
        in_flight.fetch_sub(2, Relaxed);
        // Four changes do not fit a queue of three: lost (counted), the whole index owed.
        for k in 3..7 {
            ix.insert(k, None, 4096, t);
            log.stored(k, None, None);
        }
        log.flush(&ix);
        assert!(rx.try_recv().is_err() && log.snapshot_due());
        // The next flush sends it, records kept: blocks 2..7.
        log.flush(&ix);
        let Ok(Msg::DiskSnapshot(all)) = rx.try_recv() else { panic!("the whole index after the loss") };
        let mut got = keys(&all);
        got.sort();
        assert_eq!(got, ["+2<Some(1)m", "+3<None", "+4<None", "+5<None", "+6<None"]);
        assert!(!log.snapshot_due());
        // The publisher gone: the log turns itself off.
        drop(rx);
        log.stored(8, None, None);
        log.flush(&ix);
        assert!(!log.is_on());
    }
}
