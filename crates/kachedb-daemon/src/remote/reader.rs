//! Fill: reads the local-miss tail of one batch from the remote store,
//! verifies it, and lands the blocks in reservations the serve loop makes.
//!
//! Two rounds of requests, each sent at once (pipelined, one round trip per
//! shard) and each request bounded by the tier's timeout: the start of chunk
//! 0 of every key (the header and up to [`FIRST_READ_BYTES`] in all; for
//! small blocks, everything), its metadata record where the node publishes
//! KV events, and the next-block hint of the last key, then the rest of
//! every block that has more. After a fetch a client waits for, the hints along the
//! chain after its last key are read until `--remote-read-ahead` blocks are
//! known ([`chase`]): the serve loop reads those ahead
//! ([`Tier::chain_after`](crate::tier::Tier::chain_after)). A
//! key whose request fails or times out is a miss (counted in
//! `remote_errors`), a value that does not verify is a miss (`remote_corrupt`,
//! or `remote_auth_failures` when it fails authentication); the rest of the
//! tail is still filled.
//!
//! What a hostile value can cost is bounded before it is downloaded:
//!
//! * the header is checked ([`Header::decode`]: its length against the
//!   megaslab, its chunk count against the length and chunk size, its tag
//!   under a fleet key) before any other chunk is asked for;
//! * every value is read with `GETRANGE` up to one byte past the length the
//!   header implies ([`format::chunk_read_end`]), never whole, so an overlong
//!   value costs no more than a right one;
//! * a block's chunks are read [`CHUNK_WINDOW`] at a time and the reading
//!   stops at the first missing, short or overlong one;
//! * at most [`MAX_FETCHES`] fetches run at once, and the blocks they read
//!   past the first round take [`FILL_BUDGET_BYTES`] at most (a larger block
//!   alone);
//! * a fetch runs until its deadline at most: past it, what is left of it
//!   is dropped (its requests with it) and its keys are misses.

use super::format::{self, Header};
use super::{Ctx, FetchJob, FillSpec, TierEvent, CHUNK_WINDOW, FILL_BUDGET_BYTES, FIRST_READ_BYTES, MAX_FETCHES};
use crate::tier::metrics::add;
use futures_util::StreamExt;
use kachedb_shm::BlockMeta;
use std::sync::Arc;
use tokio::time::{timeout_at, Instant};

/// A block read back and verified.
pub(super) struct Verified {
    /// Its header.
    pub(super) header: Header,
    /// Chunk 0, header included.
    pub(super) chunk0: Vec<u8>,
    /// Chunks 1.., in order.
    pub(super) rest: Vec<Vec<u8>>,
    /// Its metadata record, if it has one that verifies and the node
    /// publishes KV events (`format`, "A block's metadata record").
    pub(super) meta: Option<Arc<BlockMeta>>,
}

/// A block whose header verified, the bytes of chunk 0 read and its
/// metadata record, waiting for the rest of its chunks.
type Head = (Header, Vec<u8>, Option<Arc<BlockMeta>>);

/// The fetch ran past its deadline.
struct Cancelled;

/// Why a block read in round two is not filled.
enum Refused {
    /// A request failed or timed out.
    Error,
    /// A value did not verify.
    Bad(format::FormatError),
}

/// Runs `job` until `deadline` at most and always ends with
/// [`TierEvent::Filled`] for it, listing the blocks landed before then.
/// Then, for a fetch a client waits for, the next-block hints after its
/// last key are read along the chain (see [`chase`]).
pub(super) async fn fetch(ctx: Arc<Ctx>, job: FetchJob, deadline: Instant) {
    let mut filled = Vec::new();
    if run(&ctx, &job, deadline, &mut filled).await.is_err() {
        add(&ctx.cells().fetches_cancelled, 1);
        tracing::debug!(
            fetch = job.id,
            landed = filled.len(),
            keys = job.keys.len(),
            "remote fetch cancelled at its deadline"
        );
    }
    if job.ahead {
        add(&ctx.cells().read_ahead, filled.len() as u64);
    }
    ctx.send(TierEvent::Filled { fetch: job.id, filled });
    if let (false, Some(&last)) = (job.ahead, job.keys.last()) {
        let _ = timeout_at(deadline, chase(&ctx, last)).await;
    }
}

/// Reads the next-block hints along the chain after `key` until
/// `--remote-read-ahead` blocks after it are known (one request after
/// another: each names the next), so that the client's next miss on the
/// chain reads that many ahead. After the fetch's `Filled`: its client
/// does not wait for it.
async fn chase(ctx: &Ctx, key: u128) {
    let want = ctx.cfg.read_ahead;
    if want == 0 {
        return;
    }
    let Ok(conn) = ctx.link.conn().await else { return };
    loop {
        let known = ctx.hints().chain_after(key, want);
        // (None known: the fetch read `key`'s hint already and found none.)
        if known.is_empty() || known.len() >= want {
            return;
        }
        let at = known.last().copied().unwrap_or(key);
        if read_next(ctx, &conn, at).await.is_none() {
            return;
        }
    }
}

/// Block `key`'s next-block hint: the child it names, if it has one that
/// verifies (recorded in the tier's hints); `None` otherwise.
async fn read_next(ctx: &Ctx, conn: &super::Conn, key: u128) -> Option<u128> {
    let v = get_range(ctx, conn, ctx.scope.next_key(key), 0, format::NEXT_LEN as u64).await.ok()?;
    if v.is_empty() {
        return None;
    }
    match ctx.scope.open_next(key, &v) {
        Ok(child) => {
            ctx.hints().learn(key, child);
            Some(child)
        }
        Err(why) => {
            tracing::debug!(key = %format_args!("{key:032x}"), "remote tier: a next-block hint is ignored: {why}");
            None
        }
    }
}

/// The blocks of `job`, read, verified and landed in turn; each landed
/// one is added to `filled` at once, so a cancelled run keeps them.
async fn run(ctx: &Ctx, job: &FetchJob, deadline: Instant, filled: &mut Vec<(u64, u64)>) -> Result<(), Cancelled> {
    let cells = ctx.cells();
    let _slot = timeout_at(deadline, ctx.fetch_slots.acquire()).await.map_err(|_| Cancelled)?.map_err(|_| Cancelled)?;
    let conn = match timeout_at(deadline, ctx.link.conn()).await.map_err(|_| Cancelled)? {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!("remote tier: {e}");
            add(&cells.errors, job.keys.len() as u64);
            return Ok(());
        }
    };
    let (whole, heads) = timeout_at(deadline, read_heads(ctx, &conn, &job.keys)).await.map_err(|_| Cancelled)?;
    let hinted = round_one_hint(ctx, &job.keys);
    if !whole.is_empty() {
        land_all(ctx, job, &whole, filled).await;
    }
    drop(whole);
    for group in budget_groups(heads) {
        let kib: u64 = group.iter().map(|(h, _, _)| h.len).sum::<u64>().div_ceil(1024);
        let kib = kib.min(FILL_BUDGET_BYTES >> 10) as u32;
        let _bytes = timeout_at(deadline, ctx.fill_budget.acquire_many(kib))
            .await
            .map_err(|_| Cancelled)?
            .map_err(|_| Cancelled)?;
        let blocks = timeout_at(deadline, read_rests(ctx, &conn, group, hinted)).await.map_err(|_| Cancelled)?;
        if !blocks.is_empty() {
            land_all(ctx, job, &blocks, filled).await;
        }
    }
    Ok(())
}

/// Splits the verified headers, in chain order, into groups whose blocks
/// together fit in [`FILL_BUDGET_BYTES`] (a larger block is a group alone).
fn budget_groups(heads: Vec<Head>) -> Vec<Vec<Head>> {
    let mut groups: Vec<Vec<Head>> = Vec::new();
    let mut sum = 0u64;
    for h in heads {
        match groups.last_mut() {
            Some(g) if sum + h.0.len <= FILL_BUDGET_BYTES => {
                sum += h.0.len;
                g.push(h);
            }
            _ => {
                sum = h.0.len;
                groups.push(vec![h]);
            }
        }
    }
    groups
}

/// Asks the serve loop for reservations for `blocks` of fetch `job` and
/// copies each into its own; adds the landed ones to `filled`. A local wait
/// (the serve loop answers at its next pass, or drops the sender when it
/// stops), so not bounded by the deadline: cancelling it could lose
/// reservations made.
async fn land_all(ctx: &Ctx, job: &FetchJob, blocks: &[Verified], filled: &mut Vec<(u64, u64)>) {
    let (tx, rx) = crate::tier::reply::channel();
    let specs = blocks
        .iter()
        .map(|b| FillSpec {
            key: b.header.key,
            dtype: b.header.dtype,
            shape: b.header.shape,
            len: b.header.len,
            // The parent a next-block hint named (the block it is stored
            // after), so the fill links to its chain here too.
            parent: ctx.hints().parent_of(b.header.key),
            // The remote format names no tenant (the cluster is the
            // fleet's): a block filled from it counts for the tenant whose
            // miss asked for it, within that tenant's limit.
            tenant: Some(job.tenant.clone()),
            meta: b.meta.clone(),
        })
        .collect();
    ctx.send(TierEvent::Reserve { fetch: job.id, blocks: specs, reply: tx });
    if let Ok(reserved) = rx.await {
        for (b, r) in blocks.iter().zip(reserved) {
            let Some(r) = r else { continue };
            if land(ctx, b, r.data_offset) {
                filled.push((r.handle, b.header.len));
            }
        }
    }
}

/// Test hook: runs inside the gate after the first piece of a block is
/// copied (a copy made to block there, to test that stopping waits for it).
#[cfg(test)]
pub(super) static LAND_HOOK: std::sync::Mutex<Option<Box<dyn FnMut() + Send>>> = std::sync::Mutex::new(None);

/// Copies a verified block's bytes into its reservation at `data_offset`,
/// under the slab gate; `false` if the gate is closed (the tier is stopping).
pub(super) fn land(ctx: &Ctx, b: &Verified, data_offset: u64) -> bool {
    let copied = ctx.slab.with(data_offset, b.header.len, |ptr| {
        let mut at = 0usize;
        for piece in format::pieces(&b.chunk0, &b.rest) {
            // SAFETY: the serve loop reserved `[data_offset, data_offset + len)`
            // for the tier's session and frees it only after the gate is
            // closed (stopping) or when this fetch's `Filled` (sent after
            // this returns) commits it; a reservation is invisible to clients
            // and never evicted. `verify` checked that the pieces add up to
            // exactly `len` bytes, so every copy stays inside.
            unsafe { std::ptr::copy_nonoverlapping(piece.as_ptr(), ptr.as_ptr().add(at), piece.len()) };
            at += piece.len();
            #[cfg(test)]
            if let Some(hook) = LAND_HOOK.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_mut() {
                hook();
            }
        }
        at as u64
    });
    copied == Ok(b.header.len)
}

/// `GETRANGE key start end` (end inclusive), bounded by the timeout; `Err`
/// when it failed or timed out. A missing key reads as empty.
async fn get_range(ctx: &Ctx, conn: &super::Conn, key: String, start: u64, end: u64) -> Result<Vec<u8>, ()> {
    let mut cmd = redis::cmd("GETRANGE");
    cmd.arg(key).arg(start).arg(end);
    match tokio::time::timeout(ctx.cfg.timeout, conn.query::<Vec<u8>>(&cmd)).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => {
            ctx.link.failed(&e).await;
            tracing::debug!("remote read failed: {e}");
            Err(())
        }
        Err(_) => Err(()),
    }
}

/// Counts and logs a value refused.
fn refuse(ctx: &Ctx, key: u128, e: &format::FormatError) {
    let cells = ctx.cells();
    if e.is_auth() {
        add(&cells.auth_failures, 1);
    } else {
        add(&cells.corrupt, 1);
    }
    tracing::warn!(key = %format_args!("{key:032x}"), "remote value refused: {e}");
}

/// What round one found for one key.
enum HeadRead {
    /// The request failed or timed out.
    Error,
    /// No such key.
    Missing,
    /// A value that does not verify.
    Refused(format::FormatError),
    /// A verified header; the rest of the block comes in round two.
    Head(Header, Vec<u8>, Option<Arc<BlockMeta>>),
    /// The whole block, verified.
    Whole(Verified),
}

/// Round one for `key`: the start of its chunk 0 (with its next-block hint
/// if `with_next`), checked as soon as it arrives (while the other keys' answers are still coming in); a block
/// that fits in it is verified whole.
async fn read_head(ctx: &Ctx, conn: &super::Conn, key: u128, with_next: bool) -> HeadRead {
    let end = FIRST_READ_BYTES as u64 - 1;
    // Its metadata record and next-block hint come with it (same shard).
    let record = async {
        match ctx.cfg.records {
            true => read_record(ctx, conn, key).await,
            false => None,
        }
    };
    let next = async {
        if with_next {
            read_next(ctx, conn, key).await;
        }
    };
    let (chunk0, meta, ()) =
        futures_util::future::join3(get_range(ctx, conn, ctx.scope.chunk_key(key, 0), 0, end), record, next).await;
    let chunk0 = match chunk0 {
        Err(()) => return HeadRead::Error,
        // Absent (a real value is never empty: it starts with a header).
        Ok(v) if v.is_empty() => return HeadRead::Missing,
        Ok(v) => v,
    };
    let h = match Header::decode(&chunk0, key, &ctx.limits, &ctx.scope) {
        Ok(h) => h,
        Err(e) => return HeadRead::Refused(e),
    };
    let want0 = h.chunk_value_len(0);
    if chunk0.len() as u64 > want0 {
        return HeadRead::Refused(format::FormatError::ChunkLen { index: 0, len: chunk0.len(), want: want0 });
    }
    if h.chunk_count == 1 && chunk0.len() as u64 == want0 {
        // Hashed on a task of its own, so the blocks of a round that arrive
        // together are verified on the runtime's threads at once rather than
        // one after another on this fetch's.
        let scope = ctx.scope.clone();
        let hashed = tokio::spawn(async move {
            let verdict = format::verify(&h, &chunk0, &[], &scope);
            (verdict, chunk0)
        });
        return match hashed.await {
            Ok((Ok(()), chunk0)) => HeadRead::Whole(Verified { header: h, chunk0, rest: Vec::new(), meta }),
            Ok((Err(e), _)) => HeadRead::Refused(e),
            // The runtime is shutting down (the tier is stopping).
            Err(_) => HeadRead::Error,
        };
    }
    HeadRead::Head(h, chunk0, meta)
}

/// Block `key`'s metadata record, if it has one that verifies (one that
/// does not is logged and left out: the block is published by key).
async fn read_record(ctx: &Ctx, conn: &super::Conn, key: u128) -> Option<Arc<BlockMeta>> {
    let end = (format::RECORD_HEAD + format::RECORD_MAX) as u64;
    let v = get_range(ctx, conn, ctx.scope.record_key(key), 0, end).await.ok().filter(|v| !v.is_empty())?;
    match ctx
        .scope
        .open_record(key, &v)
        .map_err(|e| e.to_string())
        .and_then(|r| BlockMeta::decode(r).map_err(|e| e.to_string()))
    {
        Ok(m) => Some(Arc::new(m)),
        Err(why) => {
            tracing::debug!(key = %format_args!("{key:032x}"), "remote tier: the block's metadata record is ignored: {why}");
            None
        }
    }
}

/// Round one: the start of chunk 0 of every key, all at once. The blocks
/// it held whole, verified, and the verified headers of the others, with
/// the bytes read. Absent keys are misses, the others that do not verify
/// are counted.
async fn read_heads(ctx: &Ctx, conn: &super::Conn, keys: &[u128]) -> (Vec<Verified>, Vec<Head>) {
    let cells = ctx.cells();
    let hinted = round_one_hint(ctx, keys);
    let firsts = futures_util::future::join_all(keys.iter().map(|&k| read_head(ctx, conn, k, Some(k) == hinted))).await;
    let (mut whole, mut heads) = (Vec::new(), Vec::new());
    for (&key, got) in keys.iter().zip(firsts) {
        match got {
            HeadRead::Error => add(&cells.errors, 1),
            HeadRead::Missing => add(&cells.misses, 1),
            HeadRead::Refused(e) => refuse(ctx, key, &e),
            HeadRead::Head(h, chunk0, meta) => heads.push((h, chunk0, meta)),
            HeadRead::Whole(v) => whole.push(v),
        }
    }
    (whole, heads)
}

/// The key of `keys` whose next-block hint round one reads: the last, what
/// read-ahead starts from (one request a fetch; one a key cost a fill of
/// small blocks ~20 %), if the tier reads ahead.
fn round_one_hint(ctx: &Ctx, keys: &[u128]) -> Option<u128> {
    keys.last().copied().filter(|_| ctx.cfg.read_ahead > 0)
}

/// Round two: the rest of every block of `group`, all at once; the blocks
/// that verify. Each reads its next-block hint beside its chunks (unless
/// round one read it: `hinted`), a request small beside a block too large
/// for round one: a block of the group stored after another then lands
/// linked to it.
async fn read_rests(ctx: &Ctx, conn: &super::Conn, group: Vec<Head>, hinted: Option<u128>) -> Vec<Verified> {
    let got = futures_util::future::join_all(group.into_iter().map(|(h, c0, m)| async move {
        let key = h.key;
        let next = async {
            if Some(key) != hinted {
                read_next(ctx, conn, key).await;
            }
        };
        futures_util::future::join(read_rest(ctx, conn, h, c0, m), next).await.0
    }))
    .await;
    let mut out = Vec::new();
    for (key, r) in got {
        match r {
            Ok(v) => out.push(v),
            Err(Refused::Error) => add(&ctx.cells().errors, 1),
            Err(Refused::Bad(e)) => refuse(ctx, key, &e),
        }
    }
    out
}

/// The rest of block `h` (the part of chunk 0 round one did not read, and
/// chunks 1..), verified: its bytes are hashed in order as they arrive.
async fn read_rest(
    ctx: &Ctx,
    conn: &super::Conn,
    h: Header,
    mut chunk0: Vec<u8>,
    meta: Option<Arc<BlockMeta>>,
) -> (u128, Result<Verified, Refused>) {
    let want0 = h.chunk_value_len(0);
    let have0 = chunk0.len() as u64;
    if have0 < want0 && have0 < FIRST_READ_BYTES as u64 {
        // Round one read all there was: chunk 0 is short.
        let e = format::FormatError::ChunkLen { index: 0, len: chunk0.len(), want: want0 };
        return (h.key, Err(Refused::Bad(e)));
    }
    let mut sealer = format::Sealer::new(&h, &ctx.scope);
    sealer.update(chunk0.get(format::HEADER_LEN..).unwrap_or(&[]));
    // The reads in order: what is left of chunk 0 (index 0), then chunks 1..;
    // each asks for one byte more than it expects.
    let head_part = (have0 < want0).then_some((0u32, have0, want0 - have0));
    let reads = head_part.into_iter().chain((1..h.chunk_count).map(|i| (i, 0, h.chunk_value_len(i))));
    let mut rest = Vec::with_capacity((h.chunk_count - 1) as usize);
    let mut s = futures_util::stream::iter(reads)
        .map(|(index, start, want)| {
            let key = ctx.scope.chunk_key(h.key, index);
            async move { (index, want, get_range(ctx, conn, key, start, format::chunk_read_end(start, want)).await) }
        })
        .buffered(CHUNK_WINDOW);
    // The first missing (read as empty), short or overlong chunk ends the
    // reading: dropping the stream drops the requests in its window.
    while let Some((index, want, got)) = s.next().await {
        let Ok(v) = got else { return (h.key, Err(Refused::Error)) };
        if v.len() as u64 != want {
            let len = if index == 0 { chunk0.len() + v.len() } else { v.len() };
            let want = if index == 0 { want0 } else { want };
            return (h.key, Err(Refused::Bad(format::FormatError::ChunkLen { index, len, want })));
        }
        sealer.update(&v);
        if index == 0 {
            chunk0.extend_from_slice(&v);
        } else {
            rest.push(v);
        }
    }
    drop(s);
    let verdict = format::verify_lengths(&h, &chunk0, &rest).and_then(|()| format::verify_seal(&h, &sealer));
    match verdict {
        Ok(()) => (h.key, Ok(Verified { header: h, chunk0, rest, meta })),
        Err(e) => (h.key, Err(Refused::Bad(e))),
    }
}

// A header's length is bounded by the megaslab, so a block's chunk count is
// too: with MAX_FETCHES fetches at once, round one holds at most
// MAX_FETCHES × (keys per batch) × FIRST_READ_BYTES.
const _: () = assert!(MAX_FETCHES > 0 && FILL_BUDGET_BYTES >> 10 <= u32::MAX as u64);
