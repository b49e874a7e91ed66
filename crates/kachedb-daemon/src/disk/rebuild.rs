//! The index rebuild at start (and in a takeover's new daemon): the block
//! files under `blocks/` listed with their inodes, those the catalog knows
//! ([`catalog`], "The contract") indexed from it, the others' headers read
//! by many threads at once ([`index_files`]); then the catalog kept for the
//! next start and the writers let go (docs/disk.md, "Start, lock and
//! index").

use super::*;

/// Gives the allocator's free memory back to the kernel, every arena's.
fn trim_heap() {
    // SAFETY: `malloc_trim` takes no pointer and only returns free memory to
    // the kernel; glibc's allocator is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Empties `tmp/` (the catalog aside) and rebuilds the index from the
/// catalog and the headers of the files it does not know; then lets the
/// writers go.
pub(super) fn rebuild_index(s: &Shared, run: u64) {
    let t0 = Instant::now();
    // The catalog first: emptying `tmp/` keeps it.
    let loaded = load_catalog(s);
    let mut torn = s.dir.clear_tmp();
    // The block files' names; those the catalog knows are indexed from it,
    // the others' headers read by many threads at once (a cold disk answers
    // many reads in flight faster than one).
    let mut listed = match s.dir.list_blocks() {
        Ok(k) => k,
        Err(e) => {
            add(&s.cells().errors, 1);
            tracing::warn!("disk tier: reading {}/blocks: {e}", s.cfg.dir.display());
            Vec::new()
        }
    };
    let listed_at = t0.elapsed();
    listed.sort_unstable();
    let (mut found, unknown) = catalogued(&listed, loaded.as_ref().map_or(&[][..], |l| &l.entries[..]));
    let catalogued_n = found.len();
    let (matched_at, header_reads) = (t0.elapsed(), unknown.len());
    // A catalog that ends in a cut-short entry is written anew (an entry
    // appended after the cut would never be read).
    let catalog_read = loaded.as_ref().filter(|l| !l.cut).map_or(0, |l| l.read);
    drop(loaded);
    drop(listed);
    let (more, t) = index_files(s, &unknown, run);
    if !s.live(run) {
        return;
    }
    found.extend(more);
    drop(unknown);
    torn += t;
    let read = t0.elapsed();
    // Least recently written first: the LRU order the index starts with.
    found.sort_by_key(|f| f.written);
    let (mut recovered, mut found_catalogued) = (0u64, 0u64);
    let mut bytes = 0u64;
    lock(&s.index).reserve(found.len());
    // A chunk at a time, letting go of the mutexes in between: the serve
    // loop takes `order`'s at every COMMIT.
    for chunk in found.chunks_mut(INDEX_CHUNK) {
        let mut ix = lock(&s.index);
        let order = lock(&s.order);
        let mut log = lock(&s.log);
        for f in chunk {
            // Removed (deleted or replaced) while the rebuild ran.
            if order.tombs.contains_key(&f.key) {
                f.indexed = false;
                continue;
            }
            found_catalogued += u64::from(f.catalogued);
            let b = index::disk_bytes(f.file_len);
            let t = ix.tenant(f.tenant.as_deref().unwrap_or(kachedb_shm::control::DEFAULT_TENANT));
            ix.insert(f.key, f.parent, b, t);
            log.stored(f.key, f.parent, f.meta.clone());
            recovered += 1;
            bytes += b;
        }
        // The chunk's blocks in the figures and on the KV event stream.
        drop((log, order));
        s.publish(&ix);
    }
    let indexed_at = t0.elapsed();
    // The catalog for the next start: the blocks whose headers were read
    // added to it, or all of them written anew where it holds more
    // replaced entries than live ones.
    let upkeep = keep_catalog(s, &found, catalog_read, catalogued_n, run);
    drop(found);
    // The names and headers read (~100 bytes a block, in the reader threads'
    // arenas too) are free now; the daemon's trim threshold (`mallopt` in
    // `kachedb serve`) would keep them as resident memory for good.
    trim_heap();
    let victims = {
        let mut ix = lock(&s.index);
        let v = ix.shrink_to_fit();
        s.log_removed(v.iter().map(|(k, _)| k));
        lock(&s.log).resync();
        let mut order = lock(&s.order);
        for (key, _) in &v {
            count_in(&mut order.evicting, *key);
        }
        drop(order);
        s.publish(&ix);
        v
    };
    delete_victims(s, &victims);
    if !victims.is_empty() {
        let _ = s.dir.sync_blocks();
    }
    evicted(s, &victims.iter().map(|(k, _)| *k).collect::<Vec<_>>());
    let took = t0.elapsed();
    let cells = s.cells();
    cells.recovered.store(recovered, Relaxed);
    cells.catalogued.store(found_catalogued, Relaxed);
    add(&cells.torn, torn);
    cells.index_us.store(took.as_micros().max(1) as u64, Relaxed);
    cells.indexed.store(true, Relaxed);
    tracing::info!(
        event = "disk_indexed",
        dir = %s.cfg.dir.display(),
        recovered,
        catalogued = catalogued_n,
        torn,
        evicted = victims.len(),
        "disk tier {}: {recovered} blocks recovered ({} MiB; {catalogued_n} from the catalog), {torn} torn skipped, \
         {} evicted to fit, in {:.3} s (catalog read and names listed {:.3} s, matched {:.3} s, {header_reads} headers \
         read {:.3} s, indexed {:.3} s, catalog {upkeep} {:.3} s)",
        s.cfg.dir.display(),
        bytes >> 20,
        victims.len(),
        took.as_secs_f64(),
        listed_at.as_secs_f64(),
        (matched_at - listed_at).as_secs_f64(),
        (read - matched_at).as_secs_f64(),
        (indexed_at - read).as_secs_f64(),
        (took - indexed_at).as_secs_f64(),
    );
    let _g = lock(&s.indexed_wait.0);
    s.indexed.store(true, Release);
    s.indexed_wait.1.notify_all();
}

/// The catalog as the last run left it, if there is one that reads (one
/// that does not is logged, and the files' headers are read).
fn load_catalog(s: &Shared) -> Option<catalog::Loaded> {
    let f = match s.dir.open_catalog() {
        Ok(Some(f)) => f,
        Ok(None) => return None,
        Err(e) => {
            tracing::warn!("disk tier: the catalog is not read (block headers are): opening it: {e}");
            return None;
        }
    };
    match catalog::load(f) {
        Ok(l) => {
            if l.cut {
                tracing::info!(
                    entries = l.read,
                    "disk tier: the catalog ends in a cut-short entry (a crash): read up to it"
                );
            }
            Some(l)
        }
        Err(e) => {
            tracing::warn!("disk tier: the catalog is not read (block headers are): {e}");
            None
        }
    }
}

/// The block files `listed` (key, inode; sorted) that the catalog's
/// `entries` (sorted by key) know, with the same inode (`catalog`, "The
/// contract"), and the keys of the others.
fn catalogued(listed: &[(u128, u64)], entries: &[catalog::Entry]) -> (Vec<Found>, Vec<u128>) {
    let mut found = Vec::with_capacity(listed.len());
    let mut unknown = Vec::new();
    let mut e = entries.iter().peekable();
    for &(key, ino) in listed {
        while e.next_if(|x| x.key < key).is_some() {}
        match e.peek() {
            Some(x) if x.key == key && x.ino == ino => found.push(Found {
                written: UNIX_EPOCH + Duration::from_millis(x.written_ms),
                key,
                parent: x.parent,
                file_len: x.file_len,
                ino,
                tenant: Some(x.tenant.clone()),
                meta: x.record.as_deref().and_then(|r| BlockMeta::decode(r).ok()).map(Arc::new),
                catalogued: true,
                indexed: true,
            }),
            _ => unknown.push(key),
        }
    }
    (found, unknown)
}

/// Keeps the catalog after the rebuild: adds the entries of the blocks
/// `found` whose headers were read, or writes all of `found`'s (those
/// indexed) anew where the catalog read held more than twice as many
/// entries as blocks, or none (`read` 0: none, not one, or cut short), then
/// opens it for the writers.
/// Returns what it did, for the log.
fn keep_catalog(s: &Shared, found: &[Found], read: u64, catalogued: usize, run: u64) -> &'static str {
    let entry = |f: &Found| catalog::Entry {
        key: f.key,
        parent: f.parent,
        ino: f.ino,
        file_len: f.file_len,
        written_ms: f.written.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
        tenant: f.tenant.clone().unwrap_or_else(|| kachedb_shm::control::DEFAULT_TENANT.into()),
        record: format::record_bytes(f.meta.as_deref()).map(Vec::into_boxed_slice),
    };
    let live = found.iter().filter(|f| f.indexed);
    let mut slot = lock(&s.catalog);
    if !s.live(run) {
        return "left (stopped)";
    }
    let rewrite = read == 0 || read > 2 * catalogued as u64 + s.cfg.catalog_slack;
    let done = if rewrite {
        s.dir
            .replace_catalog(|w| catalog::write_all(w, live.map(entry).collect::<Vec<_>>().iter()))
            .map(|n| (catalog::Appender::new(n), "written"))
    } else {
        let mut a = catalog::Appender::new(read);
        let fresh: Vec<catalog::Entry> = live.filter(|f| !f.catalogued).map(entry).collect();
        if fresh.is_empty() {
            Ok((a, "kept"))
        } else {
            s.dir.append_catalog().and_then(|f| {
                a.append(&f, &fresh)?;
                f.sync_data()?;
                Ok((a, "added to"))
            })
        }
    };
    match done {
        Ok((a, what)) => {
            *slot = Some(a);
            what
        }
        Err(e) => {
            tracing::warn!("disk tier: no catalog (the next start reads every header): {e}");
            let _ = s.dir.remove_catalog();
            *slot = None;
            "dropped"
        }
    }
}

/// A block file that verified at start, or that the catalog knows.
#[derive(Debug)]
struct Found {
    /// When written (its header's time, or the file's).
    written: SystemTime,
    key: u128,
    parent: Option<u128>,
    /// The file's length, bytes.
    file_len: u64,
    ino: u64,
    /// `None`: a version 1 file, the default tenant's.
    tenant: Option<Arc<str>>,
    /// Its metadata record (`format`, "The block's metadata record").
    meta: Option<Arc<BlockMeta>>,
    /// Known by the catalog (its header not read).
    catalogued: bool,
    /// In the index (not removed while the rebuild ran).
    indexed: bool,
}

/// When a file was last written, by its status.
fn mtime(st: &rustix::fs::Stat) -> SystemTime {
    let since = Duration::new(u64::try_from(st.st_mtime).unwrap_or(0), st.st_mtime_nsec as u32);
    UNIX_EPOCH.checked_add(since).unwrap_or(UNIX_EPOCH)
}

/// Checks the headers of the block files of `keys`, [`INDEX_THREADS`]
/// threads taking up to [`INDEX_BATCH`] keys at a time: those that verify (when
/// written, key, parent, bytes on disk), and how many did not (deleted).
///
/// The threads send their findings a batch at a time and this thread keeps
/// them, in a vector it allocates: what outlives the threads is not left in
/// their allocator arenas, which `malloc_trim` cannot empty while pieces of
/// them are in use (with each thread's own growing vector, 100 000 blocks
/// left a daemon with 19–23 MB of `RssAnon` after the rebuild, 6.7 MB with
/// one arena).
fn index_files(s: &Shared, keys: &[u128], run: u64) -> (Vec<Found>, u64) {
    let next = &AtomicUsize::new(0);
    // `O_DIRECT` until the file system refuses it (see `TierDir::read_header`).
    let direct = &AtomicBool::new(true);
    let batch = (keys.len() / (INDEX_THREADS * 4)).clamp(1, INDEX_BATCH);
    let threads = INDEX_THREADS.min(keys.len().div_ceil(batch)).max(1);
    let mut found = Vec::with_capacity(keys.len());
    let (tx, rx) = std::sync::mpsc::channel::<Vec<Found>>();
    let torn = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..threads)
            .filter_map(|_| {
                let tx = tx.clone();
                std::thread::Builder::new()
                    .name(THREAD_NAME.into())
                    .spawn_scoped(sc, move || index_some(s, keys, batch, next, direct, run, &tx))
                    .ok()
            })
            .collect();
        // If no thread could be started, this one reads them all.
        let mut torn = if handles.is_empty() { index_some(s, keys, batch, next, direct, run, &tx) } else { 0 };
        drop(tx);
        for batch in rx {
            found.extend(batch);
        }
        torn += handles.into_iter().filter_map(|h| h.join().ok()).sum::<u64>();
        torn
    });
    (found, torn)
}

/// One thread of [`index_files`]: takes the next `batch` keys of `keys`
/// (by `next`) until none are left, reading each one's header, and
/// sends each batch's blocks that verify to `out`; how many did not.
fn index_some(
    s: &Shared,
    keys: &[u128],
    batch: usize,
    next: &AtomicUsize,
    direct: &AtomicBool,
    run: u64,
    out: &std::sync::mpsc::Sender<Vec<Found>>,
) -> u64 {
    let mut torn = 0;
    let mut page = dir::HeaderPage::new();
    // The tenant names met, each kept once (a name per block would be a
    // heap string per block).
    let mut names: Vec<Arc<str>> = Vec::new();
    loop {
        let from = next.fetch_add(batch, Relaxed);
        if from >= keys.len() || !s.live(run) {
            return torn;
        }
        let mut found = Vec::with_capacity(batch);
        for &key in &keys[from..(from + batch).min(keys.len())] {
            if !s.live(run) {
                break;
            }
            let mut read = 0;
            let mut ino = 0;
            let checked = (|| -> Result<(SystemTime, Header, u64), String> {
                let (n, st) = s.dir.read_header(key, &mut page, direct).map_err(|e| e.to_string())?;
                read = n;
                ino = st.st_ino;
                if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
                    return Err("not a regular file".into());
                }
                let h = Header::decode(&page.0[..n], key).map_err(|e| e.to_string())?;
                let len = st.st_size as u64;
                h.check_file_len(len).map_err(|e| e.to_string())?;
                Ok((mtime(&st), h, len))
            })();
            match checked {
                Ok((mtime, h, len)) => {
                    let tenant = h.tenant.map(|t| match names.iter().find(|n| ***n == *t) {
                        Some(n) => n.clone(),
                        None => {
                            let n: Arc<str> = t.into();
                            if names.len() < kachedb_shm::control::MAX_TENANTS {
                                names.push(n.clone());
                            }
                            n
                        }
                    });
                    let meta = record_of(key, &page.0[..read]);
                    found.push(Found {
                        written: mtime,
                        key,
                        parent: h.parent,
                        file_len: len,
                        ino,
                        tenant,
                        meta,
                        catalogued: false,
                        indexed: true,
                    });
                }
                Err(why) => {
                    torn += 1;
                    tracing::warn!(key = %format_args!("{key:032x}"), "disk tier: block file refused at start and deleted: {why}");
                    let _c = lock(&s.commit);
                    if s.live(run) {
                        let _ = s.dir.remove_block(key);
                    }
                }
            }
        }
        let _ = out.send(found);
    }
}
