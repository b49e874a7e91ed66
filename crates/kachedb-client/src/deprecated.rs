//! The names the put and get operations had before one name per operation
//! (`docs/PROTOCOL.md`, "Operations and their names"): each forwards to the
//! current method and goes away in 0.3.

use crate::{Client, DType, Key, Result, Shape, Value};

impl Client {
    /// Use [`put`](Client::put) with [`Value::tensor`].
    #[deprecated(since = "0.2.0", note = "use `put(key, Value::tensor(dtype, shape, bytes))`")]
    pub fn put_tensor(&self, key: Key, dtype: DType, shape: &Shape, bytes: &[u8]) -> Result<()> {
        self.put(key, Value::tensor(dtype, *shape, bytes))
    }

    /// Use [`put`](Client::put) with [`Value::parent`].
    #[deprecated(since = "0.2.0", note = "use `put(key, Value::bytes(bytes).parent(parent))`")]
    pub fn put_with_parent(&self, key: Key, parent: Option<Key>, bytes: &[u8]) -> Result<()> {
        self.put(key, Value::bytes(bytes).parent(parent))
    }

    /// Use [`put`](Client::put) with [`Value::tensor`] and [`Value::parent`].
    #[deprecated(since = "0.2.0", note = "use `put(key, Value::tensor(dtype, shape, bytes).parent(parent))`")]
    pub fn put_tensor_with_parent(
        &self,
        key: Key,
        parent: Option<Key>,
        dtype: DType,
        shape: &Shape,
        bytes: &[u8],
    ) -> Result<()> {
        self.put(key, Value::tensor(dtype, *shape, bytes).parent(parent))
    }

    /// Use [`put_many`](Client::put_many) with [`chain_parents`](crate::chain_parents).
    #[deprecated(since = "0.2.0", note = "use `put_many` with values naming their parents (`chain_parents`)")]
    pub fn put_chain(&self, items: &[(Key, &[u8])], parent: Option<Key>) -> Result<()> {
        let keys: Vec<Key> = items.iter().map(|(k, _)| *k).collect();
        let parents = crate::chain_parents(&keys, parent);
        let values: Vec<(Key, Value<'_>)> =
            items.iter().zip(parents).map(|((k, b), p)| (*k, Value::bytes(b).parent(p))).collect();
        self.put_many(&values)
    }

    /// Use [`put_many`](Client::put_many) with [`Value::tensor`].
    #[deprecated(since = "0.2.0", note = "use `put_many` with `Value::tensor` values")]
    pub fn put_many_tensors(&self, items: &[(Key, DType, Shape, &[u8])]) -> Result<()> {
        let values: Vec<(Key, Value<'_>)> = items.iter().map(|(k, d, s, b)| (*k, Value::tensor(*d, *s, b))).collect();
        self.put_many(&values)
    }

    /// Use [`put_many`](Client::put_many) with [`Value::tensor`] and [`Value::parent`].
    #[deprecated(since = "0.2.0", note = "use `put_many` with `Value::tensor(..).parent(..)` values")]
    pub fn put_many_tensors_with_parents(
        &self,
        items: &[(Key, DType, Shape, &[u8])],
        parents: &[Option<Key>],
    ) -> Result<()> {
        if !parents.is_empty() && parents.len() != items.len() {
            return Err(crate::ClientError::Invalid(format!(
                "{} parents for {} blocks: give one per block, or none",
                parents.len(),
                items.len()
            )));
        }
        let parent = |i: usize| parents.get(i).copied().flatten();
        let values: Vec<(Key, Value<'_>)> = items
            .iter()
            .enumerate()
            .map(|(i, (k, d, s, b))| (*k, Value::tensor(*d, *s, b).parent(parent(i))))
            .collect();
        self.put_many(&values)
    }

    /// Use [`put_ranges`](Client::put_ranges).
    #[deprecated(since = "0.2.0", note = "renamed `put_ranges` (the Python method's name)")]
    pub fn put_many_gathered(
        &self,
        keys: &[Key],
        dtype: DType,
        shape: &Shape,
        sources: &[&[u8]],
        parents: &[Option<Key>],
    ) -> Result<()> {
        self.put_ranges(keys, dtype, shape, sources, parents)
    }

    /// Use [`get_prefix_into`](Client::get_prefix_into).
    #[deprecated(since = "0.2.0", note = "renamed `get_prefix_into` (the Python method's name)")]
    pub fn get_prefix_scattered(
        &self,
        keys: &[Key],
        dtype: DType,
        block_len: usize,
        dests: &mut [&mut [u8]],
    ) -> Result<usize> {
        self.get_prefix_into(keys, dtype, block_len, dests)
    }
}
