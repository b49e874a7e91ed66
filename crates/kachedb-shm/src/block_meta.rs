//! The block metadata record: what an engine knows of a block and the daemon
//! does not (its hash in the engine's terms, its parent's, its tokens, the
//! block size, the LoRA adapter), handed to the daemon with a META frame
//! before the block's COMMIT and carried into the KV events
//! (`docs/PROTOCOL.md`, "META and block metadata"; `docs/events.md`).
//!
//! Every rule of the record is here: its layout ([`BlockMeta::encode`]),
//! its bounds ([`MAX_META_TOKENS`], [`MAX_LORA_NAME_LEN`], [`MAX_META_LEN`])
//! and its checks ([`BlockMeta::decode`], which never panics on any bytes).
//!
//! Layout, little-endian, [`META_HEADER_LEN`] bytes then the tokens and the
//! name, nothing after them:
//!
//! | offset | field | type |
//! | --- | --- | --- |
//! | 0 | version ([`META_VERSION`]) | u8 |
//! | 1 | flags: [`META_HAS_PARENT`], [`META_HAS_LORA_ID`]; other bits 0 | u8 |
//! | 2 | `lora_name` length in bytes (UTF-8, 0 = none) | u16 |
//! | 4 | `block_size`: tokens per block, 1 or more | u32 |
//! | 8 | `block_hash` | u64 |
//! | 16 | `parent_hash` (0 without [`META_HAS_PARENT`]) | u64 |
//! | 24 | `lora_id` (0 without [`META_HAS_LORA_ID`]) | u32 |
//! | 28 | token count, at most `block_size` and [`MAX_META_TOKENS`] | u32 |
//! | 32 | the token ids | u32 each |
//! | 32 + 4 × count | `lora_name` | bytes |

/// The record's layout version.
pub const META_VERSION: u8 = 1;
/// Flag: `parent_hash` is given.
pub const META_HAS_PARENT: u8 = 1;
/// Flag: `lora_id` is given.
pub const META_HAS_LORA_ID: u8 = 2;
/// Bytes before the tokens.
pub const META_HEADER_LEN: usize = 32;
/// Most token ids one record carries (LMCache's chunks are 256 tokens,
/// vLLM's and SGLang's blocks 1 to 256).
pub const MAX_META_TOKENS: usize = 4096;
/// Longest `lora_name`, bytes.
pub const MAX_LORA_NAME_LEN: usize = 256;
/// Longest record, bytes.
pub const MAX_META_LEN: usize = META_HEADER_LEN + 4 * MAX_META_TOKENS + MAX_LORA_NAME_LEN;
// A record's length fits the name length's u16 and the token count's u32 with room.
const _: () = assert!(MAX_LORA_NAME_LEN <= u16::MAX as usize && MAX_META_LEN < 64 * 1024);

/// What an engine tells of one block.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct BlockMeta {
    /// The block's hash in the engine's terms (vLLM: its block hash as
    /// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` gives it, the low 64 bits).
    pub block_hash: u64,
    /// The hash of the block before it in its prompt, if any.
    pub parent_hash: Option<u64>,
    /// Tokens per block in the engine.
    pub block_size: u32,
    /// The block's token ids (at most `block_size`).
    pub token_ids: Vec<u32>,
    /// The LoRA adapter's id, if any.
    pub lora_id: Option<u32>,
    /// The LoRA adapter's name, if any.
    pub lora_name: Option<String>,
}

/// Why a record is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetaError {
    /// Shorter than its header says.
    #[error("block metadata of {0} bytes is cut short (the header and the counts it gives need more)")]
    Short(usize),
    /// Longer than its header says, or than [`MAX_META_LEN`].
    #[error("block metadata of {len} bytes, its fields take {want}: nothing may follow the LoRA name")]
    Trailing {
        /// Bytes given.
        len: usize,
        /// Bytes its fields take.
        want: usize,
    },
    /// An unknown version.
    #[error("block metadata version {0}, this side reads {META_VERSION}")]
    Version(u8),
    /// Unknown flag bits.
    #[error("block metadata flags {0:#x}: only META_HAS_PARENT (1) and META_HAS_LORA_ID (2) exist")]
    Flags(u8),
    /// `block_size` 0.
    #[error("block_size 0: give the engine's tokens per block (1 or more)")]
    ZeroBlockSize,
    /// More tokens than the block holds, or than [`MAX_META_TOKENS`].
    #[error("{count} token ids for a block of {block_size} tokens (at most {MAX_META_TOKENS})")]
    TooManyTokens {
        /// Tokens given.
        count: usize,
        /// The block size given.
        block_size: u32,
    },
    /// A `lora_name` longer than [`MAX_LORA_NAME_LEN`], or not UTF-8.
    #[error("lora_name must be UTF-8 of at most {MAX_LORA_NAME_LEN} bytes")]
    LoraName,
    /// A field given as absent must be 0.
    #[error("parent_hash or lora_id is not 0 though its flag is not set")]
    AbsentNotZero,
}

impl BlockMeta {
    /// Checks the bounds [`decode`](Self::decode) checks.
    pub fn check(&self) -> Result<(), MetaError> {
        if self.block_size == 0 {
            return Err(MetaError::ZeroBlockSize);
        }
        if self.token_ids.len() > MAX_META_TOKENS || self.token_ids.len() > self.block_size as usize {
            return Err(MetaError::TooManyTokens { count: self.token_ids.len(), block_size: self.block_size });
        }
        if self.lora_name.as_ref().is_some_and(|n| n.len() > MAX_LORA_NAME_LEN || n.is_empty()) {
            return Err(MetaError::LoraName);
        }
        Ok(())
    }

    /// Bytes of the record.
    pub fn encoded_len(&self) -> usize {
        META_HEADER_LEN + 4 * self.token_ids.len() + self.lora_name.as_ref().map_or(0, String::len)
    }

    /// Appends the record to `out`, once [`check`](Self::check)ed.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), MetaError> {
        self.check()?;
        let name = self.lora_name.as_deref().unwrap_or("");
        let mut flags = 0;
        if self.parent_hash.is_some() {
            flags |= META_HAS_PARENT;
        }
        if self.lora_id.is_some() {
            flags |= META_HAS_LORA_ID;
        }
        out.reserve(self.encoded_len());
        out.push(META_VERSION);
        out.push(flags);
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.block_size.to_le_bytes());
        out.extend_from_slice(&self.block_hash.to_le_bytes());
        out.extend_from_slice(&self.parent_hash.unwrap_or(0).to_le_bytes());
        out.extend_from_slice(&self.lora_id.unwrap_or(0).to_le_bytes());
        out.extend_from_slice(&(self.token_ids.len() as u32).to_le_bytes());
        for t in &self.token_ids {
            out.extend_from_slice(&t.to_le_bytes());
        }
        out.extend_from_slice(name.as_bytes());
        Ok(())
    }

    /// The record in `bytes` (copied out of shared memory: untrusted), or
    /// why it is not one.
    pub fn decode(bytes: &[u8]) -> Result<BlockMeta, MetaError> {
        let short = || MetaError::Short(bytes.len());
        let header: &[u8; META_HEADER_LEN] =
            bytes.get(..META_HEADER_LEN).and_then(|h| h.try_into().ok()).ok_or_else(short)?;
        let u16_at = |i: usize| u16::from_le_bytes([header[i], header[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
        let u64_at = |i: usize| u64::from(u32_at(i)) | (u64::from(u32_at(i + 4)) << 32);
        let (version, flags) = (header[0], header[1]);
        if version != META_VERSION {
            return Err(MetaError::Version(version));
        }
        if flags & !(META_HAS_PARENT | META_HAS_LORA_ID) != 0 {
            return Err(MetaError::Flags(flags));
        }
        let name_len = usize::from(u16_at(2));
        let block_size = u32_at(4);
        let (parent, lora_id) = (u64_at(16), u32_at(24));
        if (flags & META_HAS_PARENT == 0 && parent != 0) || (flags & META_HAS_LORA_ID == 0 && lora_id != 0) {
            return Err(MetaError::AbsentNotZero);
        }
        let count = u32_at(28) as usize;
        if count > MAX_META_TOKENS || count > block_size as usize {
            return Err(MetaError::TooManyTokens { count, block_size });
        }
        if name_len > MAX_LORA_NAME_LEN {
            return Err(MetaError::LoraName);
        }
        let want = META_HEADER_LEN + 4 * count + name_len;
        if bytes.len() < want {
            return Err(short());
        }
        if bytes.len() > want {
            return Err(MetaError::Trailing { len: bytes.len(), want });
        }
        let tokens = &bytes[META_HEADER_LEN..META_HEADER_LEN + 4 * count];
        let token_ids = tokens.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let lora_name = match name_len {
            0 => None,
            _ => Some(std::str::from_utf8(&bytes[want - name_len..]).map_err(|_| MetaError::LoraName)?.to_owned()),
        };
        let meta = BlockMeta {
            block_hash: u64_at(8),
            parent_hash: (flags & META_HAS_PARENT != 0).then_some(parent),
            block_size,
            token_ids,
            lora_id: (flags & META_HAS_LORA_ID != 0).then_some(lora_id),
            lora_name,
        };
        meta.check()?;
        Ok(meta)
    }

    /// Heap bytes the daemon keeps for this record (besides its fixed size).
    pub fn heap_len(&self) -> usize {
        4 * self.token_ids.capacity() + self.lora_name.as_ref().map_or(0, String::capacity)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> BlockMeta {
        BlockMeta {
            block_hash: u64::MAX - 5,
            parent_hash: Some(7),
            block_size: 16,
            token_ids: (0..16).map(|t| t * 1000).collect(),
            lora_id: Some(3),
            lora_name: Some("adapter-é".into()),
        }
    }

    #[test]
    fn decode_reads_back_what_encode_wrote() {
        for m in [sample(), BlockMeta { block_hash: 1, block_size: 1, ..BlockMeta::default() }] {
            let mut out = Vec::new();
            m.encode(&mut out).unwrap();
            assert_eq!(out.len(), m.encoded_len());
            assert_eq!(BlockMeta::decode(&out).unwrap(), m);
        }
    }

    #[test]
    fn every_cut_and_every_bad_field_is_refused() {
        let mut good = Vec::new();
        sample().encode(&mut good).unwrap();
        for cut in 0..good.len() {
            assert!(BlockMeta::decode(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = good.clone();
        long.push(0);
        assert!(matches!(BlockMeta::decode(&long), Err(MetaError::Trailing { .. })));
        let bad = |at: usize, v: u8| {
            let mut b = good.clone();
            b[at] = v;
            BlockMeta::decode(&b)
        };
        assert_eq!(bad(0, 2), Err(MetaError::Version(2)));
        assert_eq!(bad(1, 4 | 3), Err(MetaError::Flags(7)));
        assert_eq!(bad(1, META_HAS_LORA_ID), Err(MetaError::AbsentNotZero));
        // block_size 15 < 16 tokens; block_size 0.
        assert!(matches!(bad(4, 15), Err(MetaError::TooManyTokens { count: 16, block_size: 15 })));
        let mut zero = good.clone();
        zero[4..8].copy_from_slice(&[0; 4]);
        assert!(BlockMeta::decode(&zero).is_err());
        // Bad UTF-8 in the name.
        let last = good.len() - 1;
        assert_eq!(bad(last, 0xff), Err(MetaError::LoraName));
        let too_many = BlockMeta { token_ids: vec![1; 17], ..sample() };
        assert!(too_many.encode(&mut Vec::new()).is_err());
        let huge = BlockMeta { block_size: u32::MAX, token_ids: vec![1; MAX_META_TOKENS + 1], ..sample() };
        assert!(huge.encode(&mut Vec::new()).is_err());
    }
}
