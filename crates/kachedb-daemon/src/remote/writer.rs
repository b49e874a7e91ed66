//! Write-behind: one pinned block to the remote store, in chunks.
//!
//! Chunks `1..` go first (up to `CHUNK_WINDOW` in flight), chunk 0 (the
//! header) last, so a reader that finds the header finds its chunks too. A
//! reader meeting a block half-overwritten by another writer sees a checksum
//! mismatch: a miss, never wrong bytes. Each request waits at most the
//! tier's timeout. Whatever the outcome, the pin goes back to the serve loop.

use super::format::{self, Header};
use super::{Ctx, RemoteCells, TierEvent, WriteJob, CHUNK_WINDOW};
use futures_util::{StreamExt, TryStreamExt};
use std::sync::atomic::Ordering::Relaxed;
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
            RemoteCells::add(&cells.writes, 1);
            RemoteCells::add(&cells.write_bytes, job.len);
        }
        Err(e) => {
            RemoteCells::add(&cells.errors, 1);
            tracing::debug!(key = %format_args!("{:032x}", job.key), "remote write failed: {e}");
        }
    }
    cells.queue_bytes.fetch_sub(job.len, Relaxed);
    cells.queue_blocks.fetch_sub(1, Relaxed);
    ctx.send(TierEvent::Written { pin: job.pin });
}

async fn write_block(ctx: &Ctx, job: &WriteJob) -> Result<(), String> {
    let ptr = ctx.region.slab_ptr(job.data_offset, job.len).ok_or("block outside the megaslab")?;
    // SAFETY: `job.pin` pins this committed block for the tier's session
    // until `write` sends `Written`, after this returns: the extent is not
    // evicted, moved or reused meanwhile, and a committed block's bytes are
    // not written again (clients write only their reservations). The region
    // stays mapped while `ctx.region` (an `Arc`) lives.
    let data: &[u8] = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), job.len as usize) };
    let header = Header::new(job.key, job.dtype, job.shape, job.len, ctx.cfg.chunk_bytes, format::checksum([data]))
        .ok_or("block needs too many chunks")?;
    let conn = ctx.link.conn().await?;
    let ns = &ctx.cfg.namespace;
    let set = |key: String, value: &[u8]| {
        let mut cmd = redis::cmd("SET");
        cmd.arg(key).arg(value);
        if let Some(ttl) = ctx.cfg.ttl {
            cmd.arg("PX").arg(ttl.as_millis().max(1) as u64);
        }
        let conn = conn.clone();
        async move {
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
        .map(|i| {
            let r = header.piece(i);
            set(format::chunk_key(ns, job.key, i), &data[r.start as usize..r.end as usize])
        })
        .buffer_unordered(CHUNK_WINDOW)
        .try_collect::<Vec<()>>()
        .await?;
    set(format::chunk_key(ns, job.key, 0), &header.chunk0(data)).await
}
