//! Handles: `kind << 62 | generation << 32 | index` (see the module docs of
//! [`store`](super)). Kind 0 and 3 are never issued, so the zero handle is
//! always bad; the generation is 30 bits and wraps.

/// Handle kinds; the top two bits of a handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum HandleKind {
    Reservation = 1,
    Pin = 2,
}

const GEN_BITS: u32 = 30;
pub(super) const GEN_MASK: u32 = (1 << GEN_BITS) - 1;

pub(super) fn encode_handle(kind: HandleKind, index: u32, generation: u32) -> u64 {
    ((kind as u64) << 62) | (u64::from(generation & GEN_MASK) << 32) | u64::from(index)
}

pub(super) fn decode_handle(handle: u64) -> Option<(HandleKind, u32, u32)> {
    let kind = match handle >> 62 {
        1 => HandleKind::Reservation,
        2 => HandleKind::Pin,
        _ => return None,
    };
    Some((kind, handle as u32, (handle >> 32) as u32 & GEN_MASK))
}

pub(super) fn next_generation(generation: u32) -> u32 {
    generation.wrapping_add(1) & GEN_MASK
}
