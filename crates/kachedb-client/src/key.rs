//! 128-bit block keys and the stable mapping from user keys to them.
//!
//! The mapping is part of the wire contract (`docs/PROTOCOL.md`, "Keys") and is
//! mirrored byte for byte by the Python package (`kachedb.key_of`); both sides
//! are tested on the same fixed vectors, so a key computed in one language finds
//! the block stored from the other.
//!
//! * bytes -> BLAKE2b, 16-byte digest, personalisation [`Key::PERSONALIZATION`],
//!   no key, no salt; the digest read as a little-endian `u128`
//!   (digest bytes `0..8` = `key_lo`, `8..16` = `key_hi`).
//! * str -> its UTF-8 bytes, then as bytes.
//! * integers -> taken as is, modulo 2^128 (negative values wrap, so Python's
//!   negative `hash()` values are valid keys).

use std::convert::Infallible;
use std::fmt;

use blake2::digest::core_api::{Buffer, UpdateCore, VariableOutputCore};
use blake2::digest::Output;
use blake2::Blake2bVarCore;

/// Digest length of key hashing, in bytes.
const KEY_LEN: usize = 16;

/// A 128-bit block key, as carried by `key_lo`/`key_hi` in a descriptor.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Key(pub u128);

impl Key {
    /// BLAKE2b personalisation of key hashing, version 1 (exactly 16 bytes, the
    /// BLAKE2b maximum). Changing it changes every key: it is versioned on purpose.
    pub const PERSONALIZATION: &'static [u8; 16] = b"kachedb-key-v1\0\0";

    /// Key of a byte string: BLAKE2b-128 with [`Key::PERSONALIZATION`], digest read
    /// as little-endian.
    pub fn from_bytes(bytes: &[u8]) -> Key {
        // The core API, because it is the only one of the `blake2` crate that takes a
        // personalisation *without* a key: `Blake2bMac` with an empty key still hashes a
        // zeroed key block, which is not what hashlib.blake2b(person=...) (the
        // reference the test vectors come from) computes.
        let mut core = Blake2bVarCore::new_with_params(&[], Self::PERSONALIZATION, 0, KEY_LEN);
        let mut buffer = Buffer::<Blake2bVarCore>::default();
        buffer.digest_blocks(bytes, |blocks| core.update_blocks(blocks));
        let mut out = Output::<Blake2bVarCore>::default();
        core.finalize_variable_core(&mut buffer, &mut out);
        // BLAKE2 truncates on the left: a 16-byte digest is the first 16 output bytes.
        let mut digest = [0u8; KEY_LEN];
        digest.copy_from_slice(&out[..KEY_LEN]);
        Key(u128::from_le_bytes(digest))
    }

    /// Key of a string: its UTF-8 bytes through [`Key::from_bytes`].
    #[allow(clippy::should_implement_trait)] // it is also implemented (`FromStr`), infallibly
    pub fn from_str(s: &str) -> Key {
        Key::from_bytes(s.as_bytes())
    }

    /// Key of a signed integer, modulo 2^128 (two's complement wrap: `-1` is `u128::MAX`).
    pub const fn from_i128_wrapping(value: i128) -> Key {
        Key(value as u128)
    }

    /// Key from its two descriptor halves.
    pub const fn from_parts(lo: u64, hi: u64) -> Key {
        Key(((hi as u128) << 64) | lo as u128)
    }

    /// Low 64 bits: the descriptor's `key_lo`.
    pub const fn lo(self) -> u64 {
        self.0 as u64
    }

    /// High 64 bits: the descriptor's `key_hi`.
    pub const fn hi(self) -> u64 {
        (self.0 >> 64) as u64
    }
}

impl From<u128> for Key {
    fn from(value: u128) -> Key {
        Key(value)
    }
}

impl From<Key> for u128 {
    fn from(key: Key) -> u128 {
        key.0
    }
}

impl From<&[u8]> for Key {
    fn from(bytes: &[u8]) -> Key {
        Key::from_bytes(bytes)
    }
}

impl From<&str> for Key {
    fn from(s: &str) -> Key {
        Key::from_bytes(s.as_bytes())
    }
}

impl std::str::FromStr for Key {
    type Err = Infallible;

    fn from_str(s: &str) -> Result<Key, Infallible> {
        Ok(Key::from_bytes(s.as_bytes()))
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({:#034x})", self.0)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::Key;

    // The same vectors are in bindings/python/tests/test_keys.py; they were
    // produced once with
    // `int.from_bytes(hashlib.blake2b(b, digest_size=16, person=b"kachedb-key-v1\0\0").digest(), "little")`.
    const BYTE_VECTORS: &[(&[u8], u128)] = &[
        (b"", 0x2cce3ad782e0344a1613fde51073c736),
        (b"prefix-hash-0", 0x94084cce0aa7c1d500b9bd01869f5bc9),
        ("h\u{e9}llo".as_bytes(), 0x4fa4808aa8b5421cb149d0917030966d),
        (&[0u8; 128], 0x3c8fc69cbf39c751b9d3cd3bd28e6de7),
        (&[0u8; 129], 0x228364acf748d6f506daf50df9649a47),
    ];

    #[test]
    fn bytes_vectors() {
        for &(input, want) in BYTE_VECTORS {
            assert_eq!(Key::from_bytes(input), Key(want), "input {input:?}");
        }
        let counting: Vec<u8> = (0..=255u8).collect();
        assert_eq!(Key::from_bytes(&counting), Key(0x1741f5ae23177cbc8ed2e64f58d49f4d));
        assert_eq!(Key::from_bytes(&[b'a'; 1000]), Key(0x8ad8b1f306fbf8e81817298fe5c2b041));
    }

    #[test]
    fn str_is_utf8_bytes() {
        assert_eq!(Key::from_str("héllo"), Key(0x4fa4808aa8b5421cb149d0917030966d));
        assert_eq!("prefix-hash-0".parse::<Key>().unwrap(), Key(0x94084cce0aa7c1d500b9bd01869f5bc9));
        assert_eq!(Key::from("héllo"), Key::from_bytes("héllo".as_bytes()));
    }

    #[test]
    fn digest_halves_are_little_endian() {
        // hashlib digest of b"" is 36c77310e5fd1316 4a34e082d73ace2c (hex, in byte order).
        let key = Key::from_bytes(b"");
        assert_eq!(key.lo(), u64::from_le_bytes([0x36, 0xc7, 0x73, 0x10, 0xe5, 0xfd, 0x13, 0x16]));
        assert_eq!(key.hi(), u64::from_le_bytes([0x4a, 0x34, 0xe0, 0x82, 0xd7, 0x3a, 0xce, 0x2c]));
        assert_eq!(Key::from_parts(key.lo(), key.hi()), key);
    }

    #[test]
    fn integers_wrap_modulo_2_128() {
        assert_eq!(Key::from(0u128), Key(0));
        assert_eq!(Key::from_i128_wrapping(0), Key(0));
        assert_eq!(Key::from_i128_wrapping(-1), Key(u128::MAX));
        assert_eq!(Key::from_i128_wrapping(i128::MIN), Key(1 << 127));
        // 2**128 + 5 is reduced by the caller (it does not fit any Rust integer) to 5.
        assert_eq!(Key::from(5u128), Key(5));
        assert_eq!(Key::from(1u128 << 64).lo(), 0);
        assert_eq!(Key::from(1u128 << 64).hi(), 1);
        assert_eq!(u128::from(Key(42)), 42);
    }

    #[test]
    fn formatting() {
        assert_eq!(Key(0xab).to_string(), "000000000000000000000000000000ab");
        assert_eq!(format!("{:?}", Key(1)), "Key(0x00000000000000000000000000000001)");
    }
}
