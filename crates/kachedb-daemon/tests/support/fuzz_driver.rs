//! Drivers shared by the proptest (`tests/frame_fuzz.rs`, runs in CI) and the
//! cargo-fuzz targets (`fuzz/fuzz_targets/{decode,frame_handler}.rs`): both
//! feed them arbitrary bytes; `Err` is a bug.
//!
//! * [`check_decode`]: a 64-byte frame through `Request::decode` and
//!   `Completion::decode`: never a panic, and what decodes is consistent.
//! * [`run_frames`]: a byte string read as a program of session opens and
//!   closes and frames from several sessions, fed to `Store::handle` as the
//!   serve loop does (frames that fail decoding are dropped: the serve loop
//!   answers those itself). After every frame: no `INTERNAL`, every invariant
//!   of the store, and a model of what each session holds: reservations and
//!   pinned blocks never overlap, handles only work for their own session,
//!   a session's GETs of one block share one handle, closing a session drops
//!   everything it held.

use kachedb_daemon::store::{SessionId, Store};
use kachedb_shm::{Completion, Op, Request, Status, TensorBlockDescriptor, MAX_DIMS};
use std::collections::HashMap;

/// Where the megaslab starts (as in a real region: 2 MiB aligned).
pub const SLAB_OFFSET: u64 = 2 << 20;
const PAGE: u64 = 4096;

/// Checks one arbitrary frame through both decoders.
pub fn check_decode(bytes: &[u8]) -> Result<(), String> {
    let mut b = [0u8; 64];
    let n = bytes.len().min(64);
    b[..n].copy_from_slice(&bytes[..n]);
    let d = TensorBlockDescriptor::from_bytes(&b);
    if let Ok(req) = Request::decode(&d) {
        if d.status != 0 || Op::from_code(d.op).is_none() {
            return Err(format!("decoded a request with status {} op {}", d.status, d.op));
        }
        match req {
            Request::Reserve { key, dtype, shape, len, page_offset } => {
                if key != d.key()
                    || dtype as u8 != d.dtype
                    || shape.ndim() != usize::from(d.ndim)
                    || shape.ndim() > MAX_DIMS
                {
                    return Err(format!("reserve fields differ from the frame: {req:?} {d:?}"));
                }
                if shape.len_bytes(dtype) != Some(len) {
                    return Err(format!("reserve len {len} is not its shape's: {req:?}"));
                }
                if page_offset >= PAGE || page_offset % 64 != 0 || page_offset != d.offset {
                    return Err(format!("reserve page offset {page_offset} accepted: {d:?}"));
                }
                if d.shape[shape.ndim()..].iter().any(|&x| x != 0) {
                    return Err(format!("non-zero unused dims accepted: {d:?}"));
                }
            }
            Request::Commit { handle, .. }
            | Request::CommitPin { handle, .. }
            | Request::CommitAs { handle, .. }
            | Request::Abort { handle }
            | Request::Release { handle }
                if handle != d.handle =>
            {
                return Err(format!("handle {handle} is not the frame's {}", d.handle));
            }
            Request::Get { key } | Request::Lookup { key } | Request::Delete { key } if key != d.key() => {
                return Err(format!("key differs from the frame's: {req:?}"));
            }
            _ => {}
        }
    }
    if let Ok(c) = Completion::decode(&d) {
        if let Some((dtype, shape, len)) = c.tensor {
            if !c.op.pins() || c.status != Status::Ok || shape.len_bytes(dtype) != Some(len) {
                return Err(format!("inconsistent completion tensor: {c:?}"));
            }
        }
        match Completion::decode(&c.encode()) {
            Ok(again) if again == c => {}
            other => return Err(format!("completion does not round-trip: {c:?} -> {other:?}")),
        }
    }
    Ok(())
}

/// What one run did (for the proptest's coverage figures).
#[derive(Clone, Copy, Debug, Default)]
pub struct Figures {
    /// Frames read.
    pub frames: u64,
    /// Frames that decoded and were handled.
    pub handled: u64,
    /// Of those, answered OK.
    pub ok: u64,
    /// Sessions closed with something held.
    pub closes: u64,
}

struct Bytes<'a>(std::slice::Iter<'a, u8>);

impl Bytes<'_> {
    fn u8(&mut self) -> Option<u8> {
        self.0.next().copied()
    }
    fn frame(&mut self) -> Option<[u8; 64]> {
        let mut b = [0u8; 64];
        let mut any = false;
        for x in b.iter_mut() {
            match self.0.next() {
                Some(&v) => {
                    *x = v;
                    any = true;
                }
                None => break,
            }
        }
        any.then_some(b)
    }
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1 && a.0 < a.1 && b.0 < b.1
}

/// Live reservations: handle -> (session, range).
type Reservations = HashMap<u64, (usize, (u64, u64))>;
/// Pins: (session, handle) -> (range, count).
type Pins = HashMap<(usize, u64), ((u64, u64), u64)>;

/// Checks the pin an OK GET or COMMIT_PIN completion `c` of session `i`
/// gave against the model, and records it.
fn record_pin(
    pins: &mut Pins,
    reservations: &Reservations,
    issued: &mut Vec<u64>,
    i: usize,
    c: &Completion,
    slab: (u64, u64),
) -> Result<(), String> {
    let Some((dtype, shape, len)) = c.tensor else { return Err(format!("pin OK without a tensor: {c:?}")) };
    let r = (c.offset, c.offset + len);
    if shape.len_bytes(dtype) != Some(len) || c.offset < slab.0 || r.1 > slab.1 {
        return Err(format!("pin answered {c:?} outside the slab {slab:?}"));
    }
    if let Some((h, (_, other))) = reservations.iter().find(|(_, (_, o))| overlaps(r, *o)) {
        return Err(format!("pinned block {r:?} overlaps reservation {h:#x} at {other:?}"));
    }
    let e = pins.entry((i, c.handle)).or_insert((r, 0));
    if e.0 != r {
        return Err(format!("pin handle {:#x} names two blocks: {:?} and {r:?}", c.handle, e.0));
    }
    e.1 += 1;
    if pins.iter().any(|((owner, h), (o, _))| *owner == i && *h != c.handle && *o == r) {
        return Err(format!("session {i} holds two pin handles on one block {r:?}"));
    }
    issued.push(c.handle);
    Ok(())
}

/// Runs the program in `data` (see the module docs).
pub fn run_frames(data: &[u8]) -> Result<Figures, String> {
    const SESSIONS: usize = 4;
    let mut bytes = Bytes(data.iter());
    let pages = 1 + u64::from(bytes.u8().unwrap_or(15)) % 64;
    let slab = (SLAB_OFFSET, SLAB_OFFSET + pages * PAGE);
    let mut st = Store::new(SLAB_OFFSET, pages * PAGE);
    let mut sessions: Vec<Option<SessionId>> = (0..SESSIONS).map(|i| (i < 3).then(|| st.open_session())).collect();
    let mut issued: Vec<u64> = Vec::new();
    // Live reservations: handle -> (session, range); pins: (session, handle) -> (range, count).
    let mut reservations: Reservations = HashMap::new();
    let mut pins: Pins = HashMap::new();
    let mut fig = Figures::default();
    while let Some(tag) = bytes.u8() {
        if tag % 32 == 0 {
            // Open or close a session.
            let i = usize::from(bytes.u8().unwrap_or(0)) % SESSIONS;
            match sessions[i].take() {
                Some(s) => {
                    st.close_session(s);
                    reservations.retain(|_, (owner, _)| *owner != i);
                    pins.retain(|(owner, _), _| *owner != i);
                    fig.closes += 1;
                }
                None => sessions[i] = Some(st.open_session()),
            }
            st.check_invariants().map_err(|e| format!("after a session open/close: {e}"))?;
            continue;
        }
        let i = usize::from(bytes.u8().unwrap_or(0)) % SESSIONS;
        let Some(raw) = bytes.frame() else { break };
        fig.frames += 1;
        let mut d = TensorBlockDescriptor::from_bytes(&raw);
        if (tag >> 5) & 3 != 0 {
            // Steer (3 in 4) towards well-formed requests on few keys, small shapes.
            d.status = 0;
            // Ops 1..=9 and COMMIT_PIN (WAIT parks in the serve loop, not here).
            d.op = 1 + d.op % 10;
            if d.op == 10 {
                d.op = Op::CommitPin as u8;
            }
            d.key_hi = 0;
            d.key_lo %= 8;
            d.dtype = 1 + d.dtype % 12;
            d.ndim %= 3;
            let ndim = usize::from(d.ndim);
            for (k, dim) in d.shape.iter_mut().enumerate() {
                *dim = if k >= ndim {
                    0
                } else if ndim == 1 {
                    *dim % 40_000
                } else {
                    *dim % 128
                };
            }
            d.offset = (d.offset % 64) * 64;
        }
        if tag & 2 != 0 && !issued.is_empty() {
            d.handle = issued[d.handle as usize % issued.len()];
        }
        let Ok(req) = Request::decode(&d) else { continue };
        let Some(s) = sessions[i] else { continue };
        let c = st.handle(s, d.request_id, &req);
        fig.handled += 1;
        if c.request_id != d.request_id || Some(c.op) != Op::from_code(d.op) {
            return Err(format!("completion {c:?} does not answer {d:?}"));
        }
        if c.status == Status::Internal {
            return Err(format!("INTERNAL for {req:?} of session {i}"));
        }
        if Completion::decode(&c.encode()) != Ok(c) {
            return Err(format!("completion does not round-trip: {c:?}"));
        }
        let ok = c.status == Status::Ok;
        fig.ok += u64::from(ok);
        match req {
            Request::Reserve { len, page_offset, .. } if ok => {
                let r = (c.offset, c.offset + len);
                if c.offset < slab.0 || r.1 > slab.1 || c.offset % PAGE != page_offset {
                    return Err(format!("reservation {r:?} (page offset {page_offset}) outside the slab {slab:?}"));
                }
                if let Some((h, (_, other))) = reservations.iter().find(|(_, (_, o))| overlaps(r, *o)) {
                    return Err(format!("reservation {r:?} overlaps reservation {h:#x} at {other:?}"));
                }
                if let Some(((_, h), (other, _))) = pins.iter().find(|(_, (o, _))| overlaps(r, *o)) {
                    return Err(format!("reservation {r:?} overlaps pinned block {h:#x} at {other:?}"));
                }
                if reservations.insert(c.handle, (i, r)).is_some() {
                    return Err(format!("handle {:#x} issued twice", c.handle));
                }
                issued.push(c.handle);
            }
            Request::Commit { handle, .. }
            | Request::Abort { handle }
            | Request::CommitPin { handle, .. }
            | Request::CommitAs { handle, .. } => {
                let own = reservations.get(&handle).is_some_and(|(owner, _)| *owner == i);
                match (own, c.status) {
                    (true, Status::Ok) => {
                        let (_, reserved) = reservations.remove(&handle).unwrap_or((i, (0, 0)));
                        if matches!(req, Request::CommitPin { .. } | Request::CommitAs { pin: true, .. }) {
                            let Some((_, _, len)) = c.tensor else {
                                return Err(format!("COMMIT_PIN OK without a tensor: {c:?}"));
                            };
                            if (c.offset, c.offset + len) != reserved {
                                return Err(format!("COMMIT_PIN pinned {c:?}, not the reservation at {reserved:?}"));
                            }
                            record_pin(&mut pins, &reservations, &mut issued, i, &c, slab)?;
                        }
                    }
                    (false, Status::BadHandle) => {}
                    (true, st) => return Err(format!("{req:?} of session {i}'s own reservation: {st:?}")),
                    (false, st) => return Err(format!("{req:?} of a handle session {i} does not own: {st:?}")),
                }
            }
            Request::Get { .. } | Request::Wait { .. } if ok => {
                record_pin(&mut pins, &reservations, &mut issued, i, &c, slab)?
            }
            Request::Release { handle } => match (pins.get_mut(&(i, handle)), c.status) {
                (Some(p), Status::Ok) => {
                    p.1 -= 1;
                    if p.1 == 0 {
                        pins.remove(&(i, handle));
                    }
                }
                (None, Status::BadHandle) => {}
                (p, st) => {
                    return Err(format!("RELEASE of {handle:#x} by session {i} (pinned here: {}): {st:?}", p.is_some()))
                }
            },
            _ => {}
        }
        st.check_invariants().map_err(|e| format!("after {req:?} of session {i}: {e}"))?;
        let stats = st.stats();
        let model_pins: u64 = pins.values().map(|p| p.1).sum();
        if stats.pins != model_pins || stats.reserved != reservations.len() as u64 {
            return Err(format!(
                "store has {} pins, {} reservations; the model {model_pins}, {}",
                stats.pins,
                stats.reserved,
                reservations.len()
            ));
        }
    }
    for s in sessions.into_iter().flatten() {
        st.close_session(s);
    }
    st.check_invariants().map_err(|e| format!("after closing every session: {e}"))?;
    let stats = st.stats();
    if stats.pins != 0 || stats.reserved != 0 || stats.unlinked_blocks != 0 || stats.internal != 0 {
        return Err(format!("left behind after every session closed: {stats:?}"));
    }
    Ok(fig)
}
