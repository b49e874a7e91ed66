//! What a block looks like on disk: its file's name and its header. Every
//! rule of the disk format lives here (docs/disk.md describes the same
//! layout).
//!
//! # Files
//!
//! `DIR/blocks/<key as 32 lowercase hex digits>.kdb` holds one block: a
//! [`HEADER_AREA`]-byte header area (the [`HEADER_LEN`]-byte header, then
//! zeros) followed by the tensor bytes, so the file is exactly
//! `HEADER_AREA + len` bytes long. The payload starts on a 4 KiB boundary:
//! on a 4 KiB-block file system the header area costs nothing for payloads
//! of whole pages, and the payload can be read with `O_DIRECT`.
//!
//! A block is written to `DIR/tmp/<key hex>.<n>.tmp`, synced, and renamed
//! to its name: a file under `blocks/` is complete (or, after damage, fails
//! its checks); a file under `tmp/` is a write the daemon did not finish
//! and is deleted at start.
//!
//! # Header, little-endian (format version 2)
//!
//! ```text
//! 0   magic b"KDBD"
//! 4   u16 format version (FORMAT_VERSION)
//! 6   u16 header length (HEADER_LEN)
//! 8   u8  dtype code, u8 ndim, u8 flags (bit 0: has a parent), u8 zero
//! 12  u32 payload offset (HEADER_AREA)
//! 16  u32 dims[6] (unused dims zero)
//! 40  u64 tensor length, bytes
//! 48  u128 block key
//! 64  u128 parent key (zero without a parent)
//! 80  u64 when written, Unix milliseconds (informational)
//! 88  u64 xxh3-64 of the tensor bytes
//! 96  u8  tenant name length (1..=64), 7 zero bytes
//! 104 tenant name (ASCII, `check_tenant_name`), zero-padded to 64 bytes
//! 168 u64 xxh3-64 of header bytes 0..168
//! 176 80 zero bytes
//! ```
//!
//! # The block's metadata record (optional, in the header area)
//!
//! Where the block's writer attached a metadata record (META, docs/events.md,
//! `kachedb_shm::block_meta`) and the daemon publishes KV events, the record
//! follows the header, at [`RECORD_AT`] (256):
//!
//! ```text
//! 256 magic b"KDBM"
//! 260 u32 record length, bytes (1..=RECORD_MAX)
//! 264 u64 xxh3-64 of the record bytes
//! 272 the record (`BlockMeta::encode`), then zeros to the payload
//! ```
//!
//! It is written only where it fits the header area ([`RECORD_MAX`] bytes:
//! ~950 tokens); a longer one is left out and the block is published by key.
//! It is outside the header checksum, so a reader that does not know it (an
//! older daemon of format version 2) reads the block as before; a record
//! that does not verify is ignored (the block stays, published by key): it
//! tells a router what a block holds, and the block's bytes are checked by
//! their own checksum.
//!
//! Version 1 (written before tenants reached the disk) is read too: its
//! header is 128 bytes, bytes 0..96 as above (version 1, length 128), the
//! xxh3-64 of bytes 0..96 at 96, then 24 zero bytes; it names no tenant, so
//! its block is the default tenant's ([`Header::tenant`] is `None`).
//!
//! The header checksum covers the payload checksum, so together they cover
//! header and payload. A reader checks everything: [`Header::decode`]
//! refuses a wrong magic, version, length, key, dtype, shape (vs. length),
//! payload offset, tenant name or header checksum; the payload is refused by
//! the fill if the file is not exactly `HEADER_AREA + len` bytes or its
//! bytes do not hash to the header's checksum.

use kachedb_shm::control::{check_tenant_name, DEFAULT_TENANT, MAX_TENANT_NAME_LEN, OTHER_TENANT};
use kachedb_shm::{BlockMeta, DType, Shape};
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::xxh3_64;

/// First bytes of every header.
pub const MAGIC: [u8; 4] = *b"KDBD";
/// The format this code writes.
pub const FORMAT_VERSION: u16 = 2;
/// The older format it reads too (no tenant: the default tenant's blocks).
pub const FORMAT_VERSION_V1: u16 = 1;
/// Header bytes (version 2); a reader reads this many (a version 1 header
/// is shorter, and zeros follow it in the header area).
pub const HEADER_LEN: usize = 256;
/// Header bytes of version 1.
const HEADER_LEN_V1: usize = 128;
/// Where the tenant name's length and the name are (version 2).
const TENANT_LEN_AT: usize = 96;
const TENANT_AT: usize = 104;
/// Where the header checksum is (version 2), and what it covers (`0..`).
const CHECKSUM_AT: usize = TENANT_AT + MAX_TENANT_NAME_LEN;
const _: () = assert!(CHECKSUM_AT + 8 <= HEADER_LEN && MAX_TENANT_NAME_LEN <= u8::MAX as usize);
/// Bytes before the payload (the header, then zeros).
pub const HEADER_AREA: u64 = 4096;
/// Where a block's metadata record starts in the header area, and its magic.
pub const RECORD_AT: usize = HEADER_LEN;
const RECORD_MAGIC: [u8; 4] = *b"KDBM";
/// Bytes before the record itself: magic, length, checksum.
const RECORD_HEAD: usize = 16;
/// Longest record the header area holds, bytes.
pub const RECORD_MAX: usize = HEADER_AREA as usize - RECORD_AT - RECORD_HEAD;
/// Most dims a shape has.
const MAX_DIMS: usize = 6;
/// Suffix of a block file.
const BLOCK_SUFFIX: &str = ".kdb";

/// Why a block file is not a block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// The file is shorter than a header.
    #[error("file shorter than a header ({0} bytes)")]
    Short(usize),
    /// The magic is wrong.
    #[error("not a kachedb disk block (bad magic)")]
    Magic,
    /// A format version this daemon does not read.
    #[error("format version {0} (this daemon reads {FORMAT_VERSION_V1} and {FORMAT_VERSION})")]
    Version(u16),
    /// The header checksum does not match.
    #[error("header checksum mismatch")]
    HeaderChecksum,
    /// The header names another key than the file's name.
    #[error("header key mismatch")]
    Key,
    /// Dtype, shape, length or offsets are inconsistent.
    #[error("inconsistent header: {0}")]
    Inconsistent(&'static str),
    /// The file is not `HEADER_AREA + len` bytes long (a torn or truncated write).
    #[error("file is {got} bytes where the header implies {want}")]
    FileLen {
        /// Its length.
        got: u64,
        /// The length the header implies.
        want: u64,
    },
    /// The tensor bytes do not hash to the header's checksum.
    #[error("payload checksum mismatch")]
    Checksum,
}

/// A block's header, as written or as decoded and checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// The tenant whose block it is; `None`: the default tenant's (a
    /// version 1 file, which names none).
    pub tenant: Option<String>,
    /// Block key.
    pub key: u128,
    /// The parent the client named at its commit, if any.
    pub parent: Option<u128>,
    /// Element type.
    pub dtype: DType,
    /// Dims.
    pub shape: Shape,
    /// Tensor bytes.
    pub len: u64,
    /// When written, Unix milliseconds.
    pub written_ms: u64,
    /// xxh3-64 of the tensor bytes.
    pub checksum: u64,
}

/// The xxh3-64 of a block's tensor bytes.
pub fn checksum(payload: &[u8]) -> u64 {
    xxh3_64(payload)
}

/// The file name of block `key` (under `DIR/blocks`).
pub fn block_name(key: u128) -> String {
    format!("{key:032x}{BLOCK_SUFFIX}")
}

/// The file of block `key` under `blocks` (`DIR/blocks`).
pub fn block_path(blocks: &Path, key: u128) -> PathBuf {
    blocks.join(block_name(key))
}

/// The key a block file's name gives, if it is a block file's name.
pub fn key_of_name(name: &str) -> Option<u128> {
    let hex = name.strip_suffix(BLOCK_SUFFIX)?;
    if hex.len() != 32 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    u128::from_str_radix(hex, 16).ok()
}

/// The record `meta` as the header area holds it: encoded, if it encodes
/// and fits ([`RECORD_MAX`]); `None` otherwise (the block goes by key).
pub fn record_bytes(meta: Option<&BlockMeta>) -> Option<Vec<u8>> {
    let mut rec = Vec::new();
    meta.is_some_and(|m| m.encode(&mut rec).is_ok() && !rec.is_empty() && rec.len() <= RECORD_MAX).then_some(rec)
}

/// The bytes a block file of `len` tensor bytes has.
pub fn file_len(len: u64) -> u64 {
    HEADER_AREA.saturating_add(len)
}

impl Header {
    /// The header area: the header, then zeros up to [`HEADER_AREA`].
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; HEADER_AREA as usize];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&(HEADER_LEN as u16).to_le_bytes());
        b[8] = self.dtype as u8;
        b[9] = self.shape.ndim() as u8;
        b[10] = u8::from(self.parent.is_some());
        b[12..16].copy_from_slice(&(HEADER_AREA as u32).to_le_bytes());
        for (i, d) in self.shape.dims().iter().enumerate() {
            b[16 + 4 * i..20 + 4 * i].copy_from_slice(&d.to_le_bytes());
        }
        b[40..48].copy_from_slice(&self.len.to_le_bytes());
        b[48..64].copy_from_slice(&self.key.to_le_bytes());
        b[64..80].copy_from_slice(&self.parent.unwrap_or(0).to_le_bytes());
        b[80..88].copy_from_slice(&self.written_ms.to_le_bytes());
        b[88..96].copy_from_slice(&self.checksum.to_le_bytes());
        let tenant = self.tenant.as_deref().unwrap_or(DEFAULT_TENANT).as_bytes();
        // Names are checked (`check_tenant_name`) before they reach a block;
        // a longer one would be cut here and refused at its read.
        let n = tenant.len().min(MAX_TENANT_NAME_LEN);
        b[TENANT_LEN_AT] = n as u8;
        b[TENANT_AT..TENANT_AT + n].copy_from_slice(&tenant[..n]);
        let hc = xxh3_64(&b[..CHECKSUM_AT]);
        b[CHECKSUM_AT..CHECKSUM_AT + 8].copy_from_slice(&hc.to_le_bytes());
        b
    }

    /// The header area with `meta` after the header where it fits
    /// ([`RECORD_MAX`]); whether it was put in.
    pub fn encode_with(&self, meta: Option<&BlockMeta>) -> (Vec<u8>, bool) {
        let mut b = self.encode();
        let rec = record_bytes(meta);
        let fits = rec.is_some();
        if let Some(rec) = rec {
            let at = RECORD_AT;
            b[at..at + 4].copy_from_slice(&RECORD_MAGIC);
            b[at + 4..at + 8].copy_from_slice(&(rec.len() as u32).to_le_bytes());
            b[at + 8..at + 16].copy_from_slice(&xxh3_64(&rec).to_le_bytes());
            b[at + RECORD_HEAD..at + RECORD_HEAD + rec.len()].copy_from_slice(&rec);
        }
        (b, fits)
    }

    /// Decodes and checks the header at the start of the file of `key`.
    pub fn decode(bytes: &[u8], key: u128) -> Result<Header, FormatError> {
        if bytes.len() < HEADER_LEN_V1 {
            return Err(FormatError::Short(bytes.len()));
        }
        let b = bytes;
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]));
        let u128_at = |o: usize| u128::from_le_bytes(b[o..o + 16].try_into().unwrap_or([0; 16]));
        if b[0..4] != MAGIC {
            return Err(FormatError::Magic);
        }
        let version = u16_at(4);
        let (header_len, checksum_at) = match version {
            FORMAT_VERSION => (HEADER_LEN, CHECKSUM_AT),
            FORMAT_VERSION_V1 => (HEADER_LEN_V1, 96),
            v => return Err(FormatError::Version(v)),
        };
        if usize::from(u16_at(6)) != header_len {
            return Err(FormatError::Inconsistent("header length"));
        }
        if b.len() < header_len {
            return Err(FormatError::Short(b.len()));
        }
        if xxh3_64(&b[..checksum_at]) != u64_at(checksum_at) {
            return Err(FormatError::HeaderChecksum);
        }
        let tenant = if version == FORMAT_VERSION {
            let n = usize::from(b[TENANT_LEN_AT]);
            let name = b.get(TENANT_AT..TENANT_AT + n).filter(|_| n <= MAX_TENANT_NAME_LEN);
            let name = name.and_then(|n| std::str::from_utf8(n).ok());
            match name {
                Some(name) if check_tenant_name(name).is_ok() || name == OTHER_TENANT => Some(name.to_owned()),
                _ => return Err(FormatError::Inconsistent("tenant name")),
            }
        } else {
            None
        };
        if u128_at(48) != key {
            return Err(FormatError::Key);
        }
        if u64::from(u32_at(12)) != HEADER_AREA {
            return Err(FormatError::Inconsistent("payload offset"));
        }
        let dtype = DType::from_code(b[8]).ok_or(FormatError::Inconsistent("dtype"))?;
        let ndim = usize::from(b[9]);
        if ndim > MAX_DIMS {
            return Err(FormatError::Inconsistent("ndim"));
        }
        if (ndim..MAX_DIMS).any(|i| u32_at(16 + 4 * i) != 0) {
            return Err(FormatError::Inconsistent("unused dims"));
        }
        let dims: Vec<u64> = (0..ndim).map(|i| u64::from(u32_at(16 + 4 * i))).collect();
        let shape = Shape::new(&dims).ok_or(FormatError::Inconsistent("shape"))?;
        let len = u64_at(40);
        if shape.check_len(dtype, len).is_err() {
            return Err(FormatError::Inconsistent("shape vs length"));
        }
        let parent = match b[10] {
            0 => None,
            1 => Some(u128_at(64)),
            _ => return Err(FormatError::Inconsistent("flags")),
        };
        Ok(Header { tenant, key, parent, dtype, shape, len, written_ms: u64_at(80), checksum: u64_at(88) })
    }

    /// The metadata record in header area `area` (its first bytes, as read:
    /// a record beyond them is not there): `None` without one, `Some(Err)`
    /// for one that does not verify.
    pub fn record(area: &[u8]) -> Option<Result<BlockMeta, String>> {
        let head = area.get(RECORD_AT..RECORD_AT + RECORD_HEAD)?;
        if head[..4] != RECORD_MAGIC {
            return None;
        }
        let len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
        let sum = u64::from_le_bytes(head[8..16].try_into().unwrap_or([0; 8]));
        let Some(rec) = (1..=RECORD_MAX)
            .contains(&len)
            .then(|| area.get(RECORD_AT + RECORD_HEAD..RECORD_AT + RECORD_HEAD + len))
            .flatten()
        else {
            return Some(Err(format!("record length {len} out of bounds")));
        };
        if xxh3_64(rec) != sum {
            return Some(Err("record checksum mismatch".into()));
        }
        Some(BlockMeta::decode(rec).map_err(|e| e.to_string()))
    }

    /// Checks that a file of `got` bytes holds this header's block whole.
    pub fn check_file_len(&self, got: u64) -> Result<(), FormatError> {
        let want = file_len(self.len);
        if got == want {
            Ok(())
        } else {
            Err(FormatError::FileLen { got, want })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            tenant: Some("team-a".into()),
            key: 0x1234_5678_9abc_def0_1122_3344_5566_7788,
            parent: Some(42),
            dtype: DType::F16,
            shape: Shape::new(&[2, 3, 4]).unwrap(),
            len: 48,
            written_ms: 1_700_000_000_000,
            checksum: checksum(&[7u8; 48]),
        }
    }

    #[test]
    fn a_header_round_trips_and_every_byte_of_it_is_checked() {
        let h = header();
        let b = h.encode();
        assert_eq!(b.len() as u64, HEADER_AREA);
        assert_eq!(Header::decode(&b, h.key), Ok(h.clone()));
        let no_parent = Header { parent: None, ..h.clone() };
        assert_eq!(Header::decode(&no_parent.encode(), h.key), Ok(no_parent));
        let other = Header { tenant: Some(OTHER_TENANT.into()), ..h.clone() };
        assert_eq!(Header::decode(&other.encode(), h.key), Ok(other));
        // Any flipped bit of the header (checksummed bytes) is refused.
        for i in 0..CHECKSUM_AT + 8 {
            let mut bad = b.clone();
            bad[i] ^= 0x10;
            assert!(Header::decode(&bad, h.key).is_err(), "byte {i} flipped was accepted");
        }
        assert_eq!(Header::decode(&b, h.key + 1), Err(FormatError::Key));
        assert_eq!(Header::decode(&b[..100], h.key), Err(FormatError::Short(100)));
        assert_eq!(Header::decode(&b[..200], h.key), Err(FormatError::Short(200)));
        // A tenant name that is no tenant name, checksummed right, is refused.
        let mut bad = b.clone();
        bad[TENANT_AT] = b' ';
        let hc = xxh3_64(&bad[..CHECKSUM_AT]);
        bad[CHECKSUM_AT..CHECKSUM_AT + 8].copy_from_slice(&hc.to_le_bytes());
        assert_eq!(Header::decode(&bad, h.key), Err(FormatError::Inconsistent("tenant name")));
    }

    /// A version 1 header as the daemon before tenants reached the disk wrote it.
    fn encode_v1(h: &Header) -> Vec<u8> {
        let mut b = h.encode();
        b[4..6].copy_from_slice(&FORMAT_VERSION_V1.to_le_bytes());
        b[6..8].copy_from_slice(&(HEADER_LEN_V1 as u16).to_le_bytes());
        b[96..].fill(0);
        let hc = xxh3_64(&b[..96]);
        b[96..104].copy_from_slice(&hc.to_le_bytes());
        b
    }

    #[test]
    fn a_version_1_header_is_read_as_the_default_tenants_block() {
        let h = header();
        let b = encode_v1(&h);
        assert_eq!(Header::decode(&b, h.key), Ok(Header { tenant: None, ..h.clone() }));
        // Its 128 bytes alone are enough, and every checksummed byte is checked.
        assert!(Header::decode(&b[..HEADER_LEN_V1], h.key).is_ok());
        for i in 0..104 {
            let mut bad = b.clone();
            bad[i] ^= 0x10;
            assert!(Header::decode(&bad, h.key).is_err(), "byte {i} flipped was accepted");
        }
        // A version this daemon does not know is refused.
        let mut v3 = h.encode();
        v3[4] = 3;
        assert_eq!(Header::decode(&v3, h.key), Err(FormatError::Version(3)));
    }

    fn meta(tokens: usize) -> BlockMeta {
        BlockMeta {
            block_hash: 0xdead_beef,
            parent_hash: Some(7),
            block_size: tokens as u32,
            token_ids: (0..tokens as u32).collect(),
            lora_id: None,
            lora_name: Some("adapter".into()),
        }
    }

    #[test]
    fn a_record_rides_in_the_header_area_where_it_fits_and_is_checked() {
        let h = header();
        let m = meta(16);
        let (b, fits) = h.encode_with(Some(&m));
        assert!(fits);
        // The header reads as before (an older reader sees the same block)...
        assert_eq!(Header::decode(&b, h.key), Ok(h.clone()));
        // ...and the record comes back, from the whole area or the bytes it spans.
        assert_eq!(Header::record(&b), Some(Ok(m.clone())));
        let end = RECORD_AT + RECORD_HEAD + m.encoded_len();
        assert_eq!(Header::record(&b[..end]), Some(Ok(m.clone())));
        assert_eq!(
            Header::record(&b[..end - 1]),
            Some(Err(format!("record length {} out of bounds", m.encoded_len())))
        );
        // Without one, none.
        assert_eq!(Header::record(&h.encode()), None);
        assert_eq!(h.encode_with(None), (h.encode(), false));
        // Any flipped bit of the record is refused, none of the header.
        for i in RECORD_AT + 4..end {
            let mut bad = b.clone();
            bad[i] ^= 0x04;
            assert!(matches!(Header::record(&bad), Some(Err(_))), "byte {i} flipped was accepted");
            assert_eq!(Header::decode(&bad, h.key), Ok(h.clone()));
        }
        // A record too long for the area is left out: the header alone.
        let long = meta(1000);
        assert!(long.encoded_len() > RECORD_MAX);
        assert_eq!(h.encode_with(Some(&long)), (h.encode(), false));
        let most = meta((RECORD_MAX - 32 - "adapter".len()) / 4);
        let (b, fits) = h.encode_with(Some(&most));
        assert!(fits && b.len() as u64 == HEADER_AREA);
        assert_eq!(Header::record(&b), Some(Ok(most)));
    }

    #[test]
    fn file_names_map_to_keys_and_back() {
        let k = 0xabcdef_u128 << 64 | 7;
        let p = block_path(Path::new("/d/blocks"), k);
        let name = p.file_name().unwrap().to_str().unwrap();
        assert_eq!(key_of_name(name), Some(k));
        assert_eq!(key_of_name("0123.kdb"), None);
        assert_eq!(key_of_name(&name.to_uppercase()), None);
        assert_eq!(key_of_name(&name.replace(".kdb", ".tmp")), None);
    }

    #[test]
    fn a_file_of_the_wrong_length_is_refused() {
        let h = header();
        assert!(h.check_file_len(HEADER_AREA + 48).is_ok());
        assert!(h.check_file_len(HEADER_AREA + 47).is_err());
        assert!(h.check_file_len(HEADER_AREA + 49).is_err());
    }
}
