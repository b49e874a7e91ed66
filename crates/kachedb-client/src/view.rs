//! What the client hands out over shared memory: [`BlockView`], a pinned
//! read-only view of a committed block, and [`Reservation`], a block being
//! written. Both keep the region mapped and the connection open while they live.

use crate::channel::Channel;
use crate::error::{ok_or, status_error, ClientError, Result};
use crate::Key;
use kachedb_shm::{BlockMeta, Completion, DType, Op, Request, Shape, Status};
use std::ptr::NonNull;
use std::sync::Arc;

/// A pinned, immutable view of a committed block. Dropping it releases the pin.
pub struct BlockView {
    channel: Arc<Channel>,
    handle: u64,
    ptr: NonNull<u8>,
    len: u64,
    dtype: DType,
    shape: Shape,
}

// SAFETY: the view points into a mapping kept alive by `channel.region`; the
// block is committed (immutable) and pinned, so no one writes it while it lives.
unsafe impl Send for BlockView {}
// SAFETY: as above; shared access is read-only.
unsafe impl Sync for BlockView {}

impl std::fmt::Debug for BlockView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockView")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape.dims())
            .field("len", &self.len)
            .finish()
    }
}

impl BlockView {
    /// The view a GET completion gives: `None` for NOT_FOUND.
    pub(crate) fn from_get(channel: &Arc<Channel>, c: Completion) -> Result<Option<BlockView>> {
        if c.status == Status::NotFound {
            return Ok(None);
        }
        let c = ok_or(c, 0)?;
        let Some((dtype, shape, len)) = c.tensor else {
            return Err(ClientError::Protocol("GET completion without dtype and shape".into()));
        };
        let Some(ptr) = channel.region.slab_ptr(c.offset, len) else {
            // Give the pin back before failing.
            channel.release(c.handle);
            return Err(ClientError::Protocol(format!("daemon returned offset {} outside the megaslab", c.offset)));
        };
        Ok(Some(BlockView { channel: channel.clone(), handle: c.handle, ptr, len, dtype, shape }))
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    /// Bytes.
    pub fn len(&self) -> usize {
        self.len as usize
    }
    /// Whether the block has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Address of the first byte in this process.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    /// The pin handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }
    /// Bytes from the region base.
    pub fn offset(&self) -> u64 {
        self.ptr.as_ptr() as u64 - self.channel.region.base() as u64
    }
}

impl std::ops::Deref for BlockView {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: [ptr, ptr+len) is inside the mapping (checked by slab_ptr when
        // the view was made), kept mapped by `channel`, and immutable while pinned.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len as usize) }
    }
}

impl BlockView {
    /// Releases the pins of `views` together: one post (one publish, one
    /// doorbell) per run of views of the same client, where dropping them one
    /// by one posts once per view.
    pub fn release_all(mut views: Vec<BlockView>) {
        let mut handles = Vec::with_capacity(views.len());
        let mut start = 0;
        while start < views.len() {
            let channel = Arc::clone(&views[start].channel);
            let end = views[start..]
                .iter()
                .position(|v| !Arc::ptr_eq(&v.channel, &channel))
                .map_or(views.len(), |n| start + n);
            handles.clear();
            for v in &mut views[start..end] {
                // RELEASED_HANDLE: the view's own drop below sends nothing.
                handles.push(std::mem::replace(&mut v.handle, RELEASED_HANDLE));
            }
            channel.release_many(&handles);
            start = end;
        }
    }
}

/// The handle of a view whose pin [`BlockView::release_all`] released: the
/// daemon never issues handle 0 (its kind bits 0 name no handle kind).
const RELEASED_HANDLE: u64 = 0;

impl Drop for BlockView {
    fn drop(&mut self) {
        if self.handle != RELEASED_HANDLE {
            self.channel.release(self.handle);
        }
    }
}

/// A reserved, not yet visible block. Write it, then [`commit`](Self::commit);
/// dropped without commit, it is aborted.
pub struct Reservation {
    channel: Arc<Channel>,
    handle: u64,
    ptr: NonNull<u8>,
    len: u64,
    dtype: DType,
    shape: Shape,
    /// What the COMMIT names besides the handle: a parent, the key to
    /// commit under, or both.
    names: CommitNames,
    done: bool,
}

/// What a reservation's COMMIT names (docs/PROTOCOL.md, "COMMIT and the
/// parent", "COMMIT and the key"): the key to commit under in place of the
/// reserved one, the block this one follows in a prefix chain, both or
/// neither. Keys as two `u64` words (8-byte aligned, not a `u128`'s 16): a
/// [`Reservation`] stays small enough to move by value in a batch's results.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum CommitNames {
    /// Committed under the reserved key, without a parent.
    #[default]
    Nothing,
    Parent([u64; 2]),
    Key([u64; 2]),
    /// The key, then the parent.
    KeyAndParent([u64; 2], [u64; 2]),
}

impl CommitNames {
    fn words(k: Key) -> [u64; 2] {
        [k.0 as u64, (k.0 >> 64) as u64]
    }

    fn key_of(w: [u64; 2]) -> Key {
        Key(u128::from(w[0]) | u128::from(w[1]) << 64)
    }

    fn new(key: Option<Key>, parent: Option<Key>) -> CommitNames {
        match (key.map(Self::words), parent.map(Self::words)) {
            (None, None) => CommitNames::Nothing,
            (None, Some(p)) => CommitNames::Parent(p),
            (Some(k), None) => CommitNames::Key(k),
            (Some(k), Some(p)) => CommitNames::KeyAndParent(k, p),
        }
    }

    fn key(self) -> Option<Key> {
        match self {
            CommitNames::Key(k) | CommitNames::KeyAndParent(k, _) => Some(Self::key_of(k)),
            _ => None,
        }
    }

    fn parent(self) -> Option<Key> {
        match self {
            CommitNames::Parent(p) | CommitNames::KeyAndParent(_, p) => Some(Self::key_of(p)),
            _ => None,
        }
    }
}

// SAFETY: the reserved extent belongs to this reservation alone until commit or
// abort, inside a mapping kept alive by `channel`.
unsafe impl Send for Reservation {}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation").field("dtype", &self.dtype).field("shape", &self.shape.dims()).finish()
    }
}

impl Reservation {
    /// The reservation a RESERVE completion `c` of `len` bytes gives.
    pub(crate) fn from_reserve(
        channel: &Arc<Channel>,
        c: Completion,
        dtype: DType,
        shape: Shape,
        len: u64,
    ) -> Result<Reservation> {
        let c = ok_or(c, len)?;
        let ptr = channel.region.slab_ptr(c.offset, len).ok_or_else(|| {
            ClientError::Protocol(format!("daemon returned offset {} outside the megaslab", c.offset))
        })?;
        Ok(Reservation {
            channel: channel.clone(),
            handle: c.handle,
            ptr,
            len,
            dtype,
            shape,
            names: CommitNames::default(),
            done: false,
        })
    }

    /// The writable bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the extent is reserved for this client alone (no reader can see
        // it before commit) and mapped while `channel` lives; `&mut self` makes the
        // slice unique in this process.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len as usize) }
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    /// Address of the first byte.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    /// Bytes.
    pub fn len(&self) -> usize {
        self.len as usize
    }
    /// Whether the block has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The reservation handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }
    /// Names the block this one follows in a prefix chain (the block of key
    /// `parent`, which must be committed before this one is; `None`: no
    /// parent). The daemon's chain-aware eviction keeps a block's ancestors
    /// cached while it is (`docs/eviction.md`). Kept with a key named with
    /// [`commit_as`](Self::commit_as).
    pub fn set_parent(&mut self, parent: Option<Key>) {
        self.names = CommitNames::new(self.names.key(), parent);
    }
    /// The parent named with [`set_parent`](Self::set_parent).
    pub fn parent(&self) -> Option<Key> {
        self.names.parent()
    }
    /// Commits the block under `key` rather than the key it was reserved
    /// with (COMMIT with `COMMIT_NAMES_KEY`): for a writer that places its
    /// bytes before it knows their key (reserve with any key, e.g. 0), with
    /// the parent named by [`set_parent`](Self::set_parent) if any (carried
    /// in the frame's shape words: a daemon that predates that commits it
    /// without one). [`commit`](Self::commit) and the batch commits then send
    /// it; `None` goes back to the reserved key.
    pub fn commit_as(&mut self, key: Option<Key>) {
        self.names = CommitNames::new(key, self.names.parent());
    }
    /// The COMMIT (`pin`: COMMIT_PIN) of this reservation, marking it finished.
    fn commit_request(&mut self, pin: bool) -> Request {
        let handle = self.take_handle();
        let parent = self.names.parent().map(|k| k.0);
        match self.names.key() {
            Some(key) => Request::CommitAs { handle, key: key.0, parent, pin },
            None if pin => Request::CommitPin { handle, parent },
            None => Request::Commit { handle, parent },
        }
    }
    /// Makes the block visible under its key (linked to its parent, if any).
    /// If the daemon refuses it (`Denied`: the key's block belongs to a
    /// tenant bound to other users or groups), the reservation is still
    /// open there; it is aborted before the error returns.
    pub fn commit(mut self) -> Result<()> {
        let req = self.commit_request(false);
        let r = self.finish(req);
        if matches!(r, Err(ClientError::Denied)) {
            // Dropped unfinished: its ABORT goes.
            drop(self.unfinished());
        }
        r
    }
    /// Makes the block visible under its key and returns a pinned view of
    /// it, in one request (COMMIT_PIN): the extent stays out of eviction and
    /// reuse until the view is dropped. For a writer that keeps a pointer to
    /// the reserved bytes (a tensor made from [`as_mut_ptr`](Self::as_mut_ptr))
    /// past the commit; such a pointer must not be written through after the
    /// commit (readers see the block as immutable), only kept valid.
    /// If the daemon refuses it (OUT_OF_MEMORY: no pin slot), the
    /// reservation is still open there; it is aborted before the error
    /// returns.
    pub fn commit_pinned(mut self) -> Result<BlockView> {
        let req = self.commit_request(true);
        let c = self.channel.finish(req)?;
        match BlockView::from_get(&self.channel, c) {
            Ok(Some(view)) => Ok(view),
            // Dropped unfinished: its ABORT goes (a finished handle's is refused, harmlessly).
            Ok(None) => {
                drop(self.unfinished());
                Err(ClientError::Protocol("COMMIT_PIN answered NOT_FOUND".into()))
            }
            Err(e) => {
                drop(self.unfinished());
                Err(e)
            }
        }
    }
    /// Drops the block.
    pub fn abort(mut self) -> Result<()> {
        self.done = true;
        self.finish(Request::Abort { handle: self.handle })
    }
    /// Attaches block metadata (`metas[i]` to `reservations[i]`; `None`:
    /// none) for the KV events (docs/events.md): each record is checked here
    /// ([`BlockMeta::check`]), all are written into one scratch reservation
    /// of this client, and one batch of META frames names them; the scratch
    /// is aborted after. Kept by the daemon with the block once committed; a
    /// second attach replaces the first. `Invalid` (nothing attached) for a
    /// record out of bounds, a count that differs from the reservations', or
    /// reservations of different clients; a refusal by the daemon after some
    /// records were attached leaves those attached (the caller aborts the
    /// reservations to undo).
    pub fn attach_meta_all(reservations: &[Reservation], metas: &[Option<BlockMeta>]) -> Result<()> {
        if metas.len() != reservations.len() {
            return Err(ClientError::Invalid(format!(
                "{} block metadata records for {} reservations: give one (or None) per reservation",
                metas.len(),
                reservations.len()
            )));
        }
        let Some(channel) = reservations.first().map(|r| r.channel.clone()) else { return Ok(()) };
        if reservations.iter().any(|r| !Arc::ptr_eq(&r.channel, &channel)) {
            return Err(ClientError::Invalid("a batch of reservations must all come from one client".into()));
        }
        let mut bytes = Vec::new();
        let mut spans = Vec::new();
        for (r, m) in reservations.iter().zip(metas) {
            let Some(m) = m else { continue };
            if r.done {
                return Err(ClientError::Invalid("block metadata for a reservation already finished".into()));
            }
            let at = bytes.len();
            m.encode(&mut bytes).map_err(|e| ClientError::Invalid(format!("block metadata: {e}")))?;
            spans.push((r.handle, at as u64, (bytes.len() - at) as u64));
        }
        if spans.is_empty() {
            return Ok(());
        }
        let len = bytes.len() as u64;
        let shape = Shape::for_bytes(len).ok_or_else(|| ClientError::Invalid(format!("{len} bytes of metadata")))?;
        let reserve = Request::reserve(0, DType::U8, shape, 0).map_err(|e| ClientError::Invalid(e.to_string()))?;
        let c = channel.call1(reserve)?;
        let mut scratch = Reservation::from_reserve(&channel, c, DType::U8, shape, len)?;
        scratch.as_mut_slice().copy_from_slice(&bytes);
        let reqs: Vec<Request> = spans
            .iter()
            .map(|&(handle, offset, len)| Request::Meta { handle, scratch: scratch.handle, offset, len })
            .collect();
        let done = channel.call(&reqs);
        let aborted = scratch.abort();
        for c in done? {
            if c.status != Status::Ok {
                return Err(match c.status {
                    Status::Invalid => ClientError::Invalid(
                        "the daemon refused a block metadata record (docs/PROTOCOL.md, \"META and block metadata\")"
                            .into(),
                    ),
                    s => status_error(s, 0),
                });
            }
        }
        aborted
    }

    /// Commits many reservations of one client with one batch of COMMITs (a
    /// closed client still finishes them), in order, each with its parent (so
    /// a chain reserved in order links block by block). Every COMMIT is sent; the first
    /// error is returned; the reservations whose COMMIT the daemon refused
    /// (`Denied`) are aborted first. Reservations of different clients are refused
    /// (`Invalid`, and dropped: aborted one by one).
    pub fn commit_all(mut reservations: Vec<Reservation>) -> Result<()> {
        let Some(channel) = reservations.first().map(|r| r.channel.clone()) else { return Ok(()) };
        if reservations.iter().any(|r| !Arc::ptr_eq(&r.channel, &channel)) {
            return Err(ClientError::Invalid("a batch of reservations must all come from one client".into()));
        }
        let reqs: Vec<Request> = reservations.iter_mut().map(|r| r.commit_request(false)).collect();
        let done = channel.finish_many(&reqs)?;
        let mut first_err = None;
        let mut refused = Vec::new();
        for (r, c) in reservations.into_iter().zip(&done) {
            if let Err(e) = ok_or(*c, 0) {
                if matches!(e, ClientError::Denied) {
                    refused.push(r);
                }
                first_err.get_or_insert(e);
            }
        }
        if !refused.is_empty() {
            // Still open at the daemon: one batch of ABORTs.
            let _ = Self::abort_all(refused);
        }
        first_err.map_or(Ok(()), Err)
    }

    /// [`commit_pinned`](Self::commit_pinned) of many reservations of one
    /// client with one batch of COMMIT_PINs: a view of each block, in order.
    /// Every COMMIT_PIN is sent; on an error the pins that were taken are
    /// released, the reservations the daemon refused are aborted, and the
    /// first error is returned.
    pub fn commit_all_pinned(reservations: Vec<Reservation>) -> Result<Vec<BlockView>> {
        let (done, first_err) = Self::commit_each_pinned(reservations);
        if let Some(e) = first_err {
            // `done` drops: the views' RELEASEs and the refused ones' ABORTs.
            return Err(e);
        }
        done.into_iter()
            .map(|d| d.map_err(|_| ClientError::Protocol("a COMMIT_PIN failed without an error".into())))
            .collect()
    }

    /// [`commit_pinned`](Self::commit_pinned) of many reservations of one
    /// client with one batch of COMMIT_PINs, each answered on its own: in
    /// order, a view of each block committed, and each reservation whose
    /// COMMIT_PIN failed given back unfinished (still reserved when the daemon
    /// refused it, OUT_OF_MEMORY: nothing reuses its extent until it is
    /// dropped, which aborts it); with the first error. Reservations of
    /// different clients are all given back, with `Invalid`.
    pub fn commit_each_pinned(
        mut reservations: Vec<Reservation>,
    ) -> (Vec<std::result::Result<BlockView, Reservation>>, Option<ClientError>) {
        let Some(channel) = reservations.first().map(|r| r.channel.clone()) else { return (Vec::new(), None) };
        if reservations.iter().any(|r| !Arc::ptr_eq(&r.channel, &channel)) {
            let e = ClientError::Invalid("a batch of reservations must all come from one client".into());
            return (reservations.into_iter().map(Err).collect(), Some(e));
        }
        let reqs: Vec<Request> = reservations.iter_mut().map(|r| r.commit_request(true)).collect();
        let done = match channel.finish_many(&reqs) {
            Ok(done) if done.len() == reservations.len() => done,
            Ok(_) => {
                let e = ClientError::Protocol("a COMMIT_PIN batch answered with another count".into());
                return (reservations.into_iter().map(|r| Err(r.unfinished())).collect(), Some(e));
            }
            Err(e) => return (reservations.into_iter().map(|r| Err(r.unfinished())).collect(), Some(e)),
        };
        let mut first_err = None;
        let out = reservations
            .into_iter()
            .zip(done)
            .map(|(r, c)| match BlockView::from_get(&channel, c) {
                Ok(Some(v)) => Ok(v),
                Ok(None) => {
                    first_err.get_or_insert(ClientError::Protocol("COMMIT_PIN answered NOT_FOUND".into()));
                    Err(r.unfinished())
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                    Err(r.unfinished())
                }
            })
            .collect();
        (out, first_err)
    }

    /// This reservation marked unfinished again (its COMMIT failed): dropped,
    /// it sends its ABORT.
    fn unfinished(mut self) -> Reservation {
        self.done = false;
        self
    }

    /// Aborts many reservations of one client with one batch of ABORTs.
    pub fn abort_all(reservations: Vec<Reservation>) -> Result<()> {
        finish_all(reservations, |r| Request::Abort { handle: r.take_handle() }).map(|_| ())
    }

    /// Marks the reservation finished by the caller (a batch COMMIT or ABORT of
    /// several reservations) and returns its handle; dropping it then sends nothing.
    pub(crate) fn take_handle(&mut self) -> u64 {
        self.done = true;
        self.handle
    }
    fn finish(&self, req: Request) -> Result<()> {
        ok_or(self.channel.finish(req)?, self.len).map(|_| ())
    }
}

/// Sends `req` of every reservation (which takes its handle) in one batch and returns the
/// completions; COMMIT and ABORT answers that are not OK become the error
/// (COMMIT_PIN answers are the caller's to read).
fn finish_all(
    mut reservations: Vec<Reservation>,
    req: impl Fn(&mut Reservation) -> Request,
) -> Result<Vec<Completion>> {
    let Some(channel) = reservations.first().map(|r| r.channel.clone()) else { return Ok(Vec::new()) };
    if reservations.iter().any(|r| !Arc::ptr_eq(&r.channel, &channel)) {
        return Err(ClientError::Invalid("a batch of reservations must all come from one client".into()));
    }
    let reqs: Vec<Request> = reservations.iter_mut().map(req).collect();
    let done = channel.finish_many(&reqs)?;
    for c in &done {
        if c.op != Op::CommitPin {
            ok_or(*c, 0)?;
        }
    }
    Ok(done)
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.finish(Request::Abort { handle: self.handle });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_names_keep_the_key_and_the_parent_apart() {
        let (k, p) = (Key(u128::MAX - 7), Key(1 << 100 | 3));
        for (key, parent) in [(None, None), (Some(k), None), (None, Some(p)), (Some(k), Some(p))] {
            let n = CommitNames::new(key, parent);
            assert_eq!((n.key(), n.parent()), (key, parent));
        }
        assert!(std::mem::size_of::<CommitNames>() <= 40);
    }
}
