//! Fill: reads the local-miss tail of one batch from the remote store,
//! verifies it, and lands the blocks in reservations the serve loop makes.
//!
//! Two rounds of requests, each sent at once (pipelined, one round trip per
//! shard) and each bounded by the tier's timeout: chunk 0 of every key (the
//! header and the first piece; for blocks of one chunk, everything), then the
//! other chunks of every block that has more. A key whose request fails or
//! times out is a miss (counted in `remote_errors`), a value that does not
//! verify is a miss (`remote_corrupt`); the rest of the tail is still filled.

use super::format::{self, Header};
use super::{Ctx, FetchJob, FillSpec, RemoteCells, TierEvent, CHUNK_WINDOW};
use futures_util::StreamExt;
use std::sync::Arc;

/// A block read back and verified.
struct Verified {
    header: Header,
    chunk0: Vec<u8>,
    rest: Vec<Vec<u8>>,
}

/// Runs `job` and always ends with [`TierEvent::Filled`] for it.
pub(super) async fn fetch(ctx: Arc<Ctx>, job: FetchJob) {
    let blocks = read_tail(&ctx, &job.keys).await;
    let mut filled = Vec::new();
    if !blocks.is_empty() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let specs = blocks
            .iter()
            .map(|b| FillSpec {
                key: b.header.key,
                dtype: b.header.dtype,
                shape: b.header.shape,
                len: b.header.len,
                parent: None,
            })
            .collect();
        ctx.send(TierEvent::Reserve { fetch: job.id, blocks: specs, reply: tx });
        // The serve loop answers at its next pass (or drops the sender when
        // it stops): a local wait, not a network one.
        if let Ok(reserved) = rx.await {
            for (b, r) in blocks.iter().zip(reserved) {
                let Some(r) = r else { continue };
                if land(&ctx, b, r.data_offset) {
                    filled.push((r.handle, b.header.len));
                }
            }
        }
    }
    ctx.send(TierEvent::Filled { fetch: job.id, filled });
}

/// Copies a verified block's bytes into its reservation at `data_offset`.
fn land(ctx: &Ctx, b: &Verified, data_offset: u64) -> bool {
    let Some(ptr) = ctx.region.slab_ptr(data_offset, b.header.len) else { return false };
    let mut at = 0usize;
    for piece in format::pieces(&b.chunk0, &b.rest) {
        // SAFETY: the serve loop reserved `[data_offset, data_offset + len)`
        // for the tier's session and touches it again only when this fetch's
        // `Filled` (sent after this returns) commits it; a reservation is
        // invisible to clients and never evicted. `verify` checked that the
        // pieces add up to exactly `len` bytes, so every copy stays inside.
        unsafe { std::ptr::copy_nonoverlapping(piece.as_ptr(), ptr.as_ptr().add(at), piece.len()) };
        at += piece.len();
    }
    at as u64 == b.header.len
}

/// One GET, bounded by the timeout; `Err` when it failed or timed out.
async fn get(ctx: &Ctx, conn: &super::Conn, key: String) -> Result<Option<Vec<u8>>, ()> {
    let cmd = {
        let mut c = redis::cmd("GET");
        c.arg(key);
        c
    };
    match tokio::time::timeout(ctx.cfg.timeout, conn.query::<Option<Vec<u8>>>(&cmd)).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => {
            ctx.link.failed(&e).await;
            tracing::debug!("remote read failed: {e}");
            Err(())
        }
        Err(_) => Err(()),
    }
}

/// Reads and verifies the blocks of `keys`; the ones that are not there, not
/// reachable or not valid are left out (and counted).
async fn read_tail(ctx: &Ctx, keys: &[u128]) -> Vec<Verified> {
    let cells = ctx.cells();
    let conn = match ctx.link.conn().await {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!("remote tier: {e}");
            RemoteCells::add(&cells.errors, keys.len() as u64);
            return Vec::new();
        }
    };
    let ns = &ctx.cfg.namespace;
    // Round 1: chunk 0 of every key, all at once.
    let firsts =
        futures_util::future::join_all(keys.iter().map(|&k| get(ctx, &conn, format::chunk_key(ns, k, 0)))).await;
    let mut heads = Vec::new();
    for (&key, got) in keys.iter().zip(firsts) {
        match got {
            Err(()) => RemoteCells::add(&cells.errors, 1),
            Ok(None) => RemoteCells::add(&cells.misses, 1),
            Ok(Some(chunk0)) => match Header::decode(&chunk0, key) {
                Ok(h) => heads.push((h, chunk0)),
                Err(e) => {
                    RemoteCells::add(&cells.corrupt, 1);
                    tracing::warn!(key = %format_args!("{key:032x}"), "remote value refused: {e}");
                }
            },
        }
    }
    // Round 2: the other chunks of every block, all at once (a window of
    // CHUNK_WINDOW per block bounds the memory in flight for huge blocks).
    let rests = futures_util::future::join_all(heads.iter().map(|(h, _)| {
        let conn = conn.clone();
        async move {
            let got: Vec<Result<Option<Vec<u8>>, ()>> = futures_util::stream::iter(1..h.chunk_count)
                .map(|i| get(ctx, &conn, format::chunk_key(ns, h.key, i)))
                .buffered(CHUNK_WINDOW)
                .collect()
                .await;
            got
        }
    }))
    .await;
    let mut out = Vec::new();
    for ((header, chunk0), rest) in heads.into_iter().zip(rests) {
        if rest.iter().any(Result::is_err) {
            RemoteCells::add(&cells.errors, 1);
            continue;
        }
        // A missing chunk (expired, evicted, or still being written) is a
        // block that does not verify.
        let rest: Option<Vec<Vec<u8>>> = rest.into_iter().map(|r| r.ok().flatten()).collect();
        let verdict = match rest {
            Some(rest) => format::verify(&header, &chunk0, &rest).map(|()| rest),
            None => Err(format::FormatError::Inconsistent("a chunk is missing")),
        };
        match verdict {
            Ok(rest) => out.push(Verified { header, chunk0, rest }),
            Err(e) => {
                RemoteCells::add(&cells.corrupt, 1);
                tracing::warn!(key = %format_args!("{:032x}", header.key), "remote value refused: {e}");
            }
        }
    }
    out
}
