//! The catalog: what the index rebuild needs of each block file (key,
//! inode, length, parent, tenant, when written, metadata record), in one
//! file read front to back at start instead of a header read per file
//! (docs/disk.md, "The catalog"). Every rule of its format lives here.
//!
//! # The contract
//!
//! The catalog is a hint, never the truth about what is on disk: the names
//! under `blocks/` say which blocks there are, and a fill reads and checks
//! each block's own header before it serves it. A block file counts as
//! catalogued only when its name's key **and** its inode (the directory
//! entry's, `d_ino`) are those of the key's latest entry here; any other
//! file's header is read as without a catalog.
//!
//! That is exact because an entry is written **ahead**: a writer appends the
//! entry of a block (with the inode of its temporary file, which the rename
//! keeps) and syncs the catalog before it renames the file into place. So
//! the file a name points to after a crash is either the one of the key's
//! latest entry (same inode) or an older one, which existed beside the
//! latest write's temporary file and so has another inode; a crash loses at
//! most entries of files never renamed. Removals write nothing: the name
//! is gone.
//!
//! The file is `DIR/tmp/catalog`: a daemon that does not know it (an older
//! build, which writes no entries) deletes it with the rest of `tmp/` at its
//! start, so a catalog never outlives writes it did not see. A catalog that
//! cannot be appended to or synced is deleted (and `tmp/` synced) before
//! the write's rename; the next start reads headers.
//!
//! # Format, little-endian
//!
//! ```text
//! file:   magic b"KDBC", u16 version (VERSION), u16 zero, u64 zero; entries
//! entry:
//! 0   u32 entry length, bytes (ENTRY_FIXED..=ENTRY_MAX)
//! 4   u8  flags (bit 0: has a parent), u8 tenant name length (1..=64), u16 zero
//! 8   u64 xxh3-64 of the entry's bytes 16..length
//! 16  u128 block key
//! 32  u128 parent key (zero without a parent)
//! 48  u64 inode of the block's file
//! 56  u64 the file's length, bytes (`format::file_len`)
//! 64  u64 when written, Unix milliseconds
//! 72  tenant name, then the block's metadata record (`BlockMeta::encode`,
//!     as the header area holds it, `format::record_bytes`) to the end
//! ```
//!
//! A reader stops at the first entry whose length or checksum is wrong (a
//! write a crash cut short); later entries of a key replace earlier ones.

use kachedb_shm::control::{check_tenant_name, MAX_TENANT_NAME_LEN};
use std::io::{Read, Write};
use std::sync::Arc;
use xxhash_rust::xxh3::xxh3_64;

/// The catalog's file name, under `DIR/tmp`.
pub(super) const FILE: &str = "catalog";
/// The name a rewritten catalog is made under before it replaces [`FILE`].
pub(super) const NEW_FILE: &str = "catalog.new";
const MAGIC: [u8; 4] = *b"KDBC";
/// The format this code writes and reads.
pub(super) const VERSION: u16 = 1;
/// Bytes before the first entry.
pub(super) const FILE_HEADER_LEN: usize = 16;
/// An entry's bytes before its tenant name.
const ENTRY_FIXED: usize = 72;
/// Longest entry: the fixed part, the longest tenant name, the longest
/// record the header area holds.
const ENTRY_MAX: usize = ENTRY_FIXED + MAX_TENANT_NAME_LEN + super::format::RECORD_MAX;
const HAS_PARENT: u8 = 1;

/// One block file as the catalog knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Entry {
    pub key: u128,
    pub parent: Option<u128>,
    /// The inode of the block's file.
    pub ino: u64,
    /// The file's length, bytes.
    pub file_len: u64,
    pub written_ms: u64,
    pub tenant: Arc<str>,
    /// The block's metadata record, encoded (`format::record_bytes`).
    pub record: Option<Box<[u8]>>,
}

/// The file's first bytes.
pub(super) fn file_header() -> [u8; FILE_HEADER_LEN] {
    let mut b = [0u8; FILE_HEADER_LEN];
    b[..4].copy_from_slice(&MAGIC);
    b[4..6].copy_from_slice(&VERSION.to_le_bytes());
    b
}

/// Appends entry `e` to `out`.
pub(super) fn encode(e: &Entry, out: &mut Vec<u8>) {
    let name = e.tenant.as_bytes();
    let rec = e.record.as_deref().unwrap_or(&[]);
    let len = ENTRY_FIXED + name.len() + rec.len();
    debug_assert!(len <= ENTRY_MAX && !name.is_empty() && name.len() <= MAX_TENANT_NAME_LEN);
    let at = out.len();
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.push(if e.parent.is_some() { HAS_PARENT } else { 0 });
    out.push(name.len() as u8);
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&[0; 8]);
    out.extend_from_slice(&e.key.to_le_bytes());
    out.extend_from_slice(&e.parent.unwrap_or(0).to_le_bytes());
    out.extend_from_slice(&e.ino.to_le_bytes());
    out.extend_from_slice(&e.file_len.to_le_bytes());
    out.extend_from_slice(&e.written_ms.to_le_bytes());
    out.extend_from_slice(name);
    out.extend_from_slice(rec);
    let sum = xxh3_64(&out[at + 16..]);
    out[at + 8..at + 16].copy_from_slice(&sum.to_le_bytes());
}

/// What a catalog file held.
#[derive(Debug, Default)]
pub(super) struct Loaded {
    /// Each key's latest entry, sorted by key.
    pub entries: Vec<Entry>,
    /// Entries read, those replaced by later ones included.
    pub read: u64,
    /// Whether it ended in bytes that are not an entry (a cut-short write).
    pub cut: bool,
}

/// Why a catalog is not read at all.
#[derive(Debug, thiserror::Error)]
pub(super) enum LoadError {
    #[error("reading it: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a catalog of version {VERSION} (bad magic or version)")]
    Header,
}

/// Reads a catalog from `r` (buffered by the caller or not: it reads in
/// large pieces).
pub(super) fn load(mut r: impl Read) -> Result<Loaded, LoadError> {
    let mut head = [0u8; FILE_HEADER_LEN];
    r.read_exact(&mut head).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => LoadError::Header,
        _ => LoadError::Io(e),
    })?;
    if head[..4] != MAGIC || u16::from_le_bytes([head[4], head[5]]) != VERSION {
        return Err(LoadError::Header);
    }
    let mut out = Loaded::default();
    // The tenant names met, each kept once.
    let mut names: Vec<Arc<str>> = Vec::new();
    let mut buf: Vec<u8> = Vec::with_capacity(1 << 20);
    let mut at = 0usize;
    let mut eof = false;
    loop {
        // Enough bytes for the next entry's length, then for the entry.
        let need = |buf: &Vec<u8>, at: usize| -> usize {
            if buf.len() - at < 4 {
                4
            } else {
                (u32::from_le_bytes(buf[at..at + 4].try_into().unwrap_or([0; 4])) as usize).clamp(4, ENTRY_MAX + 1)
            }
        };
        while buf.len() - at < need(&buf, at) && !eof {
            buf.drain(..at);
            at = 0;
            let old = buf.len();
            buf.resize(old + (1 << 20), 0);
            let n = read_some(&mut r, &mut buf[old..])?;
            buf.truncate(old + n);
            eof = n == 0;
        }
        if buf.len() == at {
            return Ok(finish(out));
        }
        match decode(&buf[at..], &mut names) {
            Some((e, len)) => {
                out.entries.push(e);
                out.read += 1;
                at += len;
            }
            None => {
                out.cut = true;
                return Ok(finish(out));
            }
        }
    }
}

fn read_some(r: &mut impl Read, into: &mut [u8]) -> std::io::Result<usize> {
    loop {
        match r.read(into) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            res => return res,
        }
    }
}

/// Keeps each key's latest entry, sorted by key.
fn finish(mut out: Loaded) -> Loaded {
    // Stable: a key's entries keep the file's order, the last one wins.
    out.entries.sort_by_key(|e| e.key);
    let mut kept: Vec<Entry> = Vec::with_capacity(out.entries.len());
    for e in out.entries.drain(..) {
        match kept.last_mut() {
            Some(last) if last.key == e.key => *last = e,
            _ => kept.push(e),
        }
    }
    kept.shrink_to_fit();
    out.entries = kept;
    out
}

/// The entry at the start of `b` and its length, if it is one.
fn decode(b: &[u8], names: &mut Vec<Arc<str>>) -> Option<(Entry, usize)> {
    let len = u32::from_le_bytes(b.get(..4)?.try_into().ok()?) as usize;
    if !(ENTRY_FIXED..=ENTRY_MAX).contains(&len) || b.len() < len {
        return None;
    }
    let e = &b[..len];
    let u64_at = |i: usize| u64::from_le_bytes(e[i..i + 8].try_into().unwrap_or([0; 8]));
    let u128_at = |i: usize| u128::from_le_bytes(e[i..i + 16].try_into().unwrap_or([0; 16]));
    if u64_at(8) != xxh3_64(&e[16..]) {
        return None;
    }
    let (flags, name_len) = (e[4], e[5] as usize);
    if flags & !HAS_PARENT != 0 || e[6..8] != [0, 0] || ENTRY_FIXED + name_len > len {
        return None;
    }
    let name = std::str::from_utf8(&e[ENTRY_FIXED..ENTRY_FIXED + name_len]).ok()?;
    check_tenant_name(name).ok()?;
    let tenant = match names.iter().find(|n| ***n == *name) {
        Some(n) => n.clone(),
        None => {
            let n: Arc<str> = name.into();
            if names.len() < kachedb_shm::control::MAX_TENANTS {
                names.push(n.clone());
            }
            n
        }
    };
    let rec = &e[ENTRY_FIXED + name_len..];
    let entry = Entry {
        key: u128_at(16),
        parent: (flags & HAS_PARENT != 0).then(|| u128_at(32)),
        ino: u64_at(48),
        file_len: u64_at(56),
        written_ms: u64_at(64),
        tenant,
        record: (!rec.is_empty()).then(|| rec.into()),
    };
    Some((entry, len))
}

/// Appends entries to the catalog file: to a descriptor opened `O_APPEND`
/// for the one batch (none is kept open between batches, so the catalog
/// never keeps its file system from being remounted read-only).
#[derive(Debug, Default)]
pub(super) struct Appender {
    /// Entries in the file.
    pub entries: u64,
    buf: Vec<u8>,
}

impl Appender {
    /// An appender to a catalog that holds `entries` entries.
    pub fn new(entries: u64) -> Appender {
        Appender { entries, buf: Vec::new() }
    }

    /// Writes `entries` to `file` (one write, not synced); how many.
    pub fn append<'a>(
        &mut self,
        mut file: &std::fs::File,
        entries: impl IntoIterator<Item = &'a Entry>,
    ) -> std::io::Result<u64> {
        self.buf.clear();
        let mut n = 0;
        for e in entries {
            encode(e, &mut self.buf);
            n += 1;
        }
        if n > 0 {
            file.write_all(&self.buf)?;
            self.entries += n;
        }
        if self.buf.capacity() > 1 << 20 {
            self.buf = Vec::new();
        }
        Ok(n)
    }
}

/// A whole catalog of `entries`: the file header, then each entry.
pub(super) fn write_all<'a>(mut w: impl Write, entries: impl IntoIterator<Item = &'a Entry>) -> std::io::Result<u64> {
    w.write_all(&file_header())?;
    let mut buf = Vec::with_capacity(1 << 20);
    let mut n = 0u64;
    for e in entries {
        encode(e, &mut buf);
        n += 1;
        if buf.len() >= 1 << 20 {
            w.write_all(&buf)?;
            buf.clear();
        }
    }
    w.write_all(&buf)?;
    w.flush()?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: u128, ino: u64) -> Entry {
        Entry {
            key,
            parent: key.is_multiple_of(2).then_some(key.wrapping_mul(3)),
            ino,
            file_len: 4096 + key as u64,
            written_ms: 1_700_000_000_000 + key as u64,
            tenant: if key.is_multiple_of(3) { "default".into() } else { "team-a".into() },
            record: key.is_multiple_of(4).then(|| vec![key as u8; 40].into()),
        }
    }

    fn bytes(entries: &[Entry]) -> Vec<u8> {
        let mut f = Vec::new();
        write_all(&mut f, entries).unwrap();
        f
    }

    #[test]
    fn entries_come_back_as_written_the_latest_of_each_key_sorted() {
        let written: Vec<Entry> = (0..20_000u128).map(|k| entry(k * 7919 % 20_000, k as u64 + 10)).collect();
        let mut again = written[..100].to_vec();
        for e in &mut again {
            e.ino += 1_000_000;
        }
        let mut all = written.clone();
        all.extend(again.iter().cloned());
        let l = load(&bytes(&all)[..]).unwrap();
        assert_eq!((l.read, l.cut), (20_100, false));
        assert_eq!(l.entries.len(), 20_000);
        assert!(l.entries.windows(2).all(|w| w[0].key < w[1].key));
        for e in &l.entries {
            let want = again.iter().find(|a| a.key == e.key).or_else(|| written.iter().find(|w| w.key == e.key));
            assert_eq!(Some(e), want);
        }
    }

    #[test]
    fn a_cut_or_damaged_tail_ends_the_catalog_and_what_came_before_stays() {
        let written: Vec<Entry> = (0..50u128).map(|k| entry(k, k as u64)).collect();
        let full = bytes(&written);
        let first_49 = bytes(&written[..49]).len();
        // Cut anywhere inside the last entry.
        for cut in first_49 + 1..full.len() {
            let l = load(&full[..cut]).unwrap();
            assert_eq!((l.entries.len(), l.cut), (49, true), "cut at {cut}");
        }
        // Any byte of the last entry flipped.
        for i in first_49..full.len() {
            let mut bad = full.clone();
            bad[i] ^= 0x40;
            let l = load(&bad[..]).unwrap();
            assert_eq!(l.entries.len(), 49, "byte {i} flipped");
        }
        // A catalog that is not one.
        assert!(matches!(load(&b"KDBD\x01\0"[..]), Err(LoadError::Header)));
        let mut v2 = full.clone();
        v2[4] = 2;
        assert!(matches!(load(&v2[..]), Err(LoadError::Header)));
        assert!(matches!(load(&[][..]), Err(LoadError::Header)));
    }

    #[test]
    fn the_appender_writes_what_the_loader_reads() {
        let dir = std::env::temp_dir().join(format!("kachedb-catalog-{}", std::process::id()));
        std::fs::write(&dir, file_header()).unwrap();
        let mut a = Appender::new(0);
        let written: Vec<Entry> = (0..300u128).map(|k| entry(k, k as u64)).collect();
        for chunk in written.chunks(64) {
            let f = std::fs::OpenOptions::new().append(true).open(&dir).unwrap();
            assert_eq!(a.append(&f, chunk).unwrap(), chunk.len() as u64);
        }
        assert_eq!(a.entries, 300);
        let l = load(std::fs::File::open(&dir).unwrap()).unwrap();
        let _ = std::fs::remove_file(&dir);
        assert_eq!(l.entries, written);
    }
}
