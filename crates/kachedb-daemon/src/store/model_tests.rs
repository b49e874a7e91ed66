//! Property tests of the store: random op sequences from several sessions
//! against a model (under both eviction policies, with chain links), and
//! arbitrary frames and hand-built requests.

use super::tests::{reserve_req, SLAB_OFFSET};
use super::*;
use crate::alloc::{round_up_to_pages, PAGE_LEN};
use kachedb_shm::{DType, Op, TensorBlockDescriptor};
use proptest::prelude::*;
use std::collections::HashMap;

const SESSIONS: usize = 3;
const PAGES: u64 = 32;
const KEYS: u8 = 8;

#[derive(Clone, Debug)]
enum Step {
    Reserve {
        s: usize,
        key: u8,
        len: u64,
        page_offset: u64,
    },
    /// `how`: 0 own live, 1 another session's live, 2 a dead handle, 3 random.
    Commit {
        s: usize,
        pick: usize,
        how: u8,
        random: u64,
        parent: Option<u8>,
    },
    Abort {
        s: usize,
        pick: usize,
        how: u8,
        random: u64,
    },
    Get {
        s: usize,
        key: u8,
    },
    Release {
        s: usize,
        pick: usize,
        how: u8,
        random: u64,
    },
    Lookup {
        s: usize,
        key: u8,
    },
    Delete {
        s: usize,
        key: u8,
    },
    Stats {
        s: usize,
    },
    Close {
        s: usize,
    },
}

fn step() -> impl Strategy<Value = Step> {
    let s = 0..SESSIONS;
    let key = 0..KEYS;
    let how = prop_oneof![6 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8), 1 => Just(3u8)];
    prop_oneof![
        6 => (s.clone(), key.clone(), 0u64..7 * PAGE_LEN, 0u64..64)
            .prop_map(|(s, key, len, po)| Step::Reserve { s, key, len, page_offset: po * 64 }),
        1 => (s.clone(), key.clone()).prop_map(|(s, key)| Step::Reserve { s, key, len: 40 * PAGE_LEN, page_offset: 0 }),
        5 => (s.clone(), any::<usize>(), how.clone(), any::<u64>(), proptest::option::weighted(0.7, 0..KEYS))
            .prop_map(|(s, pick, how, random, parent)| Step::Commit { s, pick, how, random, parent }),
        2 => (s.clone(), any::<usize>(), how.clone(), any::<u64>())
            .prop_map(|(s, pick, how, random)| Step::Abort { s, pick, how, random }),
        4 => (s.clone(), key.clone()).prop_map(|(s, key)| Step::Get { s, key }),
        4 => (s.clone(), any::<usize>(), how, any::<u64>())
            .prop_map(|(s, pick, how, random)| Step::Release { s, pick, how, random }),
        2 => (s.clone(), key.clone()).prop_map(|(s, key)| Step::Lookup { s, key }),
        2 => (s.clone(), key).prop_map(|(s, key)| Step::Delete { s, key }),
        1 => s.clone().prop_map(|s| Step::Stats { s }),
        1 => s.prop_map(|s| Step::Close { s }),
    ]
}

/// A live object's data region, for the overlap check.
#[derive(Clone, Copy, Debug)]
struct Region {
    data_offset: u64,
    len: u64,
}

impl Region {
    fn end(&self) -> u64 {
        self.data_offset + self.len.max(1)
    }
    fn overlaps(&self, o: &Region) -> bool {
        self.data_offset < o.end() && o.data_offset < self.end()
    }
}

#[derive(Clone, Debug)]
struct MRes {
    handle: u64,
    key: u128,
    region: Region,
}

#[derive(Clone, Debug)]
struct MPin {
    handle: u64,
    region: Region,
}

#[derive(Clone, Debug)]
struct MSession {
    id: SessionId,
    res: Vec<MRes>,
    /// One entry per successful GET not yet released.
    pins: Vec<MPin>,
}

struct Model {
    st: Store,
    sessions: Vec<MSession>,
    committed: HashMap<u128, Region>,
    /// Chain links between committed keys: child -> parent.
    links: HashMap<u128, u128>,
    /// Handles whose object is gone; they must stay bad for every session.
    dead: Vec<u64>,
    next_id: u32,
}

impl Model {
    fn new(policy: EvictionPolicy) -> Model {
        let mut st = Store::new(SLAB_OFFSET, PAGES * PAGE_LEN);
        st.set_eviction_policy(policy);
        let sessions =
            (0..SESSIONS).map(|_| MSession { id: st.open_session(), res: Vec::new(), pins: Vec::new() }).collect();
        Model { st, sessions, committed: HashMap::new(), links: HashMap::new(), dead: Vec::new(), next_id: 0 }
    }

    /// `key` is no longer committed: its own link goes, and its children's
    /// (they stay, without a parent). Returns how many children it had.
    fn unlink_key(&mut self, key: u128) -> usize {
        self.links.remove(&key);
        let before = self.links.len();
        self.links.retain(|_, p| *p != key);
        before - self.links.len()
    }

    fn send(&mut self, s: usize, req: Request) -> Completion {
        self.next_id = self.next_id.wrapping_add(1);
        let c = self.st.handle(self.sessions[s].id, self.next_id, &req);
        assert_eq!(c.request_id, self.next_id);
        assert_ne!(c.status, Status::Internal, "{req:?}");
        c
    }

    fn live_regions(&self) -> Vec<Region> {
        let mut v: Vec<Region> = self.committed.values().copied().collect();
        for s in &self.sessions {
            v.extend(s.res.iter().map(|r| r.region));
            v.extend(s.pins.iter().map(|p| p.region));
        }
        v
    }

    fn is_pinned(&self, region: &Region) -> bool {
        self.sessions.iter().any(|s| s.pins.iter().any(|p| p.region.data_offset == region.data_offset))
    }

    /// A handle for a Commit/Abort/Release step and whether it must succeed.
    fn pick_handle(&self, s: usize, pick: usize, how: u8, random: u64, pin: bool) -> (u64, bool) {
        let own: Vec<u64> = if pin {
            self.sessions[s].pins.iter().map(|p| p.handle).collect()
        } else {
            self.sessions[s].res.iter().map(|r| r.handle).collect()
        };
        let others: Vec<u64> = self
            .sessions
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != s)
            .flat_map(|(_, m)| {
                if pin {
                    m.pins.iter().map(|p| p.handle).collect::<Vec<_>>()
                } else {
                    m.res.iter().map(|r| r.handle).collect()
                }
            })
            .collect();
        let h = match how {
            0 if !own.is_empty() => own[pick % own.len()],
            1 if !others.is_empty() => others[pick % others.len()],
            2 if !self.dead.is_empty() => self.dead[pick % self.dead.len()],
            _ => random,
        };
        (h, own.contains(&h))
    }

    fn run(&mut self, step: &Step) -> Result<(), TestCaseError> {
        let evictions_before = self.st.stats().evictions;
        match *step {
            Step::Reserve { s, key, len, page_offset } => {
                let key = u128::from(key);
                let (before, probe) = (super::unit_tests::fingerprint(&self.st), self.st.clone());
                let c = self.send(s, reserve_req(key, len, page_offset));
                let need = round_up_to_pages(len + page_offset).unwrap();
                prop_assert_eq!(c.status == Status::TooLarge, len + page_offset > PAGES * PAGE_LEN);
                match c.status {
                    Status::Ok => {
                        let region = Region { data_offset: c.offset, len };
                        prop_assert_eq!(c.offset % PAGE_LEN, page_offset);
                        prop_assert!(c.offset >= SLAB_OFFSET);
                        prop_assert!(c.offset + len <= SLAB_OFFSET + PAGES * PAGE_LEN);
                        // Evictions happened first; drop what they took from the model.
                        self.reconcile(true)?;
                        for live in self.live_regions() {
                            prop_assert!(!region.overlaps(&live), "{:?} overlaps live {:?}", region, live);
                        }
                        prop_assert!(!self.dead.contains(&c.handle));
                        self.sessions[s].res.push(MRes { handle: c.handle, key, region });
                    }
                    Status::TooLarge => prop_assert!(len + page_offset > PAGES * PAGE_LEN),
                    Status::OutOfMemory => {
                        // A refusal changes nothing (`unit.rs`), and comes
                        // only when evicting all it could would not make room.
                        prop_assert_eq!(super::unit_tests::fingerprint(&self.st), before);
                        prop_assert!(self.st.stats().largest_free_bytes < need);
                        prop_assert!(!probe.fits_after_evicting_all(self.sessions[s].id, need));
                    }
                    other => prop_assert!(false, "reserve -> {:?}", other),
                }
            }
            Step::Commit { s, pick, how, random, parent } => {
                let (h, own) = self.pick_handle(s, pick, how, random, false);
                let parent = parent.map(u128::from);
                let c = self.send(s, Request::Commit { handle: h, parent });
                if own {
                    prop_assert_eq!(c.status, Status::Ok);
                    let i = self.sessions[s].res.iter().position(|r| r.handle == h).unwrap();
                    let r = self.sessions[s].res.swap_remove(i);
                    if self.committed.contains_key(&r.key) {
                        self.unlink_key(r.key);
                    }
                    // Linked when the parent is committed and not the key itself.
                    if let Some(p) = parent.filter(|&p| p != r.key && self.committed.contains_key(&p)) {
                        self.links.insert(r.key, p);
                    }
                    self.committed.insert(r.key, r.region);
                    self.dead.push(h);
                } else {
                    prop_assert_eq!(c.status, Status::BadHandle);
                }
            }
            Step::Abort { s, pick, how, random } => {
                let (h, own) = self.pick_handle(s, pick, how, random, false);
                let c = self.send(s, Request::Abort { handle: h });
                if own {
                    prop_assert_eq!(c.status, Status::Ok);
                    self.sessions[s].res.retain(|r| r.handle != h);
                    self.dead.push(h);
                } else {
                    prop_assert_eq!(c.status, Status::BadHandle);
                }
            }
            Step::Get { s, key } => {
                let key = u128::from(key);
                let c = self.send(s, Request::Get { key });
                match self.committed.get(&key).copied() {
                    Some(region) => {
                        prop_assert_eq!(c.status, Status::Ok);
                        prop_assert_eq!(c.offset, region.data_offset);
                        let (dtype, shape, len) = c.tensor.unwrap();
                        prop_assert_eq!((dtype, len), (DType::U8, region.len));
                        prop_assert_eq!(shape.len_bytes(dtype), Some(len));
                        // Same handle as this session's earlier pins of this block, distinct from others'.
                        for (i, m) in self.sessions.iter().enumerate() {
                            for p in &m.pins {
                                let same_block = p.region.data_offset == region.data_offset;
                                prop_assert_eq!(p.handle == c.handle, i == s && same_block);
                            }
                        }
                        prop_assert!(!self.dead.contains(&c.handle));
                        self.sessions[s].pins.push(MPin { handle: c.handle, region });
                    }
                    None => prop_assert_eq!(c.status, Status::NotFound),
                }
            }
            Step::Release { s, pick, how, random } => {
                let (h, own) = self.pick_handle(s, pick, how, random, true);
                let c = self.send(s, Request::Release { handle: h });
                if own {
                    prop_assert_eq!(c.status, Status::Ok);
                    let pins = &mut self.sessions[s].pins;
                    let i = pins.iter().position(|p| p.handle == h).unwrap();
                    pins.swap_remove(i);
                    if !pins.iter().any(|p| p.handle == h) {
                        self.dead.push(h);
                    }
                } else {
                    prop_assert_eq!(c.status, Status::BadHandle);
                }
            }
            Step::Lookup { s, key } => {
                let key = u128::from(key);
                let c = self.send(s, Request::Lookup { key });
                let want = if self.committed.contains_key(&key) { Status::Ok } else { Status::NotFound };
                prop_assert_eq!(c.status, want);
            }
            Step::Delete { s, key } => {
                let key = u128::from(key);
                let c = self.send(s, Request::Delete { key });
                let want = if self.committed.remove(&key).is_some() { Status::Ok } else { Status::NotFound };
                prop_assert_eq!(c.status, want);
                self.unlink_key(key);
            }
            Step::Stats { s } => {
                let c = self.send(s, Request::Stats);
                prop_assert_eq!(c.status, Status::Ok);
                prop_assert_eq!(c.handle, self.committed.len() as u64);
                prop_assert_eq!(c.offset, self.st.stats().bytes_used);
            }
            Step::Close { s } => {
                let m = &mut self.sessions[s];
                self.st.close_session(m.id);
                self.dead.extend(m.res.drain(..).map(|r| r.handle));
                self.dead.extend(m.pins.drain(..).map(|p| p.handle));
                m.id = self.st.open_session();
            }
        }
        if !matches!(step, Step::Reserve { .. }) {
            prop_assert_eq!(self.st.stats().evictions, evictions_before);
        }
        self.reconcile(false)?;
        self.check()
    }

    /// Drops evicted keys from the model (only allowed after a RESERVE) and
    /// checks that every model key is in the store with the same region.
    fn reconcile(&mut self, evictions_allowed: bool) -> Result<(), TestCaseError> {
        let keys: Vec<u128> = self.committed.keys().copied().collect();
        let mut evicted = Vec::new();
        for key in keys {
            let region = self.committed[&key];
            match self.st.peek(key) {
                Some(info) => {
                    prop_assert_eq!(info.data_offset, region.data_offset);
                    prop_assert_eq!(info.len, region.len);
                }
                None => {
                    prop_assert!(evictions_allowed, "key {} vanished", key);
                    prop_assert!(!self.is_pinned(&region), "pinned key {} was evicted", key);
                    self.committed.remove(&key);
                    evicted.push(key);
                }
            }
        }
        // Under the chain policy only leaves go: no key evicted now is the
        // parent of a key still committed.
        let chain = self.st.eviction_policy() == EvictionPolicy::Chain;
        for &key in &evicted {
            if chain {
                let orphan = self.links.iter().find(|&(c, p)| *p == key && self.committed.contains_key(c));
                prop_assert!(orphan.is_none(), "evicted {} before its child {:?}", key, orphan);
            }
        }
        for key in evicted {
            self.unlink_key(key);
        }
        Ok(())
    }

    fn check(&self) -> Result<(), TestCaseError> {
        self.st.check_invariants().map_err(TestCaseError::fail)?;
        for key in 0..u128::from(KEYS) {
            prop_assert_eq!(self.st.peek(key).is_some(), self.committed.contains_key(&key));
        }
        // Distinct live objects never share bytes (pins of one block share its region).
        let mut regions: Vec<(u64, u64)> = self.live_regions().iter().map(|r| (r.data_offset, r.end())).collect();
        regions.sort_unstable();
        regions.dedup();
        for w in regions.windows(2) {
            prop_assert!(w[0].1 <= w[1].0, "live regions {:?} and {:?} overlap", w[0], w[1]);
        }
        let st = self.st.stats();
        prop_assert_eq!(st.blocks, self.committed.len() as u64);
        prop_assert_eq!(st.chained_blocks, self.links.len() as u64);
        for (c, p) in &self.links {
            prop_assert!(self.committed.contains_key(c) && self.committed.contains_key(p));
        }
        prop_assert_eq!(st.reserved, self.sessions.iter().map(|m| m.res.len() as u64).sum::<u64>());
        prop_assert_eq!(st.pins, self.sessions.iter().map(|m| m.pins.len() as u64).sum::<u64>());
        prop_assert_eq!(st.bytes_used + st.bytes_free, st.bytes_total);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random op sequences from several sessions against a model: visible
    /// keys, regions, pins, handle checks, eviction rules, invariants.
    #[test]
    fn random_sessions_match_the_model(
        steps in proptest::collection::vec(step(), 1..200),
        lru in any::<bool>(),
    ) {
        let mut m = Model::new(if lru { EvictionPolicy::Lru } else { EvictionPolicy::Chain });
        for step in &steps {
            m.run(step)?;
        }
        // Tear down: everything returns to one free extent.
        for s in 0..SESSIONS {
            m.st.close_session(m.sessions[s].id);
        }
        let s = m.st.open_session();
        for key in 0..u128::from(KEYS) {
            m.st.handle(s, 0, &Request::Delete { key });
        }
        m.st.check_invariants().map_err(TestCaseError::fail)?;
        let st = m.st.stats();
        prop_assert_eq!(st.bytes_used, 0);
        prop_assert_eq!(st.largest_free_bytes, st.bytes_total);
        prop_assert_eq!(st.internal, 0);
    }

    /// Arbitrary frames and arbitrary hand-built requests never panic, never
    /// report INTERNAL, and keep every invariant.
    #[test]
    fn arbitrary_requests_never_break_the_store(
        frames in proptest::collection::vec((any::<[u8; 64]>(), 1u8..=9, 0usize..2, any::<bool>()), 1..100),
        lru in any::<bool>(),
    ) {
        let mut st = Store::new(SLAB_OFFSET, 16 * PAGE_LEN);
        st.set_eviction_policy(if lru { EvictionPolicy::Lru } else { EvictionPolicy::Chain });
        let sessions = [st.open_session(), st.open_session()];
        let mut handles: Vec<u64> = Vec::new();
        for (bytes, op, s, small) in frames {
            let mut d = TensorBlockDescriptor::from_bytes(&bytes);
            d.op = op;
            d.status = 0;
            if small {
                // Mostly well-formed: small keys and shapes, recent handles.
                d.key_hi = 0;
                d.key_lo %= 4;
                d.dtype = d.dtype % 12 + 1;
                d.ndim %= 3;
                for (i, dim) in d.shape.iter_mut().enumerate() {
                    *dim = if i < usize::from(d.ndim) { *dim % 5000 } else { 0 };
                }
                d.offset = if d.op == Op::Commit as u8 { d.offset % 2 } else { (d.offset % 64) * 64 };
                if let Some(&h) = handles.get(d.handle as usize % handles.len().max(1)) {
                    d.handle = h;
                }
            }
            let req = match Request::decode(&d) {
                Ok(req) => req,
                Err(_) => continue,
            };
            let c = st.handle(sessions[s], d.request_id, &req);
            prop_assert_ne!(c.status, Status::Internal);
            if c.status == Status::Ok && c.handle != 0 && c.op != Op::Stats {
                handles.push(c.handle);
            }
            st.check_invariants().map_err(TestCaseError::fail)?;
        }
        // Hand-built requests that bypass the decoder's checks.
        for (len, page_offset) in [(u64::MAX, 0), (0, u64::MAX), (u64::MAX, 4032), (1, 4095)] {
            let shape = Shape::new(&[7]).unwrap();
            let req = Request::Reserve { key: 1, dtype: DType::U8, shape, len, page_offset };
            let c = st.handle(sessions[0], 0, &req);
            prop_assert!(matches!(c.status, Status::Invalid | Status::TooLarge));
        }
        st.close_session(sessions[0]);
        st.close_session(sessions[1]);
        st.check_invariants().map_err(TestCaseError::fail)?;
    }
}
