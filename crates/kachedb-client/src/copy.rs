//! The copies into and out of blocks, used by every copy path of the client
//! (and of the Python bindings): copies of [`PARALLEL_COPY_MIN`] bytes and more,
//! one block or a batch together, are split between threads (a single `memcpy`
//! reaches about half of a socket's memory bandwidth; torch's own `copy_` is
//! multi-threaded too).

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
/// large ones. If a thread cannot be started, the others copy its share.
///
/// # Panics
/// If the slices of a pair differ in length.
pub fn copy_many(pairs: &mut [(&mut [u8], &[u8])]) {
    for (d, s) in pairs.iter() {
        assert_eq!(d.len(), s.len(), "copy_many slices of different lengths");
    }
    let total: usize = pairs.iter().map(|(_, s)| s.len()).sum();
    let threads = copy_threads(total);
    if threads <= 1 {
        for (d, s) in pairs.iter_mut() {
            d.copy_from_slice(s);
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
            Some((d, s)) => d.copy_from_slice(s),
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
}
