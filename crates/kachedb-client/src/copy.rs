//! The copies into and out of blocks, used by every copy path of the client
//! (and of the Python bindings): copies of [`PARALLEL_COPY_MIN`] bytes and more,
//! one block or a batch together, are split between threads (a single `memcpy`
//! reaches about half of a socket's memory bandwidth; torch's own `copy_` is
//! multi-threaded too), and on x86-64 written with non-temporal (streaming)
//! stores: a block that large does not stay in the caches for its reader anyway,
//! and a streaming store writes a line without reading it first, so the copy
//! moves two bytes of memory traffic per byte instead of three (on the
//! development machine: 2 GiB in ~100 ms with two threads against ~135 ms for
//! two threads of glibc's `memcpy`).

use std::sync::{Mutex, OnceLock, PoisonError};

/// Copies of at least this many bytes are split between threads.
const PARALLEL_COPY_MIN: usize = 32 << 20;
/// Each copying thread gets at least this many bytes.
const PARALLEL_COPY_CHUNK: usize = 16 << 20;
/// At most this many threads copy one block (a few saturate a socket's memory
/// bandwidth).
const PARALLEL_COPY_MAX_THREADS: usize = 8;

/// How many threads copy `n` bytes: 1 below [`PARALLEL_COPY_MIN`], else up to one
/// per [`PARALLEL_COPY_CHUNK`], per available core, and [`PARALLEL_COPY_MAX_THREADS`].
fn copy_threads(n: usize) -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    if n < PARALLEL_COPY_MIN {
        return 1;
    }
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |c| c.get()));
    cores.min(PARALLEL_COPY_MAX_THREADS).min(n / PARALLEL_COPY_CHUNK).max(1)
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
    let threads = copy_threads(total);
    if threads <= 1 {
        for (d, s) in pairs.iter_mut() {
            stream_copy(d, s);
        }
        return;
    }
    // Work items of about `chunk` bytes: large blocks cut into page-aligned
    // chunks, small ones whole.
    let chunk = total.div_ceil(threads * 4).next_multiple_of(4096).max(PARALLEL_COPY_CHUNK / 4);
    let items = pairs.iter_mut().flat_map(|(d, s)| d.chunks_mut(chunk).zip(s.chunks(chunk)));
    let work = Mutex::new(items);
    let run = || loop {
        let next = work.lock().unwrap_or_else(PoisonError::into_inner).next();
        match next {
            Some((d, s)) => stream_copy(d, s),
            None => break,
        }
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

/// `dst.copy_from_slice(src)` with non-temporal stores (x86-64: SSE2, part of
/// the base instruction set) for the 64-byte-aligned middle of `dst`, ordinary
/// stores for the unaligned head and tail; ends with a store fence, so the
/// streamed bytes are ordered before this thread's later stores (the COMMIT, or
/// the end of a copying thread that the committing thread joins). Elsewhere a
/// plain copy.
fn stream_copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "stream_copy slices of different lengths");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        const LINE: usize = 64;
        let head = dst.as_ptr().align_offset(LINE).min(dst.len());
        let body = (dst.len() - head) / LINE * LINE;
        let (d_head, d_rest) = dst.split_at_mut(head);
        let (d_body, d_tail) = d_rest.split_at_mut(body);
        let (s_head, s_rest) = src.split_at(head);
        let (s_body, s_tail) = s_rest.split_at(body);
        d_head.copy_from_slice(s_head);
        for (d, s) in d_body.chunks_exact_mut(LINE).zip(s_body.chunks_exact(LINE)) {
            let (dp, sp) = (d.as_mut_ptr().cast::<__m128i>(), s.as_ptr().cast::<__m128i>());
            // SAFETY: `d` and `s` are 64 bytes each (four 16-byte vectors) of the
            // caller's slices, which do not overlap (one is borrowed mutably);
            // `d` starts 64-byte aligned (the body starts at `head`, a multiple
            // of 64 past an aligned address), as the streaming store requires;
            // the loads are unaligned loads. SSE2 is part of x86-64.
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
        // SAFETY: a fence; SSE is part of x86-64.
        unsafe { _mm_sfence() };
        d_tail.copy_from_slice(s_tail);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
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
        let mut dsts: Vec<Vec<u8>> = srcs.iter().map(|s| vec![0u8; s.len()]).collect();
        let mut pairs: Vec<(&mut [u8], &[u8])> =
            dsts.iter_mut().zip(&srcs).map(|(d, s)| (d.as_mut_slice(), s.as_slice())).collect();
        copy_many(&mut pairs);
        assert_eq!(dsts, srcs);
        let mut one = vec![0u8; 33 << 20];
        let src: Vec<u8> = (0..one.len()).map(|j| (j % 251) as u8).collect();
        copy_into(&mut one, &src);
        assert_eq!(one, src);
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
