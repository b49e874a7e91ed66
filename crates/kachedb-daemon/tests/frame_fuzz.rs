//! The CI version of the cargo-fuzz targets in `fuzz/` (same drivers,
//! `tests/support/fuzz_driver.rs`): arbitrary 64-byte frames through both
//! decoders, and arbitrary programs of frames from several sessions through
//! `Store::handle`, checking the store's invariants and a model of what each
//! session holds after every frame.

#[path = "support/fuzz_driver.rs"]
mod fuzz_driver;

use proptest::prelude::*;

fn cases(ci: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if std::env::var("KACHEDB_SOAK").is_ok_and(|v| !v.is_empty() && v != "0") { ci * 20 } else { ci })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(4096)))]

    /// Any 64 bytes: neither decoder panics; what decodes is consistent and
    /// completions round-trip.
    #[test]
    fn decoders_take_any_frame(bytes in proptest::collection::vec(any::<u8>(), 0..=64)) {
        fuzz_driver::check_decode(&bytes).map_err(TestCaseError::fail)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(768)))]

    /// Any program of frames from several sessions (mostly steered to be
    /// well-formed, with handles of every session): no panic, no INTERNAL,
    /// every invariant after every frame, handles honoured for their owner
    /// only, no reservation ever overlapping another or a pinned block.
    #[test]
    fn frame_handler_takes_any_program(data in proptest::collection::vec(any::<u8>(), 0..6000)) {
        fuzz_driver::run_frames(&data).map_err(TestCaseError::fail)?;
    }
}

/// A fixed long program (a deterministic seed), so one CI run always covers
/// a few thousand frames with sessions closing mid-way.
#[test]
fn frame_handler_long_program() {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut total = fuzz_driver::Figures::default();
    for round in 0..64 {
        let data: Vec<u8> = (0..20_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let f = fuzz_driver::run_frames(&data).unwrap_or_else(|e| panic!("round {round}: {e}"));
        total.frames += f.frames;
        total.handled += f.handled;
        total.ok += f.ok;
        total.closes += f.closes;
    }
    assert!(total.ok > 1000 && total.closes > 10, "{total:?}");
    eprintln!("figures: {{\"test\":\"frame_handler_long_program\",\"frames\":{},\"handled\":{},\"ok\":{},\"session_closes\":{}}}", total.frames, total.handled, total.ok, total.closes);
}
