//! The WAITs the serve loop has parked: a WAIT for a key that is not committed
//! yet is answered when a COMMIT of that key is served, or `TIMED_OUT` at its
//! deadline (`docs/PROTOCOL.md`, WAIT). Nothing here blocks: the serve loop
//! asks at each COMMIT ([`Waits::take_key`]) and each pass
//! ([`Waits::take_expired`]), and bounds its idle park by
//! [`Waits::next_deadline`].
//!
//! A channel has at most one parked WAIT: the serve loop serves nothing more
//! of a channel while its WAIT is parked (completions stay in request order),
//! so there are never more waits than channels, and the scans over them are
//! over at most `channel_count` entries.

use std::collections::HashMap;
use std::time::Instant;

/// One parked WAIT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Waiter {
    /// The key waited for.
    pub key: u128,
    /// The WAIT frame's request id, echoed in its completion.
    pub request_id: u32,
    /// When it times out; `None`: never.
    pub deadline: Option<Instant>,
}

/// The parked WAITs, by channel and by key.
#[derive(Debug, Default)]
pub(crate) struct Waits {
    /// Indexed by channel.
    by_channel: Vec<Option<Waiter>>,
    /// Key -> channels waiting for it.
    by_key: HashMap<u128, Vec<u32>>,
    count: usize,
}

impl Waits {
    /// Room for `channels` channels.
    pub(crate) fn new(channels: u32) -> Waits {
        Waits { by_channel: vec![None; channels as usize], by_key: HashMap::new(), count: 0 }
    }

    /// Whether no WAIT is parked.
    pub(crate) fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Parks `w` for `channel` (replacing a parked one, which the serve loop
    /// never has).
    pub(crate) fn park(&mut self, channel: u32, w: Waiter) {
        self.remove_channel(channel);
        let Some(slot) = self.by_channel.get_mut(channel as usize) else { return };
        *slot = Some(w);
        self.by_key.entry(w.key).or_default().push(channel);
        self.count += 1;
    }

    /// Forgets the WAIT of `channel` (its client went away), if any.
    pub(crate) fn remove_channel(&mut self, channel: u32) -> Option<Waiter> {
        let w = self.by_channel.get_mut(channel as usize)?.take()?;
        self.count -= 1;
        if let Some(chs) = self.by_key.get_mut(&w.key) {
            chs.retain(|&c| c != channel);
            if chs.is_empty() {
                self.by_key.remove(&w.key);
            }
        }
        Some(w)
    }

    /// Takes every WAIT for `key` (a COMMIT of it was served).
    pub(crate) fn take_key(&mut self, key: u128) -> Vec<(u32, Waiter)> {
        let Some(chs) = self.by_key.remove(&key) else { return Vec::new() };
        let mut out = Vec::with_capacity(chs.len());
        for ch in chs {
            if let Some(w) = self.by_channel.get_mut(ch as usize).and_then(Option::take) {
                self.count -= 1;
                out.push((ch, w));
            }
        }
        out
    }

    /// Takes every WAIT whose deadline is `now` or earlier.
    pub(crate) fn take_expired(&mut self, now: Instant) -> Vec<(u32, Waiter)> {
        if self.count == 0 {
            return Vec::new();
        }
        let expired: Vec<u32> = (0..self.by_channel.len() as u32)
            .filter(|&ch| matches!(self.by_channel[ch as usize], Some(Waiter { deadline: Some(d), .. }) if d <= now))
            .collect();
        expired.into_iter().filter_map(|ch| self.remove_channel(ch).map(|w| (ch, w))).collect()
    }

    /// Every parked WAIT, by channel.
    pub(crate) fn parked(&self) -> impl Iterator<Item = (u32, Waiter)> + '_ {
        self.by_channel.iter().enumerate().filter_map(|(ch, w)| w.map(|w| (ch as u32, w)))
    }

    /// The earliest deadline of a parked WAIT.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        if self.count == 0 {
            return None;
        }
        self.by_channel.iter().flatten().filter_map(|w| w.deadline).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn park_take_expire() {
        let now = Instant::now();
        let mut w = Waits::new(4);
        assert!(w.is_empty() && w.next_deadline().is_none());
        let a = Waiter { key: 7, request_id: 1, deadline: None };
        let b = Waiter { key: 7, request_id: 2, deadline: Some(now + Duration::from_secs(5)) };
        let c = Waiter { key: 9, request_id: 3, deadline: Some(now) };
        w.park(0, a);
        w.park(2, b);
        w.park(3, c);
        assert_eq!(w.next_deadline(), Some(now));
        assert_eq!(w.take_expired(now), vec![(3, c)]);
        assert_eq!(w.take_key(9), vec![]);
        let mut got = w.take_key(7);
        got.sort_by_key(|(ch, _)| *ch);
        assert_eq!(got, vec![(0, a), (2, b)]);
        assert!(w.is_empty());
        w.park(1, a);
        assert_eq!(w.remove_channel(1), Some(a));
        assert!(w.take_key(7).is_empty() && w.is_empty());
        // A channel outside the table is ignored.
        w.park(99, a);
        assert!(w.is_empty());
    }
}
