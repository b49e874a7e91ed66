//! The store's serialized form, handed to a new daemon by a takeover
//! (`crate::takeover`). Every table travels as it is — slots with their
//! generations, pin slots, free lists, the eviction list's ticks, chain
//! links, sessions, counters — so the handles clients hold (slot index and
//! generation) name the same reservations and pins in the new daemon.
//! `serde` derives on the store's types make the form; a change to any of
//! them changes it, and `takeover::STATE_VERSION` must then change too.
//! The receiving side checks the whole store ([`Store::restore_checked`])
//! before it serves from it.

use super::Store;
use kachedb_shm::{DType, Shape};

impl Store {
    /// `self` (just deserialized) if it manages the megaslab
    /// `[slab_offset, slab_offset + slab_len)` and passes the full invariant
    /// check; otherwise why not.
    pub fn restore_checked(self, slab_offset: u64, slab_len: u64) -> Result<Store, String> {
        let fresh = Store::new(slab_offset, slab_len);
        if self.slab_len != fresh.slab_len || self.alloc.range() != fresh.alloc.range() {
            return Err(format!(
                "the store manages {:?} ({} bytes), the region's megaslab is {:?} ({} bytes)",
                self.alloc.range(),
                self.slab_len,
                fresh.alloc.range(),
                fresh.slab_len
            ));
        }
        self.check_invariants()?;
        Ok(self)
    }
}

/// A [`DType`] as its wire code.
pub(super) mod dtype_code {
    use super::DType;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(d: &DType, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(*d as u8)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DType, D::Error> {
        let code = u8::deserialize(d)?;
        DType::from_code(code).ok_or_else(|| serde::de::Error::custom(format!("unknown dtype code {code}")))
    }
}

/// A [`Shape`] as its list of dims.
pub(super) mod shape_dims {
    use super::Shape;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(shape: &Shape, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(shape.dims())
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Shape, D::Error> {
        let dims = Vec::<u64>::deserialize(d)?;
        Shape::new(&dims).ok_or_else(|| serde::de::Error::custom(format!("bad shape {dims:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{EvictionPolicy, SessionId, StoreStats};
    use super::*;
    use kachedb_shm::{Request, Status};

    fn reserve(st: &mut Store, s: SessionId, key: u128, len: u64) -> u64 {
        let shape = Shape::for_bytes(len).unwrap();
        let c = st.handle(s, 1, &Request::Reserve { key, dtype: DType::U8, shape, len, page_offset: 0 });
        assert_eq!(c.status, Status::Ok);
        c.handle
    }

    /// A store carried through its serialized form answers every request as
    /// the original does: the same handles work, pins and reservations are
    /// the same, eviction takes the same blocks next.
    #[test]
    fn a_restored_store_behaves_as_the_original() {
        let mut a = Store::new(4096, 64 * 4096);
        a.set_eviction_policy(EvictionPolicy::Chain);
        let (s1, s2) = (a.open_session(), a.open_session());
        for k in 1..=10u128 {
            let h = reserve(&mut a, s1, k, 4096 * 2);
            let parent = (k > 1).then_some(k - 1);
            assert_eq!(a.handle(s1, 2, &Request::Commit { handle: h, parent }).status, Status::Ok);
        }
        let pin = a.handle(s2, 3, &Request::Get { key: 5 });
        assert_eq!(pin.status, Status::Ok);
        let open = reserve(&mut a, s2, 99, 4096);
        let json = serde_json::to_vec(&a).unwrap();
        let mut b = serde_json::from_slice::<Store>(&json).unwrap().restore_checked(4096, 64 * 4096).unwrap();
        // The request window starts again in the new daemon (its sketch does not travel).
        let no_window = |mut st: StoreStats| {
            (st.window_distinct_keys, st.window_key_requests, st.working_set_bytes) = (0, 0, 0);
            st.hit_ratio_ceiling = 0.0;
            st
        };
        assert_eq!(no_window(a.stats()), b.stats());
        a.restart_window();
        // The same requests give the same answers from here on.
        let script = [
            (s2, Request::Release { handle: pin.handle }),
            (s2, Request::Commit { handle: open, parent: Some(10) }),
            (
                s1,
                Request::Reserve {
                    key: 50,
                    dtype: DType::U8,
                    shape: Shape::for_bytes(40 * 4096).unwrap(),
                    len: 40 * 4096,
                    page_offset: 0,
                },
            ),
            (s1, Request::Lookup { key: 1 }),
            (s1, Request::Get { key: 10 }),
            (s2, Request::Release { handle: pin.handle }),
        ];
        for (s, r) in &script {
            let (x, y) = (a.handle(*s, 7, r), b.handle(*s, 7, r));
            assert_eq!((x.status, x.handle, x.offset), (y.status, y.handle, y.offset), "{r:?}");
        }
        b.check_invariants().unwrap();
        assert_eq!(a.stats(), b.stats());
    }

    #[test]
    fn a_state_for_another_megaslab_or_broken_is_refused() {
        let mut a = Store::new(4096, 64 * 4096);
        let s = a.open_session();
        let h = reserve(&mut a, s, 1, 4096);
        assert_eq!(a.handle(s, 2, &Request::Commit { handle: h, parent: None }).status, Status::Ok);
        let json = serde_json::to_vec(&a).unwrap();
        let b: Store = serde_json::from_slice(&json).unwrap();
        assert!(b.restore_checked(4096, 32 * 4096).unwrap_err().contains("megaslab"));
        // A slot's extent edited to overlap nothing the allocator handed out.
        let mut v: serde_json::Value = serde_json::from_slice(&json).unwrap();
        v["slots"][0]["state"]["Block"]["tensor"]["extent"]["offset"] = serde_json::json!(8192 * 4);
        let c: Store = serde_json::from_value(v).unwrap();
        assert!(c.restore_checked(4096, 64 * 4096).is_err());
    }
}
