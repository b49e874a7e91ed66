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
//! 4   u16 format version (FORMAT_VERSION)
//! 6   u16 header length (HEADER_LEN)
//! 8   u8  dtype code, u8 ndim, u16 zero
//! 12  u32 chunk count
//! 16  u32 dims[6] (unused dims zero)
//! 40  u64 tensor length, bytes
//! 48  u32 chunk bytes (payload per chunk), u32 zero
//! 56  u128 block key
//! 72  u64 xxh3-64 of the tensor bytes
//! 80  u64 xxh3-64 of header bytes 0..80
//! 88  8 zero bytes
//! ```
//!
//! A reader trusts nothing it has not checked: [`Header::decode`] refuses a
//! wrong magic, version, length, key, dtype, shape (vs. length), chunk count
//! (vs. length and chunk bytes) or header checksum; [`verify`] refuses pieces
//! of the wrong length or whose bytes do not hash to the header's checksum.

use kachedb_shm::{DType, Shape};
use std::ops::Range;
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

/// First bytes of every header.
pub const MAGIC: [u8; 4] = *b"KDBR";
/// The format this code writes and the only one it reads.
pub const FORMAT_VERSION: u16 = 1;
/// Header bytes at the start of chunk 0.
pub const HEADER_LEN: usize = 96;
/// Smallest chunk payload accepted (below it a large block needs too many keys).
pub const MIN_CHUNK_BYTES: u32 = 64 * 1024;
/// Largest chunk payload accepted (Redis stalls a shard on values much larger).
pub const MAX_CHUNK_BYTES: u32 = 64 * 1024 * 1024;
/// Default chunk payload: 1 MiB, where one Redis shard moves the most bytes a
/// second without holding its event loop for long (docs/remote.md, sizing).
pub const DEFAULT_CHUNK_BYTES: u32 = 1024 * 1024;
/// Most dims a shape has.
const MAX_DIMS: usize = 6;

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
    #[error("format version {0} (this daemon reads {FORMAT_VERSION})")]
    Version(u16),
    /// The header checksum does not match.
    #[error("header checksum mismatch")]
    HeaderChecksum,
    /// The header names another key than the one asked for.
    #[error("header key mismatch")]
    Key,
    /// Dtype, shape, length, chunk bytes or chunk count are inconsistent.
    #[error("inconsistent header: {0}")]
    Inconsistent(&'static str),
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
    /// xxh3-64 of the tensor bytes.
    pub checksum: u64,
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

/// The Redis key of chunk `index` of block `key` in `namespace`.
pub fn chunk_key(namespace: &str, key: u128, index: u32) -> String {
    format!("{namespace}:{{{key:032x}}}:{index}")
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

impl Header {
    /// The header of a block; `None` if `chunk_bytes` is not accepted or the
    /// block needs too many chunks.
    pub fn new(key: u128, dtype: DType, shape: Shape, len: u64, chunk_bytes: u32, checksum: u64) -> Option<Header> {
        if !chunk_bytes_ok(u64::from(chunk_bytes)) {
            return None;
        }
        let chunk_count = chunk_count(len, chunk_bytes)?;
        Some(Header { key, dtype, shape, len, chunk_bytes, chunk_count, checksum })
    }

    /// The tensor bytes chunk `index` carries (empty past the last chunk).
    pub fn piece(&self, index: u32) -> Range<u64> {
        let cb = u64::from(self.chunk_bytes);
        let start = (u64::from(index) * cb).min(self.len);
        start..(start + cb).min(self.len)
    }

    /// The header bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
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
        b[72..80].copy_from_slice(&self.checksum.to_le_bytes());
        let hc = xxh3_64(&b[..80]);
        b[80..88].copy_from_slice(&hc.to_le_bytes());
        b
    }

    /// Decodes and checks the header at the start of chunk 0 of the block
    /// asked for as `key`.
    pub fn decode(chunk0: &[u8], key: u128) -> Result<Header, FormatError> {
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
        if version != FORMAT_VERSION {
            return Err(FormatError::Version(version));
        }
        if usize::from(u16_at(6)) != HEADER_LEN {
            return Err(FormatError::Inconsistent("header length"));
        }
        if xxh3_64(&b[..80]) != u64_at(80) {
            return Err(FormatError::HeaderChecksum);
        }
        let stored_key = u128::from_le_bytes(b[56..72].try_into().unwrap_or([0; 16]));
        if stored_key != key {
            return Err(FormatError::Key);
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
        Ok(Header { key, dtype, shape, len, chunk_bytes, chunk_count, checksum: u64_at(72) })
    }

    /// Chunk 0's value: this header and the first piece of `payload_start`
    /// (the tensor bytes, or at least their first piece).
    pub fn chunk0(&self, payload_start: &[u8]) -> Vec<u8> {
        let n = self.piece(0).end as usize;
        let mut v = Vec::with_capacity(HEADER_LEN + n);
        v.extend_from_slice(&self.encode());
        v.extend_from_slice(&payload_start[..n.min(payload_start.len())]);
        v
    }
}

/// The tensor bytes of a block read back, as pieces: chunk 0 past its header,
/// then the other chunks whole. Call [`verify`] first.
pub fn pieces<'a>(chunk0: &'a [u8], rest: &'a [Vec<u8>]) -> impl Iterator<Item = &'a [u8]> {
    std::iter::once(chunk0.get(HEADER_LEN..).unwrap_or(&[])).chain(rest.iter().map(Vec::as_slice))
}

/// Checks that `chunk0` (header included) and `rest` (chunks 1.., in order)
/// are exactly the block `h` describes: every piece of the right length and
/// the bytes hashing to its checksum.
pub fn verify(h: &Header, chunk0: &[u8], rest: &[Vec<u8>]) -> Result<(), FormatError> {
    if rest.len() as u64 + 1 != u64::from(h.chunk_count) {
        return Err(FormatError::Inconsistent("chunk count"));
    }
    for (i, p) in pieces(chunk0, rest).enumerate() {
        let want = h.piece(i as u32);
        if p.len() as u64 != want.end - want.start {
            return Err(FormatError::ChunkLen { index: i as u32, len: p.len(), want: want.end - want.start });
        }
    }
    if checksum(pieces(chunk0, rest)) != h.checksum {
        return Err(FormatError::Checksum);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CB: u32 = MIN_CHUNK_BYTES;

    fn block(len: usize) -> (Header, Vec<u8>, Vec<Vec<u8>>) {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        let h = Header::new(
            0xABCD_u128 << 64 | 42,
            DType::U8,
            Shape::new(&[len as u64]).unwrap(),
            len as u64,
            CB,
            checksum([data.as_slice()]),
        )
        .unwrap();
        let c0 = h.chunk0(&data);
        let rest =
            (1..h.chunk_count).map(|i| data[h.piece(i).start as usize..h.piece(i).end as usize].to_vec()).collect();
        (h, c0, rest)
    }

    #[test]
    fn round_trips_sizes_around_chunk_edges() {
        for len in [0usize, 1, CB as usize - 1, CB as usize, CB as usize + 1, 3 * CB as usize + 17] {
            let (h, c0, rest) = block(len);
            assert_eq!(h.chunk_count as usize, len.div_ceil(CB as usize).max(1));
            let back = Header::decode(&c0, h.key).unwrap();
            assert_eq!(back, h);
            verify(&back, &c0, &rest).unwrap();
            let joined: Vec<u8> = pieces(&c0, &rest).flatten().copied().collect();
            assert_eq!(joined.len(), len);
            assert_eq!(checksum([joined.as_slice()]), h.checksum);
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
        assert_eq!(Header::decode(&c0[..HEADER_LEN - 1], h.key), Err(FormatError::Short(HEADER_LEN - 1)));
        assert_eq!(Header::decode(&c0, h.key + 1), Err(FormatError::Key));
        let mut bad = c0.clone();
        bad[0] = b'X';
        assert_eq!(Header::decode(&bad, h.key), Err(FormatError::Magic));
        let mut bad = c0.clone();
        bad[4] = 9;
        assert_eq!(Header::decode(&bad, h.key), Err(FormatError::Version(9)));
        // Any other header byte flipped: the header checksum catches it.
        for i in 8..88 {
            let mut bad = c0.clone();
            bad[i] ^= 0x40;
            assert!(Header::decode(&bad, h.key).is_err(), "byte {i} flipped was accepted");
        }
    }

    #[test]
    fn inconsistent_headers_with_valid_checksums_are_refused() {
        let (h, _, _) = block(1000);
        let reseal = |f: &dyn Fn(&mut [u8; HEADER_LEN])| {
            let mut b = h.encode();
            f(&mut b);
            let hc = xxh3_64(&b[..80]);
            b[80..88].copy_from_slice(&hc.to_le_bytes());
            Header::decode(&b, h.key)
        };
        assert!(reseal(&|b| b[8] = 200).is_err(), "unknown dtype");
        assert!(reseal(&|b| b[9] = 7).is_err(), "ndim");
        assert!(reseal(&|b| b[40] = 0xff).is_err(), "length vs shape");
        assert!(reseal(&|b| b[12] = 5).is_err(), "chunk count");
        assert!(reseal(&|b| b[48..52].copy_from_slice(&16u32.to_le_bytes())).is_err(), "chunk bytes");
        assert!(reseal(&|b| b[30] = 1).is_err(), "unused dim");
    }

    #[test]
    fn payload_corruption_is_refused() {
        let (h, c0, rest) = block(2 * CB as usize + 100);
        let mut bad0 = c0.clone();
        *bad0.last_mut().unwrap() ^= 1;
        assert_eq!(verify(&h, &bad0, &rest), Err(FormatError::Checksum));
        let mut bad = rest.clone();
        bad[1][5] ^= 0x80;
        assert_eq!(verify(&h, &c0, &bad), Err(FormatError::Checksum));
        let mut short = rest.clone();
        short[0].pop();
        assert!(matches!(verify(&h, &c0, &short), Err(FormatError::ChunkLen { index: 1, .. })));
        assert!(verify(&h, &c0, &rest[..1]).is_err(), "a missing chunk");
        // Chunks swapped: same lengths only if equal, and the checksum differs.
        let swapped = vec![rest[0].clone(), rest[0].clone()];
        assert!(verify(&h, &c0, &swapped).is_err());
    }

    #[test]
    fn chunk_sizes_are_bounded() {
        assert!(Header::new(1, DType::U8, Shape::new(&[1]).unwrap(), 1, MIN_CHUNK_BYTES - 1, 0).is_none());
        assert!(Header::new(1, DType::U8, Shape::new(&[1]).unwrap(), 1, MAX_CHUNK_BYTES + 1, 0).is_none());
        assert!(chunk_bytes_ok(u64::from(DEFAULT_CHUNK_BYTES)));
    }
}
