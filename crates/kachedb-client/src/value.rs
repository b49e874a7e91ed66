//! [`Value`]: what [`Client::put`](crate::Client::put) and
//! [`Client::put_many`](crate::Client::put_many) store under a key — the
//! bytes, their dtype and shape, and the block's parent in a prefix chain.

use crate::error::{ClientError, Result};
use crate::Key;
use kachedb_shm::{DType, Shape};

/// A block's bytes and what the daemon records with them. Plain bytes
/// (`&[u8]`, `&Vec<u8>`, `&[u8; N]`) convert into a flat `u8` value without
/// a parent.
#[derive(Clone, Copy, Debug)]
pub struct Value<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) dtype: DType,
    /// `None`: flat (`[len]` of `u8`).
    pub(crate) shape: Option<Shape>,
    pub(crate) parent: Option<Key>,
}

impl<'a> Value<'a> {
    /// `bytes` as a flat `u8` block.
    pub fn bytes(bytes: &'a [u8]) -> Value<'a> {
        Value { bytes, dtype: DType::U8, shape: None, parent: None }
    }

    /// `bytes` as a tensor of `dtype` and `shape` (checked at the put: the
    /// bytes must be exactly that tensor's).
    pub fn tensor(dtype: DType, shape: Shape, bytes: &'a [u8]) -> Value<'a> {
        Value { bytes, dtype, shape: Some(shape), parent: None }
    }

    /// The same value, naming `parent` as the block before it in a prefix
    /// chain (`None`: no parent; see [`Reservation::set_parent`](crate::Reservation::set_parent)).
    pub fn parent(self, parent: Option<Key>) -> Value<'a> {
        Value { parent, ..self }
    }

    /// Its shape: the given one, or the flat shape of its bytes.
    pub(crate) fn shape(&self) -> Result<Shape> {
        match self.shape {
            Some(s) => Ok(s),
            None => Shape::for_bytes(self.bytes.len() as u64).ok_or_else(|| {
                ClientError::Invalid("a flat block above 4 GiB must be a multiple of 4096 bytes".into())
            }),
        }
    }
}

impl<'a> From<&'a [u8]> for Value<'a> {
    fn from(bytes: &'a [u8]) -> Value<'a> {
        Value::bytes(bytes)
    }
}

impl<'a> From<&'a Vec<u8>> for Value<'a> {
    fn from(bytes: &'a Vec<u8>) -> Value<'a> {
        Value::bytes(bytes)
    }
}

impl<'a, const N: usize> From<&'a [u8; N]> for Value<'a> {
    fn from(bytes: &'a [u8; N]) -> Value<'a> {
        Value::bytes(bytes)
    }
}
