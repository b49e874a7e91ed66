//! Heap bytes per block of the disk tier's index, counted by the allocator:
//! `cargo run --release -p kachedb-daemon --example disk_index_ram`.
//!
//! For 10^3 … 10^6 blocks in chains of 16 (8 KiB files, as the restart
//! benchmark writes them), the index built as the rebuild builds it (sized
//! first) and grown one write at a time, and beside it the tier's set of
//! the same keys in a `HashSet<u128>` (what a second copy of the keys, as
//! the tier kept beside its index before, costs).

use kachedb_daemon::disk::index::{Index, Limits, DEFAULT_ROW};
use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashSet;
use std::sync::atomic::{AtomicIsize, Ordering::Relaxed};

/// The system allocator, counting the bytes held.
struct Counting;

static HELD: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call goes to `System` with the caller's arguments; the
// counter is only arithmetic on the sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        HELD.fetch_add(l.size() as isize, Relaxed);
        // SAFETY: forwarded as given (see the impl).
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        HELD.fetch_sub(l.size() as isize, Relaxed);
        // SAFETY: forwarded as given (see the impl).
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        HELD.fetch_add(new as isize - l.size() as isize, Relaxed);
        // SAFETY: forwarded as given (see the impl).
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Heap bytes `make` leaves held (what it returns is kept until then).
fn held_by<T>(make: impl FnOnce() -> T) -> (T, isize) {
    let before = HELD.load(Relaxed);
    let t = make();
    (t, HELD.load(Relaxed) - before)
}

fn main() {
    println!(
        "{:>9}  {:>15}  {:>15}  {:>19}  {:>14}",
        "blocks", "sized, B/block", "grown, B/block", "HashSet<u128>, B/block", "sized, ns/insert"
    );
    for n in [1_000u64, 10_000, 100_000, 1_000_000] {
        let parent = |k: u64| (!k.is_multiple_of(16)).then(|| u128::from(k - 1));
        let t = std::time::Instant::now();
        let (ix, sized) = held_by(|| {
            let mut ix = Index::new(u64::MAX, &Limits::default());
            ix.reserve(n as usize);
            (0..n).for_each(|k| ix.insert(k.into(), parent(k), 8192, DEFAULT_ROW));
            ix
        });
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        assert_eq!(ix.blocks(), n);
        drop(ix);
        let (ix, grown) = held_by(|| {
            let mut ix = Index::new(u64::MAX, &Limits::default());
            (0..n).for_each(|k| ix.insert(k.into(), parent(k), 8192, DEFAULT_ROW));
            ix
        });
        drop(ix);
        let (set, on_disk) = held_by(|| (0..n).map(u128::from).collect::<HashSet<u128>>());
        drop(set);
        let per = |b: isize| b as f64 / n as f64;
        println!("{n:>9}  {:>15.1}  {:>15.1}  {:>22.1}  {ns:>16.0}", per(sized), per(grown), per(on_disk));
    }
}
