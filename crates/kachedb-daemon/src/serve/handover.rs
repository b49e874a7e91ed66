//! The serve loop's side of a takeover (`crate::takeover` has the protocol
//! between the two daemons): the state the loop hands over ([`ServeState`]:
//! the store, each channel's session, the parked WAITs, the counters),
//! stopping and resuming for it ([`Serve::hand_over`]), and taking up a
//! state handed over ([`Serve::restore`]).

use super::session::{unpark_fetch, Session};
use super::Serve;
use crate::metrics::Health;
use crate::store::{SessionId, Store};
use crate::tier::PendingWrite;
use crate::waits::Waiter;
use kachedb_shm::control::ServeStats;
use kachedb_shm::{Layout, TensorBlockDescriptor};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One channel's session as the serve loop holds it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct ChannelState {
    pub channel: u32,
    pub session: SessionId,
    pub pid: i32,
    pub uid: u32,
    /// Completions not yet pushed (64-byte frames).
    pub backlog: Vec<Vec<u8>>,
    /// Request frames popped behind a parked WAIT.
    pub held: Vec<Vec<u8>>,
    pub waiting: bool,
    pub kicked: bool,
    /// Keys already asked of a tier for the held frames.
    pub tier_asked: HashSet<u128>,
}

/// A parked WAIT.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct ParkedWait {
    pub channel: u32,
    pub key: u128,
    pub request_id: u32,
    /// Milliseconds left before it times out; `None`: never.
    pub left_ms: Option<u64>,
}

/// The serve loop's part of the takeover state (written with `S = &Store`,
/// read with `S = Store`), encoded by `crate::takeover::encode`: a change to
/// it changes `crate::takeover::STATE_VERSION`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct ServeState<S = Store> {
    pub region_generation: u64,
    /// The region's geometry as the old daemon serves it: the new daemon
    /// compares it with the region header, which any client can write.
    pub layout: RegionLayout,
    pub store: S,
    pub channels: Vec<ChannelState>,
    pub waits: Vec<ParkedWait>,
    pub counters: ServeStats,
    pub uptime_ms: u64,
    /// The tiers' writes taken and not finished: the new daemon offers them
    /// to its tiers again (their blocks are in the store handed over).
    pub tier_writes: Vec<PendingWrite>,
    /// Keys whose older copy a tier could not remove: the new daemon's
    /// tiers remove them.
    pub tier_unremoved: Vec<u128>,
    /// The descriptors the stopped tiers hand over, in the order they come
    /// after the offer's own: each tier's name and how many.
    pub tier_fds: Vec<(String, u32)>,
}

/// A region's geometry ([`Layout`]), as the takeover state carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RegionLayout {
    pub channel_count: u32,
    pub ring_capacity: u32,
    pub channel_offset: u64,
    pub channel_stride: u64,
    pub slab_offset: u64,
    pub slab_len: u64,
    pub region_len: u64,
}

impl From<&Layout> for RegionLayout {
    fn from(l: &Layout) -> RegionLayout {
        RegionLayout {
            channel_count: l.channel_count,
            ring_capacity: l.ring_capacity,
            channel_offset: l.channel_offset,
            channel_stride: l.channel_stride,
            slab_offset: l.slab_offset,
            slab_len: l.slab_len,
            region_len: l.region_len,
        }
    }
}

impl std::fmt::Display for RegionLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} channels x {} slots, channel stride {} B, megaslab {} B at {}",
            self.channel_count, self.ring_capacity, self.channel_stride, self.slab_len, self.slab_offset
        )
    }
}

impl Serve {
    /// Takes up the sessions, parked WAITs and counters of the daemon taken
    /// over (`crate::takeover`); `streams` are the channels' connections.
    /// A session whose connection did not come along is closed.
    pub(crate) fn restore(
        mut self,
        channels: Vec<ChannelState>,
        waits: Vec<ParkedWait>,
        counters: ServeStats,
        streams: &HashMap<u32, Arc<UnixStream>>,
    ) -> Serve {
        let frames = |v: Vec<Vec<u8>>| -> Vec<TensorBlockDescriptor> {
            v.iter()
                .filter_map(|b| <&[u8; 64]>::try_from(b.as_slice()).ok().map(TensorBlockDescriptor::from_bytes))
                .collect()
        };
        self.counters = counters;
        for c in channels {
            let (Some(slot), Some(stream), Some((sub, comp))) = (
                self.sessions.get_mut(c.channel as usize),
                streams.get(&c.channel),
                self.region.daemon_channel(c.channel),
            ) else {
                self.store.close_session(c.session);
                continue;
            };
            self.store.set_session_uid(c.session, c.uid);
            *slot = Some(Session {
                session: c.session,
                sub,
                comp,
                stream: stream.clone(),
                pid: c.pid,
                uid: c.uid,
                backlog: frames(c.backlog),
                kicked: c.kicked,
                waiting: c.waiting,
                held: frames(c.held),
                fetch: None,
                tier_asked: c.tier_asked,
                stuck_since: None,
                held_answers: Vec::new(),
            });
        }
        let now = Instant::now();
        for w in waits {
            if self.sessions.get(w.channel as usize).is_some_and(Option::is_some) {
                let deadline = w.left_ms.map(|ms| now + Duration::from_millis(ms));
                self.waits.park(w.channel, Waiter { key: w.key, request_id: w.request_id, deadline });
            }
        }
        self
    }

    /// Stops for a takeover: stops the tiers (dropping their sessions; their
    /// removals are over, and the answers waiting for them sent), ends the
    /// fetches channels are parked on, sends the serialized state — with the
    /// tiers' unfinished writes and the descriptors they hand over — on
    /// `state` and waits for `outcome`. Resumes (restarting the tiers, which
    /// kept their storage, and offering them their unfinished writes again)
    /// unless told to stop for good.
    pub(super) fn hand_over(&mut self, state: Sender<crate::events::StateOut>, outcome: Receiver<bool>) {
        self.metrics.set_health(Health::HandingOver);
        let (stopped, resolved) = self.tiers.stop(&mut self.store);
        self.removals_done(resolved);
        for s in self.sessions.iter_mut().flatten() {
            if s.fetch.is_some() {
                unpark_fetch(s);
            }
        }
        let mut fds = Vec::new();
        let mut tier_fds = Vec::new();
        for (_, t) in &stopped.tiers {
            if let Some((name, f)) = t.handover_fds() {
                tier_fds.push((name.to_string(), f.len() as u32));
                fds.extend(f);
            }
        }
        let mut st = self.state();
        st.tier_writes = stopped.pending.clone();
        st.tier_unremoved = stopped.unremoved.clone();
        st.tier_fds = tier_fds;
        let bytes = crate::takeover::encode(&st);
        let ok = bytes.is_ok();
        let _ = state.send(bytes.map(|b| (b, fds)));
        if ok && outcome.recv().unwrap_or(false) {
            self.handed_over = true;
            self.metrics.set_health(Health::HandedOver);
            return;
        }
        tracing::info!("takeover did not happen; serving on");
        self.metrics.set_health(Health::Serving);
        self.tiers.resume(stopped, &mut self.store);
    }

    /// Offers the daemon's tiers the writes and removals the tiers of the
    /// daemon taken over had not finished (their blocks are in the store).
    pub(crate) fn take_up_tier_work(mut self, writes: Vec<PendingWrite>, unremoved: Vec<u128>) -> Serve {
        for key in unremoved {
            self.tiers.remove_unanswered(key);
        }
        let n = writes.len();
        for w in writes {
            self.tiers.rewrite(&mut self.store, w);
        }
        if n > 0 {
            tracing::info!("offered the tiers {n} block(s) the daemon taken over had not written yet");
        }
        self
    }

    /// The serve loop's state for a takeover.
    fn state(&self) -> ServeState<&Store> {
        let frames = |v: &[TensorBlockDescriptor]| v.iter().map(|d| d.as_bytes().to_vec()).collect();
        let now = Instant::now();
        ServeState {
            region_generation: self.region.generation(),
            layout: RegionLayout::from(self.region.layout()),
            store: &self.store,
            channels: self
                .sessions
                .iter()
                .enumerate()
                .filter_map(|(ch, s)| {
                    let s = s.as_ref()?;
                    Some(ChannelState {
                        channel: ch as u32,
                        session: s.session,
                        pid: s.pid,
                        uid: s.uid,
                        backlog: frames(&s.backlog),
                        held: frames(&s.held),
                        waiting: s.waiting,
                        kicked: s.kicked,
                        tier_asked: s.tier_asked.clone(),
                    })
                })
                .collect(),
            waits: self
                .waits
                .parked()
                .map(|(channel, w)| ParkedWait {
                    channel,
                    key: w.key,
                    request_id: w.request_id,
                    left_ms: w.deadline.map(|d| d.saturating_duration_since(now).as_millis() as u64),
                })
                .collect(),
            counters: self.counters.clone(),
            uptime_ms: self.started.elapsed().as_millis() as u64,
            tier_writes: Vec::new(),
            tier_unremoved: Vec::new(),
            tier_fds: Vec::new(),
        }
    }
}
