//! The door of a port anyone may reach (the rendezvous store's, a rank's): how many connections
//! may be in their handshake at once, in all and from one source address, and how often a refusal
//! is logged. A stranger who opens connections and sends nothing, or a byte at a time, holds at
//! most its source's share of the slots until the handshake's deadline: the job's own processes,
//! from other addresses or after a retry, still get in.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Handshake slots: at most `total` connections in their handshake at once, at most
/// `per_source` of them from one address. Clones share the slots.
#[derive(Debug, Clone)]
pub(crate) struct Gate {
    total: usize,
    per_source: usize,
    taken: Arc<Mutex<Taken>>,
}

#[derive(Debug, Default)]
struct Taken {
    total: usize,
    by_source: HashMap<IpAddr, usize>,
}

/// One connection's handshake slot, given back when dropped.
#[derive(Debug)]
pub(crate) struct Pass {
    source: IpAddr,
    taken: Arc<Mutex<Taken>>,
}

impl Drop for Pass {
    fn drop(&mut self) {
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        taken.total = taken.total.saturating_sub(1);
        if let Some(n) = taken.by_source.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                taken.by_source.remove(&self.source);
            }
        }
    }
}

/// Why a connection got no slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Full {
    /// Every slot is taken.
    All(usize),
    /// Its source holds its share already.
    Source(usize),
}

impl std::fmt::Display for Full {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Full::All(n) => write!(f, "{n} connections are in their handshake already"),
            Full::Source(n) => write!(f, "its address has {n} connections in their handshake"),
        }
    }
}

impl Gate {
    /// `total` slots, `per_source` of them at most for one address.
    pub(crate) fn new(total: usize, per_source: usize) -> Self {
        Self {
            total,
            per_source: per_source.min(total),
            taken: Arc::default(),
        }
    }

    /// A slot for a connection from `source`, if its address and the whole have one free.
    pub(crate) fn enter(&self, source: IpAddr) -> Result<Pass, Full> {
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        if taken.total >= self.total {
            return Err(Full::All(self.total));
        }
        let from_source = taken.by_source.get(&source).copied().unwrap_or(0);
        if from_source >= self.per_source {
            return Err(Full::Source(self.per_source));
        }
        taken.total += 1;
        *taken.by_source.entry(source).or_insert(0) += 1;
        Ok(Pass {
            source,
            taken: self.taken.clone(),
        })
    }
}

/// A log line that is written at most once per `every`, with the count of those left out since.
#[derive(Debug)]
pub(crate) struct RateLimited {
    every: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimited {
    /// At most one line per `every`.
    pub(crate) fn new(every: Duration) -> Self {
        Self {
            every,
            last: None,
            suppressed: 0,
        }
    }

    /// `Some(lines left out since the last one)` when a line may be written now.
    pub(crate) fn allow(&mut self) -> Option<u64> {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|last| now.duration_since(last) < self.every)
        {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// `text` (a peer's run id, a refusal) as a log may show it: control characters escaped, at most
/// 200 characters.
pub(crate) fn printable(text: &str) -> String {
    let escaped: String = text
        .chars()
        .flat_map(char::escape_debug)
        .take(200)
        .collect();
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_address_cannot_take_every_slot_and_slots_come_back() {
        let gate = Gate::new(4, 2);
        let (a, b, c): (IpAddr, IpAddr, IpAddr) = (
            "10.0.0.1".parse().unwrap(),
            "10.0.0.2".parse().unwrap(),
            "10.0.0.3".parse().unwrap(),
        );
        let first = gate.enter(a).unwrap();
        let _second = gate.enter(a).unwrap();
        assert_eq!(gate.enter(a).unwrap_err(), Full::Source(2));
        let _b1 = gate.enter(b).unwrap();
        let _b2 = gate.enter(b).unwrap();
        assert_eq!(gate.enter(c).unwrap_err(), Full::All(4));
        drop(first);
        assert!(gate.enter(c).is_ok(), "a slot given back is free again");
        assert!(gate.taken.lock().unwrap().by_source.len() <= 3);
    }

    #[test]
    fn a_rate_limited_line_counts_what_it_left_out() {
        let mut limit = RateLimited::new(Duration::from_millis(50));
        assert_eq!(limit.allow(), Some(0));
        assert_eq!(limit.allow(), None);
        assert_eq!(limit.allow(), None);
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(limit.allow(), Some(2));
        assert_eq!(printable("run\u{1b}[31m\n"), "run\\u{1b}[31m\\n");
    }
}
