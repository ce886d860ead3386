//! Kubernetes Events with bounded output: reported by a few nodes only, deduplicated, rate
//! limited, through a bounded queue.
//!
//! A cluster can hold thousands of invalid objects, and every node's kube-ipvs sees all of
//! them: one Event per object per node would make a tenant churning bad objects drive
//! nodes × objects Event writes (5,000 nodes × 1,000 objects). So every node logs and counts
//! every invalid object (`kube_ipvs_invalid_objects_total`), but only a few nodes write its
//! Event, and what they write passes further limits:
//!
//! 0. **Reporters** ([`Reporters`]): the Event about an object is written only by the
//!    `--event-reporters` (default [`DEFAULT_REPORTERS`]) nodes that rank highest for it by
//!    rendezvous (highest-random-weight) hashing over the **candidates**: the node names of the
//!    endpoints (`nodeName`) of every EndpointSlice in the store, which every node already
//!    holds ([`Candidates`]). Each node decides alone, and every node with the same store
//!    decides the same: per object, at most k nodes write, and at least one when k ≥ 1 and a
//!    reporter is up. No API traffic: knowing every Node instead would mean watching all Nodes,
//!    whose status updates (every node, every few minutes) would then reach every node
//!    (N² events: about 80,000 a second at 5,000 nodes). A node hosting no endpoint never
//!    reports; when no endpoint names a node at all (a cluster without `nodeName`s, a test),
//!    every node reports, as without this limit. Held-back Events are counted as `delegated`.
//! 1. **Deduplication**: one Event per (object, reason) per [`DEDUP_PERIOD`] (10 minutes);
//! 2. **Rate**: at most [`MAX_PER_MINUTE`] Events per minute node-wide (a fixed window);
//! 3. **Queue**: a bounded channel of [`QUEUE_CAPACITY`] to the publisher task; when full,
//!    the new Event is dropped.
//!
//! Every Event held back is counted in `kube_ipvs_events_dropped_total{reason}` (`delegated`,
//! `duplicate`, `rate_limited`, `queue_full`); the object is still logged and counted in
//! `kube_ipvs_invalid_objects_total` on every node. Notes carry user text (names, bad values):
//! control characters are escaped and the note is cut to [`NOTE_MAX_BYTES`] (the API's limit
//! for `events.k8s.io/v1` notes); reasons and actions are fixed words.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::metrics::Metrics;

/// One Event per (object, reason) per this period.
pub const DEDUP_PERIOD: Duration = Duration::from_secs(10 * 60);
/// Events per minute, node-wide.
pub const MAX_PER_MINUTE: u32 = 30;
/// Events waiting for the publisher.
pub const QUEUE_CAPACITY: usize = 64;
/// The API's limit on an `events.k8s.io/v1` note (1 KiB).
pub const NOTE_MAX_BYTES: usize = 1024;
/// Deduplication keys kept before expired ones are pruned (admitted keys are bounded anyway:
/// at most `MAX_PER_MINUTE` × 10 per `DEDUP_PERIOD`).
const DEDUP_PRUNE_AT: usize = 1024;
/// The rate window.
const WINDOW: Duration = Duration::from_secs(60);

/// Nodes that write the Event about one object by default (`--event-reporters`).
pub const DEFAULT_REPORTERS: usize = 3;

/// FNV-1a (64 bit) of `bytes`, continuing from `state`: a hash every node and every version of
/// kube-ipvs computes the same (nodes running different builds during a rollout must agree on
/// the reporters), unlike std's `DefaultHasher`.
fn fnv1a(state: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(state, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// FNV-1a's offset basis.
const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;

/// splitmix64's finalizer: spreads the bits of a hash.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The hash of a node name.
fn node_hash(name: &str) -> u64 {
    mix(fnv1a(FNV_BASIS, name.as_bytes()))
}

/// The hash of an object: its kind, namespace and name (the same on every node; its UID is not
/// in the model).
fn object_hash(r: &Regarding) -> u64 {
    let mut h = fnv1a(FNV_BASIS, r.kind.as_bytes());
    h = fnv1a(h, b"/");
    h = fnv1a(h, r.namespace.as_deref().unwrap_or_default().as_bytes());
    h = fnv1a(h, b"/");
    mix(fnv1a(h, r.name.as_bytes()))
}

/// A node's rendezvous score for an object (higher ranks first).
fn score(object: u64, node: u64) -> u64 {
    mix(object ^ node)
}

/// The nodes that may report: distinct node names with their hashes (see the module
/// documentation). Built once per batch of rejections.
#[derive(Debug, Clone, Default)]
pub struct Candidates {
    /// (hash, name), sorted by name (the ranking's tie-break needs names).
    nodes: Vec<(u64, Box<str>)>,
}

impl Candidates {
    /// The distinct names among `names`.
    pub fn new<'a>(names: impl IntoIterator<Item = &'a str>) -> Candidates {
        let distinct: HashSet<&str> = names.into_iter().collect();
        let mut nodes: Vec<(u64, Box<str>)> = distinct
            .into_iter()
            .map(|n| (node_hash(n), Box::from(n)))
            .collect();
        nodes.sort_by(|a, b| a.1.cmp(&b.1));
        Candidates { nodes }
    }

    /// How many distinct names.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// No names at all.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}

/// Decides whether this node writes the Event about an object (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reporters {
    node: String,
    hash: u64,
    k: usize,
}

impl Reporters {
    /// This node is `node`; `k` nodes report each object (0: every node reports).
    pub fn new(node: &str, k: usize) -> Reporters {
        Reporters {
            node: node.to_string(),
            hash: node_hash(node),
            k,
        }
    }

    /// Whether this node is among the `k` candidates that rank highest for `object` (by score,
    /// ties by the smaller name). A node that is not a candidate never reports; with no
    /// candidates at all, or `k` = 0, every node does.
    pub fn reports(&self, object: &Regarding, candidates: &Candidates) -> bool {
        if self.k == 0 || candidates.is_empty() {
            return true;
        }
        if candidates
            .nodes
            .binary_search_by(|(_, n)| (**n).cmp(self.node.as_str()))
            .is_err()
        {
            return false;
        }
        let o = object_hash(object);
        let mine = score(o, self.hash);
        let mut better = 0;
        for (h, n) in &candidates.nodes {
            let s = score(o, *h);
            if s > mine || (s == mine && **n < *self.node) {
                better += 1;
                if better >= self.k {
                    return false;
                }
            }
        }
        true
    }
}

/// The object an Event is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Regarding {
    /// `v1`, `discovery.k8s.io/v1`.
    pub api_version: &'static str,
    /// `Service`, `EndpointSlice`, `Node`.
    pub kind: &'static str,
    /// Namespace (None for cluster-scoped objects).
    pub namespace: Option<String>,
    /// Name.
    pub name: String,
}

/// One Event to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventRequest {
    /// The object.
    pub regarding: Regarding,
    /// A fixed CamelCase word, e.g. `InvalidObject`, `VIPConflict`.
    pub reason: &'static str,
    /// A fixed CamelCase word, e.g. `Skip`.
    pub action: &'static str,
    /// Free text (sanitized by [`EventSink::submit`]).
    pub note: String,
}

/// What the limiter decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Send it.
    Admit,
    /// The same (object, reason) was sent within the dedup period.
    Duplicate,
    /// The per-minute cap is reached.
    RateLimited,
}

impl Admission {
    /// The `reason` label of `kube_ipvs_events_dropped_total`.
    pub fn label(self) -> &'static str {
        match self {
            Admission::Admit => "admitted",
            Admission::Duplicate => "duplicate",
            Admission::RateLimited => "rate_limited",
        }
    }
}

/// Deduplication and the per-minute cap, with time passed in (pure; tests inject it).
#[derive(Debug)]
pub struct EventLimiter {
    period: Duration,
    per_minute: u32,
    seen: HashMap<(Regarding, &'static str), Instant>,
    window: Option<Instant>,
    in_window: u32,
}

impl Default for EventLimiter {
    fn default() -> Self {
        EventLimiter::new(DEDUP_PERIOD, MAX_PER_MINUTE)
    }
}

impl EventLimiter {
    /// One Event per (object, reason) per `period`, at most `per_minute` a minute.
    pub fn new(period: Duration, per_minute: u32) -> EventLimiter {
        EventLimiter {
            period,
            per_minute,
            seen: HashMap::new(),
            window: None,
            in_window: 0,
        }
    }

    /// Decides on one Event at `now` (and records it when admitted). A rate-limited Event is
    /// not recorded as seen, so a later occurrence can still be reported.
    pub fn admit(
        &mut self,
        regarding: &Regarding,
        reason: &'static str,
        now: Instant,
    ) -> Admission {
        let key = (regarding.clone(), reason);
        if let Some(t) = self.seen.get(&key) {
            if now.saturating_duration_since(*t) < self.period {
                return Admission::Duplicate;
            }
        }
        if self
            .window
            .is_none_or(|w| now.saturating_duration_since(w) >= WINDOW)
        {
            self.window = Some(now);
            self.in_window = 0;
        }
        if self.in_window >= self.per_minute {
            return Admission::RateLimited;
        }
        self.in_window += 1;
        if self.seen.len() >= DEDUP_PRUNE_AT {
            let period = self.period;
            self.seen
                .retain(|_, t| now.saturating_duration_since(*t) < period);
        }
        self.seen.insert(key, now);
        Admission::Admit
    }

    /// Keys remembered for deduplication (memory bound checks).
    pub fn tracked(&self) -> usize {
        self.seen.len()
    }
}

/// `s` with control characters escaped (`\n`, `\u{1b}`) and cut to at most `max` bytes on a
/// character boundary.
pub fn sanitize(s: &str, max: usize) -> String {
    let mut out = String::with_capacity(s.len().min(max));
    for c in s.chars() {
        let piece: String = if c.is_control() {
            c.escape_default().collect()
        } else {
            c.to_string()
        };
        if out.len() + piece.len() > max {
            break;
        }
        out.push_str(&piece);
    }
    out
}

/// The sending side: the reporters, the limiter, then the bounded queue. Cheap to clone.
#[derive(Debug, Clone)]
pub struct EventSink {
    tx: tokio::sync::mpsc::Sender<EventRequest>,
    limiter: Arc<Mutex<EventLimiter>>,
    metrics: Option<Arc<Metrics>>,
    reporters: Option<Arc<Reporters>>,
}

/// What became of a submitted Event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Submitted {
    /// Queued for the publisher.
    Queued,
    /// Dropped: duplicate, rate limited, queue full or publisher gone (the label).
    Dropped(&'static str),
}

impl EventSink {
    /// A sink with the default limits and a queue of [`QUEUE_CAPACITY`]; the receiver goes to
    /// [`publish_events`].
    pub fn new(
        metrics: Option<Arc<Metrics>>,
    ) -> (EventSink, tokio::sync::mpsc::Receiver<EventRequest>) {
        EventSink::with_limits(EventLimiter::default(), QUEUE_CAPACITY, metrics)
    }

    /// A sink with the given limiter and queue capacity.
    pub fn with_limits(
        limiter: EventLimiter,
        capacity: usize,
        metrics: Option<Arc<Metrics>>,
    ) -> (EventSink, tokio::sync::mpsc::Receiver<EventRequest>) {
        let (tx, rx) = tokio::sync::mpsc::channel(capacity.max(1));
        (
            EventSink {
                tx,
                limiter: Arc::new(Mutex::new(limiter)),
                metrics,
                reporters: None,
            },
            rx,
        )
    }

    /// The same sink, writing Events about objects only where [`Reporters`] says so
    /// ([`Self::submit_among`]); without it, every node reports.
    pub fn with_reporters(mut self, reporters: Reporters) -> EventSink {
        self.reporters = Some(Arc::new(reporters));
        self
    }

    /// Submits one Event now (never blocks; callable from any thread).
    pub fn submit(&self, ev: EventRequest) -> Submitted {
        self.submit_at(ev, Instant::now())
    }

    /// Submits one Event about an object now if this node is one of its reporters among
    /// `candidates`; otherwise it is held back as `delegated` (another node writes it).
    pub fn submit_among(&self, ev: EventRequest, candidates: &Candidates) -> Submitted {
        if let Some(r) = &self.reporters {
            if !r.reports(&ev.regarding, candidates) {
                return self.dropped("delegated");
            }
        }
        self.submit(ev)
    }

    /// Submits one Event at `now`.
    pub fn submit_at(&self, mut ev: EventRequest, now: Instant) -> Submitted {
        let admission = {
            let mut l = match self.limiter.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            l.admit(&ev.regarding, ev.reason, now)
        };
        if admission != Admission::Admit {
            return self.dropped(admission.label());
        }
        ev.note = sanitize(&ev.note, NOTE_MAX_BYTES);
        match self.tx.try_send(ev) {
            Ok(()) => Submitted::Queued,
            Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => self.dropped("queue_full"),
            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => self.dropped("closed"),
        }
    }

    fn dropped(&self, reason: &'static str) -> Submitted {
        if let Some(m) = &self.metrics {
            m.record_event_dropped(reason);
        }
        Submitted::Dropped(reason)
    }
}

/// Publishes queued Events (`events.k8s.io/v1`, type Warning, reported by `kube-ipvs` with
/// the node as instance) until every sink is dropped. A failure is logged and counted
/// (`kube_ipvs_events_published_total{result="error"}`), never retried: the object stays in
/// the log and the invalid-objects metric.
pub async fn publish_events(
    client: kube::Client,
    node_name: String,
    mut rx: tokio::sync::mpsc::Receiver<EventRequest>,
    metrics: Option<Arc<Metrics>>,
) {
    use kube::runtime::events::{Event, EventType, Recorder, Reporter};
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "kube-ipvs".into(),
            instance: Some(node_name),
        },
    );
    while let Some(r) = rx.recv().await {
        let reference = k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some(r.regarding.api_version.into()),
            kind: Some(r.regarding.kind.into()),
            namespace: r.regarding.namespace.clone(),
            name: Some(r.regarding.name.clone()),
            ..Default::default()
        };
        let ev = Event {
            type_: EventType::Warning,
            reason: r.reason.into(),
            note: Some(r.note.clone()),
            action: r.action.into(),
            secondary: None,
        };
        let result = publish_bounded(&recorder, &ev, &reference, EVENT_PUBLISH_TIMEOUT).await;
        if let Some(m) = &metrics {
            m.record_event_published(result.is_ok());
        }
        if let Err(e) = result {
            tracing::warn!(
                kind = r.regarding.kind,
                object = %format!(
                    "{}/{}",
                    r.regarding.namespace.as_deref().unwrap_or_default(),
                    r.regarding.name
                ),
                reason = r.reason,
                error = %e,
                "could not emit an Event"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Publishing with a time limit, so an API server that does not answer holds up neither the
// Events after it nor the proxy's start.

/// Longest time publishing one Event may take (the API call, its retries included) before it
/// is given up and logged: an API server that does not answer must not hold up the Events
/// after it, nor (for the Node Event) the start of the proxy.
pub const EVENT_PUBLISH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Why an Event was not published.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The API server refused it or could not be reached.
    #[error(transparent)]
    Api(#[from] kube::Error),
    /// No answer within [`EVENT_PUBLISH_TIMEOUT`].
    #[error("no answer from the API server within {0:?}")]
    Timeout(std::time::Duration),
}

/// Publishes `ev` regarding `reference`, for at most `limit`.
pub async fn publish_bounded(
    recorder: &kube::runtime::events::Recorder,
    ev: &kube::runtime::events::Event,
    reference: &k8s_openapi::api::core::v1::ObjectReference,
    limit: std::time::Duration,
) -> Result<(), PublishError> {
    match tokio::time::timeout(limit, recorder.publish(ev, reference)).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(PublishError::Timeout(limit)),
    }
}

/// Publishes one Warning Event regarding this node's Node object (e.g. the IPVS fallback).
pub async fn publish_node_event(
    client: kube::Client,
    node_name: String,
    reason: &'static str,
    action: &'static str,
    note: String,
) {
    use kube::runtime::events::{Event, EventType, Recorder, Reporter};
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "kube-ipvs".into(),
            instance: Some(node_name.clone()),
        },
    );
    let reference = k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node_name),
        ..Default::default()
    };
    let ev = Event {
        type_: EventType::Warning,
        reason: reason.into(),
        note: Some(sanitize(&note, NOTE_MAX_BYTES)),
        action: action.into(),
        secondary: None,
    };
    if let Err(e) = publish_bounded(&recorder, &ev, &reference, EVENT_PUBLISH_TIMEOUT).await {
        tracing::warn!(error = %e, reason, "could not emit an Event on the Node");
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn obj(name: &str) -> Regarding {
        Regarding {
            api_version: "v1",
            kind: "Service",
            namespace: Some("default".into()),
            name: name.into(),
        }
    }

    fn req(name: &str, note: &str) -> EventRequest {
        EventRequest {
            regarding: obj(name),
            reason: "InvalidObject",
            action: "Skip",
            note: note.into(),
        }
    }

    #[test]
    fn one_event_per_object_and_reason_per_period() {
        let t0 = Instant::now();
        let mut l = EventLimiter::new(Duration::from_secs(600), 30);
        assert_eq!(l.admit(&obj("a"), "InvalidObject", t0), Admission::Admit);
        // Same object and reason within the period: held back, even a minute later.
        for s in [0, 1, 61, 599] {
            let now = t0 + Duration::from_secs(s);
            assert_eq!(
                l.admit(&obj("a"), "InvalidObject", now),
                Admission::Duplicate
            );
        }
        // Another reason or another object is a different Event.
        assert_eq!(l.admit(&obj("a"), "VIPConflict", t0), Admission::Admit);
        assert_eq!(l.admit(&obj("b"), "InvalidObject", t0), Admission::Admit);
        // After the period, the same Event again.
        let later = t0 + Duration::from_secs(600);
        assert_eq!(l.admit(&obj("a"), "InvalidObject", later), Admission::Admit);
    }

    #[test]
    fn per_minute_cap_holds_and_the_window_reopens() {
        let t0 = Instant::now();
        let mut l = EventLimiter::new(Duration::from_secs(600), 30);
        let results: Vec<Admission> = (0..100)
            .map(|i| {
                l.admit(
                    &obj(&format!("s{i}")),
                    "InvalidObject",
                    t0 + Duration::from_millis(i),
                )
            })
            .collect();
        let admitted = results.iter().filter(|a| **a == Admission::Admit).count();
        assert_eq!(admitted, 30);
        assert!(results[30..].iter().all(|a| *a == Admission::RateLimited));
        // A rate-limited object is not remembered: it is admitted in the next window.
        let next = t0 + Duration::from_secs(60);
        assert_eq!(
            l.admit(&obj("s99"), "InvalidObject", next),
            Admission::Admit
        );
        assert_eq!(
            l.admit(&obj("s0"), "InvalidObject", next),
            Admission::Duplicate
        );
        // 1,000 objects over 10 minutes: 30 a minute, no more.
        let mut l = EventLimiter::new(Duration::from_secs(600), 30);
        let mut admitted = 0;
        for i in 0..1000u64 {
            let now = t0 + Duration::from_millis(i * 600); // 10 minutes in all
            if l.admit(&obj(&format!("x{i}")), "InvalidObject", now) == Admission::Admit {
                admitted += 1;
            }
        }
        assert_eq!(admitted, 300);
    }

    #[test]
    fn dedup_memory_is_bounded() {
        let t0 = Instant::now();
        let mut l = EventLimiter::new(Duration::from_secs(600), 30);
        // Ten hours of distinct objects at the cap: expired keys are pruned.
        for i in 0..18_000u64 {
            let now = t0 + Duration::from_secs(2 * i);
            l.admit(&obj(&format!("o{i}")), "InvalidObject", now);
        }
        assert!(l.tracked() <= DEDUP_PRUNE_AT, "{}", l.tracked());
    }

    #[test]
    fn notes_are_escaped_and_cut_to_one_kib() {
        assert_eq!(sanitize("a\nb\x1b[31mc\td", 100), "a\\nb\\u{1b}[31mc\\td");
        let long = "é".repeat(2000); // 2 bytes each
        let s = sanitize(&long, NOTE_MAX_BYTES);
        assert_eq!(s.len(), NOTE_MAX_BYTES);
        let s = sanitize(&format!("x{long}"), NOTE_MAX_BYTES);
        assert_eq!(s.len(), NOTE_MAX_BYTES - 1, "never splits a character");
        // An escape never straddles the limit.
        let s = sanitize(&format!("{}\n", "a".repeat(1023)), NOTE_MAX_BYTES);
        assert_eq!(s, "a".repeat(1023));
    }

    #[test]
    fn invalid_object_reason_labels_are_a_fixed_set() {
        use crate::engine::{reason_label, INVALID_REASON_LABELS};
        let cases = [
            ("port 70000 out of range 1..65535", "port_out_of_range"),
            ("invalid clusterIP \"10.96.0.999\"", "invalid_clusterip"),
            ("10000 endpoints (max 1000)", "too_many_endpoints"),
            ("unknown protocol \"FOO\"", "unknown_protocol"),
            ("duplicate port 80/Tcp", "duplicate_port"),
            (
                "unknown scheduler \"x\" in annotation kube-ipvs.io/scheduler",
                "unknown_scheduler_in_annotation",
            ),
            (
                "VIP conflict: 1.2.3.4:80/TCP is served by a/b",
                "vip_conflict",
            ),
            (
                "ignored invalid externalIP \"x\" (and 2 more)",
                "ignored_invalid_externalip",
            ),
            (
                "ignored endpoint with invalid address \"10.0.0.999\"",
                "ignored_endpoint_with_invalid_address",
            ),
            (
                "over the real-server budget (1000001 real servers in its first 3 of 9 ports, \
                 max 1000000: --max-real-servers-per-service)",
                "over_the_realserver_budget",
            ),
            (
                "would overfill an ipset (KUBE-LOOP-BACK would hold 65537 members, maxelem 65536)",
                "would_overfill_an_ipset",
            ),
            (
                "hairpin members left out (40000 members would overfill KUBE-LOOP-BACK, maxelem \
                 65536): a pod reaching this Service through its ClusterIP may not reach itself",
                "hairpin_members_left_out",
            ),
            // User text that used to leak into the label: words inside a quoted value.
            ("unknown protocol \"A evil label\"", "other"),
            ("invalid externalIP \"x y z\"", "other"),
            ("something never seen", "other"),
        ];
        for (reason, want) in cases {
            let got = reason_label(reason);
            assert_eq!(got, want, "{reason}");
            assert!(INVALID_REASON_LABELS.contains(&got));
        }
    }

    /// `n` node names as a real cluster names them.
    fn node_names(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| {
                format!(
                    "ip-10-{}-{}-{}.ec2.internal",
                    i / 65_536,
                    (i / 256) % 256,
                    i % 256
                )
            })
            .collect()
    }

    #[test]
    fn every_object_is_reported_by_exactly_k_of_5000_nodes() {
        let names = node_names(5_000);
        let candidates = Candidates::new(names.iter().map(String::as_str));
        assert_eq!(candidates.len(), 5_000);
        let k = DEFAULT_REPORTERS;
        let nodes: Vec<Reporters> = names.iter().map(|n| Reporters::new(n, k)).collect();
        let mut per_node = vec![0usize; nodes.len()];
        for i in 0..1_000 {
            let o = Regarding {
                api_version: "v1",
                kind: if i % 2 == 0 {
                    "Service"
                } else {
                    "EndpointSlice"
                },
                namespace: Some(format!("tenant-{}", i % 7)),
                name: format!("bad-{i}"),
            };
            // Each node decides alone, from the same candidates.
            let mut writers = 0;
            for (j, node) in nodes.iter().enumerate() {
                if node.reports(&o, &candidates) {
                    writers += 1;
                    per_node[j] += 1;
                }
            }
            assert_eq!(writers, k, "{o:?}");
        }
        // Spread over the nodes: nobody writes for more than a small share of the objects.
        assert!(
            per_node.iter().all(|n| *n <= 10),
            "{:?}",
            per_node.iter().max()
        );
        // A node that is not a candidate (hosts no endpoint) never writes.
        let outsider = Reporters::new("not-a-candidate", k);
        assert!(!outsider.reports(&obj("x"), &candidates));
        // k = 0: everybody; no candidates at all: everybody (nothing is known to rank).
        assert!(Reporters::new("not-a-candidate", 0).reports(&obj("x"), &candidates));
        assert!(outsider.reports(&obj("x"), &Candidates::default()));
        // Fewer candidates than k: all of them write.
        let few = Candidates::new(["a", "b"]);
        assert!(["a", "b"]
            .iter()
            .all(|n| Reporters::new(n, 3).reports(&obj("x"), &few)));
    }

    #[test]
    fn reporter_hash_is_stable() {
        // Nodes running different versions during a rollout must pick the same reporters: the
        // hash is fixed (FNV-1a + splitmix64), never std's randomized or unstable hashers.
        assert_eq!(fnv1a(FNV_BASIS, b""), FNV_BASIS);
        assert_eq!(fnv1a(FNV_BASIS, b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(mix(0), 0);
        assert_eq!(object_hash(&obj("web")), object_hash(&obj("web")));
        assert_ne!(object_hash(&obj("web")), object_hash(&obj("web2")));
    }

    #[tokio::test]
    async fn sink_holds_back_events_this_node_does_not_report() {
        let metrics = Arc::new(Metrics::new());
        let (sink, mut rx) = EventSink::new(Some(metrics.clone()));
        let names = node_names(50);
        let candidates = Candidates::new(names.iter().map(String::as_str));
        let mine = Reporters::new(&names[0], 3);
        let sink = sink.with_reporters(mine.clone());
        let (mut queued, mut delegated) = (0, 0);
        // About 3 in 50 objects are this node's to report (fewer than the 30 a minute).
        for i in 0..100 {
            let ev = req(&format!("s{i}"), "bad");
            match sink.submit_among(ev.clone(), &candidates) {
                Submitted::Queued => {
                    assert!(mine.reports(&ev.regarding, &candidates));
                    queued += 1;
                }
                Submitted::Dropped("delegated") => delegated += 1,
                other => panic!("{other:?}"),
            }
        }
        assert!(queued >= 1 && delegated >= 1, "{queued} {delegated}");
        for _ in 0..queued {
            rx.recv().await.unwrap();
        }
        let line = format!("kube_ipvs_events_dropped_total{{reason=\"delegated\"}} {delegated}");
        assert!(metrics.encode().unwrap().contains(&line), "{line}");
    }

    #[tokio::test]
    async fn sink_queues_admitted_events_and_counts_every_drop() {
        let metrics = Arc::new(Metrics::new());
        let limiter = EventLimiter::new(Duration::from_secs(600), 5);
        let (sink, mut rx) = EventSink::with_limits(limiter, 3, Some(metrics.clone()));
        let t0 = Instant::now();
        let mut out = Vec::new();
        for i in 0..10 {
            out.push(sink.submit_at(req(&format!("s{i}"), "bad\nvalue"), t0));
        }
        out.push(sink.submit_at(req("s0", "again"), t0));
        let queued = out.iter().filter(|s| **s == Submitted::Queued).count();
        assert_eq!(queued, 3);
        assert_eq!(out[3], Submitted::Dropped("queue_full"));
        assert_eq!(out[4], Submitted::Dropped("queue_full"));
        assert!(out[5..10]
            .iter()
            .all(|s| *s == Submitted::Dropped("rate_limited")));
        assert_eq!(out[10], Submitted::Dropped("duplicate"));
        let first = rx.recv().await.unwrap();
        assert_eq!(first.note, "bad\\nvalue");
        let text = metrics.encode().unwrap();
        for (reason, n) in [("queue_full", 2), ("rate_limited", 5), ("duplicate", 1)] {
            let line = format!("kube_ipvs_events_dropped_total{{reason=\"{reason}\"}} {n}");
            assert!(text.contains(&line), "{line} missing:\n{text}");
        }
    }
}
