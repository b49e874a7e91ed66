//! The copies into and out of blocks, used by every copy path of the client
//! (and of the Python bindings): copies of [`PARALLEL_COPY_MIN`] bytes and more,
//! one block or a batch together, are split between threads (a single `memcpy`
//! reaches about half of a socket's memory bandwidth; torch's own `copy_` is
//! multi-threaded too), and on x86-64 written with non-temporal (streaming)
//! stores: a block that large does not stay in the caches for its reader anyway,
//! and a streaming store writes a line without reading it first, so the copy
//! moves two bytes of memory traffic per byte instead of three (on the
//! development machine: 2 GiB in ~100 ms with two threads against ~135 ms for
//! two threads of glibc's `memcpy`; on an Intel Xeon host, ~113 ms, as glibc's).

use std::sync::{Mutex, OnceLock, PoisonError};

/// Copies of at least this many bytes are split between threads.
const PARALLEL_COPY_MIN: usize = 32 << 20;
/// Each copying thread gets at least this many bytes.
const PARALLEL_COPY_CHUNK: usize = 16 << 20;
/// At most this many threads copy one block (a few saturate a socket's memory
/// bandwidth).
const PARALLEL_COPY_MAX_THREADS: usize = 8;

/// How many threads copy `n` bytes: 1 below [`PARALLEL_COPY_MIN`], else up to one
/// per [`PARALLEL_COPY_CHUNK`], per core this thread may run on now, and
/// [`PARALLEL_COPY_MAX_THREADS`].
fn copy_threads(n: usize) -> usize {
    if n < PARALLEL_COPY_MIN {
        return 1;
    }
    usable_cores().min(PARALLEL_COPY_MAX_THREADS).min(n / PARALLEL_COPY_CHUNK).max(1)
}

/// The cores the copy's threads can run on: the CPUs in this thread's affinity
/// mask now (one syscall: a caller pinned to one CPU after the first copy gets
/// one thread, not several taking turns on that CPU), and no more than
/// `available_parallelism` found at the first call (which also counts a
/// cgroup's CPU quota; reading that is too slow to repeat per copy).
fn usable_cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    let limit = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |c| c.get()));
    let now = rustix::thread::sched_getaffinity(None).map_or(limit, |set| set.count() as usize);
    limit.min(now).max(1)
}

/// `dst.copy_from_slice(src)`, split into page-aligned chunks that
/// [`copy_threads`] threads (this one included) take in turn. If a thread cannot
/// be started, the others copy its share.
///
/// # Panics
/// If the slices differ in length.
pub fn copy_into(dst: &mut [u8], src: &[u8]) {
    copy_many(&mut [(dst, src)]);
}

/// `dst.copy_from_slice(src)` for every pair: a batch of at least
/// [`PARALLEL_COPY_MIN`] bytes in all is split between [`copy_threads`] threads
/// (this one included), whole pairs for small blocks, page-aligned chunks of
/// large ones, each written with streaming stores ([`stream_copy`]). If a
/// thread cannot be started, the others copy its share.
///
/// # Panics
/// If the slices of a pair differ in length.
pub fn copy_many(pairs: &mut [(&mut [u8], &[u8])]) {
    copy_many_on(pairs, PARALLEL_COPY_MAX_THREADS);
}

/// [`copy_many`] on at most `max_threads` threads, this one included (`0`
/// counts as `1`): `1` copies on the calling thread alone, still with
/// streaming stores for a batch of [`PARALLEL_COPY_MIN`] bytes or more (for a
/// copy that runs beside other work, such as an engine's compute, and should
/// take one core, not all of them).
///
/// # Panics
/// If the slices of a pair differ in length.
pub fn copy_many_on(pairs: &mut [(&mut [u8], &[u8])], max_threads: usize) {
    for (d, s) in pairs.iter() {
        assert_eq!(d.len(), s.len(), "copy_many slices of different lengths");
    }
    let total: usize = pairs.iter().map(|(_, s)| s.len()).sum();
    if total < PARALLEL_COPY_MIN {
        for (d, s) in pairs.iter_mut() {
            d.copy_from_slice(s);
        }
        return;
    }
    let threads = copy_threads(total).min(max_threads);
    if threads <= 1 {
        for (d, s) in pairs.iter_mut() {
            stream_copy(d, s);
        }
        store_fence();
        return;
    }
    // Work items of about `chunk` bytes: large blocks cut into page-aligned
    // chunks, small ones whole.
    let chunk = total.div_ceil(threads * 4).next_multiple_of(4096).max(PARALLEL_COPY_CHUNK / 4);
    let items = pairs.iter_mut().flat_map(|(d, s)| d.chunks_mut(chunk).zip(s.chunks(chunk)));
    let work = Mutex::new(items);
    let run = || {
        loop {
            let next = work.lock().unwrap_or_else(PoisonError::into_inner).next();
            match next {
                Some((d, s)) => stream_copy(d, s),
                None => break,
            }
        }
        store_fence();
    };
    std::thread::scope(|scope| {
        for _ in 1..threads {
            if std::thread::Builder::new().name("kachedb-copy".into()).spawn_scoped(scope, run).is_err() {
                break;
            }
        }
        run();
    });
}

/// `dst.copy_from_slice(src)` with non-temporal stores for the 64-byte-aligned
/// middle of `dst`, ordinary stores for the unaligned head and tail. Not
/// fenced: the caller runs [`store_fence`] once after its last `stream_copy`
/// (a fence waits for every streamed line of the thread to drain, so one per
/// block would stall a batch of small blocks once per block). The middle is
/// copied four 4 KiB pages at a time, one line of each page in turn
/// ([`x86::stream_pages`]), as glibc's own large-copy loop does: four streams in
/// flight instead of one (on an Intel Xeon host, 2 GiB with two threads in
/// ~113 ms against ~138 ms line after line, and 256 MiB in ~16 against ~25 ms).
/// Elsewhere than x86-64 a plain copy.
fn stream_copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "stream_copy slices of different lengths");
    #[cfg(target_arch = "x86_64")]
    {
        let head = dst.as_ptr().align_offset(LINE).min(dst.len());
        let body = (dst.len() - head) / LINE * LINE;
        let (d_head, d_rest) = dst.split_at_mut(head);
        let (d_body, d_tail) = d_rest.split_at_mut(body);
        let (s_head, s_rest) = src.split_at(head);
        let (s_body, s_tail) = s_rest.split_at(body);
        d_head.copy_from_slice(s_head);
        let groups = body / GROUP;
        let (d_groups, d_lines) = d_body.split_at_mut(groups * GROUP);
        let (s_groups, s_lines) = s_body.split_at(groups * GROUP);
        if std::arch::is_x86_feature_detected!("avx") {
            // SAFETY: AVX is present (checked just above).
            unsafe { x86::stream_pages_avx(d_groups, s_groups) };
        } else {
            x86::stream_pages(d_groups, s_groups);
        }
        x86::stream_lines(d_lines, s_lines);
        d_tail.copy_from_slice(s_tail);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// Orders this thread's streamed stores ([`stream_copy`]) before its later
/// stores: the COMMIT, or the end of a copying thread that the committing
/// thread joins (a non-temporal store is not ordered by the release that a
/// join or a ring push makes; `sfence` drains it). Nothing elsewhere than x86-64.
fn store_fence() {
    // SAFETY: a fence; SSE is part of x86-64.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Bytes of a cache line: the unit of one round of streaming stores.
#[cfg(target_arch = "x86_64")]
const LINE: usize = 64;
/// Bytes of a page of [`stream_pages`]'s four.
#[cfg(target_arch = "x86_64")]
const PAGE: usize = 4096;
/// Bytes of one group of four interleaved pages.
#[cfg(target_arch = "x86_64")]
const GROUP: usize = 4 * PAGE;

/// The streaming-store loops of [`stream_copy`]. Each takes a destination that
/// starts 64-byte aligned, and a source of the same length that it does not
/// overlap (one of them is borrowed mutably).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{GROUP, LINE, PAGE};
    use std::arch::x86_64::{
        __m128i, __m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_loadu_si128, _mm_stream_si128,
    };

    /// One line (64 bytes) from `s` to `d` with SSE2 streaming stores.
    ///
    /// # Safety
    /// `s` is readable and `d` writable for 64 bytes, `d` is 64-byte aligned,
    /// and they do not overlap.
    #[inline(always)]
    unsafe fn line_sse2(d: *mut u8, s: *const u8) {
        let (dp, sp) = (d.cast::<__m128i>(), s.cast::<__m128i>());
        // SAFETY: the function's contract; SSE2 is part of x86-64; the loads
        // are unaligned loads, the stores aligned (`d` is).
        unsafe {
            let (a, b, c, e) = (
                _mm_loadu_si128(sp),
                _mm_loadu_si128(sp.add(1)),
                _mm_loadu_si128(sp.add(2)),
                _mm_loadu_si128(sp.add(3)),
            );
            _mm_stream_si128(dp, a);
            _mm_stream_si128(dp.add(1), b);
            _mm_stream_si128(dp.add(2), c);
            _mm_stream_si128(dp.add(3), e);
        }
    }

    /// [`line_sse2`] with 32-byte AVX stores.
    ///
    /// # Safety
    /// As [`line_sse2`], and the CPU has AVX.
    #[inline(always)]
    unsafe fn line_avx(d: *mut u8, s: *const u8) {
        let (dp, sp) = (d.cast::<__m256i>(), s.cast::<__m256i>());
        // SAFETY: the function's contract.
        unsafe {
            let (a, b) = (_mm256_loadu_si256(sp), _mm256_loadu_si256(sp.add(1)));
            _mm256_stream_si256(dp, a);
            _mm256_stream_si256(dp.add(1), b);
        }
    }

    /// Copies whole lines, one after the other.
    pub(super) fn stream_lines(d: &mut [u8], s: &[u8]) {
        assert!(
            d.len() == s.len() && d.len().is_multiple_of(LINE) && (d.is_empty() || d.as_ptr().align_offset(LINE) == 0)
        );
        for (d, s) in d.chunks_exact_mut(LINE).zip(s.chunks_exact(LINE)) {
            // SAFETY: 64 bytes each, `d` aligned (a multiple of 64 past an
            // aligned start), disjoint (the caller's contract).
            unsafe { line_sse2(d.as_mut_ptr(), s.as_ptr()) };
        }
    }

    /// Copies whole groups of four pages, line `l` of each of the four in turn.
    pub(super) fn stream_pages(d: &mut [u8], s: &[u8]) {
        assert!(
            d.len() == s.len() && d.len().is_multiple_of(GROUP) && (d.is_empty() || d.as_ptr().align_offset(LINE) == 0)
        );
        for (d, s) in d.chunks_exact_mut(GROUP).zip(s.chunks_exact(GROUP)) {
            let (dp, sp) = (d.as_mut_ptr(), s.as_ptr());
            for l in (0..PAGE).step_by(LINE) {
                for p in (0..GROUP).step_by(PAGE) {
                    // SAFETY: `p + l + 64 <= GROUP`, inside both 16 KiB chunks;
                    // `dp + p + l` is 64-byte aligned (an aligned start plus
                    // multiples of 64); the chunks are disjoint.
                    unsafe { line_sse2(dp.add(p + l), sp.add(p + l)) };
                }
            }
        }
    }

    /// [`stream_pages`] with AVX stores.
    ///
    /// # Safety
    /// The CPU has AVX.
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn stream_pages_avx(d: &mut [u8], s: &[u8]) {
        assert!(
            d.len() == s.len() && d.len().is_multiple_of(GROUP) && (d.is_empty() || d.as_ptr().align_offset(LINE) == 0)
        );
        for (d, s) in d.chunks_exact_mut(GROUP).zip(s.chunks_exact(GROUP)) {
            let (dp, sp) = (d.as_mut_ptr(), s.as_ptr());
            for l in (0..PAGE).step_by(LINE) {
                for p in (0..GROUP).step_by(PAGE) {
                    // SAFETY: as in `stream_pages`; AVX is present (the
                    // function's contract).
                    unsafe { line_avx(dp.add(p + l), sp.add(p + l)) };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_small_and_large_batches() {
        let srcs: Vec<Vec<u8>> = [0usize, 1, 4095, 70_000, 40 << 20]
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (j * 7 + i) as u8).collect())
            .collect();
        // Threads by size, then the calling thread alone (a large batch
        // streamed on one thread).
        for max_threads in [PARALLEL_COPY_MAX_THREADS, 1] {
            let mut dsts: Vec<Vec<u8>> = srcs.iter().map(|s| vec![0u8; s.len()]).collect();
            let mut pairs: Vec<(&mut [u8], &[u8])> =
                dsts.iter_mut().zip(&srcs).map(|(d, s)| (d.as_mut_slice(), s.as_slice())).collect();
            copy_many_on(&mut pairs, max_threads);
            assert_eq!(dsts, srcs, "max_threads {max_threads}");
        }
        let mut one = vec![0u8; 33 << 20];
        let src: Vec<u8> = (0..one.len()).map(|j| (j % 251) as u8).collect();
        copy_into(&mut one, &src);
        assert_eq!(one, src);
    }

    /// Batches just below, at and just above [`PARALLEL_COPY_MIN`] (the plain
    /// copy, then the streamed one, on one thread and on several), made of
    /// pairs of odd lengths at odd offsets of their buffers: every byte of
    /// every destination equals its source, and nothing around a destination
    /// is written.
    #[test]
    fn batches_at_the_streaming_threshold_copy_every_byte_and_nothing_else() {
        const GUARD: usize = 67;
        // Odd lengths (the last one fills the batch up to `total`) at
        // destination offsets that are not 64-byte aligned, and sources at
        // other offsets.
        let lens = [1usize, 63, 65, 4095, 4097, 65_537, 3 << 20, (5 << 20) + 13];
        for total in [PARALLEL_COPY_MIN - 1, PARALLEL_COPY_MIN, PARALLEL_COPY_MIN + 4097] {
            let mut sizes: Vec<usize> = lens.to_vec();
            let used: usize = sizes.iter().sum();
            sizes.push(total - used);
            let srcs: Vec<Vec<u8>> =
                sizes.iter().enumerate().map(|(i, &n)| (0..n + 3).map(|j| (j * 131 + i * 7) as u8).collect()).collect();
            for max_threads in [1, PARALLEL_COPY_MAX_THREADS] {
                let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0xA5u8; n + 2 * GUARD]).collect();
                let mut pairs: Vec<(&mut [u8], &[u8])> = bufs
                    .iter_mut()
                    .zip(&srcs)
                    .enumerate()
                    .map(|(i, (b, s))| {
                        let (n, d_off, s_off) = (sizes[i], GUARD - i % 5, i % 4);
                        (&mut b[d_off..d_off + n], &s[s_off..s_off + n])
                    })
                    .collect();
                assert_eq!(pairs.iter().map(|(d, _)| d.len()).sum::<usize>(), total);
                copy_many_on(&mut pairs, max_threads);
                for (i, b) in bufs.iter().enumerate() {
                    let (n, d_off, s_off) = (sizes[i], GUARD - i % 5, i % 4);
                    assert!(
                        b[d_off..d_off + n] == srcs[i][s_off..s_off + n],
                        "total {total} threads {max_threads} pair {i}"
                    );
                    assert!(
                        b[..d_off].iter().chain(&b[d_off + n..]).all(|&x| x == 0xA5),
                        "total {total} threads {max_threads} pair {i}: wrote outside the destination"
                    );
                }
            }
        }
    }

    /// The copy's threads are counted from the CPUs the calling thread may run
    /// on at the time of the copy: a thread pinned to one CPU copies alone.
    #[test]
    fn a_thread_pinned_to_one_cpu_copies_alone() {
        let big = PARALLEL_COPY_CHUNK * PARALLEL_COPY_MAX_THREADS;
        let before = copy_threads(big);
        assert!((1..=PARALLEL_COPY_MAX_THREADS).contains(&before));
        std::thread::spawn(move || {
            let mine = rustix::thread::sched_getaffinity(None).expect("affinity");
            let cpu = (0..rustix::thread::CpuSet::MAX_CPU).find(|&c| mine.is_set(c)).expect("a CPU");
            let mut one = rustix::thread::CpuSet::new();
            one.set(cpu);
            rustix::thread::sched_setaffinity(None, &one).expect("pin");
            assert_eq!(copy_threads(big), 1);
            assert_eq!(copy_threads(PARALLEL_COPY_MIN - 1), 1);
        })
        .join()
        .unwrap();
        assert_eq!(copy_threads(big), before, "the pin was this test's thread's only");
    }

    /// Both page loops (the SSE2 one and, where the CPU has it, the AVX one)
    /// copy every byte of every group, and nothing past it.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn both_page_loops_copy_whole_groups() {
        let n = 3 * GROUP;
        let src: Vec<u8> = (0..n).map(|j| (j * 31 % 253) as u8).collect();
        let mut buf = vec![0xAAu8; n + 2 * LINE];
        let start = buf.as_ptr().align_offset(LINE);
        let mut check = |f: &dyn Fn(&mut [u8], &[u8])| {
            buf.fill(0xAA);
            f(&mut buf[start..start + n], &src);
            assert!(buf[start..start + n] == src[..]);
            assert!(buf[..start].iter().chain(&buf[start + n..]).all(|&b| b == 0xAA));
        };
        check(&|d, s| x86::stream_pages(d, s));
        if std::arch::is_x86_feature_detected!("avx") {
            // SAFETY: AVX is present.
            check(&|d, s| unsafe { x86::stream_pages_avx(d, s) });
        }
    }

    #[test]
    fn streaming_copy_handles_every_alignment_and_length() {
        let src: Vec<u8> = (0..70_000usize).map(|j| (j * 13 % 251) as u8).collect();
        for d_off in [0usize, 1, 15, 16, 63, 64, 65] {
            for s_off in [0usize, 3, 64] {
                for len in [0usize, 1, 63, 64, 65, 127, 128, 129, 4096, 65_000] {
                    let mut dst = vec![0xAAu8; len + d_off + 64];
                    stream_copy(&mut dst[d_off..d_off + len], &src[s_off..s_off + len]);
                    assert_eq!(
                        &dst[d_off..d_off + len],
                        &src[s_off..s_off + len],
                        "d_off {d_off} s_off {s_off} len {len}"
                    );
                    assert!(dst[..d_off].iter().all(|&b| b == 0xAA), "wrote before the destination");
                    assert!(dst[d_off + len..].iter().all(|&b| b == 0xAA), "wrote past the destination");
                }
            }
        }
    }
}
