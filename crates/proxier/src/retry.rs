//! One retry policy for every kernel subsystem, and the fixed set of subsystems a sync reports.
//!
//! A failed operation of any subsystem (IPVS, kube-ipvs0 addresses, ipset, iptables, conntrack,
//! a kernel read of a full sync) is retried with exponential backoff starting at
//! `minSyncPeriod` (at least [`MIN_FLOOR`]) and doubling up to `syncPeriod`, each delay jittered by
//! ±[`RetryPolicy::jitter`] so that a fleet of nodes hit by the same fault does not retry in
//! lock-step. A success resets the backoff. Each proxier keeps one [`Backoff`] per subsystem (so one
//! per subsystem per family).
//!
//! Upstream kube-proxy retries a failed sync through its `BoundedFrequencyRunner`
//! (`proxier.syncRunner.RetryAfter(proxier.syncPeriod)` in `pkg/proxy/ipvs/proxier.go`
//! `syncProxyRules`): one fixed delay of a whole syncPeriod. kube-ipvs retries sooner first and
//! backs off to the same bound, so a transient fault heals in about minSyncPeriod and a
//! persistent one costs no more than upstream.

use std::time::{Duration, Instant};

/// The floor of the first retry delay (a `minSyncPeriod` of 0 must not retry in a busy loop).
pub const MIN_FLOOR: Duration = Duration::from_secs(1);

/// The subsystems a sync touches: a fixed, bounded set (metric labels, health reasons).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Subsystem {
    /// IPVS virtual and real servers (generic netlink).
    Ipvs,
    /// kube-ipvs0 and its addresses (rtnetlink).
    Address,
    /// ipsets.
    Ipset,
    /// iptables rules (iptables-save / iptables-restore).
    Iptables,
    /// conntrack cleanup of stale UDP flows (ctnetlink).
    Conntrack,
    /// sysctls.
    Sysctl,
    /// The API source (watches of Services, EndpointSlices and the Node).
    Source,
}

impl Subsystem {
    /// Every subsystem, in label order.
    pub const ALL: [Subsystem; 7] = [
        Subsystem::Ipvs,
        Subsystem::Address,
        Subsystem::Ipset,
        Subsystem::Iptables,
        Subsystem::Conntrack,
        Subsystem::Sysctl,
        Subsystem::Source,
    ];

    /// The metric label / health reason.
    pub fn as_str(self) -> &'static str {
        match self {
            Subsystem::Ipvs => "ipvs",
            Subsystem::Address => "address",
            Subsystem::Ipset => "ipset",
            Subsystem::Iptables => "iptables",
            Subsystem::Conntrack => "conntrack",
            Subsystem::Sysctl => "sysctl",
            Subsystem::Source => "source",
        }
    }
}

impl std::fmt::Display for Subsystem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The delays of a [`Backoff`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// First delay (`minSyncPeriod`, raised to [`MIN_FLOOR`]).
    pub min: Duration,
    /// Largest delay (`syncPeriod`).
    pub max: Duration,
    /// Relative jitter: each delay is multiplied by a factor in `1 ± jitter`.
    pub jitter: f64,
}

impl Default for RetryPolicy {
    /// kube-proxy's IPVS-mode defaults: 1 s (the floor) to 30 s, ±15 %.
    fn default() -> Self {
        RetryPolicy::new(Duration::ZERO, Duration::from_secs(30))
    }
}

impl RetryPolicy {
    /// From `minSyncPeriod` to `syncPeriod`, ±15 %.
    pub fn new(min_sync_period: Duration, sync_period: Duration) -> RetryPolicy {
        RetryPolicy {
            min: min_sync_period,
            max: sync_period,
            jitter: 0.15,
        }
    }

    /// The delay after `failures` consecutive failures (1 = the first), before jitter.
    pub fn nominal(&self, failures: u32) -> Duration {
        let max = self.max.max(MIN_FLOOR);
        let base = self.min.max(MIN_FLOOR).min(max);
        let shift = failures.saturating_sub(1).min(20);
        base.saturating_mul(1u32 << shift).min(max)
    }
}

/// Exponential backoff of one subsystem: when the next retry is due, reset on success.
#[derive(Debug, Clone)]
pub struct Backoff {
    policy: RetryPolicy,
    failures: u32,
    due: Option<Instant>,
    rng: u64,
}

impl Backoff {
    /// A backoff with no failure recorded.
    pub fn new(policy: RetryPolicy) -> Backoff {
        // Seeded per instance so that nodes (and subsystems) do not share a jitter sequence.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let local = 0u8;
        let addr = std::ptr::addr_of!(local) as u64;
        Backoff::with_seed(policy, nanos ^ addr.rotate_left(32))
    }

    /// A backoff with a fixed jitter seed (tests).
    pub fn with_seed(policy: RetryPolicy, seed: u64) -> Backoff {
        Backoff {
            policy,
            failures: 0,
            due: None,
            rng: seed | 1,
        }
    }

    /// The policy.
    pub fn policy(&self) -> RetryPolicy {
        self.policy
    }

    /// Replaces the policy (keeps the failure count).
    pub fn set_policy(&mut self, policy: RetryPolicy) {
        self.policy = policy;
    }

    fn next_unit(&mut self) -> f64 {
        // splitmix64: good enough for jitter, no dependency.
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Records a failure at `now` and schedules the next retry; returns the delay.
    pub fn failed(&mut self, now: Instant) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let nominal = self.policy.nominal(self.failures);
        let j = self.policy.jitter.clamp(0.0, 0.9);
        let factor = 1.0 - j + 2.0 * j * self.next_unit();
        let delay = nominal.mul_f64(factor);
        self.due = Some(now + delay);
        delay
    }

    /// Records a success: the next failure starts again at the first delay.
    pub fn succeeded(&mut self) {
        self.failures = 0;
        self.due = None;
    }

    /// Consecutive failures so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// True while the last attempt failed.
    pub fn failing(&self) -> bool {
        self.failures > 0
    }

    /// When the next retry is due (None: no failure pending).
    pub fn due(&self) -> Option<Instant> {
        self.due
    }

    /// True when an attempt may run at `now` (no failure, or its delay has passed).
    pub fn ready(&self, now: Instant) -> bool {
        self.due.is_none_or(|t| now >= t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn doubles_from_min_to_max_with_jitter_and_resets() {
        let p = RetryPolicy::new(Duration::from_secs(2), Duration::from_secs(30));
        assert_eq!(p.nominal(1), secs(2.0));
        assert_eq!(p.nominal(2), secs(4.0));
        assert_eq!(p.nominal(4), secs(16.0));
        assert_eq!(p.nominal(5), secs(30.0));
        assert_eq!(p.nominal(1000), secs(30.0));
        let mut b = Backoff::with_seed(p, 7);
        let t0 = Instant::now();
        assert!(b.ready(t0) && !b.failing());
        let mut seen = Vec::new();
        for n in 1..=6 {
            let d = b.failed(t0);
            let nominal = p.nominal(n).as_secs_f64();
            assert!(
                d.as_secs_f64() >= nominal * 0.85 - 1e-9
                    && d.as_secs_f64() <= nominal * 1.15 + 1e-9,
                "failure {n}: {d:?} not within 15 % of {nominal}"
            );
            assert_eq!(b.due(), Some(t0 + d));
            assert!(!b.ready(t0));
            assert!(b.ready(t0 + d));
            seen.push(d);
        }
        // Jittered: not every delay is exactly its nominal value.
        assert!(seen
            .iter()
            .enumerate()
            .any(|(i, d)| *d != p.nominal(i as u32 + 1)));
        b.succeeded();
        assert!(b.ready(t0) && !b.failing() && b.due().is_none());
        let d = b.failed(t0);
        assert!(d <= secs(2.3), "{d:?}");
    }

    #[test]
    fn zero_min_sync_period_has_a_floor() {
        let p = RetryPolicy::new(Duration::ZERO, Duration::from_secs(10));
        assert_eq!(p.nominal(1), MIN_FLOOR);
        assert_eq!(p.nominal(5), secs(10.0));
        // A syncPeriod under the floor bounds the delay at the floor.
        let p = RetryPolicy::new(Duration::ZERO, Duration::from_millis(100));
        assert_eq!(p.nominal(3), MIN_FLOOR);
    }

    #[test]
    fn labels_are_a_fixed_set() {
        let labels: Vec<&str> = Subsystem::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(
            labels,
            [
                "ipvs",
                "address",
                "ipset",
                "iptables",
                "conntrack",
                "sysctl",
                "source"
            ]
        );
    }
}
