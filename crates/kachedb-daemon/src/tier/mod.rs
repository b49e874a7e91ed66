//! The tiers behind the megaslab, as the serve loop sees them: one interface
//! ([`Tier`]) that every tier implements (the disk tier, `crate::disk`, and
//! the remote tier, `crate::remote`), the jobs the loop hands a tier, and the [`TierEvent`]s a tier
//! reports back.
//!
//! The division of work: the serve loop owns the [`Store`](crate::store::Store).
//! It takes a pin for each block a tier writes behind, makes the reservations
//! a fill asks for and commits them; a tier never touches the store. A tier
//! runs its own threads, reads a pinned block's bytes and writes a filled
//! block's bytes in the megaslab, and tells the loop what it did through
//! [`TierEvents`], which queue a [`TierEvent`] for the loop and ring its
//! doorbell. Each tier has a [`TierId`] so the loop can tell the reports of
//! several tiers apart.

pub mod gate;
pub mod metrics;
pub mod reply;
pub mod threads;
pub mod view;

use kachedb_shm::{BlockMeta, DType, Shape};
use std::sync::Arc;
use std::time::Duration;

/// Which of the daemon's tiers (its place in the order they were started).
pub type TierId = usize;

/// A block offered to a tier for writing behind, before it is pinned.
#[derive(Clone, Copy, Debug)]
pub struct Offer<'a> {
    /// Tensor bytes.
    pub len: u64,
    /// The tenant whose block it is (its row's name in the megaslab).
    pub tenant: &'a str,
    /// That tenant's limit on megaslab bytes, if it has one: a tier keeps
    /// the tenant's blocks pinned for writing within a share of it, so that
    /// its backlog never holds the whole of it (docs/disk.md).
    pub tenant_limit: Option<u64>,
}

/// A write a tier had taken and not finished when it stopped: offered again
/// by the daemon that serves next (this one resumed, or its successor).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PendingWrite {
    /// Key.
    pub key: u128,
    /// The parent its client named.
    pub parent: Option<u128>,
}

/// What a tier says when told that a key's older copy must go (a DELETE,
/// or a COMMIT that replaced it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removal {
    /// Nothing of the key's to remove that could outlive a crash: answer now.
    Done,
    /// The tier removes its copy (from now on it serves none, and no earlier
    /// write of the key lands) and reports [`TierEvent::Removed`] with this
    /// token once the removal is durable (or failed).
    Pending(u64),
}

/// What a tier hands on when it stops for a takeover.
#[derive(Debug, Default)]
pub struct Handover {
    /// Writes taken and not finished, in the order they were taken.
    pub pending: Vec<PendingWrite>,
    /// Removals it finished (or gave up on) while stopping: each token, and
    /// whether it is durable. A token it answered before, or took up while
    /// stopping without answering, is durable unless its key is in
    /// [`unremoved`](Self::unremoved).
    pub removed: Vec<(u64, Result<(), String>)>,
    /// Keys whose older copy could not be removed (their removal keeps
    /// failing): whichever daemon serves next must remove them too.
    pub unremoved: Vec<u128>,
}

/// A block a client committed, pinned for the tier's session, to write behind.
#[derive(Clone, Debug)]
pub struct WriteJob {
    /// The tenant whose block it is (the name of its row in the megaslab's
    /// tenant table: `_other` for a tenant counted there).
    pub tenant: String,
    /// Key.
    pub key: u128,
    /// The parent the client named when it committed the block (its chain's
    /// previous block), if any; the local link may not exist.
    pub parent: Option<u128>,
    /// The pin to give back ([`TierEvent::Written`]) when done.
    pub pin: u64,
    /// Where the tensor bytes are, bytes from the region base.
    pub data_offset: u64,
    /// Tensor bytes.
    pub len: u64,
    /// Element type.
    pub dtype: DType,
    /// Dims.
    pub shape: Shape,
    /// Its metadata record (META), if its writer attached one and the
    /// daemon publishes KV events: the disk tier keeps it with the block.
    pub meta: Option<Arc<BlockMeta>>,
}

/// Keys missing locally, to fill: the local-miss tail of one batch.
#[derive(Clone, Debug)]
pub struct FetchJob {
    /// Fetch id (the serve loop matches the answer to the parked channel by it).
    pub id: u64,
    /// The tenant of the client whose miss started the fetch (the name of
    /// the row it is counted in). A tier that keeps no tenant with its
    /// blocks (the remote tier: the cluster is the fleet's) fills them for
    /// this one ([`FillSpec::tenant`]), within its limit.
    pub tenant: String,
    /// Keys, in chain order.
    pub keys: Vec<u128>,
    /// A read-ahead ([`Tier::chain_after`]): nobody waits for it, its
    /// reservations take free megaslab space only, and a tier runs it after
    /// the fetches clients wait for.
    pub ahead: bool,
}

/// A block a fill found: what the serve loop needs to reserve room for it.
#[derive(Clone, Debug)]
pub struct FillSpec {
    /// The tenant the block is counted for once filled, if the tier keeps
    /// it; `None`: the default tenant.
    pub tenant: Option<String>,
    /// Key.
    pub key: u128,
    /// Element type.
    pub dtype: DType,
    /// Dims.
    pub shape: Shape,
    /// Tensor bytes.
    pub len: u64,
    /// The parent the block was committed with, if the tier keeps it: the
    /// fill commits the block naming it (linked if the parent is local).
    pub parent: Option<u128>,
    /// The block's metadata record (META), if the tier kept it: the filled
    /// block is published with it (docs/events.md).
    pub meta: Option<Arc<BlockMeta>>,
}

/// A reservation the serve loop made for a fill.
#[derive(Clone, Copy, Debug)]
pub struct Reserved {
    /// The reservation handle (of the tier's session).
    pub handle: u64,
    /// Where its tensor bytes go, bytes from the region base.
    pub data_offset: u64,
}

/// What a tier tells the serve loop.
#[derive(Debug)]
pub enum TierEvent {
    /// Fetch `fetch` found these blocks: reserve room for each (`None` where
    /// not: present locally by now, or no room) and answer on `reply`. If
    /// the reply cannot be delivered, the serve loop aborts them.
    Reserve {
        /// Fetch id.
        fetch: u64,
        /// The blocks.
        blocks: Vec<FillSpec>,
        /// Where the answer goes (one entry per block).
        reply: reply::Sender<Vec<Option<Reserved>>>,
    },
    /// Fetch `fetch` is over: these reservations hold their bytes, commit
    /// them (in this order); the fetch's other reservations are aborted.
    /// Then the keys still missing go to the next tier, if there is one;
    /// once none is left, the frames its channel held are served. Empty:
    /// nothing was filled (the keys are missing there too, or the fill
    /// failed).
    Filled {
        /// Fetch id.
        fetch: u64,
        /// Reservation handles to commit, with their tensor bytes.
        filled: Vec<(u64, u64)>,
    },
    /// A write-behind job is over (written or not): drop its pin.
    Written {
        /// The pin handle (of the tier's session).
        pin: u64,
    },
    /// The removal of [`Removal::Pending`] `token` is durable (`Ok`), or
    /// could not be made so (`Err`: why; the tier goes on trying, and serves
    /// no copy of the key meanwhile).
    Removed {
        /// The token.
        token: u64,
        /// The outcome.
        result: Result<(), String>,
    },
}

/// Where one tier's events go: the serve loop's event queue (made by
/// `crate::events::EventSender::tier_events`), which rings its doorbell.
#[derive(Clone)]
pub struct TierEvents {
    tier: TierId,
    send: Arc<dyn Fn(TierId, TierEvent) + Send + Sync>,
}

impl TierEvents {
    /// Events of tier `tier`, delivered by `send`.
    pub fn new(tier: TierId, send: impl Fn(TierId, TierEvent) + Send + Sync + 'static) -> TierEvents {
        TierEvents { tier, send: Arc::new(send) }
    }

    /// Reports `ev` to the serve loop.
    pub fn send(&self, ev: TierEvent) {
        (self.send)(self.tier, ev);
    }

    /// The tier these events come from.
    pub fn tier(&self) -> TierId {
        self.tier
    }
}

impl std::fmt::Debug for TierEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierEvents").field("tier", &self.tier).finish()
    }
}

/// Why a tier could not start (or start again).
pub type TierError = Box<dyn std::error::Error + Send + Sync>;

/// Which committed blocks a tier is offered for writing behind
/// (`kachedb serve --disk-admit`, docs/disk.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Admission {
    /// Every block a client commits, at its commit.
    #[default]
    First,
    /// Only a block requested again (GET, LOOKUP or WAIT) while it is in the
    /// megaslab after its commit, at that request; and a block committed
    /// again after it was seen committed once.
    Second,
}

/// A tier behind the megaslab, driven by the serve loop (which calls every
/// method on its own thread; none of them blocks on I/O).
pub trait Tier: Send + std::fmt::Debug {
    /// Offers a block a client just committed for writing behind. If the
    /// tier takes it (its queue, and the tenant's share of it, have room),
    /// it calls `pinned`, which pins the block for the tier's session and
    /// describes it (`None`: the block is gone; nothing is written), and it
    /// reports [`TierEvent::Written`] once done with the pin. A block not
    /// taken is counted by the tier as dropped.
    fn write_behind(&self, offer: Offer<'_>, pinned: &mut dyn FnMut() -> Option<WriteJob>);

    /// Starts filling the keys of `job`, missing locally: the tier asks for
    /// reservations ([`TierEvent::Reserve`]), copies the blocks it has into
    /// them, and always ends with [`TierEvent::Filled`].
    fn fetch(&self, job: FetchJob);

    /// The blocks a client walking a chain asks for after `key` (which it
    /// just asked for), in order, that this tier holds: what the serve loop
    /// reads ahead, with fetches of their own ([`FetchJob::ahead`]), into free
    /// megaslab space only, committed as the first blocks eviction takes
    /// until a client uses them. Within the tier's bound on read-ahead;
    /// empty when it has none or cannot tell now (it must not block).
    fn chain_after(&self, _key: u128) -> Vec<u128> {
        Vec::new()
    }

    /// The longest a fetch can take before the serve loop stops waiting for it.
    fn fetch_bound(&self) -> Duration;

    /// Counts one filled block of `len` bytes that the serve loop committed.
    fn landed(&self, len: u64);

    /// A fetch that ended at this tier committed blocks `us` microseconds
    /// after its local miss: for the tier's fill latency
    /// ([`metrics::FillLatency`]).
    fn filled_after(&self, us: u64);

    /// Which committed blocks the serve loop offers this tier
    /// ([`write_behind`](Self::write_behind)).
    fn admission(&self) -> Admission {
        Admission::First
    }

    /// The copy of `key` this tier holds for this node, if any, must go: a
    /// client deleted the key, or committed a newer block of it. From now on
    /// the tier serves no copy of it and no write of it taken before now
    /// lands; a write taken after (the newer block's) does. Called on the
    /// serve loop after the store applied the request, whether or not the
    /// key was local. A tier that may hold a copy that could outlive a crash
    /// answers [`Removal::Pending`] and reports the removal durable with
    /// [`TierEvent::Removed`]; the client's answer waits for it. (The remote
    /// tier keeps its copy: it is the fleet's, docs/remote.md.)
    fn remove(&self, key: u128) -> Removal;

    /// The daemon serves from now on: a tier started held (for a takeover,
    /// before the old daemon stopped) may touch its storage.
    fn release(&self) {}

    /// The serve loop stopped waiting for a fetch of this tier (past
    /// [`fetch_bound`](Self::fetch_bound)); for the tier's counters.
    fn timed_out(&self) {}

    /// A client's answer waited for a removal of this tier that was not
    /// confirmed durable (it failed, or took longer than
    /// [`fetch_bound`](Self::fetch_bound)): answered `NOT_DURABLE`; for the
    /// tier's counters.
    fn unconfirmed(&self) {}

    /// Stops the tier's work for a takeover: when this returns, nothing of
    /// the tier touches the megaslab any more, its queued removals are done
    /// (or given up on), and the writes it had taken and not finished are
    /// handed back ([`Handover::pending`]) for whichever daemon serves next
    /// to offer again (the serve loop drops their pins and the fills'
    /// reservations with the tier's session). The tier keeps its storage
    /// (the disk tier: its directory and lock) until the stopped tier is
    /// dropped, so a takeover that fails resumes it as it was. Dropping a
    /// running tier stops it too (at shutdown).
    fn stop(self: Box<Self>) -> (Box<dyn StoppedTier>, Handover);
}

/// A tier stopped for a takeover.
pub trait StoppedTier: Send + std::fmt::Debug {
    /// Starts it again (the takeover did not happen), reporting to the same
    /// [`TierEvents`] as before.
    fn resume(self: Box<Self>) -> Result<Box<dyn Tier>, TierError>;

    /// What the new daemon's tier of the same kind adopts, sent with the
    /// takeover: the tier's name and descriptors of its storage (the disk
    /// tier: its directory and the lock's open file, so that the lock is
    /// never let go between the two daemons). Copies: this tier keeps its own.
    fn handover_fds(&self) -> Option<(&'static str, Vec<std::os::fd::OwnedFd>)> {
        None
    }
}
