//! The daemon's frame handler (`Store::handle`) driven by arbitrary programs
//! of frames from several sessions, with session opens and closes; the store's
//! invariants and a model of each session's reservations and pins are checked
//! after every frame (see `fuzz_driver::run_frames`).
#![no_main]

#[path = "../../crates/kachedb-daemon/tests/support/fuzz_driver.rs"]
mod fuzz_driver;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(e) = fuzz_driver::run_frames(data) {
        panic!("{e}");
    }
});
