//! The serve loop's side of a takeover (`crate::takeover` has the protocol
//! between the two daemons): the state the loop hands over ([`ServeState`]:
//! the store, each channel's session, the parked WAITs, the counters),
//! stopping and resuming for it ([`Serve::hand_over`]), and taking up a
//! state handed over ([`Serve::restore`]).

use super::session::{unpark_fetch, Session};
use super::Serve;
use crate::metrics::Health;
use crate::store::SessionId;
use crate::takeover::state::{ChannelState, ParkedWait, RegionLayout, ServeCounters, ServeState, TierWrite};
use crate::tier::PendingWrite;
use crate::waits::Waiter;
use kachedb_shm::TensorBlockDescriptor;
use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Serve {
    /// Takes up the sessions, parked WAITs and counters of the daemon taken
    /// over (`crate::takeover`); `streams` are the channels' connections.
    /// A session whose connection did not come along is closed.
    pub(crate) fn restore(
        mut self,
        channels: Vec<ChannelState>,
        waits: Vec<ParkedWait>,
        counters: ServeCounters,
        streams: &HashMap<u32, Arc<UnixStream>>,
    ) -> Serve {
        let frames = |v: Vec<Vec<u8>>| -> Vec<TensorBlockDescriptor> {
            v.iter()
                .filter_map(|b| <&[u8; 64]>::try_from(b.as_slice()).ok().map(TensorBlockDescriptor::from_bytes))
                .collect()
        };
        self.counters = counters.to_stats();
        for c in channels {
            let session = SessionId::from_u64(c.session);
            let (Some(slot), Some(stream), Some((sub, comp))) = (
                self.sessions.get_mut(c.channel as usize),
                streams.get(&c.channel),
                self.region.daemon_channel(c.channel),
            ) else {
                self.store.close_session(session);
                continue;
            };
            self.store.set_session_uid(session, c.uid);
            *slot = Some(Session {
                session,
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
                tier_asked: c.tier_asked.into_iter().collect(),
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
        st.tier_writes = stopped.pending.iter().map(|w| TierWrite { key: w.key, parent: w.parent }).collect();
        st.tier_unremoved = stopped.unremoved.clone();
        st.tier_fds = tier_fds;
        let bytes = crate::takeover::state::encode(&st);
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

    /// The serve loop's state for a takeover (the tiers' work added by the caller).
    fn state(&self) -> ServeState {
        let frames = |v: &[TensorBlockDescriptor]| v.iter().map(|d| d.as_bytes().to_vec()).collect();
        let now = Instant::now();
        ServeState {
            region_generation: self.region.generation(),
            layout: RegionLayout::from(self.region.layout()),
            store: self.store.to_state(),
            channels: self
                .sessions
                .iter()
                .enumerate()
                .filter_map(|(ch, s)| {
                    let s = s.as_ref()?;
                    Some(ChannelState {
                        channel: ch as u32,
                        session: s.session.as_u64(),
                        pid: s.pid,
                        uid: s.uid,
                        backlog: frames(&s.backlog),
                        held: frames(&s.held),
                        waiting: s.waiting,
                        kicked: s.kicked,
                        tier_asked: s.tier_asked.iter().copied().collect(),
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
            counters: ServeCounters::of(&self.counters),
            uptime_ms: self.started.elapsed().as_millis() as u64,
            tier_writes: Vec::new(),
            tier_unremoved: Vec::new(),
            tier_fds: Vec::new(),
        }
    }
}
