//! The serve loop's side of the remote tier (`crate::remote`): the tier's
//! own session, the fetches channels are parked on, and the fill work
//! (reservations and commits) done in slices between ring polls.

use super::session::{unpark_fetch, wake_waits};
use super::Serve;
use crate::metrics::RemoteCells;
use crate::remote::{FetchJob, FillSpec, RemoteEvent, RemoteTier, Reserved, WriteJob};
use crate::store::{SessionId, Store};
use kachedb_shm::{Request, Status};
use std::collections::{HashMap, VecDeque};
use std::time::Instant;

/// Remote-fill blocks reserved or committed per pass: the serve loop polls
/// the rings between slices, so a fill of a long chain delays a ring
/// request by at most one slice (about a microsecond per block).
const REMOTE_SLICE: usize = 8;

/// The serve loop's side of the remote tier (`crate::remote`).
pub(super) struct RemoteSide {
    pub(super) tier: RemoteTier,
    /// The tier's own session: its write-behind pins and fill reservations.
    pub(super) session: SessionId,
    pub(super) next_fetch: u64,
    /// Fetches channels are parked on: id -> (channel, when to stop waiting).
    pub(super) pending: HashMap<u64, (u32, Instant)>,
    /// Fill work queued, done [`REMOTE_SLICE`] blocks per pass, in order.
    pub(super) work: VecDeque<RemoteWork>,
}

/// Fill work the serve loop does in slices between ring polls.
pub(super) enum RemoteWork {
    /// Reservations asked for by a fetch: `answers` holds those made so far;
    /// all of them go back on `reply` once the last is made.
    Reserve {
        blocks: Vec<FillSpec>,
        answers: Vec<Option<Reserved>>,
        reply: tokio::sync::oneshot::Sender<Vec<Option<Reserved>>>,
    },
    /// A fetch's filled reservations, committed from `next` on; once all
    /// are, its channel is unparked and WAITs on `committed` answered.
    Commit { fetch: u64, filled: Vec<(u64, u64)>, next: usize, committed: Vec<u128> },
}

impl RemoteSide {
    /// Queues the block of `key` (just committed by a client) for writing,
    /// pinned; or drops it, counted, when the queue is full.
    pub(super) fn queue_write(&mut self, store: &mut Store, key: u128) {
        let Some(b) = store.peek(key) else { return };
        if !self.tier.admit(b.len) {
            return;
        }
        let c = store.handle_internal(self.session, &Request::Get { key });
        if c.status != Status::Ok {
            self.tier.unadmit(b.len);
            return;
        }
        self.tier.write(WriteJob {
            key,
            pin: c.handle,
            data_offset: b.data_offset,
            len: b.len,
            dtype: b.dtype,
            shape: b.shape,
        });
    }

    /// Starts a fetch of `keys` for `channel`; its id.
    pub(super) fn start_fetch(&mut self, channel: u32, keys: Vec<u128>) -> u64 {
        self.next_fetch += 1;
        let id = self.next_fetch;
        self.pending.insert(id, (channel, Instant::now() + self.tier.fetch_bound()));
        self.tier.fetch(FetchJob { id, keys });
        id
    }
}

impl Serve {
    /// Serves with the remote tier `tier` behind the store (a session of
    /// its own holds its pins and reservations).
    pub(crate) fn with_remote(mut self, tier: Option<RemoteTier>) -> Serve {
        self.remote = tier.map(|tier| RemoteSide {
            tier,
            session: self.store.open_internal_session(),
            next_fetch: 0,
            pending: HashMap::new(),
            work: VecDeque::new(),
        });
        self
    }

    /// The earliest time the serve loop stops waiting for a remote fetch.
    pub(super) fn next_fetch_deadline(&self) -> Option<Instant> {
        self.remote.as_ref()?.pending.values().map(|&(_, d)| d).min()
    }

    /// Unparks the channels whose remote fetch never came back in time (their
    /// held frames are then answered from what is local); whether any.
    pub(super) fn expire_fetches(&mut self) -> bool {
        let Some(r) = self.remote.as_mut() else { return false };
        let now = Instant::now();
        let expired: Vec<u64> = r.pending.iter().filter(|(_, &(_, d))| d <= now).map(|(&id, _)| id).collect();
        for id in &expired {
            if let Some((ch, _)) = r.pending.remove(id) {
                if let Some(s) = self.sessions.get_mut(ch as usize).and_then(Option::as_mut) {
                    if s.fetch.as_ref().is_some_and(|f| f.id == *id) {
                        unpark_fetch(s);
                    }
                }
            }
        }
        !expired.is_empty()
    }

    /// What the remote tier's workers report. A write's pin is dropped at
    /// once; reservations and commits of a fill are queued and done
    /// [`REMOTE_SLICE`] blocks per pass ([`remote_slice`](Self::remote_slice)).
    pub(super) fn on_remote(&mut self, ev: RemoteEvent) {
        let Some(r) = self.remote.as_mut() else { return };
        match ev {
            RemoteEvent::Written { pin } => {
                self.store.handle_internal(r.session, &Request::Release { handle: pin });
            }
            RemoteEvent::Reserve { fetch: _, blocks, reply } => {
                let answers = Vec::with_capacity(blocks.len());
                r.work.push_back(RemoteWork::Reserve { blocks, answers, reply });
            }
            RemoteEvent::Filled { fetch, filled } => {
                r.work.push_back(RemoteWork::Commit { fetch, filled, next: 0, committed: Vec::new() });
            }
        }
    }

    /// Does up to [`REMOTE_SLICE`] blocks of the queued fill work (and
    /// finishes the piece of work they end); whether any was done.
    pub(super) fn remote_slice(&mut self) -> bool {
        let Some(r) = self.remote.as_mut() else { return false };
        let mut budget = REMOTE_SLICE;
        let mut did = false;
        while budget > 0 {
            let Some(work) = r.work.pop_front() else { break };
            did = true;
            match work {
                RemoteWork::Reserve { blocks, mut answers, reply } => {
                    let from = answers.len();
                    let to = blocks.len().min(from + budget);
                    budget -= to - from;
                    for b in &blocks[from..to] {
                        // Committed by a client meanwhile: that block stands.
                        let answer = if self.store.peek(b.key).is_some() {
                            None
                        } else {
                            let c = self.store.handle_internal(
                                r.session,
                                &Request::Reserve {
                                    key: b.key,
                                    dtype: b.dtype,
                                    shape: b.shape,
                                    len: b.len,
                                    page_offset: 0,
                                },
                            );
                            (c.status == Status::Ok).then_some(Reserved { handle: c.handle, data_offset: c.offset })
                        };
                        answers.push(answer);
                    }
                    if answers.len() < blocks.len() {
                        r.work.push_front(RemoteWork::Reserve { blocks, answers, reply });
                        break;
                    }
                    if let Err(answers) = reply.send(answers) {
                        for a in answers.into_iter().flatten() {
                            self.store.handle_internal(r.session, &Request::Abort { handle: a.handle });
                        }
                    }
                }
                RemoteWork::Commit { fetch, filled, mut next, mut committed } => {
                    let cells = &self.metrics.metrics().remote;
                    let to = filled.len().min(next + budget);
                    budget -= to - next;
                    for &(handle, len) in &filled[next..to] {
                        let key = self.store.reservation_key(r.session, handle);
                        // Committed by a client while the fill ran: that block is newer
                        // (and may have chain links); the fill's copy is dropped.
                        if key.is_some_and(|k| self.store.peek(k).is_some()) {
                            self.store.handle_internal(r.session, &Request::Abort { handle });
                            continue;
                        }
                        if self.store.handle_internal(r.session, &Request::Commit { handle, parent: None }).status
                            == Status::Ok
                        {
                            RemoteCells::add(&cells.fills, 1);
                            RemoteCells::add(&cells.fill_bytes, len);
                            committed.extend(key);
                        }
                    }
                    next = to;
                    if next < filled.len() {
                        r.work.push_front(RemoteWork::Commit { fetch, filled, next, committed });
                        break;
                    }
                    // Every block of the fetch is in: serve its channel's frames again.
                    if let Some((ch, _)) = r.pending.remove(&fetch) {
                        if let Some(s) = self.sessions.get_mut(ch as usize).and_then(Option::as_mut) {
                            if s.fetch.as_ref().is_some_and(|f| f.id == fetch) {
                                let started = unpark_fetch(s);
                                if !committed.is_empty() {
                                    self.metrics.remote_fill(started.elapsed().as_micros() as u64);
                                }
                            }
                        }
                    }
                    if !committed.is_empty() && !self.waits.is_empty() {
                        wake_waits(
                            &mut self.store,
                            &mut self.sessions,
                            &mut self.waits,
                            &mut committed,
                            &mut self.counters,
                        );
                    }
                    // An empty fetch still takes a turn: at most one per block of budget.
                    budget = budget.saturating_sub(1);
                }
            }
        }
        did
    }
}
