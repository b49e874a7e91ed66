//! Write-behind: one pinned block to the remote store, in chunks.
//!
//! Chunks `1..` go first (up to `CHUNK_WINDOW` in flight), chunk 0 (the
//! header) last, so a reader that finds the header finds its chunks too. A
//! reader meeting a block half-overwritten by another writer sees a checksum
//! (or tag) mismatch: a miss, never wrong bytes. With a fleet key the block
//! is sealed with keyed tags over the namespace (format 4), else with
//! checksums (format 1). A block's metadata record (META), if it has one,
//! goes under its own key just before chunk 0 (`format`, "A block's
//! metadata record"). A block committed naming a parent leaves a hint
//! under the parent's next key, after chunk 0 (`format`, "A block's next
//! block"). Each
//! request waits at most the tier's timeout. Every read of the pinned block
//! runs under the slab gate (hashing it, and copying each chunk into its
//! request), never across a network wait. Whatever the outcome, the pin goes
//! back to the serve loop.

use super::format::Header;
use super::{Ctx, TierEvent, WriteJob, CHUNK_WINDOW};
use crate::tier::metrics::add;
use futures_util::{StreamExt, TryStreamExt};
use std::sync::Arc;

/// Writes `job`'s block, then hands its pin back and takes it out of the queue.
pub(super) async fn write(ctx: Arc<Ctx>, job: WriteJob) {
    let outcome = match ctx.write_slots.acquire().await {
        Ok(_permit) => write_block(&ctx, &job).await,
        Err(_) => Err("shutting down".to_string()),
    };
    let cells = ctx.cells();
    match outcome {
        Ok(()) => {
            add(&cells.writes, 1);
            add(&cells.write_bytes, job.len);
        }
        Err(e) => {
            add(&cells.errors, 1);
            tracing::debug!(key = %format_args!("{:032x}", job.key), "remote write failed: {e}");
        }
    }
    ctx.queue().pop(job.len);
    ctx.pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&job.pin);
    ctx.send(TierEvent::Written { pin: job.pin });
}

/// Runs `f` on bytes `range` of `job`'s pinned block, under the slab gate;
/// an error once the gate is closed (the tier is stopping).
fn with_block<R>(
    ctx: &Ctx,
    job: &WriteJob,
    range: std::ops::Range<u64>,
    f: impl FnOnce(&[u8]) -> R,
) -> Result<R, String> {
    if range.end > job.len {
        return Err("range outside the block".into());
    }
    ctx.slab
        .with(job.data_offset + range.start, range.end - range.start, |ptr| {
            // SAFETY: `job.pin` pins this committed block for the tier's
            // session until `write` sends `Written`, after this returns, and
            // the serve loop frees the tier's pins only after closing the
            // gate (which waits for this closure): the extent is not evicted,
            // moved or reused meanwhile, and a committed block's bytes are
            // not written again (clients write only their reservations).
            let data = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), (range.end - range.start) as usize) };
            f(data)
        })
        .map_err(|why| format!("not read from the megaslab: {why:?}"))
}

async fn write_block(ctx: &Ctx, job: &WriteJob) -> Result<(), String> {
    let scope = &*ctx.scope;
    let header = Header::new(job.key, job.dtype, job.shape, job.len, ctx.cfg.chunk_bytes)
        .ok_or("block needs too many chunks")?;
    let header = with_block(ctx, job, 0..job.len, |data| header.sealed(data, scope))?;
    let conn = ctx.link.conn().await?;
    // The SET of chunk `i`, its value copied from the block now (under the gate).
    let set_cmd = |i: u32| -> Result<redis::Cmd, String> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(scope.chunk_key(job.key, i));
        if i == 0 {
            let value = with_block(ctx, job, header.piece(0), |first| header.chunk0(first, scope))?;
            cmd.arg(value);
        } else {
            with_block(ctx, job, header.piece(i), |piece| {
                cmd.arg(piece);
            })?;
        }
        if let Some(ttl) = ctx.cfg.ttl {
            cmd.arg("PX").arg(ttl.as_millis().max(1) as u64);
        }
        Ok(cmd)
    };
    let send = |cmd: Result<redis::Cmd, String>| {
        let conn = conn.clone();
        async move {
            let cmd = cmd?;
            match tokio::time::timeout(ctx.cfg.timeout, conn.query::<()>(&cmd)).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => {
                    ctx.link.failed(&e).await;
                    Err(e.to_string())
                }
                Err(_) => Err("timed out".to_string()),
            }
        }
    };
    futures_util::stream::iter(1..header.chunk_count)
        .map(|i| send(set_cmd(i)))
        .buffer_unordered(CHUNK_WINDOW)
        .try_collect::<Vec<()>>()
        .await?;
    // The block's metadata record, before chunk 0 (a reader that finds the
    // header finds it too); one that is not stored leaves the block to be
    // published by key.
    if let Some(value) = job.meta.as_deref().and_then(|m| {
        let mut rec = Vec::new();
        m.encode(&mut rec).ok()?;
        scope.seal_record(job.key, &rec)
    }) {
        let mut cmd = redis::cmd("SET");
        cmd.arg(scope.record_key(job.key)).arg(value);
        if let Some(ttl) = ctx.cfg.ttl {
            cmd.arg("PX").arg(ttl.as_millis().max(1) as u64);
        }
        if let Err(e) = send(Ok(cmd)).await {
            tracing::debug!(key = %format_args!("{:032x}", job.key), "remote write of a block's metadata record failed: {e}");
        }
    }
    send(set_cmd(0)).await?;
    // The parent's next-block hint, after chunk 0 (a reader it steers finds
    // the block); one not stored only means no read-ahead into this block.
    if let Some(parent) = job.parent {
        let mut cmd = redis::cmd("SET");
        cmd.arg(scope.next_key(parent)).arg(scope.seal_next(parent, job.key));
        if let Some(ttl) = ctx.cfg.ttl {
            cmd.arg("PX").arg(ttl.as_millis().max(1) as u64);
        }
        if let Err(e) = send(Ok(cmd)).await {
            tracing::debug!(key = %format_args!("{:032x}", job.key), "remote write of a next-block hint failed: {e}");
        }
    }
    Ok(())
}
