//! `ExtentAllocator`: best-fit page allocator for the megaslab.
//!
//! It manages the byte range `[base_offset, base_offset + total_len)` of the
//! region in [`PAGE_LEN`]-byte pages and hands out contiguous [`Extent`]s
//! (torch views need contiguity). Pure bookkeeping: it never touches memory.
//!
//! Three ordered indexes, each `O(log n)` per operation:
//! * free extents by offset (`offset -> len`), for coalescing with neighbours;
//! * free extents by `(len, offset)`, for best fit: the smallest free extent that
//!   fits, the lowest offset among equals;
//! * allocated extents by offset (`offset -> len`), so that `free` can tell an
//!   extent it handed out from a double free or a made-up extent, and refuse the
//!   latter without corrupting the free lists.
//!
//! Together the free and allocated extents tile the managed range exactly;
//! [`ExtentAllocator::check_invariants`] verifies that.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;

/// Allocation granule in bytes: the region's page frame.
pub use kachedb_shm::region::PAGE_LEN;
const _: () = assert!(PAGE_LEN.is_power_of_two());

/// A contiguous run of whole pages of the region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(test, derive(serde::Serialize))]
pub struct Extent {
    /// Start, bytes from the region base; a multiple of [`PAGE_LEN`].
    pub offset: u64,
    /// Bytes; a non-zero multiple of [`PAGE_LEN`].
    pub len: u64,
}

impl Extent {
    /// One past the last byte, bytes from the region base.
    pub fn end_offset(&self) -> u64 {
        self.offset.saturating_add(self.len)
    }
}

/// Why [`ExtentAllocator::try_free`] refused an extent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FreeError {
    /// The extent is not one that `alloc` handed out and that is still live:
    /// a double free, a stale copy, or a made-up extent.
    #[error("extent at offset {offset} len {len} is not a live allocation (double free?)")]
    NotAllocated {
        /// Start of the refused extent, bytes from the region base.
        offset: u64,
        /// Length of the refused extent, bytes.
        len: u64,
    },
}

/// Best-fit allocator of page extents with coalescing on free.
#[derive(Clone, Debug)]
#[cfg_attr(test, derive(serde::Serialize))]
pub struct ExtentAllocator {
    /// Start of the managed range, bytes from the region base; page aligned.
    base_offset: u64,
    /// Managed bytes; a multiple of [`PAGE_LEN`].
    total_len: u64,
    /// Free extents: offset -> len. Never two adjacent entries (coalesced).
    free_by_offset: BTreeMap<u64, u64>,
    /// The same free extents as `(len, offset)`, for best fit.
    free_by_len: BTreeSet<(u64, u64)>,
    /// Live allocations: offset -> len.
    allocated: BTreeMap<u64, u64>,
    /// Sum of the free extents' lengths, bytes.
    free_len: u64,
}

/// Whether `x` (bytes) is a multiple of [`PAGE_LEN`] (a power of two).
pub fn is_page_aligned(x: u64) -> bool {
    x & (PAGE_LEN - 1) == 0
}

/// `len` rounded up to whole pages, at least one page; `None` on overflow.
pub fn round_up_to_pages(len: u64) -> Option<u64> {
    let pages = len.max(1).div_ceil(PAGE_LEN);
    pages.checked_mul(PAGE_LEN)
}

impl ExtentAllocator {
    /// An allocator for `[base_offset, base_offset + len)`, all free.
    ///
    /// `base_offset` should be page aligned; if it is not, the range starts at
    /// the next page boundary instead (and loses the bytes before it). `len` is
    /// rounded down to whole pages, and clipped so the range ends within `u64`.
    pub fn new(base_offset: u64, len: u64) -> Self {
        debug_assert!(is_page_aligned(base_offset), "base_offset {base_offset} is not page aligned");
        let (aligned_base, len) = match base_offset.checked_next_multiple_of(PAGE_LEN) {
            Some(b) => (b, len.saturating_sub(b - base_offset)),
            None => (base_offset - base_offset % PAGE_LEN, 0),
        };
        let len = len.min(u64::MAX - aligned_base);
        let total_len = len - len % PAGE_LEN;
        let mut a = Self {
            base_offset: aligned_base,
            total_len,
            free_by_offset: BTreeMap::new(),
            free_by_len: BTreeSet::new(),
            allocated: BTreeMap::new(),
            free_len: 0,
        };
        if total_len > 0 {
            a.insert_free(aligned_base, total_len);
        }
        a
    }

    /// An allocator for `[base_offset, base_offset + len)` (as [`new`](Self::new))
    /// whose live allocations are `extents`, in any order; the rest is free,
    /// coalesced. `Err` names the first extent that is not page aligned,
    /// empty, outside the range or overlapping another. One sort and one
    /// pass: the indexes are built from sorted runs.
    pub fn with_allocated(base_offset: u64, len: u64, mut extents: Vec<Extent>) -> Result<Self, String> {
        let empty = Self::new(base_offset, len);
        let (base, total) = (empty.base_offset, empty.total_len);
        extents.sort_unstable_by_key(|e| e.offset);
        let mut free = Vec::new();
        let mut at = base;
        for e in &extents {
            let end = e.offset.checked_add(e.len).filter(|&end| end <= base + total);
            let Some(end) = end.filter(|_| e.len > 0 && is_page_aligned(e.offset) && is_page_aligned(e.len)) else {
                return Err(format!("extent at {} of {} bytes is not whole pages of the megaslab", e.offset, e.len));
            };
            if e.offset < at {
                return Err(format!(
                    "extent at {} overlaps the one before it (or starts before the megaslab)",
                    e.offset
                ));
            }
            if e.offset > at {
                free.push((at, e.offset - at));
            }
            at = end;
        }
        if at < base + total {
            free.push((at, base + total - at));
        }
        let free_len = free.iter().map(|&(_, l)| l).sum();
        let mut by_len: Vec<(u64, u64)> = free.iter().map(|&(o, l)| (l, o)).collect();
        by_len.sort_unstable();
        Ok(Self {
            base_offset: base,
            total_len: total,
            free_by_offset: free.into_iter().collect(),
            free_by_len: by_len.into_iter().collect(),
            allocated: extents.iter().map(|e| (e.offset, e.len)).collect(),
            free_len,
        })
    }

    /// Start of the managed range, bytes from the region base.
    pub fn base_offset(&self) -> u64 {
        self.base_offset
    }

    /// Managed bytes (free + used).
    pub fn total_bytes(&self) -> u64 {
        self.total_len
    }

    /// Bytes in free extents.
    pub fn free_bytes(&self) -> u64 {
        self.free_len
    }

    /// Bytes in live allocations.
    pub fn used_bytes(&self) -> u64 {
        self.total_len - self.free_len
    }

    /// Length of the largest free extent, bytes (0 when full).
    pub fn largest_free(&self) -> u64 {
        self.free_by_len.last().map_or(0, |&(len, _)| len)
    }

    /// Number of free extents (a fragmentation measure).
    pub fn free_extent_count(&self) -> usize {
        self.free_by_offset.len()
    }

    /// Number of live allocations.
    pub fn allocated_count(&self) -> usize {
        self.allocated.len()
    }

    /// Live allocations in offset order.
    pub fn allocated_extents(&self) -> impl Iterator<Item = Extent> + '_ {
        self.allocated.iter().map(|(&offset, &len)| Extent { offset, len })
    }

    /// Whether `e` is exactly a live allocation.
    pub fn is_allocated(&self, e: Extent) -> bool {
        self.allocated.get(&e.offset) == Some(&e.len)
    }

    /// Allocates `len` bytes rounded up to whole pages (0 bytes take one page),
    /// from the smallest free extent that fits (lowest offset among equals),
    /// carving from its front. `None` when no free extent is large enough.
    /// `O(log n)` in the number of free extents.
    pub fn alloc(&mut self, len: u64) -> Option<Extent> {
        let need = round_up_to_pages(len)?;
        let (free_len, free_offset) = *self.free_by_len.range((Bound::Included((need, 0)), Bound::Unbounded)).next()?;
        self.remove_free(free_offset, free_len);
        if free_len > need {
            self.insert_free(free_offset + need, free_len - need);
        }
        self.allocated.insert(free_offset, need);
        Some(Extent { offset: free_offset, len: need })
    }

    /// Allocates exactly `e` (page aligned, non-empty), which must lie within
    /// one free extent: carves it out, leaving the free pieces before and
    /// after it. `false` (and nothing changes) if any page of `e` is not
    /// free. For putting back an extent that was freed a moment ago (a
    /// refused reservation unit restores the blocks it evicted, at the same
    /// extents). `O(log n)`.
    pub fn alloc_at(&mut self, e: Extent) -> bool {
        if e.len == 0 || !is_page_aligned(e.offset) || !is_page_aligned(e.len) {
            return false;
        }
        let Some(end) = e.offset.checked_add(e.len) else { return false };
        let Some((&free_offset, &free_len)) = self.free_by_offset.range(..=e.offset).next_back() else {
            return false;
        };
        if free_offset + free_len < end {
            return false;
        }
        self.remove_free(free_offset, free_len);
        if free_offset < e.offset {
            self.insert_free(free_offset, e.offset - free_offset);
        }
        if end < free_offset + free_len {
            self.insert_free(end, free_offset + free_len - end);
        }
        self.allocated.insert(e.offset, e.len);
        true
    }

    /// Frees `e`, which must be a live allocation, coalescing it with free
    /// neighbours. Returns `false` (and changes nothing) for a double free or
    /// an extent `alloc` did not hand out; that is a caller bug, so debug
    /// builds assert on it. `O(log n)`.
    pub fn free(&mut self, e: Extent) -> bool {
        match self.try_free(e) {
            Ok(()) => true,
            Err(err) => {
                if cfg!(debug_assertions) {
                    panic!("ExtentAllocator::free: {err}");
                }
                false
            }
        }
    }

    /// [`free`](Self::free) without the debug assertion: refuses an extent
    /// that is not exactly a live allocation with [`FreeError::NotAllocated`].
    pub fn try_free(&mut self, e: Extent) -> Result<(), FreeError> {
        if !self.is_allocated(e) {
            return Err(FreeError::NotAllocated { offset: e.offset, len: e.len });
        }
        self.allocated.remove(&e.offset);
        let mut start = e.offset;
        let mut len = e.len;
        // Coalesce with the free extent just before, if it ends where `e` starts.
        if let Some((&prev_offset, &prev_len)) = self.free_by_offset.range(..start).next_back() {
            if prev_offset + prev_len == start {
                self.remove_free(prev_offset, prev_len);
                start = prev_offset;
                len += prev_len;
            }
        }
        // And with the one just after, if it starts where `e` ends.
        let end = start + len;
        if let Some(&next_len) = self.free_by_offset.get(&end) {
            self.remove_free(end, next_len);
            len += next_len;
        }
        self.insert_free(start, len);
        Ok(())
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        self.free_by_offset.insert(offset, len);
        self.free_by_len.insert((len, offset));
        self.free_len += len;
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        self.free_by_offset.remove(&offset);
        self.free_by_len.remove(&(len, offset));
        self.free_len -= len;
    }

    /// The managed range: (start, bytes).
    pub fn range(&self) -> (u64, u64) {
        (self.base_offset, self.total_len)
    }

    /// Checks every structural invariant; `Err` names the first one broken.
    ///
    /// Free extents are page aligned, non-empty, inside the range, disjoint
    /// and coalesced (no two adjacent); both free indexes hold the same
    /// extents; free and allocated extents together tile the range exactly;
    /// `free_bytes + used_bytes == total_bytes`. `O(n)`.
    pub fn check_invariants(&self) -> Result<(), String> {
        if !is_page_aligned(self.base_offset) || !is_page_aligned(self.total_len) {
            return Err(format!("range {} + {} is not page aligned", self.base_offset, self.total_len));
        }
        let end = self.base_offset.checked_add(self.total_len).ok_or_else(|| "range end overflows u64".to_string())?;
        if self.free_by_offset.len() != self.free_by_len.len() {
            return Err(format!(
                "free indexes disagree: {} by offset, {} by len",
                self.free_by_offset.len(),
                self.free_by_len.len()
            ));
        }
        let mut free_sum = 0u64;
        for (&offset, &len) in &self.free_by_offset {
            if !self.free_by_len.contains(&(len, offset)) {
                return Err(format!("free extent {offset}+{len} missing from the by-len index"));
            }
            free_sum += len;
        }
        if free_sum != self.free_len {
            return Err(format!("free_len {} but free extents sum to {free_sum}", self.free_len));
        }
        let mut used_sum = 0u64;
        for &len in self.allocated.values() {
            used_sum += len;
        }
        if free_sum + used_sum != self.total_len {
            return Err(format!("free {free_sum} + used {used_sum} != total {}", self.total_len));
        }
        // Merge the two offset-ordered lists and walk the range start to end.
        let mut free = self.free_by_offset.iter().peekable();
        let mut used = self.allocated.iter().peekable();
        let mut cursor = self.base_offset;
        let mut prev_was_free = false;
        loop {
            let next_free = free.peek().map(|(&o, &l)| (o, l));
            let next_used = used.peek().map(|(&o, &l)| (o, l));
            let (offset, len, is_free) = match (next_free, next_used) {
                (None, None) => break,
                (Some((fo, fl)), Some((uo, _))) if fo < uo => {
                    free.next();
                    (fo, fl, true)
                }
                (Some((fo, fl)), None) => {
                    free.next();
                    (fo, fl, true)
                }
                (_, Some((uo, ul))) => {
                    used.next();
                    (uo, ul, false)
                }
            };
            let kind = if is_free { "free" } else { "allocated" };
            if len == 0 || !is_page_aligned(offset) || !is_page_aligned(len) {
                return Err(format!("{kind} extent {offset}+{len} is empty or not page aligned"));
            }
            if offset != cursor {
                return Err(format!("{kind} extent {offset}+{len} does not start at {cursor}: gap or overlap"));
            }
            if is_free && prev_was_free {
                return Err(format!("free extent at {offset} is not coalesced with the one before"));
            }
            cursor = offset
                .checked_add(len)
                .filter(|&e| e <= end)
                .ok_or_else(|| format!("{kind} extent {offset}+{len} runs past the range end {end}"))?;
            prev_was_free = is_free;
        }
        if cursor != end {
            return Err(format!("extents stop at {cursor}, the range ends at {end}"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    #[test]
    fn new_rounds_len_down_and_starts_free() {
        let a = ExtentAllocator::new(2 * MIB, 10 * PAGE_LEN + 100);
        assert_eq!(a.total_bytes(), 10 * PAGE_LEN);
        assert_eq!(a.free_bytes(), 10 * PAGE_LEN);
        assert_eq!(a.used_bytes(), 0);
        assert_eq!(a.largest_free(), 10 * PAGE_LEN);
        assert_eq!(a.base_offset(), 2 * MIB);
        a.check_invariants().unwrap();
    }

    #[test]
    fn empty_range() {
        let mut a = ExtentAllocator::new(0, 100);
        assert_eq!(a.total_bytes(), 0);
        assert_eq!(a.alloc(0), None);
        assert_eq!(a.largest_free(), 0);
        a.check_invariants().unwrap();
    }

    #[test]
    fn range_at_the_top_of_u64_is_clipped() {
        let base = u64::MAX - u64::MAX % PAGE_LEN - 4 * PAGE_LEN;
        let mut a = ExtentAllocator::new(base, u64::MAX);
        assert_eq!(a.total_bytes(), 4 * PAGE_LEN);
        a.check_invariants().unwrap();
        let e = a.alloc(4 * PAGE_LEN).unwrap();
        assert_eq!(e.offset, base);
        assert!(a.free(e));
        a.check_invariants().unwrap();
    }

    #[test]
    fn rounds_up_to_pages() {
        let mut a = ExtentAllocator::new(0, 16 * PAGE_LEN);
        let zero = a.alloc(0).unwrap();
        assert_eq!(zero, Extent { offset: 0, len: PAGE_LEN });
        let one = a.alloc(1).unwrap();
        assert_eq!(one, Extent { offset: PAGE_LEN, len: PAGE_LEN });
        let exact = a.alloc(PAGE_LEN).unwrap();
        assert_eq!(exact.len, PAGE_LEN);
        let over = a.alloc(PAGE_LEN + 1).unwrap();
        assert_eq!(over.len, 2 * PAGE_LEN);
        assert_eq!(a.used_bytes(), 5 * PAGE_LEN);
        assert_eq!(a.alloc(u64::MAX), None);
        assert_eq!(a.alloc(u64::MAX - 1), None);
        a.check_invariants().unwrap();
    }

    #[test]
    fn best_fit_takes_the_smallest_hole() {
        let mut a = ExtentAllocator::new(0, 100 * PAGE_LEN);
        // Layout: [h1: 8 pages][x][h2: 2 pages][x][h3: 4 pages][x][rest]
        let h1 = a.alloc(8 * PAGE_LEN).unwrap();
        let _x1 = a.alloc(PAGE_LEN).unwrap();
        let h2 = a.alloc(2 * PAGE_LEN).unwrap();
        let _x2 = a.alloc(PAGE_LEN).unwrap();
        let h3 = a.alloc(4 * PAGE_LEN).unwrap();
        let _x3 = a.alloc(PAGE_LEN).unwrap();
        assert!(a.free(h1));
        assert!(a.free(h2));
        assert!(a.free(h3));
        a.check_invariants().unwrap();
        // 3 pages: h3 (4 pages) is the best fit, not h1 or the tail.
        let e = a.alloc(3 * PAGE_LEN).unwrap();
        assert_eq!(e.offset, h3.offset);
        // 2 pages: h2 exactly.
        let e = a.alloc(2 * PAGE_LEN).unwrap();
        assert_eq!(e, h2);
        // 1 page: the leftover page of h3.
        let e = a.alloc(PAGE_LEN).unwrap();
        assert_eq!(e.offset, h3.offset + 3 * PAGE_LEN);
        a.check_invariants().unwrap();
    }

    #[test]
    fn alloc_at_carves_exactly_and_undoes_a_free() {
        let mut a = ExtentAllocator::new(2 * MIB, 8 * PAGE_LEN);
        let x = a.alloc(2 * PAGE_LEN).unwrap();
        let y = a.alloc(3 * PAGE_LEN).unwrap();
        let z = a.alloc(PAGE_LEN).unwrap();
        let before = a.clone();
        // y freed coalesces with nothing on its left (x) or right (z): carve it back.
        assert!(a.try_free(y).is_ok());
        assert!(a.alloc_at(y));
        assert_eq!(format!("{a:?}"), format!("{before:?}"));
        // Freed between free neighbours, it coalesces into one extent; carving
        // it back splits that extent into the same pieces.
        assert!(a.try_free(x).is_ok() && a.try_free(z).is_ok());
        let two_holes = a.clone();
        assert!(a.try_free(y).is_ok());
        assert_eq!(a.free_extent_count(), 1);
        assert!(a.alloc_at(y));
        assert_eq!(format!("{a:?}"), format!("{two_holes:?}"));
        a.check_invariants().unwrap();
        // Pages that are not all free, or a misaligned or empty extent: refused, nothing changes.
        for bad in [
            y,
            Extent { offset: y.offset - PAGE_LEN, len: 2 * PAGE_LEN },
            Extent { offset: y.offset + 1, len: PAGE_LEN },
            Extent { offset: x.offset, len: 0 },
            Extent { offset: 2 * MIB + 8 * PAGE_LEN, len: PAGE_LEN },
        ] {
            assert!(!a.alloc_at(bad), "{bad:?}");
            assert_eq!(format!("{a:?}"), format!("{two_holes:?}"));
        }
    }

    #[test]
    fn free_coalesces_both_sides() {
        let mut a = ExtentAllocator::new(0, 3 * PAGE_LEN);
        let x = a.alloc(1).unwrap();
        let y = a.alloc(1).unwrap();
        let z = a.alloc(1).unwrap();
        assert_eq!(a.free_bytes(), 0);
        assert_eq!(a.largest_free(), 0);
        assert_eq!(a.alloc(1), None);
        assert!(a.free(x));
        assert!(a.free(z));
        assert_eq!(a.free_extent_count(), 2);
        assert_eq!(a.largest_free(), PAGE_LEN);
        assert!(a.free(y));
        assert_eq!(a.free_extent_count(), 1);
        assert_eq!(a.largest_free(), 3 * PAGE_LEN);
        a.check_invariants().unwrap();
    }

    #[test]
    fn two_gib_in_three_gib() {
        let mut a = ExtentAllocator::new(2 * MIB, 3 * GIB);
        let small = a.alloc(100).unwrap();
        let big = a.alloc(2 * GIB).unwrap();
        assert_eq!(big.len, 2 * GIB);
        assert!(a.alloc(GIB).is_none(), "only 1 GiB - 1 page is left");
        assert!(a.free(small));
        assert!(a.alloc(GIB).is_none(), "the freed page is not adjacent to the tail");
        assert!(a.free(big));
        assert_eq!(a.free_extent_count(), 1);
        assert_eq!(a.alloc(GIB).unwrap().offset, 2 * MIB);
        a.check_invariants().unwrap();
    }

    #[test]
    fn try_free_refuses_double_and_made_up_frees() {
        let mut a = ExtentAllocator::new(0, 8 * PAGE_LEN);
        let e = a.alloc(2 * PAGE_LEN).unwrap();
        let _f = a.alloc(PAGE_LEN).unwrap();
        assert_eq!(a.try_free(e), Ok(()));
        assert_eq!(a.try_free(e), Err(FreeError::NotAllocated { offset: e.offset, len: e.len }));
        // Part of a live allocation, a wrong length, outside the range.
        let g = a.alloc(4 * PAGE_LEN).unwrap();
        assert!(a.try_free(Extent { offset: g.offset, len: PAGE_LEN }).is_err());
        assert!(a.try_free(Extent { offset: g.offset + PAGE_LEN, len: PAGE_LEN }).is_err());
        assert!(a.try_free(Extent { offset: 1 << 40, len: PAGE_LEN }).is_err());
        assert!(a.try_free(Extent { offset: u64::MAX, len: u64::MAX }).is_err());
        a.check_invariants().unwrap();
        assert_eq!(a.try_free(g), Ok(()));
        a.check_invariants().unwrap();
    }

    /// Debug builds assert on a double free; release builds return `false`.
    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "double free"))]
    fn free_twice_asserts_in_debug_only() {
        let mut a = ExtentAllocator::new(0, 8 * PAGE_LEN);
        let e = a.alloc(1).unwrap();
        assert!(a.free(e));
        assert!(!a.free(e));
        a.check_invariants().unwrap();
    }

    #[derive(Clone, Debug)]
    enum AllocOp {
        Alloc(u64),
        Free(usize),
    }

    fn alloc_op() -> impl Strategy<Value = AllocOp> {
        prop_oneof![
            3 => (0u64..40 * PAGE_LEN).prop_map(AllocOp::Alloc),
            1 => (0u64..3).prop_map(|p| AllocOp::Alloc(p * PAGE_LEN)),
            3 => any::<usize>().prop_map(AllocOp::Free),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Random alloc/free sequences keep every invariant; live extents are
        /// disjoint, inside the range, of the rounded length; freeing all
        /// coalesces back to one extent.
        #[test]
        fn random_alloc_free(pages in 1u64..200, ops in proptest::collection::vec(alloc_op(), 1..300)) {
            let base = 7 * 2 * MIB;
            let mut a = ExtentAllocator::new(base, pages * PAGE_LEN);
            let mut live: Vec<Extent> = Vec::new();
            for op in ops {
                match op {
                    AllocOp::Alloc(len) => {
                        let fits = round_up_to_pages(len).unwrap() <= a.largest_free();
                        match a.alloc(len) {
                            Some(e) => {
                                prop_assert!(fits);
                                prop_assert_eq!(e.len, round_up_to_pages(len).unwrap());
                                prop_assert!(e.offset >= base && e.end_offset() <= base + pages * PAGE_LEN);
                                for l in &live {
                                    prop_assert!(e.end_offset() <= l.offset || l.end_offset() <= e.offset,
                                        "{:?} overlaps {:?}", e, l);
                                }
                                live.push(e);
                            }
                            None => prop_assert!(!fits),
                        }
                    }
                    AllocOp::Free(i) => {
                        if !live.is_empty() {
                            let e = live.swap_remove(i % live.len());
                            prop_assert!(a.free(e));
                            prop_assert!(a.try_free(e).is_err());
                        }
                    }
                }
                a.check_invariants().map_err(TestCaseError::fail)?;
                prop_assert_eq!(a.used_bytes(), live.iter().map(|e| e.len).sum::<u64>());
                prop_assert_eq!(a.allocated_count(), live.len());
            }
            for e in live.drain(..) {
                prop_assert!(a.free(e));
                a.check_invariants().map_err(TestCaseError::fail)?;
            }
            prop_assert_eq!(a.free_extent_count(), 1);
            prop_assert_eq!(a.largest_free(), pages * PAGE_LEN);
        }
    }
}
