//! META: a block metadata record (`kachedb_shm::block_meta`) attached to an
//! open reservation, kept with the block it becomes, and carried into the
//! index's changes (`changes.rs`) for the KV events.
//!
//! The record lies in another open reservation of the same client (a
//! scratch block it reserved, wrote and will ABORT); the serve loop reads it
//! out of the megaslab (`read`), the store checks it. A META refused changes
//! nothing. A second META of one reservation replaces the first.
//!
//! Kept only while the index's changes are logged (the KV event publisher
//! runs); otherwise a META is checked and answered, and its record dropped.
//!
//! Memory: an entry of `Store::metas` per block that has a record (a map
//! entry, ~24 bytes, and the record: ~100 bytes plus 4 per token; a
//! 16-token vLLM block ~170 bytes), dropped when the slot is freed (the
//! block evicted, deleted or replaced and unpinned, the reservation aborted).
//! Eviction undone puts the record back with the block.

use super::{SessionId, Store};
use kachedb_shm::{BlockMeta, Completion, Op, Request, Status};
use std::sync::Arc;

impl Store {
    /// Answers a META of session `s` (`req`; any other request goes to
    /// [`handle`](Self::handle)): `read(offset, len)` gives the `len` bytes
    /// of megaslab at `offset` (bytes from the region base), or `None`.
    /// `BAD_HANDLE` for a handle that is not an open reservation of `s`;
    /// `INVALID` for a record outside its scratch reservation's bytes, in
    /// the reservation it describes, or that does not decode.
    pub fn handle_meta(
        &mut self,
        s: SessionId,
        request_id: u32,
        req: &Request,
        read: impl FnOnce(u64, u64) -> Option<Vec<u8>>,
    ) -> Completion {
        let Request::Meta { handle, scratch, offset, len } = *req else {
            return self.handle(s, request_id, req);
        };
        self.counters.request(Op::Meta);
        let status = match self.meta(s, handle, scratch, offset, len, read) {
            Ok(()) => Status::Ok,
            Err(st) => st,
        };
        self.counters.answer(Op::Meta, status);
        Completion { request_id, op: Op::Meta, status, handle: 0, offset: 0, tensor: None }
    }

    fn meta(
        &mut self,
        s: SessionId,
        handle: u64,
        scratch: u64,
        offset: u64,
        len: u64,
        read: impl FnOnce(u64, u64) -> Option<Vec<u8>>,
    ) -> Result<(), Status> {
        let index = self.own_reservation(s, handle)?;
        let from = self.own_reservation(s, scratch)?;
        if from == index {
            return Err(Status::Invalid);
        }
        let (data_offset, data_len) = match self.slots.get(from as usize).map(|slot| &slot.state) {
            Some(super::SlotState::Reserved { tensor, .. }) => (tensor.data_offset, tensor.len),
            _ => return Err(Status::Internal),
        };
        if offset.checked_add(len).is_none_or(|end| end > data_len) {
            return Err(Status::Invalid);
        }
        let bytes = read(data_offset + offset, len).ok_or(Status::Internal)?;
        let meta = BlockMeta::decode(&bytes).map_err(|e| {
            tracing::debug!("META refused: {e}");
            Status::Invalid
        })?;
        // Kept only for the KV events: without a publisher, checked and dropped.
        if self.changes.is_on() {
            self.metas.insert(index, Arc::new(meta));
        }
        Ok(())
    }

    /// The record of `key`'s block, if it has one (kept only while the
    /// index's changes are logged): the disk tier writes it with the block.
    pub fn block_meta(&self, key: u128) -> Option<Arc<BlockMeta>> {
        let &index = self.keys.get(&key)?;
        self.metas.get(&index).cloned()
    }

    /// Attaches `meta` to the open reservation `handle` of internal session
    /// `s` (a tier's fill of a block whose record the tier kept), as a META
    /// does; nothing if the index's changes are not logged or the handle is
    /// not such a reservation.
    pub fn attach_internal_meta(&mut self, s: SessionId, handle: u64, meta: Arc<BlockMeta>) {
        if !self.changes.is_on() {
            return;
        }
        if let Ok(index) = self.own_reservation(s, handle) {
            self.metas.insert(index, meta);
        }
    }

    /// Records kept (one per block or reservation that has one).
    pub fn metas_held(&self) -> usize {
        self.metas.len()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{reserve_req, SLAB_OFFSET};
    use super::super::IndexChange;
    use super::*;
    use crate::alloc::PAGE_LEN;

    fn record(hash: u64) -> Vec<u8> {
        let m = BlockMeta {
            block_hash: hash,
            parent_hash: Some(1),
            block_size: 4,
            token_ids: vec![9, 8, 7, 6],
            ..BlockMeta::default()
        };
        let mut out = Vec::new();
        m.encode(&mut out).unwrap();
        out
    }

    fn meta(handle: u64, scratch: u64, len: usize) -> Request {
        Request::Meta { handle, scratch, offset: 0, len: len as u64 }
    }

    /// A META's record goes with the block into the change log and the
    /// snapshot, and is dropped with the block; a bad one, or one naming
    /// what is not the client's open reservation, changes nothing.
    #[test]
    fn a_record_lives_as_long_as_its_block_and_a_bad_one_changes_nothing() {
        let mut st = Store::new(SLAB_OFFSET, 8 * PAGE_LEN);
        st.log_changes(true);
        let (s, other) = (st.open_session(), st.open_session());
        let block = st.handle(s, 1, &reserve_req(5, 100, 0)).handle;
        let scratch = st.handle(s, 2, &reserve_req(0, 4096, 0)).handle;
        let good = record(77);
        let read = |bytes: Vec<u8>| move |_: u64, _: u64| Some(bytes);
        // Refused: not decodable, too long for the scratch, the block as its
        // own scratch, another session's, an unknown handle.
        let mut bad = good.clone();
        bad[0] = 9;
        assert_eq!(st.handle_meta(s, 3, &meta(block, scratch, bad.len()), read(bad)).status, Status::Invalid);
        let past = Request::Meta { handle: block, scratch, offset: 4090, len: good.len() as u64 };
        assert_eq!(st.handle_meta(s, 3, &past, read(good.clone())).status, Status::Invalid);
        assert_eq!(st.handle_meta(s, 3, &meta(block, block, good.len()), read(good.clone())).status, Status::Invalid);
        assert_eq!(
            st.handle_meta(other, 3, &meta(block, scratch, good.len()), read(good.clone())).status,
            Status::BadHandle
        );
        assert_eq!(st.handle_meta(s, 3, &meta(block, 12345, good.len()), read(good.clone())).status, Status::BadHandle);
        assert_eq!(st.metas_held(), 0);
        // Through `handle` a META has no record to read.
        assert_eq!(st.handle(s, 3, &meta(block, scratch, good.len())).status, Status::Invalid);
        assert_eq!(st.handle_meta(s, 3, &meta(block, scratch, good.len()), read(good.clone())).status, Status::Ok);
        assert_eq!(st.handle(s, 4, &Request::Abort { handle: scratch }).status, Status::Ok);
        assert_eq!(st.handle(s, 5, &Request::Commit { handle: block, parent: None }).status, Status::Ok);
        let mut log = Vec::new();
        st.take_changes(&mut log);
        let want = BlockMeta::decode(&good).unwrap();
        assert!(matches!(&log[..], [IndexChange::Stored { key: 5, meta: Some(m), .. }] if **m == want), "{log:?}");
        assert!(matches!(&st.index_snapshot()[..], [IndexChange::Stored { meta: Some(m), .. }] if **m == want));
        st.check_invariants().unwrap();
        assert_eq!(st.handle(s, 6, &Request::Delete { key: 5 }).status, Status::Ok);
        assert_eq!(st.metas_held(), 0);
        st.check_invariants().unwrap();
    }

    /// A RESERVE that evicts a block with a record and is then refused puts
    /// the block back with its record.
    #[test]
    fn eviction_undone_puts_the_record_back() {
        let mut st = Store::new(SLAB_OFFSET, 4 * PAGE_LEN);
        st.log_changes(true);
        let s = st.open_session();
        let block = st.handle(s, 1, &reserve_req(5, 2 * PAGE_LEN, 0)).handle;
        let scratch = st.handle(s, 2, &reserve_req(0, 100, 0)).handle;
        let good = record(77);
        let r = st.handle_meta(s, 3, &meta(block, scratch, good.len()), |_, _| Some(good.clone()));
        assert_eq!(r.status, Status::Ok);
        st.handle(s, 4, &Request::Abort { handle: scratch });
        st.handle(s, 5, &Request::Commit { handle: block, parent: None });
        // An open reservation holds one page: a unit of 1 + 3 pages evicts block 5 and still does not fit.
        let pinned = st.handle(s, 6, &reserve_req(6, PAGE_LEN, 0)).handle;
        let unit = [(7, reserve_req(7, PAGE_LEN, 0)), (8, reserve_req(8, 3 * PAGE_LEN, 0))];
        let mut out = Vec::new();
        st.handle_unit(s, &unit, &mut out);
        assert!(out.iter().all(|c| c.status == Status::OutOfMemory), "{out:?}");
        assert!(st.peek(5).is_some());
        assert_eq!(st.metas_held(), 1);
        st.check_invariants().unwrap();
        st.handle(s, 9, &Request::Abort { handle: pinned });
        st.handle(s, 10, &Request::Delete { key: 5 });
        assert_eq!(st.metas_held(), 0);
    }

    /// Without the publisher a good record is answered OK and not kept.
    #[test]
    fn without_the_publisher_a_record_is_checked_and_dropped() {
        let mut st = Store::new(SLAB_OFFSET, 4 * PAGE_LEN);
        let s = st.open_session();
        let block = st.handle(s, 1, &reserve_req(5, 100, 0)).handle;
        let scratch = st.handle(s, 2, &reserve_req(0, 100, 0)).handle;
        let good = record(77);
        let r = st.handle_meta(s, 3, &meta(block, scratch, good.len()), |_, _| Some(good.clone()));
        assert_eq!((r.status, st.metas_held()), (Status::Ok, 0));
        let r = st.handle_meta(s, 3, &meta(block, scratch, good.len()), |_, _| Some(vec![0; 40]));
        assert_eq!(r.status, Status::Invalid);
    }
}
