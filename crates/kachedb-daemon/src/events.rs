//! The queue from the control thread to the serve loop: [`Event`]s, sent by
//! an [`EventSender`] that rings the region doorbell after each one so a
//! parked serve loop wakes and sees it.

use crate::tier::{TierEvent, TierEvents, TierId};
use kachedb_shm::{Region, Stats};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;

/// What the control thread tells the serve loop.
#[derive(Debug)]
pub enum Event {
    /// A client said hello and got `channel`.
    Attach {
        /// Channel.
        channel: u32,
        /// Its socket (to shut down a corrupt client).
        stream: Arc<UnixStream>,
        /// Peer pid.
        pid: i32,
        /// Peer uid.
        uid: u32,
        /// The tenant it named in its hello (checked), if any.
        tenant: Option<String>,
    },
    /// A client's socket closed.
    Detach {
        /// Channel.
        channel: u32,
        /// The daemon closed it (a control protocol error), not the client.
        closed_by_daemon: bool,
    },
    /// Someone asked for stats; the answer goes back on this sender once
    /// every frame published before the question has been served.
    Stats(Sender<Stats>),
    /// A tier behind the megaslab reports (`crate::tier`).
    Tier {
        /// Which tier.
        tier: TierId,
        /// What it reports.
        event: TierEvent,
    },
    /// A new daemon takes over (`crate::takeover`): the serve loop stops, sends
    /// its serialized state (or why it cannot) on `state`, and waits for
    /// `outcome`: `true`, stop for good; `false` (or the sender gone), resume.
    Takeover {
        /// Where the state goes, with the descriptors the stopped tiers hand
        /// over (in the order the state lists them).
        state: Sender<StateOut>,
        /// What happens next.
        outcome: Receiver<bool>,
    },
}

/// What the serve loop sends for a takeover: its serialized state and the
/// descriptors its stopped tiers hand over, or why it cannot.
pub type StateOut = Result<(Vec<u8>, Vec<std::os::fd::OwnedFd>), String>;

/// The control thread's end of the queue.
#[derive(Debug, Clone)]
pub struct EventSender {
    tx: Sender<Event>,
    region: Arc<Region>,
}

impl EventSender {
    /// Queues `ev` and rings the doorbell of `region`'s serve loop.
    pub fn send(&self, ev: Event) {
        let _ = self.tx.send(ev);
        // SYNC POINT: `notify`'s SeqCst fence orders the queue's publish
        // before its load of the doorbell state; it pairs with the fence in the
        // serve loop's park, whose ready check looks at the queue: either the
        // loop sees the event there, or this sees PARKED and wakes it.
        self.region.doorbell().notify();
    }

    /// Where tier `tier` reports: this queue, as [`Event::Tier`].
    pub fn tier_events(&self, tier: TierId) -> TierEvents {
        let events = self.clone();
        TierEvents::new(tier, move |tier, event| events.send(Event::Tier { tier, event }))
    }
}

/// A new queue for the serve loop of `region`: the sender and the receiver.
pub fn queue(region: Arc<Region>) -> (EventSender, Receiver<Event>) {
    let (tx, rx) = mpsc::channel();
    (EventSender { tx, region }, rx)
}
