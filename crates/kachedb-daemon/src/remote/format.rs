//! What a block looks like in the remote store: its key names, its header
//! and how its bytes are cut into chunks. Every rule of the remote format
//! lives here (docs/remote.md describes the same layout).
//!
//! # Keys
//!
//! Block `key` (128 bits) in namespace `ns` is stored under the Redis keys
//! `ns:{<key as 32 lowercase hex digits>}:<i>` for chunk `i` in
//! `0..chunk_count`. The braces are a Redis Cluster hash tag: every chunk of
//! one block lives in one slot (one shard), so a block is whole or absent
//! with its shard, and blocks spread over the shards by key.
//!
//! # Values
//!
//! Chunk 0 is the [`HEADER_LEN`]-byte header followed by the first piece of
//! the tensor bytes; chunk `i > 0` is the `i`-th piece, raw. Every piece is
//! `chunk_bytes` long except the last (which holds the remainder, at least one
//! byte unless the block is empty: an empty block is one chunk holding only
//! the header).
//!
//! The header, little-endian:
//!
//! ```text
//! 0   magic b"KDBR"
//! 4   u16 format version: FORMAT_PLAIN (1) or FORMAT_KEYED (4)
//! 6   u16 header length (HEADER_LEN)
//! 8   u8  dtype code, u8 ndim, u16 zero
//! 12  u32 chunk count
//! 16  u32 dims[6] (unused dims zero)
//! 40  u64 tensor length, bytes
//! 48  u32 chunk bytes (payload per chunk), u32 zero
//! 56  u128 block key
//!     format 1 (plain: every writer is trusted)
//! 72  u64 xxh3-64 of the tensor bytes
//! 80  u64 xxh3-64 of header bytes 0..80
//! 88  8 zero bytes
//!     format 4 (keyed: written by a holder of the fleet key)
//! 72  [u8; 16] block tag: AEGIS-128X4 MAC (block subkey, 128-bit tag) of
//!     the namespace (u32 length, then its bytes), header bytes 0..72, then
//!     the tensor bytes
//! 88  [u8; 8]  header tag: keyed BLAKE3 (header subkey) of the namespace
//!     (u32 length, then its bytes) and header bytes 0..88, first 8 bytes
//! ```
//!
//! # A block's metadata record
//!
//! Where a block's writer attached a metadata record (META, docs/events.md,
//! `kachedb_shm::block_meta`) and the node publishes KV events, the record
//! is stored under `ns:{<key hex>}:m` (the block's hash tag: its shard),
//! set before chunk 0, with the chunks' TTL; a reader that publishes KV
//! events reads it beside chunk 0 and lands the block with it. Its value,
//! little-endian:
//!
//! ```text
//! 0   magic b"KDBM"
//! 4   u16 format version: FORMAT_PLAIN (1) or FORMAT_KEYED (4), as the block's
//! 6   u16 zero
//! 8   u32 record length (1..=RECORD_MAX)
//! 12  u32 zero
//! 16  u128 block key
//! 32  [u8; 16] format 1: xxh3-64 of bytes 0..32 and the record, then 8 zero
//!     bytes; format 4: keyed BLAKE3 (header subkey) of the namespace (u32
//!     length, then its bytes), bytes 0..32 and the record, first 16 bytes
//! 48  the record (`BlockMeta::encode`)
//! ```
//!
//! It tells a router what a block holds; the block's bytes are proved by
//! their own tags. A record that does not verify is ignored (the block is
//! filled and published by key). Nothing else reads it: a daemon before it
//! never asks for the key.
//!
//! # A block's next block (read-ahead hint)
//!
//! When a block committed naming a parent is written, its key is stored, after
//! the block's chunk 0, under its parent's next key `ns:{<parent hex>}:n`
//! (the parent's hash tag: its shard), with the chunks' TTL: the child
//! written last. A reader filling a block reads its next key beside chunk 0
//! and reads ahead along what it names (docs/remote.md, "Read-ahead"). Its
//! value is laid out as a metadata record's, magic b"KDBN", key the parent,
//! and a 16-byte record: the child's key, little-endian. A hint is a guess
//! about what to read next, never served as data: the blocks it names are
//! read and verified like any other, and a hint that does not verify
//! ([`Scope::open_next`]) is ignored.
//!
//! # What a value is
//!
//! A value's identity is its namespace, its block key, its dtype, shape,
//! length and chunking, and its tensor bytes. With a fleet key both tags
//! cover all of it: the header fields and the key are header bytes, the
//! namespace is fed in before them (it is not stored: a reader feeds its
//! own). A value copied into another namespace's keys, or under another
//! block key, does not verify there ([`FormatError::HeaderTag`]). Without a
//! key the checksums cover the header and the bytes, not the namespace:
//! every writer is trusted, and one can store anything under any key.
//!
//! # Fleet key
//!
//! A fleet shares one 32-byte secret ([`FleetKey`]). From it two subkeys are
//! derived (BLAKE3 `derive_key`, contexts [`BLOCK_TAG_CONTEXT`] and
//! [`HEADER_TAG_CONTEXT`]). A node with the key writes format 4 and reads
//! only format 4; a node without it writes format 1 and reads only format 1.
//! Neither reads the other's values ([`FormatError::UnkeyedValue`],
//! [`FormatError::KeyedValue`]); a daemon of another format refuses a value
//! of this one as an unknown version. The earlier keyed formats are not read:
//! format 2 (keyed BLAKE3 block tags) and format 3 (this layout, with tags
//! that do not cover the namespace) are unknown versions
//! ([`FormatError::Version`]), misses that are never served; they are
//! written over as the fleet stores those blocks again, or expire. The header
//! tag lets a reader refuse a forged header before it downloads anything
//! else; the block tag (128 bits) is what authenticates the value: a value
//! whose tag does not verify was written with another key, corrupted, or
//! forged, and is never served.
//!
//! The block tag is a MAC, not a hash: AEGIS-128X4 used as a MAC (the
//! `aegis` crate's `Aegis128X4Mac`, fixed all-zero nonce, as its MAC mode
//! allows), keyed with the 128-bit block subkey. It is ~8× faster than keyed
//! BLAKE3 on AES-capable x86 (VAES), so authenticating a fill costs about
//! what xxh3 does; forging a tag without the key is as hard as the MAC's
//! 128 bits. The header tag stays keyed BLAKE3 (88 bytes).
//!
//! # Limits
//!
//! A reader refuses a header whose length is above the largest block its
//! megaslab could ever hold ([`Limits::max_len`]); with the chunk bytes
//! bounded ([`MIN_CHUNK_BYTES`]..=[`MAX_CHUNK_BYTES`]) and the chunk count
//! tied to both, no header makes it ask for more than
//! `max_len / MIN_CHUNK_BYTES + 1` chunks. A chunk value longer than the
//! header implies is refused (a reader asks for one byte more than it
//! expects, never for the whole value: see [`chunk_read_end`]).
//!
//! A reader trusts nothing it has not checked: [`Header::decode`] refuses a
//! wrong magic, version, keying, length, key, dtype, shape (vs. length),
//! chunk count (vs. length and chunk bytes), a length above the limit, or a
//! header checksum or tag mismatch; [`verify`] refuses pieces of the wrong
//! length or whose bytes do not hash to the header's checksum or tag.

use kachedb_shm::{DType, Shape};
use std::ops::Range;
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

/// First bytes of every header.
pub const MAGIC: [u8; 4] = *b"KDBR";
/// The format of values written without a fleet key (checksums only).
pub const FORMAT_PLAIN: u16 = 1;
/// The format of values written with a fleet key (keyed tags over the
/// namespace, the header and the tensor bytes).
pub const FORMAT_KEYED: u16 = 4;
/// Header bytes at the start of chunk 0.
pub const HEADER_LEN: usize = 96;
/// Smallest chunk payload accepted (below it a large block needs too many keys).
pub const MIN_CHUNK_BYTES: u32 = 64 * 1024;
/// Largest chunk payload accepted (Redis stalls a shard on values much larger).
pub const MAX_CHUNK_BYTES: u32 = 64 * 1024 * 1024;
/// Default chunk payload: 1 MiB, where one Redis shard moves the most bytes a
/// second without holding its event loop for long (docs/remote.md, sizing).
pub const DEFAULT_CHUNK_BYTES: u32 = 1024 * 1024;
/// Bytes of a fleet key.
pub const FLEET_KEY_LEN: usize = 32;
/// BLAKE3 `derive_key` context of the block-tag subkey.
pub const BLOCK_TAG_CONTEXT: &str = "kachedb remote tier 2026 block tag v4 aegis128x4 namespace";
/// BLAKE3 `derive_key` context of the header-tag subkey.
pub const HEADER_TAG_CONTEXT: &str = "kachedb remote tier 2026 header tag v4 namespace";
/// Most dims a shape has.
const MAX_DIMS: usize = 6;
/// Bytes of the block tag kept in the header.
const BLOCK_TAG_LEN: usize = 16;
/// Bytes of the header tag kept in the header.
const HEADER_TAG_LEN: usize = 8;
/// Header bytes a block tag covers (before the tensor bytes).
const BLOCK_TAG_COVERS: usize = 72;

/// Why a value read from the remote store is not a block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// Chunk 0 is shorter than a header.
    #[error("value shorter than a header ({0} bytes)")]
    Short(usize),
    /// The magic is wrong.
    #[error("not a kachedb block (bad magic)")]
    Magic,
    /// A format version this daemon does not read.
    #[error("format version {0} (this daemon reads {FORMAT_PLAIN} and {FORMAT_KEYED})")]
    Version(u16),
    /// A keyed value, and this node has no fleet key.
    #[error("a keyed value (format {FORMAT_KEYED}) and this node has no --remote-key-file: refused")]
    KeyedValue,
    /// An unkeyed value, and this node has a fleet key.
    #[error("an unkeyed value (format {FORMAT_PLAIN}) and this node requires the fleet key: refused")]
    UnkeyedValue,
    /// The header checksum does not match.
    #[error("header checksum mismatch")]
    HeaderChecksum,
    /// The header tag does not verify: another fleet key, another namespace
    /// (a value copied from it), or forged.
    #[error("header tag mismatch (written with another fleet key or in another namespace, or forged)")]
    HeaderTag,
    /// The header names another key than the one asked for.
    #[error("header key mismatch")]
    Key,
    /// Dtype, shape, length, chunk bytes or chunk count are inconsistent.
    #[error("inconsistent header: {0}")]
    Inconsistent(&'static str),
    /// A length above the largest block this node's megaslab could hold.
    #[error("length {len} above the largest block this node could hold ({max} bytes)")]
    TooLarge {
        /// The header's length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A chunk is missing or of the wrong length.
    #[error("chunk {index}: {len} bytes where {want} were expected")]
    ChunkLen {
        /// Chunk index.
        index: u32,
        /// Its length.
        len: usize,
        /// The length the header implies.
        want: u64,
    },
    /// The tensor bytes do not hash to the header's checksum.
    #[error("payload checksum mismatch")]
    Checksum,
    /// The block tag does not verify: another fleet key or namespace,
    /// corrupted, or forged.
    #[error("block tag mismatch (written with another fleet key or in another namespace, corrupted, or forged)")]
    BlockTag,
}

impl FormatError {
    /// Whether the value failed authentication (its keying or a tag), as
    /// opposed to being malformed.
    pub fn is_auth(&self) -> bool {
        matches!(self, Self::KeyedValue | Self::UnkeyedValue | Self::HeaderTag | Self::BlockTag)
    }
}

/// The secret a fleet shares, as its two derived subkeys.
#[derive(Clone)]
pub struct FleetKey {
    block: aegis::aegis128x4::Key,
    header: [u8; 32],
}

impl std::fmt::Debug for FleetKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FleetKey(<hidden>)")
    }
}

/// The first 128 bits of BLAKE3 `derive_key(context, secret)`.
fn subkey_128(context: &str, secret: &[u8; FLEET_KEY_LEN]) -> aegis::aegis128x4::Key {
    let k = blake3::derive_key(context, secret);
    let mut out = [0u8; 16];
    out.copy_from_slice(&k[..16]);
    out
}

impl FleetKey {
    /// The key of `secret`.
    pub fn new(secret: &[u8; FLEET_KEY_LEN]) -> FleetKey {
        FleetKey {
            block: subkey_128(BLOCK_TAG_CONTEXT, secret),
            header: blake3::derive_key(HEADER_TAG_CONTEXT, secret),
        }
    }

    /// The key held in a key file: exactly 32 bytes (e.g. `head -c 32
    /// /dev/urandom`), or 64 hex digits with optional surrounding whitespace
    /// (e.g. `openssl rand -hex 32`).
    pub fn parse(file: &[u8]) -> Result<FleetKey, &'static str> {
        if let Ok(raw) = <[u8; FLEET_KEY_LEN]>::try_from(file) {
            // 32 bytes that are all hex digits would be a short hex key: refuse the ambiguity.
            if !raw.iter().all(u8::is_ascii_hexdigit) {
                return Ok(FleetKey::new(&raw));
            }
        }
        let text = std::str::from_utf8(file).map_err(|_| "not 32 bytes, nor 64 hex digits")?.trim();
        if text.len() != 2 * FLEET_KEY_LEN || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err("give exactly 32 bytes, or 64 hex digits (e.g. `openssl rand -hex 32`)");
        }
        let mut raw = [0u8; FLEET_KEY_LEN];
        for (i, b) in raw.iter_mut().enumerate() {
            *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).map_err(|_| "bad hex digit")?;
        }
        Ok(FleetKey::new(&raw))
    }

    /// The header tag of `header` (its bytes 0..88) in `namespace`.
    fn header_tag(&self, namespace: &str, header: &[u8]) -> [u8; HEADER_TAG_LEN] {
        let mut h = blake3::Hasher::new_keyed(&self.header);
        h.update(&namespace_prefix(namespace));
        h.update(namespace.as_bytes());
        h.update(&header[..88]);
        let mut t = [0u8; HEADER_TAG_LEN];
        t.copy_from_slice(&h.finalize().as_bytes()[..HEADER_TAG_LEN]);
        t
    }
}

/// The length of `namespace` as the tags take it before its bytes (u32,
/// little-endian), so that no two (namespace, header) pairs feed the same bytes.
fn namespace_prefix(namespace: &str) -> [u8; 4] {
    u32::try_from(namespace.len()).unwrap_or(u32::MAX).to_le_bytes()
}

/// Where a node's values live and what seals them: its namespace (the
/// prefix of its Redis keys, covered by the keyed tags) and its fleet key,
/// if it has one.
#[derive(Clone, Debug)]
pub struct Scope {
    namespace: String,
    fleet: Option<FleetKey>,
}

impl Scope {
    /// Values in `namespace`, sealed with `fleet`'s key (format 4) or, without
    /// one, with checksums (format 1).
    pub fn new(namespace: &str, fleet: Option<FleetKey>) -> Scope {
        Scope { namespace: namespace.to_owned(), fleet }
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The fleet key, if any.
    pub fn fleet(&self) -> Option<&FleetKey> {
        self.fleet.as_ref()
    }

    /// The Redis key of chunk `index` of block `key` ([`chunk_key`]).
    pub fn chunk_key(&self, key: u128, index: u32) -> String {
        chunk_key(&self.namespace, key, index)
    }
}

/// What proves a block's bytes: a checksum (format 1) or a keyed tag (format 4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seal {
    /// xxh3-64 of the tensor bytes.
    Checksum(u64),
    /// AEGIS-128X4 MAC of the namespace, header bytes 0..72 and the tensor bytes.
    Tag([u8; BLOCK_TAG_LEN]),
}

/// A block's header, as written or as decoded and checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Block key.
    pub key: u128,
    /// Element type.
    pub dtype: DType,
    /// Dims.
    pub shape: Shape,
    /// Tensor bytes.
    pub len: u64,
    /// Payload bytes per chunk.
    pub chunk_bytes: u32,
    /// Chunks, chunk 0 (with the header) included.
    pub chunk_count: u32,
    /// The checksum or tag of the tensor bytes (a placeholder until [`Header::seal`]).
    pub seal: Seal,
}

/// What a reader accepts beyond the format's own rules.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// The largest block this node's megaslab could ever hold, bytes.
    pub max_len: u64,
}

/// Chunks a block of `len` bytes takes with `chunk_bytes` per chunk (at
/// least one); `None` if it would need more than `u32::MAX`.
pub fn chunk_count(len: u64, chunk_bytes: u32) -> Option<u32> {
    let cb = u64::from(chunk_bytes.max(1));
    u32::try_from(len.div_ceil(cb).max(1)).ok()
}

/// Whether `chunk_bytes` is an accepted chunk size.
pub fn chunk_bytes_ok(chunk_bytes: u64) -> bool {
    (u64::from(MIN_CHUNK_BYTES)..=u64::from(MAX_CHUNK_BYTES)).contains(&chunk_bytes)
}

/// The last byte offset (inclusive, as Redis `GETRANGE` takes it) a reader
/// asks for when it expects `want` bytes of a value from `start` on: one past
/// them, so that a longer value shows as too long without being read whole.
pub fn chunk_read_end(start: u64, want: u64) -> u64 {
    start + want
}

/// The Redis key of chunk `index` of block `key` in `namespace`.
pub fn chunk_key(namespace: &str, key: u128, index: u32) -> String {
    format!("{namespace}:{{{key:032x}}}:{index}")
}

/// First bytes of a metadata record's value.
const RECORD_MAGIC: [u8; 4] = *b"KDBM";
/// First bytes of a next-block hint's value ("A block's next block").
const NEXT_MAGIC: [u8; 4] = *b"KDBN";
/// Bytes of a next-block hint's value.
pub const NEXT_LEN: usize = RECORD_HEAD + 16;
/// A record value's bytes before the record.
pub const RECORD_HEAD: usize = 48;
/// Longest record stored, bytes (~16 000 tokens).
pub const RECORD_MAX: usize = 64 << 10;

/// Why a stored metadata record is ignored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// Not a record of this format, or of another block or length.
    #[error("not a record of this block ({0})")]
    Malformed(&'static str),
    /// Its checksum or tag does not verify.
    #[error("its checksum or tag does not verify")]
    Seal,
}

impl Scope {
    /// The Redis key of block `key`'s metadata record ("A block's metadata
    /// record").
    pub fn record_key(&self, key: u128) -> String {
        format!("{}:{{{key:032x}}}:m", self.namespace)
    }

    /// The seal of a record value's bytes 0..32 `head` and record `rec`.
    fn record_seal(&self, head: &[u8], rec: &[u8]) -> [u8; 16] {
        let mut t = [0u8; 16];
        match &self.fleet {
            Some(k) => {
                let mut h = blake3::Hasher::new_keyed(&k.header);
                h.update(&namespace_prefix(&self.namespace));
                h.update(self.namespace.as_bytes());
                h.update(head);
                h.update(rec);
                t.copy_from_slice(&h.finalize().as_bytes()[..16]);
            }
            None => {
                let mut h = Xxh3::new();
                h.update(head);
                h.update(rec);
                t[..8].copy_from_slice(&h.digest().to_le_bytes());
            }
        }
        t
    }

    /// The value storing record `rec` of block `key`; `None` if it is empty
    /// or longer than [`RECORD_MAX`].
    pub fn seal_record(&self, key: u128, rec: &[u8]) -> Option<Vec<u8>> {
        self.seal_as(RECORD_MAGIC, key, rec)
    }

    /// The record a value read under block `key`'s record key holds, checked.
    pub fn open_record<'a>(&self, key: u128, v: &'a [u8]) -> Result<&'a [u8], RecordError> {
        self.open_as(RECORD_MAGIC, key, v)
    }

    /// The Redis key of block `parent`'s next-block hint ("A block's next
    /// block").
    pub fn next_key(&self, parent: u128) -> String {
        format!("{}:{{{parent:032x}}}:n", self.namespace)
    }

    /// The value naming `child` as the block written last after `parent`.
    pub fn seal_next(&self, parent: u128, child: u128) -> Vec<u8> {
        self.seal_as(NEXT_MAGIC, parent, &child.to_le_bytes()).unwrap_or_default()
    }

    /// The child a value read under `parent`'s next key names, checked.
    pub fn open_next(&self, parent: u128, v: &[u8]) -> Result<u128, RecordError> {
        let rec = self.open_as(NEXT_MAGIC, parent, v)?;
        let child: [u8; 16] = rec.try_into().map_err(|_| RecordError::Malformed("length"))?;
        Ok(u128::from_le_bytes(child))
    }

    /// A value of kind `magic` holding `rec` for block `key` (the layout of
    /// "A block's metadata record"); `None` if `rec` is empty or longer than
    /// [`RECORD_MAX`].
    fn seal_as(&self, magic: [u8; 4], key: u128, rec: &[u8]) -> Option<Vec<u8>> {
        if rec.is_empty() || rec.len() > RECORD_MAX {
            return None;
        }
        let mut v = Vec::with_capacity(RECORD_HEAD + rec.len());
        v.extend_from_slice(&magic);
        v.extend_from_slice(&(if self.fleet.is_some() { FORMAT_KEYED } else { FORMAT_PLAIN }).to_le_bytes());
        v.extend_from_slice(&[0, 0]);
        v.extend_from_slice(&(rec.len() as u32).to_le_bytes());
        v.extend_from_slice(&[0; 4]);
        v.extend_from_slice(&key.to_le_bytes());
        let seal = self.record_seal(&v[..32], rec);
        v.extend_from_slice(&seal);
        v.extend_from_slice(rec);
        Some(v)
    }

    /// What a value of kind `magic` for block `key` holds, checked.
    fn open_as<'a>(&self, magic: [u8; 4], key: u128, v: &'a [u8]) -> Result<&'a [u8], RecordError> {
        let head = v.get(..RECORD_HEAD).ok_or(RecordError::Malformed("short"))?;
        let want = if self.fleet.is_some() { FORMAT_KEYED } else { FORMAT_PLAIN };
        if head[..4] != magic || u16::from_le_bytes([head[4], head[5]]) != want {
            return Err(RecordError::Malformed("magic or format"));
        }
        let len = u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize;
        if head[6..8] != [0, 0] || head[12..16] != [0; 4] || !(1..=RECORD_MAX).contains(&len) {
            return Err(RecordError::Malformed("length"));
        }
        if v.len() != RECORD_HEAD + len {
            return Err(RecordError::Malformed("length"));
        }
        if u128::from_le_bytes(head[16..32].try_into().unwrap_or([0; 16])) != key {
            return Err(RecordError::Malformed("another block's"));
        }
        let rec = &v[RECORD_HEAD..];
        if head[32..48] != self.record_seal(&head[..32], rec) {
            return Err(RecordError::Seal);
        }
        Ok(rec)
    }
}

/// Why a namespace is refused, or `None` if it is fine: 1–64 printable ASCII
/// characters without spaces or braces (braces would change the hash tag).
pub fn namespace_problem(ns: &str) -> Option<&'static str> {
    if ns.is_empty() || ns.len() > 64 {
        Some("must be 1 to 64 characters")
    } else if !ns.bytes().all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}') {
        Some("must be printable ASCII without spaces or braces")
    } else {
        None
    }
}

/// The xxh3-64 of a block's bytes given as pieces (the same as of their concatenation).
pub fn checksum<'a>(pieces: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let mut h = Xxh3::new();
    for p in pieces {
        h.update(p);
    }
    h.digest()
}

/// Compares two tags in time independent of where they differ.
fn tags_equal(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Computes a block's seal from its pieces, fed in order.
pub enum Sealer {
    /// Format 1.
    Plain(Box<Xxh3>),
    /// Format 4.
    Keyed(Box<aegis::aegis128x4::Aegis128X4Mac<BLOCK_TAG_LEN>>),
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Sealer::Plain(_) => "Sealer::Plain",
            Sealer::Keyed(_) => "Sealer::Keyed",
        })
    }
}

impl Sealer {
    /// A sealer for the block `h` describes in `scope`: keyed with its
    /// fleet key (over its namespace and `h`'s fields first) if it has one.
    pub fn new(h: &Header, scope: &Scope) -> Sealer {
        match scope.fleet() {
            None => Sealer::Plain(Box::new(Xxh3::new())),
            Some(k) => {
                let mut m = aegis::aegis128x4::Aegis128X4Mac::<BLOCK_TAG_LEN>::new(&k.block);
                m.update(&namespace_prefix(scope.namespace()));
                m.update(scope.namespace().as_bytes());
                m.update(&h.fields(FORMAT_KEYED)[..BLOCK_TAG_COVERS]);
                Sealer::Keyed(Box::new(m))
            }
        }
    }

    /// Feeds the next piece of tensor bytes.
    pub fn update(&mut self, piece: &[u8]) {
        match self {
            Sealer::Plain(h) => h.update(piece),
            Sealer::Keyed(m) => {
                m.update(piece);
            }
        }
    }

    /// The seal of the bytes fed.
    pub fn finish(&self) -> Seal {
        match self {
            Sealer::Plain(h) => Seal::Checksum(h.digest()),
            Sealer::Keyed(m) => Seal::Tag(m.as_ref().clone().finalize()),
        }
    }
}

impl Header {
    /// The header of a block, not sealed yet; `None` if `chunk_bytes` is not
    /// accepted or the block needs too many chunks.
    pub fn new(key: u128, dtype: DType, shape: Shape, len: u64, chunk_bytes: u32) -> Option<Header> {
        if !chunk_bytes_ok(u64::from(chunk_bytes)) {
            return None;
        }
        let chunk_count = chunk_count(len, chunk_bytes)?;
        Some(Header { key, dtype, shape, len, chunk_bytes, chunk_count, seal: Seal::Checksum(0) })
    }

    /// The header of a block of `data` in `scope`, sealed with its fleet
    /// key if it has one (format 4), else with a checksum (format 1).
    pub fn sealed(mut self, data: &[u8], scope: &Scope) -> Header {
        let mut s = Sealer::new(&self, scope);
        s.update(data);
        self.seal = s.finish();
        self
    }

    /// The tensor bytes chunk `index` carries (empty past the last chunk).
    pub fn piece(&self, index: u32) -> Range<u64> {
        let cb = u64::from(self.chunk_bytes);
        let start = (u64::from(index) * cb).min(self.len);
        start..(start + cb).min(self.len)
    }

    /// The bytes of chunk `index`'s value: the header and the first piece
    /// for chunk 0, the piece for the others.
    pub fn chunk_value_len(&self, index: u32) -> u64 {
        let p = self.piece(index);
        p.end - p.start + if index == 0 { HEADER_LEN as u64 } else { 0 }
    }

    /// Header bytes 0..72 for format `version` (the rest zero).
    fn fields(&self, version: u16) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&version.to_le_bytes());
        b[6..8].copy_from_slice(&(HEADER_LEN as u16).to_le_bytes());
        b[8] = self.dtype as u8;
        b[9] = self.shape.ndim() as u8;
        b[12..16].copy_from_slice(&self.chunk_count.to_le_bytes());
        for (i, d) in self.shape.dims().iter().enumerate() {
            b[16 + 4 * i..20 + 4 * i].copy_from_slice(&d.to_le_bytes());
        }
        b[40..48].copy_from_slice(&self.len.to_le_bytes());
        b[48..52].copy_from_slice(&self.chunk_bytes.to_le_bytes());
        b[56..72].copy_from_slice(&self.key.to_le_bytes());
        b
    }

    /// The header bytes. A header sealed with a tag needs the same `scope`
    /// (namespace and fleet key) for its header tag (without a key the header
    /// tag is zero: no reader accepts it).
    pub fn encode(&self, scope: &Scope) -> [u8; HEADER_LEN] {
        match self.seal {
            Seal::Checksum(c) => {
                let mut b = self.fields(FORMAT_PLAIN);
                b[72..80].copy_from_slice(&c.to_le_bytes());
                let hc = xxh3_64(&b[..80]);
                b[80..88].copy_from_slice(&hc.to_le_bytes());
                b
            }
            Seal::Tag(t) => {
                let mut b = self.fields(FORMAT_KEYED);
                b[72..88].copy_from_slice(&t);
                if let Some(k) = scope.fleet() {
                    let ht = k.header_tag(scope.namespace(), &b);
                    b[88..96].copy_from_slice(&ht);
                }
                b
            }
        }
    }

    /// Decodes and checks the header at the start of chunk 0 of the block
    /// asked for as `key`, read in `scope` (its namespace and fleet key, or
    /// none) by a node whose megaslab sets `limits`.
    pub fn decode(chunk0: &[u8], key: u128, limits: &Limits, scope: &Scope) -> Result<Header, FormatError> {
        let fleet = scope.fleet();
        if chunk0.len() < HEADER_LEN {
            return Err(FormatError::Short(chunk0.len()));
        }
        let b = &chunk0[..HEADER_LEN];
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]));
        if b[0..4] != MAGIC {
            return Err(FormatError::Magic);
        }
        let version = u16_at(4);
        match (version, fleet) {
            (FORMAT_PLAIN, None) | (FORMAT_KEYED, Some(_)) => {}
            (FORMAT_PLAIN, Some(_)) => return Err(FormatError::UnkeyedValue),
            (FORMAT_KEYED, None) => return Err(FormatError::KeyedValue),
            (v, _) => return Err(FormatError::Version(v)),
        }
        if usize::from(u16_at(6)) != HEADER_LEN {
            return Err(FormatError::Inconsistent("header length"));
        }
        // The header's own seal first: nothing of a forged header is looked at.
        let seal = match fleet {
            None => {
                if xxh3_64(&b[..80]) != u64_at(80) {
                    return Err(FormatError::HeaderChecksum);
                }
                if b[88..96] != [0; 8] {
                    return Err(FormatError::Inconsistent("reserved bytes"));
                }
                Seal::Checksum(u64_at(72))
            }
            Some(k) => {
                if !tags_equal(&k.header_tag(scope.namespace(), b), &b[88..96]) {
                    return Err(FormatError::HeaderTag);
                }
                let mut t = [0u8; BLOCK_TAG_LEN];
                t.copy_from_slice(&b[72..88]);
                Seal::Tag(t)
            }
        };
        let stored_key = u128::from_le_bytes(b[56..72].try_into().unwrap_or([0; 16]));
        if stored_key != key {
            return Err(FormatError::Key);
        }
        if b[10..12] != [0; 2] || b[52..56] != [0; 4] {
            return Err(FormatError::Inconsistent("reserved bytes"));
        }
        let dtype = DType::from_code(b[8]).ok_or(FormatError::Inconsistent("dtype"))?;
        let ndim = usize::from(b[9]);
        if ndim > MAX_DIMS {
            return Err(FormatError::Inconsistent("ndim"));
        }
        let dims: Vec<u64> = (0..ndim).map(|i| u64::from(u32_at(16 + 4 * i))).collect();
        if (ndim..MAX_DIMS).any(|i| u32_at(16 + 4 * i) != 0) {
            return Err(FormatError::Inconsistent("unused dims"));
        }
        let shape = Shape::new(&dims).ok_or(FormatError::Inconsistent("shape"))?;
        let len = u64_at(40);
        if len > limits.max_len {
            return Err(FormatError::TooLarge { len, max: limits.max_len });
        }
        if shape.check_len(dtype, len).is_err() {
            return Err(FormatError::Inconsistent("shape vs length"));
        }
        let chunk_bytes = u32_at(48);
        if !chunk_bytes_ok(u64::from(chunk_bytes)) {
            return Err(FormatError::Inconsistent("chunk bytes"));
        }
        let chunk_count = u32_at(12);
        if Some(chunk_count) != self::chunk_count(len, chunk_bytes) {
            return Err(FormatError::Inconsistent("chunk count"));
        }
        Ok(Header { key, dtype, shape, len, chunk_bytes, chunk_count, seal })
    }

    /// Chunk 0's value in `scope`: this header and the first piece of
    /// `payload_start` (the tensor bytes, or at least their first piece).
    pub fn chunk0(&self, payload_start: &[u8], scope: &Scope) -> Vec<u8> {
        let n = self.piece(0).end as usize;
        let mut v = Vec::with_capacity(HEADER_LEN + n);
        v.extend_from_slice(&self.encode(scope));
        v.extend_from_slice(&payload_start[..n.min(payload_start.len())]);
        v
    }
}

/// The tensor bytes of a block read back, as pieces: chunk 0 past its header,
/// then the other chunks whole. Call [`verify`] first.
pub fn pieces<'a>(chunk0: &'a [u8], rest: &'a [Vec<u8>]) -> impl Iterator<Item = &'a [u8]> {
    std::iter::once(chunk0.get(HEADER_LEN..).unwrap_or(&[])).chain(rest.iter().map(Vec::as_slice))
}

/// Checks that `chunk0` (header included, as [`Header::decode`] accepted it
/// in the same `scope`) and `rest` (chunks 1.., in order) are exactly the
/// block `h` describes: every piece of the right length and the bytes
/// hashing to its checksum, or to its tag in `scope`.
pub fn verify(h: &Header, chunk0: &[u8], rest: &[Vec<u8>], scope: &Scope) -> Result<(), FormatError> {
    verify_lengths(h, chunk0, rest)?;
    let mut s = Sealer::new(h, scope);
    for p in pieces(chunk0, rest) {
        s.update(p);
    }
    verify_seal(h, &s)
}

/// Checks that `chunk0` and `rest` have the pieces `h` describes, each of
/// the right length.
pub fn verify_lengths(h: &Header, chunk0: &[u8], rest: &[Vec<u8>]) -> Result<(), FormatError> {
    if rest.len() as u64 + 1 != u64::from(h.chunk_count) {
        return Err(FormatError::Inconsistent("chunk count"));
    }
    for (i, p) in pieces(chunk0, rest).enumerate() {
        let want = h.piece(i as u32);
        if p.len() as u64 != want.end - want.start {
            return Err(FormatError::ChunkLen { index: i as u32, len: p.len(), want: want.end - want.start });
        }
    }
    Ok(())
}

/// Checks the seal `sealer` computed (made by [`Sealer::new`] for `h` in the
/// reader's scope, fed every tensor byte in order) against `h`'s.
pub fn verify_seal(h: &Header, sealer: &Sealer) -> Result<(), FormatError> {
    match (h.seal, sealer.finish()) {
        (Seal::Checksum(want), Seal::Checksum(got)) if want == got => Ok(()),
        (Seal::Checksum(_), Seal::Checksum(_)) => Err(FormatError::Checksum),
        (Seal::Tag(want), Seal::Tag(got)) if tags_equal(&got, &want) => Ok(()),
        (Seal::Tag(_), Seal::Tag(_)) => Err(FormatError::BlockTag),
        (Seal::Checksum(_), Seal::Tag(_)) => Err(FormatError::UnkeyedValue),
        (Seal::Tag(_), Seal::Checksum(_)) => Err(FormatError::KeyedValue),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CB: u32 = MIN_CHUNK_BYTES;
    const LIMITS: Limits = Limits { max_len: 1 << 30 };

    fn block_with(len: usize, scope: &Scope) -> (Header, Vec<u8>, Vec<Vec<u8>>) {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        let h = Header::new(0xABCD_u128 << 64 | 42, DType::U8, Shape::new(&[len as u64]).unwrap(), len as u64, CB)
            .unwrap()
            .sealed(&data, scope);
        let c0 = h.chunk0(&data, scope);
        let rest =
            (1..h.chunk_count).map(|i| data[h.piece(i).start as usize..h.piece(i).end as usize].to_vec()).collect();
        (h, c0, rest)
    }

    fn block(len: usize) -> (Header, Vec<u8>, Vec<Vec<u8>>) {
        block_with(len, &plain())
    }

    fn fleet(byte: u8) -> FleetKey {
        FleetKey::new(&[byte; FLEET_KEY_LEN])
    }

    /// Namespace "ns", no fleet key.
    fn plain() -> Scope {
        Scope::new("ns", None)
    }

    /// Namespace "ns", the fleet key of `byte`.
    fn keyed(byte: u8) -> Scope {
        Scope::new("ns", Some(fleet(byte)))
    }

    #[test]
    fn round_trips_sizes_around_chunk_edges() {
        for k in [plain(), keyed(1)] {
            for len in [0usize, 1, CB as usize - 1, CB as usize, CB as usize + 1, 3 * CB as usize + 17] {
                let (h, c0, rest) = block_with(len, &k);
                assert_eq!(h.chunk_count as usize, len.div_ceil(CB as usize).max(1));
                let back = Header::decode(&c0, h.key, &LIMITS, &k).unwrap();
                assert_eq!(back, h);
                verify(&back, &c0, &rest, &k).unwrap();
                let joined: Vec<u8> = pieces(&c0, &rest).flatten().copied().collect();
                assert_eq!(joined.len(), len);
                assert_eq!(h.chunk_value_len(0), c0.len() as u64);
            }
        }
    }

    #[test]
    fn keys_share_one_hash_tag() {
        assert_eq!(chunk_key("ns", 0xff, 3), "ns:{000000000000000000000000000000ff}:3");
        assert!(namespace_problem("prod-a").is_none());
        assert!(namespace_problem("").is_some());
        assert!(namespace_problem("a{b").is_some());
        assert!(namespace_problem("a b").is_some());
    }

    #[test]
    fn header_corruption_is_refused() {
        let (h, c0, _) = block(1000);
        let d = |b: &[u8], key| Header::decode(b, key, &LIMITS, &plain());
        assert_eq!(d(&c0[..HEADER_LEN - 1], h.key), Err(FormatError::Short(HEADER_LEN - 1)));
        assert_eq!(d(&c0, h.key + 1), Err(FormatError::Key));
        let mut bad = c0.clone();
        bad[0] = b'X';
        assert_eq!(d(&bad, h.key), Err(FormatError::Magic));
        let mut bad = c0.clone();
        bad[4] = 9;
        assert_eq!(d(&bad, h.key), Err(FormatError::Version(9)));
        // Any other header byte flipped: the header checksum catches it.
        for i in 8..HEADER_LEN {
            let mut bad = c0.clone();
            bad[i] ^= 0x40;
            assert!(d(&bad, h.key).is_err(), "byte {i} flipped was accepted");
        }
    }

    #[test]
    fn inconsistent_headers_with_valid_checksums_are_refused() {
        let (h, _, _) = block(1000);
        let reseal = |f: &dyn Fn(&mut [u8; HEADER_LEN])| {
            let mut b = h.encode(&plain());
            f(&mut b);
            let hc = xxh3_64(&b[..80]);
            b[80..88].copy_from_slice(&hc.to_le_bytes());
            Header::decode(&b, h.key, &LIMITS, &plain())
        };
        assert!(reseal(&|b| b[8] = 200).is_err(), "unknown dtype");
        assert!(reseal(&|b| b[9] = 7).is_err(), "ndim");
        assert!(reseal(&|b| b[40] = 0xff).is_err(), "length vs shape");
        assert!(reseal(&|b| b[12] = 5).is_err(), "chunk count");
        assert!(reseal(&|b| b[48..52].copy_from_slice(&16u32.to_le_bytes())).is_err(), "chunk bytes");
        assert!(reseal(&|b| b[30] = 1).is_err(), "unused dim");
        assert!(reseal(&|b| b[10] = 1).is_err(), "reserved byte");
    }

    /// A consistent header whose length is far beyond the megaslab (2^32 - 1
    /// chunks of 64 MiB, ~2^58 bytes) is refused before any chunk is read.
    #[test]
    fn a_header_beyond_the_megaslab_is_refused() {
        let chunks = u64::from(u32::MAX);
        let len = chunks * u64::from(MAX_CHUNK_BYTES);
        let h =
            Header::new(7, DType::U8, Shape::new(&[u64::from(MAX_CHUNK_BYTES), chunks]).unwrap(), len, MAX_CHUNK_BYTES)
                .unwrap();
        assert_eq!(h.chunk_count, u32::MAX);
        let b = h.encode(&plain());
        assert_eq!(Header::decode(&b, 7, &LIMITS, &plain()), Err(FormatError::TooLarge { len, max: LIMITS.max_len }));
        assert!(Header::decode(&b, 7, &Limits { max_len: u64::MAX }, &plain()).is_ok(), "only the limit refuses it");
    }

    #[test]
    fn payload_corruption_is_refused() {
        let (h, c0, rest) = block(2 * CB as usize + 100);
        let mut bad0 = c0.clone();
        *bad0.last_mut().unwrap() ^= 1;
        assert_eq!(verify(&h, &bad0, &rest, &plain()), Err(FormatError::Checksum));
        let mut bad = rest.clone();
        bad[1][5] ^= 0x80;
        assert_eq!(verify(&h, &c0, &bad, &plain()), Err(FormatError::Checksum));
        let mut short = rest.clone();
        short[0].pop();
        assert!(matches!(verify(&h, &c0, &short, &plain()), Err(FormatError::ChunkLen { index: 1, .. })));
        assert!(verify(&h, &c0, &rest[..1], &plain()).is_err(), "a missing chunk");
        let swapped = vec![rest[0].clone(), rest[0].clone()];
        assert!(verify(&h, &c0, &swapped, &plain()).is_err());
    }

    /// Keyed values: only a node with the same key reads them; a keyless node
    /// refuses them, a keyed node refuses unkeyed ones, and a payload changed
    /// with its plain checksum fixed up fails the tag.
    #[test]
    fn keyed_values_are_read_only_with_the_same_key() {
        let (a, b) = (keyed(1), keyed(2));
        let (h, c0, rest) = block_with(3 * CB as usize, &a);
        assert!(matches!(h.seal, Seal::Tag(_)));
        assert_eq!(u16::from_le_bytes([c0[4], c0[5]]), FORMAT_KEYED);
        assert_eq!(Header::decode(&c0, h.key, &LIMITS, &b), Err(FormatError::HeaderTag));
        assert_eq!(Header::decode(&c0, h.key, &LIMITS, &plain()), Err(FormatError::KeyedValue));
        let ok = Header::decode(&c0, h.key, &LIMITS, &a).unwrap();
        verify(&ok, &c0, &rest, &a).unwrap();
        // The header of A's value with B's header tag (a forger who guessed
        // it): the block tag still fails under B.
        let mut forged = c0.clone();
        let ht = b.fleet().unwrap().header_tag(b.namespace(), &forged[..HEADER_LEN]);
        forged[88..96].copy_from_slice(&ht);
        let hb = Header::decode(&forged, h.key, &LIMITS, &b).unwrap();
        assert_eq!(verify(&hb, &forged, &rest, &b), Err(FormatError::BlockTag));
        // A payload byte changed: the tag fails.
        let mut bad = rest.clone();
        bad[0][9] ^= 1;
        assert_eq!(verify(&ok, &c0, &bad, &a), Err(FormatError::BlockTag));
        // An unkeyed value (valid checksums) at a keyed node.
        let (hp, p0, _) = block(100);
        assert_eq!(Header::decode(&p0, hp.key, &LIMITS, &a), Err(FormatError::UnkeyedValue));
        assert!(FormatError::UnkeyedValue.is_auth() && FormatError::BlockTag.is_auth());
        assert!(!FormatError::Checksum.is_auth());
    }

    /// The block tag does not depend on how the bytes are cut into pieces
    /// (the writer seals a block whole, a reader as chunks arrive), and it
    /// is pinned: a change of the MAC or of what it covers changes the format.
    #[test]
    fn the_block_tag_is_the_same_for_any_cut_and_pinned() {
        let k = keyed(7);
        let data: Vec<u8> = (0..300_001u32).map(|i| (i * 131 + 17) as u8).collect();
        let h = Header::new(42, DType::U8, Shape::new(&[data.len() as u64]).unwrap(), data.len() as u64, CB).unwrap();
        let whole = h.sealed(&data, &k).seal;
        for cut in [1usize, 15, 16, 17, 63, 64, 255, 256, 4096, 65_537] {
            let mut s = Sealer::new(&h, &k);
            for p in data.chunks(cut) {
                s.update(p);
            }
            assert_eq!(s.finish(), whole, "pieces of {cut} bytes");
        }
        let Seal::Tag(t) = whole else { panic!("a keyed seal") };
        let hex: String = t.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "a6c551df9470b6c90a27c0af8746f95a", "format 4, namespace \"ns\"");
    }

    /// Keyed values of the earlier formats are not read: format 2 (BLAKE3
    /// block tags) and format 3 (tags that do not cover the namespace) are
    /// unknown versions, misses, whatever their tags.
    #[test]
    fn earlier_keyed_formats_are_unknown_versions() {
        let a = keyed(1);
        for old in [2u16, 3] {
            let (h, mut c0, _) = block_with(1000, &a);
            c0[4..6].copy_from_slice(&old.to_le_bytes());
            let ht = a.fleet().unwrap().header_tag(a.namespace(), &c0[..HEADER_LEN]);
            c0[88..96].copy_from_slice(&ht);
            assert_eq!(Header::decode(&c0, h.key, &LIMITS, &a), Err(FormatError::Version(old)));
            assert!(!FormatError::Version(old).is_auth());
        }
    }

    /// The keyed tags cover the namespace: a value sealed in namespace "ns"
    /// is refused in "ns2" under the same fleet key (its header tag first);
    /// with its header tag made for "ns2" (only a key holder could), the
    /// block tag still fails there. The block key is a header field, covered
    /// by both tags: the value asked for under another key is refused. A plain value's
    /// checksums do not cover the namespace (every writer is trusted).
    #[test]
    fn the_keyed_tags_cover_the_namespace_and_the_key() {
        let here = keyed(1);
        let there = Scope::new("ns2", Some(fleet(1)));
        let (h, c0, rest) = block_with(3 * CB as usize + 5, &here);
        assert_eq!(Header::decode(&c0, h.key, &LIMITS, &there), Err(FormatError::HeaderTag));
        assert!(FormatError::HeaderTag.is_auth());
        let mut moved = c0.clone();
        let ht = there.fleet().unwrap().header_tag(there.namespace(), &moved[..HEADER_LEN]);
        moved[88..96].copy_from_slice(&ht);
        let hm = Header::decode(&moved, h.key, &LIMITS, &there).unwrap();
        assert_eq!(verify(&hm, &moved, &rest, &there), Err(FormatError::BlockTag));
        // The namespace's length is fed before its bytes: "ns" + "x…" and
        // "nsx" + "…" do not feed the same bytes.
        let shifted = Scope::new("nsx", Some(fleet(1)));
        assert_ne!(
            here.fleet().unwrap().header_tag("ns", &c0[..HEADER_LEN]),
            shifted.fleet().unwrap().header_tag("nsx", &c0[..HEADER_LEN])
        );
        assert_eq!(Header::decode(&c0, h.key ^ 1, &LIMITS, &here), Err(FormatError::Key));
        verify(&Header::decode(&c0, h.key, &LIMITS, &here).unwrap(), &c0, &rest, &here).unwrap();
        let (hp, p0, prest) = block(1000);
        let elsewhere = Scope::new("ns2", None);
        verify(&Header::decode(&p0, hp.key, &LIMITS, &elsewhere).unwrap(), &p0, &prest, &elsewhere).unwrap();
    }

    #[test]
    fn key_files_hold_32_bytes_or_64_hex_digits() {
        let raw = [0x9cu8; 32];
        let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        let a = FleetKey::parse(&raw).unwrap();
        let b = FleetKey::parse(format!("{hex}\n").as_bytes()).unwrap();
        assert_eq!((a.block, a.header), (b.block, b.header));
        assert_ne!(a.block[..], a.header[..16]);
        assert!(FleetKey::parse(b"short").is_err());
        assert!(FleetKey::parse(&[0u8; 33]).is_err());
        assert!(FleetKey::parse(&hex.as_bytes()[..32]).is_err(), "32 hex digits: ambiguous, refused");
        assert!(FleetKey::parse(format!("{}zz", &hex[..62]).as_bytes()).is_err());
        assert_eq!(format!("{a:?}"), "FleetKey(<hidden>)");
    }

    #[test]
    fn chunk_sizes_are_bounded() {
        assert!(Header::new(1, DType::U8, Shape::new(&[1]).unwrap(), 1, MIN_CHUNK_BYTES - 1).is_none());
        assert!(Header::new(1, DType::U8, Shape::new(&[1]).unwrap(), 1, MAX_CHUNK_BYTES + 1).is_none());
        assert!(chunk_bytes_ok(u64::from(DEFAULT_CHUNK_BYTES)));
    }
    #[test]
    fn a_record_opens_in_its_own_scope_only_and_any_flipped_byte_is_refused() {
        let rec: Vec<u8> = (0..300u32).map(|i| (i * 7) as u8).collect();
        let key = 0x1234_5678_9abc_def0_0fed_cba9_8765_4321u128;
        let plain = Scope::new("ns-a", None);
        let keyed = Scope::new("ns-a", Some(FleetKey::new(&[7u8; 32])));
        for s in [&plain, &keyed] {
            let v = s.seal_record(key, &rec).unwrap();
            assert_eq!(s.open_record(key, &v), Ok(&rec[..]));
            assert!(s.open_record(key + 1, &v).is_err(), "another block's record");
            for i in 0..v.len() {
                let mut bad = v.clone();
                bad[i] ^= 0x10;
                assert!(s.open_record(key, &bad).is_err(), "byte {i} flipped was accepted");
            }
            assert!(s.open_record(key, &v[..v.len() - 1]).is_err());
            assert_eq!(s.record_key(key), format!("ns-a:{{{key:032x}}}:m"));
        }
        // Not across formats, namespaces or fleet keys.
        assert!(keyed.open_record(key, &plain.seal_record(key, &rec).unwrap()).is_err());
        assert!(plain.open_record(key, &keyed.seal_record(key, &rec).unwrap()).is_err());
        let other_ns = Scope::new("ns-b", Some(FleetKey::new(&[7u8; 32])));
        assert_eq!(other_ns.open_record(key, &keyed.seal_record(key, &rec).unwrap()), Err(RecordError::Seal));
        let other_key = Scope::new("ns-a", Some(FleetKey::new(&[8u8; 32])));
        assert_eq!(other_key.open_record(key, &keyed.seal_record(key, &rec).unwrap()), Err(RecordError::Seal));
        assert!(plain.seal_record(key, &[]).is_none());
        assert!(plain.seal_record(key, &vec![1u8; RECORD_MAX + 1]).is_none());
    }

    #[test]
    fn a_next_hint_names_its_child_in_its_own_scope_only_and_is_no_record() {
        let (parent, child) = (0xaa_u128 << 100 | 5, 0xbb_u128 << 100 | 6);
        let plain = Scope::new("ns-a", None);
        let keyed = Scope::new("ns-a", Some(FleetKey::new(&[7u8; 32])));
        for s in [&plain, &keyed] {
            let v = s.seal_next(parent, child);
            assert_eq!(v.len(), NEXT_LEN);
            assert_eq!(s.open_next(parent, &v), Ok(child));
            assert!(s.open_next(child, &v).is_err(), "another parent's hint");
            for i in 0..v.len() {
                let mut bad = v.clone();
                bad[i] ^= 0x01;
                assert!(s.open_next(parent, &bad).is_err(), "byte {i} flipped was accepted");
            }
            // A hint is not a record, nor the reverse.
            assert!(s.open_record(parent, &v).is_err());
            let rec = s.seal_record(parent, &child.to_le_bytes()).unwrap();
            assert!(s.open_next(parent, &rec).is_err());
            assert_eq!(s.next_key(parent), format!("ns-a:{{{parent:032x}}}:n"));
        }
        assert!(keyed.open_next(parent, &plain.seal_next(parent, child)).is_err());
        let other_key = Scope::new("ns-a", Some(FleetKey::new(&[8u8; 32])));
        assert_eq!(other_key.open_next(parent, &keyed.seal_next(parent, child)), Err(RecordError::Seal));
    }
}
