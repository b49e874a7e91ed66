//! `Request::decode` and `Completion::decode` of arbitrary bytes (the first
//! 64, zero-padded): no panic, consistent results, completions round-trip.
#![no_main]

#[path = "../../crates/kachedb-daemon/tests/support/fuzz_driver.rs"]
mod fuzz_driver;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(e) = fuzz_driver::check_decode(data) {
        panic!("{e}");
    }
});
