//! The tiers the daemon is built with: the one list that names them.

use crate::tier_kind::TierKind;

/// The tiers the daemon is built with, in the order a local miss asks them
/// (docs/tiers.md). A new tier is its module (a `mod` line in `lib.rs`) and
/// its entry here.
pub static TIERS: &[&dyn TierKind] = &[&crate::disk::setup::KIND, &crate::remote::setup::KIND];
