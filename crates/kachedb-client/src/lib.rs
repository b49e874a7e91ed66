//! KacheDB blocking Rust client.
//!
//! ```no_run
//! use kachedb_client::{Client, ConnectOptions, Key};
//! let kc = Client::connect(&ConnectOptions::default())?;
//! kc.put(Key::from_bytes(b"prefix-0"), &[1u8, 2, 3])?;
//! let view = kc.get(Key::from_bytes(b"prefix-0"))?.expect("present");
//! assert_eq!(&*view, &[1, 2, 3]);
//! # Ok::<(), kachedb_client::ClientError>(())
//! ```
//!
//! Stores: [`Client::put`] (one block), [`Client::put_many`] (a batch),
//! [`Client::put_ranges`] (a batch, each block gathered from byte ranges), and
//! [`Client::reserve`] / [`Client::reserve_many`] to write in place; reads:
//! [`Client::get`], [`Client::get_many`], [`Client::get_prefix`],
//! [`Client::get_prefix_into`] (`docs/PROTOCOL.md` maps each to its wire op
//! and its Python method).
//!
//! Blocks of a prefix chain name their **parent** (the block before them):
//! [`Value::parent`], [`Reservation::set_parent`], the `parents` of
//! [`Client::put_ranges`] and [`Client::reserve_many_with_parents`]
//! ([`chain_parents`] builds them for a chain). The daemon's chain-aware eviction then never evicts a block before
//! the blocks that follow it (`docs/eviction.md`).
//!
//! One [`Client`] is one channel (a pair of rings) to the daemon. It can be
//! shared between threads (`Arc<Client>` or `&Client`); operations on one client
//! are serialised by a mutex, so use one client per thread for parallel work.
//! Views ([`BlockView`]) keep their block pinned, and keep the region mapped and
//! the connection open, for as long as they live.
//!
//! Modules: [`key`] (user keys to 128-bit keys), `connect` (the control
//! socket: hello, fd passing, stats), `channel` (the rings: exchange, release
//! queue, liveness), `view` ([`BlockView`], [`Reservation`]), `error`
//! ([`ClientError`]). Every frame is built by `kachedb_shm`'s [`Request::encode`].
#![warn(missing_docs)]

mod channel;
mod connect;
pub mod copy;
mod deprecated;
mod error;
pub mod key;
mod value;
mod view;

pub use connect::{daemon_stats, ConnectOptions, DEFAULT_ANSWER_TIMEOUT, TRUST_UID_ENV};
pub use error::{ClientError, Result};
pub use kachedb_shm::{BlockMeta, DType, Shape, Stats};
pub use key::Key;
pub use value::Value;
pub use view::{BlockView, Reservation};

use channel::Channel;
use error::{invalid, ok_or, status_error};
use kachedb_shm::{page_offset_of, Completion, Region, Request, Status, WAIT_FOREVER};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// A connection to the daemon. See the crate docs.
pub struct Client {
    channel: Arc<Channel>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("channel", &self.channel.index)
            .field("socket", &self.channel.socket_path)
            .finish()
    }
}

impl Client {
    /// Connects to the daemon, maps its region and takes a channel.
    pub fn connect(opts: &ConnectOptions) -> Result<Client> {
        let (stream, path) = connect::connect_trusted(opts)?;
        let (reply, fd) = connect::hello(&stream, opts.tenant.as_deref())?;
        // The data path never reads this stream with a timeout (it polls it
        // for hang-up); writes (release batches) must not give up either.
        stream.set_read_timeout(None).ok();
        stream.set_write_timeout(None).ok();
        let region = Region::attach(fd)?;
        if reply.generation != region.generation() {
            return Err(ClientError::Protocol("region generation does not match the hello reply".into()));
        }
        let channel = Channel::new(region, reply.channel, stream, opts.wait, path)?;
        Ok(Client { channel: Arc::new(channel) })
    }

    /// The channel this client holds.
    pub fn channel(&self) -> u32 {
        self.channel.index
    }

    /// The mapped region.
    pub fn region(&self) -> &Arc<Region> {
        &self.channel.region
    }

    /// Stops this client from starting new operations. The connection (and so
    /// the pins of live views) stays open until the last view is dropped.
    pub fn close(&self) {
        self.channel.closed.store(true, Ordering::Release);
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.channel.closed.load(Ordering::Acquire)
    }

    /// Round trip with no effect.
    pub fn ping(&self) -> Result<()> {
        ok_or(self.channel.call1(Request::Ping)?, 0).map(|_| ())
    }

    /// Reserves a block for `key` with `dtype` and `shape`; write it through the
    /// returned [`Reservation`] and commit. `page_offset` (valid by
    /// [`kachedb_shm::page_offset_is_valid`]: a multiple of 64 below 4096) asks
    /// for a data start with that offset within a 4 KiB page, which makes a copy
    /// from a source with the same alignment run at full speed.
    pub fn reserve(&self, key: Key, dtype: DType, shape: &Shape, page_offset: u64) -> Result<Reservation> {
        let req = Request::reserve(key.0, dtype, *shape, page_offset).map_err(invalid)?;
        let c = self.channel.call1(req)?;
        Reservation::from_reserve(&self.channel, c, dtype, *shape, req.reserve_len())
    }

    /// Reserves a block for a copy of `src`: checks that `src` is exactly
    /// `shape` of `dtype`, and asks for the page offset of `src`
    /// ([`kachedb_shm::page_offset_of`]) so the copy runs at full speed.
    pub fn reserve_for_copy(&self, key: Key, dtype: DType, shape: &Shape, src: &[u8]) -> Result<Reservation> {
        shape.check_len(dtype, src.len() as u64).map_err(invalid)?;
        self.reserve(key, dtype, shape, page_offset_of(src.as_ptr()))
    }

    /// Stores `value` under `key` (one copy into shared memory): flat bytes
    /// (`&[u8]`, `&Vec<u8>`, `&[u8; N]`: a `u8` block) or a [`Value`] that
    /// says the dtype and shape ([`Value::tensor`]) and the block's parent in a
    /// prefix chain ([`Value::parent`]).
    pub fn put<'a>(&self, key: Key, value: impl Into<Value<'a>>) -> Result<()> {
        let v = value.into();
        let shape = v.shape()?;
        let mut r = self.reserve_for_copy(key, v.dtype, &shape, v.bytes)?;
        r.set_parent(v.parent);
        copy::copy_into(r.as_mut_slice(), v.bytes);
        r.commit()
    }

    /// Stores many blocks, as [`put`](Self::put) each: all RESERVEs in one
    /// batch ([`reserve_many`](Self::reserve_many), each at its source's page
    /// offset), the copies ([`copy::copy_many`]: split between threads when
    /// the batch is large), then all COMMITs in one batch, in order (a block
    /// may name one earlier in the batch as its parent: [`chain_parents`],
    /// [`Value::parent`]). All or nothing: if any reservation fails, every one
    /// is aborted and the first error returned (nothing becomes visible).
    pub fn put_many<'a, V: Into<Value<'a>> + Clone>(&self, items: &[(Key, V)]) -> Result<()> {
        let values: Vec<(Key, Value<'a>)> = items.iter().map(|(k, v)| (*k, v.clone().into())).collect();
        let mut wanted = Vec::with_capacity(values.len());
        for (key, v) in &values {
            let shape = v.shape()?;
            shape.check_len(v.dtype, v.bytes.len() as u64).map_err(invalid)?;
            wanted.push((*key, v.dtype, shape, page_offset_of(v.bytes.as_ptr())));
        }
        let parents: Vec<Option<Key>> = values.iter().map(|(_, v)| v.parent).collect();
        let mut reservations = self.reserve_many_with_parents(&wanted, &parents)?;
        let mut pairs: Vec<(&mut [u8], &[u8])> =
            reservations.iter_mut().zip(&values).map(|(r, (_, v))| (r.as_mut_slice(), v.bytes)).collect();
        copy::copy_many(&mut pairs);
        drop(pairs);
        self.commit_many(reservations)
    }

    /// Stores one block of `dtype` and `shape` per key, each gathered from
    /// `sources.len() / keys.len()` byte ranges in order (block `i` is the
    /// concatenation of `sources[i * per .. (i + 1) * per]`), block `i` naming
    /// `parents[i]` (`parents` empty: none): one batch of RESERVEs, the copies
    /// (one [`copy::copy_many`] over every range: split between threads when
    /// the batch is large), one batch of COMMITs. For a block whose bytes lie
    /// in pieces in the caller's memory (an engine's KV pages, one range per
    /// layer), with no staging copy. All or nothing, as
    /// [`put_many`](Self::put_many); `ClientError::Invalid` (nothing reserved)
    /// if the ranges do not divide evenly between the keys or a block's ranges
    /// do not add up to its bytes.
    pub fn put_ranges(
        &self,
        keys: &[Key],
        dtype: DType,
        shape: &Shape,
        sources: &[&[u8]],
        parents: &[Option<Key>],
    ) -> Result<()> {
        let per = ranges_per_block(keys.len(), sources.len())?;
        if keys.is_empty() {
            return Ok(());
        }
        let block_len = shape
            .len_bytes(dtype)
            .ok_or_else(|| ClientError::Invalid(format!("a block of {:?} {dtype:?} is too large", shape.dims())))?;
        check_ranges(sources.iter().map(|s| s.len()), per, |_| block_len)?;
        // Each block at the page offset of its first byte's source.
        let first = |s: &[&[u8]]| s.iter().find(|r| !r.is_empty()).map_or(0, |r| page_offset_of(r.as_ptr()));
        let wanted: Vec<_> = keys.iter().zip(sources.chunks(per)).map(|(k, s)| (*k, dtype, *shape, first(s))).collect();
        let mut reservations = self.reserve_many_with_parents(&wanted, parents)?;
        fill_gathered(&mut reservations, sources, usize::MAX)?;
        self.commit_many(reservations)
    }

    /// Pins the leading present keys of `keys` ([`get_prefix`](Self::get_prefix),
    /// one round trip) and copies each block, while it is pinned, into
    /// `dests.len() / keys.len()` byte ranges in order (block `i`'s bytes into
    /// `dests[i * per .. (i + 1) * per]`), then releases the pins together
    /// (one post). Stops at the first missing key, or at the first block that
    /// is not of `dtype` and `block_len` bytes (its ranges are left as they
    /// were). Returns how many blocks were copied. `ClientError::Invalid`
    /// (nothing asked of the daemon) if the ranges do not divide evenly between
    /// the keys or a block's ranges do not add up to `block_len`.
    pub fn get_prefix_into(
        &self,
        keys: &[Key],
        dtype: DType,
        block_len: usize,
        dests: &mut [&mut [u8]],
    ) -> Result<usize> {
        let per = ranges_per_block(keys.len(), dests.len())?;
        if keys.is_empty() {
            return Ok(0);
        }
        check_ranges(dests.iter().map(|d| d.len()), per, |_| block_len as u64)?;
        let views = self.get_prefix(keys)?;
        let n = views.iter().take_while(|v| v.dtype() == dtype && v.len() == block_len).count();
        let mut pairs: Vec<(&mut [u8], &[u8])> = Vec::with_capacity(n * per);
        for (v, ds) in views.iter().take(n).zip(dests.chunks_mut(per)) {
            let mut rest: &[u8] = v;
            for d in ds.iter_mut() {
                let (s, tail) = rest.split_at(d.len());
                pairs.push((&mut **d, s));
                rest = tail;
            }
        }
        copy::copy_many(&mut pairs);
        drop(pairs);
        BlockView::release_all(views);
        Ok(n)
    }

    /// Reserves many blocks in one batch of RESERVEs: `(key, dtype, shape,
    /// page_offset)` each, as [`reserve`](Self::reserve). All or nothing: if one
    /// fails, the others are aborted (one batch of ABORTs) and its error returned.
    /// Write each, then [`commit_many`](Self::commit_many) (or drop to abort).
    ///
    /// The batch goes as reservation units (`docs/PROTOCOL.md`, "Reservation
    /// units") of up to the ring's capacity of RESERVEs (1024 by default),
    /// which the daemon admits whole or not at all: a refused unit leaves
    /// nothing reserved and evicts nothing, so a batch that cannot fit costs
    /// no one a block. A longer batch is admitted in units of that size: if
    /// a later unit is refused, the earlier ones' reservations are aborted,
    /// but the blocks they evicted to make room stay evicted. (A daemon
    /// older than units serves each RESERVE on its own.)
    pub fn reserve_many(&self, items: &[(Key, DType, Shape, u64)]) -> Result<Vec<Reservation>> {
        self.reserve_many_with_parents(items, &[])
    }

    /// [`reserve_many`](Self::reserve_many) where reservation `i` names
    /// `parents[i]` as its parent ([`Reservation::set_parent`]; `parents`
    /// empty: none, else one per item). [`commit_many`](Self::commit_many)
    /// commits them in order, so a block may name one earlier in the batch.
    pub fn reserve_many_with_parents(
        &self,
        items: &[(Key, DType, Shape, u64)],
        parents: &[Option<Key>],
    ) -> Result<Vec<Reservation>> {
        if !parents.is_empty() && parents.len() != items.len() {
            return Err(ClientError::Invalid(format!(
                "{} parents for {} blocks: give one per block, or none",
                parents.len(),
                items.len()
            )));
        }
        let reqs = items
            .iter()
            .map(|(key, dtype, shape, page_offset)| {
                Request::reserve(key.0, *dtype, *shape, *page_offset).map_err(invalid)
            })
            .collect::<Result<Vec<_>>>()?;
        let done = self.channel.call_units(&reqs)?;
        let mut out = Vec::with_capacity(items.len());
        let mut first_err = None;
        for (c, (_, dtype, shape, _)) in done.into_iter().zip(items) {
            let len = shape.len_bytes(*dtype).unwrap_or(0);
            match Reservation::from_reserve(&self.channel, c, *dtype, *shape, len) {
                Ok(r) => out.push(r),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_err {
            self.abort_many(out)?;
            return Err(e);
        }
        for (r, parent) in out.iter_mut().zip(parents) {
            r.set_parent(*parent);
        }
        Ok(out)
    }

    /// Commits many reservations with one batch of COMMITs
    /// ([`Reservation::commit_all`]): each block becomes visible under its key.
    pub fn commit_many(&self, reservations: Vec<Reservation>) -> Result<()> {
        Reservation::commit_all(reservations)
    }

    /// Attaches what an engine knows of each block (its hash, parent, tokens:
    /// [`BlockMeta`]) to open reservations, for the KV events
    /// ([`Reservation::attach_meta_all`]); commit them as usual after.
    pub fn attach_meta(&self, reservations: &[Reservation], metas: &[Option<BlockMeta>]) -> Result<()> {
        Reservation::attach_meta_all(reservations, metas)
    }

    /// Aborts many reservations with one batch of ABORTs ([`Reservation::abort_all`]).
    pub fn abort_many(&self, reservations: Vec<Reservation>) -> Result<()> {
        Reservation::abort_all(reservations)
    }

    /// Pins the block under `key` and returns a view of it, or `None`.
    pub fn get(&self, key: Key) -> Result<Option<BlockView>> {
        let c = self.channel.call1(Request::Get { key: key.0 })?;
        BlockView::from_get(&self.channel, c)
    }

    /// Pins many blocks with one publish per ring-full of frames.
    pub fn get_many(&self, keys: &[Key]) -> Result<Vec<Option<BlockView>>> {
        let reqs: Vec<Request> = keys.iter().map(|k| Request::Get { key: k.0 }).collect();
        let done = self.channel.call(&reqs)?;
        done.into_iter().map(|c| BlockView::from_get(&self.channel, c)).collect()
    }

    /// Pins the leading present keys of `keys` (a prefix-cache hash chain) and
    /// returns their views, in one round trip: lookup and pin are one GET per
    /// key, so no block can be evicted between them. The pins of present keys
    /// after the first missing one are released (fire-and-forget).
    pub fn get_prefix(&self, keys: &[Key]) -> Result<Vec<BlockView>> {
        let mut got = self.get_many(keys)?.into_iter();
        let prefix = got.by_ref().map_while(|v| v).collect();
        drop(got); // releases the pins past the first miss
        Ok(prefix)
    }

    /// Pins the block under `key` once it is committed, by this or another
    /// process, and returns its view; at once if it is already there. The
    /// daemon parks the request (no polling) until a COMMIT of `key` or the
    /// `timeout` (`None`: no deadline): then [`ClientError::TimedOut`]. This
    /// client's other operations (from other threads) wait meanwhile: give
    /// each waiting thread its own client.
    pub fn wait_for(&self, key: Key, timeout: Option<Duration>) -> Result<BlockView> {
        let timeout_us = match timeout {
            None => WAIT_FOREVER,
            Some(t) => u64::try_from(t.as_micros()).unwrap_or(WAIT_FOREVER - 1).min(WAIT_FOREVER - 1),
        };
        let c = self.channel.call1(Request::Wait { key: key.0, timeout_us })?;
        if c.status == Status::TimedOut {
            return Err(ClientError::TimedOut(timeout.unwrap_or(Duration::MAX)));
        }
        BlockView::from_get(&self.channel, c)?.ok_or_else(|| ClientError::Protocol("WAIT answered NOT_FOUND".into()))
    }

    /// How many leading keys of `keys` are present (a prefix-cache hash chain).
    pub fn lookup(&self, keys: &[Key]) -> Result<usize> {
        let reqs: Vec<Request> = keys.iter().map(|k| Request::Lookup { key: k.0 }).collect();
        let done = self.channel.call(&reqs)?;
        Ok(done.iter().take_while(|c| c.status == Status::Ok).count())
    }

    /// Whether `key` is present.
    pub fn contains(&self, key: Key) -> Result<bool> {
        Ok(self.lookup(&[key])? == 1)
    }

    /// Unlinks `key`; returns whether it was present.
    pub fn delete(&self, key: Key) -> Result<bool> {
        let c: Completion = self.channel.call1(Request::Delete { key: key.0 })?;
        match c.status {
            Status::Ok => Ok(true),
            Status::NotFound => Ok(false),
            s => Err(status_error(s, 0)),
        }
    }

    /// Unlinks many keys in one batch; returns how many were present.
    pub fn delete_many(&self, keys: &[Key]) -> Result<usize> {
        let reqs: Vec<Request> = keys.iter().map(|k| Request::Delete { key: k.0 }).collect();
        let mut n = 0;
        for c in self.channel.call(&reqs)? {
            match c.status {
                Status::Ok => n += 1,
                Status::NotFound => {}
                s => return Err(status_error(s, 0)),
            }
        }
        Ok(n)
    }

    /// The daemon's stats, over the control socket.
    pub fn stats(&self) -> Result<Stats> {
        daemon_stats(&ConnectOptions { socket: Some(self.channel.socket_path.clone()), ..Default::default() })
    }

    /// Sends raw frames as they are (no validation; request ids are assigned)
    /// and returns the raw completions: for tests of the daemon's handling of
    /// malformed input (feature `testing`).
    #[cfg(feature = "testing")]
    pub fn call_raw(
        &self,
        frames: &[kachedb_shm::TensorBlockDescriptor],
    ) -> Result<Vec<kachedb_shm::TensorBlockDescriptor>> {
        self.channel.call_raw(frames)
    }

    /// For a process that inherited this client through `fork()`: forgets the
    /// connection without touching the rings (which belong to the parent) and
    /// closes this process's copy of the socket, so the daemon still sees the
    /// parent's exit. Every later call fails with `Disconnected`; views
    /// inherited from the parent stay readable but release nothing.
    pub fn forget_after_fork(&self) {
        self.channel.forget_after_fork();
    }
}

/// The parents of a prefix chain of `keys`: each key's parent is the key
/// before it, the first key's `first` (for [`Value::parent`], the `parents` of
/// [`Client::put_ranges`] and [`Client::reserve_many_with_parents`]).
pub fn chain_parents(keys: &[Key], first: Option<Key>) -> Vec<Option<Key>> {
    std::iter::once(first).chain(keys.iter().map(|k| Some(*k))).take(keys.len()).collect()
}

/// Byte ranges per block when `ranges` ranges are shared evenly by `blocks`
/// blocks (at least one each).
fn ranges_per_block(blocks: usize, ranges: usize) -> Result<usize> {
    if blocks == 0 && ranges == 0 {
        return Ok(1);
    }
    if blocks == 0 || ranges == 0 || !ranges.is_multiple_of(blocks) {
        return Err(ClientError::Invalid(format!(
            "{ranges} byte ranges for {blocks} blocks: give each block the same number of ranges (at least one)"
        )));
    }
    Ok(ranges / blocks)
}

/// Copies byte ranges into reservations: reservation `i` gets the
/// concatenation of `sources[i * per .. (i + 1) * per]`, `per` being
/// `sources.len() / reservations.len()`, in one [`copy::copy_many_on`] of at
/// most `max_threads` threads (streaming stores for a large batch even on one).
/// For a block whose bytes lie in pieces (an engine's KV pages, one range per
/// layer) written into reservations the caller commits itself.
/// `ClientError::Invalid` (nothing copied) if the ranges do not divide evenly
/// between the reservations or a reservation's ranges do not add up to its
/// bytes.
pub fn fill_gathered(reservations: &mut [Reservation], sources: &[&[u8]], max_threads: usize) -> Result<()> {
    let per = ranges_per_block(reservations.len(), sources.len())?;
    if reservations.is_empty() {
        return Ok(());
    }
    check_ranges(sources.iter().map(|s| s.len()), per, |i| reservations[i].len() as u64)?;
    let mut pairs: Vec<(&mut [u8], &[u8])> = Vec::with_capacity(sources.len());
    for (r, srcs) in reservations.iter_mut().zip(sources.chunks(per)) {
        let mut rest = r.as_mut_slice();
        for s in srcs {
            let (d, tail) = rest.split_at_mut(s.len());
            pairs.push((d, *s));
            rest = tail;
        }
    }
    copy::copy_many_on(&mut pairs, max_threads);
    Ok(())
}

/// Checks that run `i` of `per` range lengths adds up to `block_len(i)`.
fn check_ranges(lens: impl Iterator<Item = usize>, per: usize, block_len: impl Fn(usize) -> u64) -> Result<()> {
    let lens: Vec<usize> = lens.collect();
    for (i, run) in lens.chunks(per).enumerate() {
        let sum = run.iter().try_fold(0u64, |acc, &n| acc.checked_add(n as u64));
        let block_len = block_len(i);
        if sum != Some(block_len) {
            let sum = sum.map_or_else(|| "more than 2^64".to_string(), |n| n.to_string());
            return Err(ClientError::Invalid(format!(
                "the byte ranges of block {i} add up to {sum} bytes, not the block's {block_len}"
            )));
        }
    }
    Ok(())
}
