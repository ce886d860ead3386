//! The sync loop: source events in, bounded-frequency syncs out.
//!
//! Runs on a dedicated thread (the kernel calls block). Events from the sources and from the
//! node-address tracker arrive on one channel and are applied to the [`Store`] at once; syncs
//! happen when something is pending, changes at most once per `min_sync_period` (bursts
//! coalesce; work with a timer of its own, such as the periodic full sync, a retry, a drift-check
//! step or a drain check, does not restart that wait, see [`Backend::paced`]), and a full drift
//! check runs every `sync_period`. Nothing is programmed until Services and
//! EndpointSlices have both been listed once, and this node's Node has been seen or
//! [`LoopConfig::node_wait`] has passed (see [`NodeGate`]).
//!
//! The input channel is bounded ([`input_channel`]): a full channel makes the sender wait
//! (back-pressure up to the watchers), nothing is ever dropped. The store holds the truth and
//! the channel only carries changes to it; the loop drains everything queued into one batch
//! before a sync, so a burst of any size coalesces into one sync per `min_sync_period`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::time::{Duration, Instant, SystemTime};

use ipvs_netlink::Family;

use crate::ipvs_mode::{Proxier, Refusal, SyncKind, SyncReport};
use crate::kernel::Kernel;
use desired::HealthCheck;
use model::ServiceName;

use model::event::{Kind, Object, SourceEvent};
use model::store::{Changes, Store};

/// A backend for a family that could not be served at start and now can (see
/// [`Input::AddBackend`]).
pub struct NewBackend(pub Box<dyn Backend + Send>);

impl std::fmt::Debug for NewBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("NewBackend").field(&self.0.family()).finish()
    }
}

/// What the loop receives.
#[derive(Debug)]
pub enum Input {
    /// A change from a source.
    Source(SourceEvent),
    /// The node's addresses (other than kube-ipvs0's) changed.
    NodeAddresses(BTreeSet<IpAddr>),
    /// The node's addresses are not known (the tracker has not dumped them yet): until the
    /// next [`Input::NodeAddresses`], syncs use the Node object's addresses (see
    /// [`node_object_addresses`]).
    NodeAddressesUnknown,
    /// kube-ipvs0 was deleted behind our back: repair now instead of at the next resync.
    LinkDeleted,
    /// Serve one more family from now on (its first sync is a full one, like any start).
    AddBackend(NewBackend),
    /// Stop after the current step (SIGTERM): kernel state stays as it is.
    Shutdown,
}

/// Timing of the loop.
#[derive(Debug, Clone, Copy)]
pub struct LoopConfig {
    /// Minimum time between two syncs (`minSyncPeriod`).
    pub min_sync_period: Duration,
    /// Time between full drift checks (`syncPeriod`).
    pub sync_period: Duration,
    /// Return after the first successful full sync (`--once`).
    pub once: bool,
    /// Longest wait for this node's Node object before the first sync (see [`NodeGate`]).
    pub node_wait: Duration,
}

/// Capacity of the loop's input channel (events, not objects: the store holds the objects).
pub const INPUT_CAPACITY: usize = 1024;

/// The loop's input channel, bounded to `capacity` inputs (at least 1).
pub fn input_channel(capacity: usize) -> (InputSender, Receiver<Input>) {
    let (tx, rx) = std::sync::mpsc::sync_channel(capacity.max(1));
    (InputSender(tx), rx)
}

/// The sending side of [`input_channel`]: when the channel is full the sender waits until the
/// loop has taken inputs; an input is never dropped.
#[derive(Debug, Clone)]
pub struct InputSender(SyncSender<Input>);

impl InputSender {
    /// Sends from a plain thread, waiting while the channel is full; false once the loop ended.
    pub fn send_blocking(&self, input: Input) -> bool {
        self.0.send(input).is_ok()
    }

    /// Sends from async code: at once when there is room, else the wait happens on tokio's
    /// blocking pool so no runtime worker is blocked (the caller's task waits, which is the
    /// back-pressure). False once the loop ended.
    pub async fn send(&self, input: Input) -> bool {
        match self.0.try_send(input) {
            Ok(()) => true,
            Err(TrySendError::Disconnected(_)) => false,
            Err(TrySendError::Full(input)) => {
                let tx = self.0.clone();
                tokio::task::spawn_blocking(move || tx.send(input).is_ok())
                    .await
                    .unwrap_or(false)
            }
        }
    }
}

/// Holds the first sync until this node's Node object is known, for at most a bound.
///
/// NodePort addresses with `nodePortAddresses: [primary]`, topology hints (the zone label) and
/// load-balancer source ranges admitting the node all read the Node; a first sync without it
/// would compute less than a previous run programmed, and delete the difference. Both sources
/// provide the Node (the static source synthesizes one), so the gate always applies; it costs
/// nothing when the Node comes with the first lists. Like upstream kube-proxy, which waits
/// about 30 s for its Node at startup (`cmd/kube-proxy/app/server.go`, `getNodeIPs`), and then
/// goes on without it; here, what the first sync then cannot compute is adopted from the kernel
/// rather than deleted (see [`crate::adopt`]).
#[derive(Debug)]
pub struct NodeGate {
    wait: Duration,
    started: Option<Instant>,
    open: bool,
}

impl NodeGate {
    /// A gate that waits at most `wait` (zero: open at once).
    pub fn new(wait: Duration) -> NodeGate {
        NodeGate {
            wait,
            started: None,
            open: wait.is_zero(),
        }
    }

    /// True when syncs may run: the Node is known, or the wait is over. The wait starts when
    /// Services and EndpointSlices are listed (before, nothing syncs anyway).
    pub fn open(&mut self, store: &Store, now: Instant) -> bool {
        if self.open {
            return true;
        }
        if store.node().is_some() {
            if self.started.is_some() {
                tracing::info!("node object seen: first sync proceeds");
            }
            self.open = true;
            return true;
        }
        let started = *self.started.get_or_insert_with(|| {
            tracing::info!(
                wait_s = self.wait.as_secs_f64(),
                listed = store.kind_synced(Kind::Node),
                "waiting for this node's Node object before the first sync"
            );
            now
        });
        if now >= started + self.wait {
            tracing::warn!(
                waited_s = self.wait.as_secs_f64(),
                "no Node object for this node: first sync proceeds without it; \
                 NodePort virtual servers it cannot compute are kept, not deleted"
            );
            self.open = true;
        }
        self.open
    }

    /// When the wait ends, while it runs.
    pub fn deadline(&self) -> Option<Instant> {
        match (self.open, self.started) {
            (false, Some(t)) => Some(t + self.wait),
            _ => None,
        }
    }
}

/// Observes the loop (metrics, health).
pub trait SyncObserver {
    /// A change was queued (for `kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds`).
    fn queued(&self, _changes: &Changes) {}
    /// Services with Service changes and services with EndpointSlice changes not synced yet
    /// (kube-proxy's `*_changes_pending`); `(0, 0)` after each sync.
    fn pending(&self, _services: usize, _endpoints: usize) {}
    /// A sync of one family finished.
    fn synced(&self, _family: Family, _report: &SyncReport, _backend: &dyn Backend) {}
    /// Objects newly rejected as invalid by a sync of `family`: `(key, reason)`, where the key
    /// is `service ns/name` or `endpointslice ns/name` (each rejection reported once); `store`
    /// is what the sync saw.
    fn rejected(&self, _family: Family, _rejected: &[(String, String)], _store: &Store) {}
    /// Services newly isolated by a sync of `family` because the kernel refuses their
    /// programming (each reported once per isolation; see `ipvs_mode::refusal`).
    fn refused(&self, _family: Family, _refused: &[Refusal]) {}
    /// A family's backend joined the loop ([`Input::AddBackend`]).
    fn family_added(&self, _family: Family) {}
    /// A sync of `family` without error programmed the EndpointSlice changes triggered at
    /// `triggers` (their last-change-trigger-time annotations, see [`ProgrammingTriggers`]):
    /// upstream's `metrics.NetworkProgrammingLatency.Observe` in `syncProxyRules`.
    fn network_programmed(&self, _family: Family, _triggers: &[SystemTime]) {}
    /// The loop is about to wait for input; it wakes up at the latest at `until` (its next
    /// timed work: a retry, the periodic full sync, the end of the Node wait).
    fn waiting(&self, _until: Instant) {}
    /// The loop woke up and works (applies inputs, syncs) until its next [`Self::waiting`]. A
    /// step that never ends, or a wake-up that never comes, is a wedged loop (`/livez`).
    fn working(&self) {}
}

/// The most trigger times kept between two syncs of a family (a bound on memory while syncs
/// cannot run, e.g. before the first list completes); later ones are not measured.
pub const MAX_PENDING_TRIGGERS: usize = 4096;

/// Change-trigger times of EndpointSlice updates not programmed yet, per family: the start
/// points of `kubeproxy_network_programming_duration_seconds`.
///
/// Like upstream's `EndpointsChangeTracker` (`pkg/proxy/endpointschangetracker.go`,
/// `EndpointSliceUpdate` with `getLastChangeTriggerTime`): a time is recorded for an added or
/// updated slice that changed the store, whose annotation is later than the tracker's start
/// (older ones describe changes a previous proxy programmed), never for a deletion (its
/// annotation dates the slice's last update, not the deletion). A family's sync takes its
/// times whatever the outcome; only a sync without error reports them.
#[derive(Debug)]
pub struct ProgrammingTriggers {
    started: SystemTime,
    pending: BTreeMap<Family, Vec<SystemTime>>,
}

impl ProgrammingTriggers {
    /// A tracker that ignores trigger times before `started`.
    pub fn new(started: SystemTime) -> ProgrammingTriggers {
        ProgrammingTriggers {
            started,
            pending: BTreeMap::new(),
        }
    }

    /// The family and trigger time an event would record (if its change is effective).
    pub fn of_event(ev: &SourceEvent) -> Option<(Family, SystemTime)> {
        match ev {
            SourceEvent::Apply(Object::EndpointSlice(s))
            | SourceEvent::InitApply(Object::EndpointSlice(s)) => {
                Some((s.family()?, s.trigger_time?))
            }
            _ => None,
        }
    }

    /// Records a trigger time of an effective change of `family`.
    pub fn record(&mut self, family: Family, at: SystemTime) {
        if at <= self.started {
            return;
        }
        let total: usize = self.pending.values().map(Vec::len).sum();
        if total < MAX_PENDING_TRIGGERS {
            self.pending.entry(family).or_default().push(at);
        }
    }

    /// Takes the times pending for `family` (its sync is running).
    pub fn take(&mut self, family: Family) -> Vec<SystemTime> {
        self.pending.remove(&family).unwrap_or_default()
    }
}

/// One family's proxy backend (IPVS mode or iptables mode), driven by the loop.
pub trait Backend {
    /// The address family.
    fn family(&self) -> Family;
    /// Records store changes.
    fn note(&mut self, changes: &Changes);
    /// The node's addresses changed.
    fn note_node_addresses(&mut self);
    /// Asks for a full sync (drift check) next time.
    fn request_full(&mut self);
    /// The periodic sync is due (every `syncPeriod`): by default a full sync (IPVS mode's
    /// starts its sliced drift check); iptables mode runs a cheaper check (see
    /// [`crate::iptables_mode`]).
    fn periodic(&mut self) {
        self.request_full();
    }
    /// True when a sync has work to do now.
    fn pending(&self, now: Instant) -> bool;
    /// True when changes are due, the work `minSyncPeriod` paces: only a step that programs
    /// changes restarts the wait. Work with a timer of its own (IPVS mode's periodic full sync,
    /// retries with their backoff, drift-check steps at most one per `minSyncPeriod`, drain
    /// checks every drain interval) does not, so a change right after it is not held for a
    /// whole `minSyncPeriod`. Upstream's `syncRunner` paces all its syncs (each is a full one),
    /// and drains in a loop of its own (`GracefulTerminationManager`,
    /// pkg/proxy/ipvs/graceful_termination.go). By default every pending sync is paced.
    fn paced(&self, now: Instant) -> bool {
        self.pending(now)
    }
    /// True when its next sync is a full one (a drift check or a retried adoption).
    fn full_due(&self, _now: Instant) -> bool {
        false
    }
    /// When timed work (retries, drain checks, drift-check steps) is next due.
    fn retry_due(&self) -> Option<Instant>;
    /// Runs one sync.
    fn sync(&mut self, store: &Store, node_addresses: &BTreeSet<IpAddr>) -> SyncReport;
    /// Real servers draining now (IPVS mode; 0 elsewhere).
    fn draining(&self) -> usize {
        0
    }
    /// Real servers deleted after draining so far: (last connection ended, cap reached).
    fn drained(&self) -> (u64, u64) {
        (0, 0)
    }
    /// Objects currently skipped as invalid, and the total counted.
    fn invalid_objects(&self) -> (usize, u64) {
        (0, 0)
    }
    /// Service ports a Local traffic policy leaves without endpoints: (internal, external).
    fn no_local_endpoints(&self) -> (usize, usize) {
        (0, 0)
    }
    /// Objects newly rejected as invalid since the last call: `(key, reason)`.
    fn take_rejections(&mut self) -> Vec<(String, String)> {
        Vec::new()
    }
    /// Health-check node ports of externalTrafficPolicy=Local services, by service.
    fn health_checks(&self) -> BTreeMap<ServiceName, HealthCheck> {
        BTreeMap::new()
    }
    /// IPVS virtual servers and real servers programmed (IPVS mode; 0 elsewhere).
    fn ipvs_programmed(&self) -> (usize, usize) {
        (0, 0)
    }
    /// IPVS netlink requests sent so far, by command (cumulative).
    fn ipvs_requests(&self) -> ipvs_netlink::OpCounts {
        ipvs_netlink::OpCounts::default()
    }
    /// Services isolated now because the kernel refuses their programming (IPVS mode).
    fn refused_services(&self) -> usize {
        0
    }
    /// Services newly isolated since the last call.
    fn take_refusals(&mut self) -> Vec<Refusal> {
        Vec::new()
    }
}

/// An observer that does nothing.
#[derive(Debug, Default)]
pub struct NoObserver;

impl SyncObserver for NoObserver {}

/// One family's proxier and its kernel.
pub struct FamilyProxier {
    /// The proxier.
    pub proxier: Proxier,
    /// Its kernel.
    pub kernel: Box<dyn Kernel + Send>,
}

impl Backend for FamilyProxier {
    fn family(&self) -> Family {
        self.proxier.family()
    }
    fn note(&mut self, changes: &Changes) {
        self.proxier.note(changes);
    }
    fn note_node_addresses(&mut self) {
        self.proxier.note_node_addresses();
    }
    fn request_full(&mut self) {
        self.proxier.request_full();
    }
    fn pending(&self, now: Instant) -> bool {
        self.proxier.pending(now)
    }
    fn paced(&self, now: Instant) -> bool {
        self.proxier.paced_pending(now)
    }
    fn full_due(&self, now: Instant) -> bool {
        self.proxier.full_due(now)
    }
    fn retry_due(&self) -> Option<Instant> {
        self.proxier.retry_due()
    }
    fn sync(&mut self, store: &Store, node_addresses: &BTreeSet<IpAddr>) -> SyncReport {
        self.proxier
            .sync(store, node_addresses, self.kernel.as_mut())
    }
    fn draining(&self) -> usize {
        self.proxier.draining()
    }
    fn drained(&self) -> (u64, u64) {
        let s = self.proxier.drain_stats();
        (s.removed_drained, s.removed_cap)
    }
    fn invalid_objects(&self) -> (usize, u64) {
        let r = self.proxier.rejections();
        (r.current(), r.total())
    }
    fn no_local_endpoints(&self) -> (usize, usize) {
        self.proxier.desired().no_local_endpoints()
    }
    fn take_rejections(&mut self) -> Vec<(String, String)> {
        self.proxier
            .take_rejections()
            .into_iter()
            .map(|(k, why)| (k, why.to_string()))
            .collect()
    }
    fn health_checks(&self) -> BTreeMap<ServiceName, HealthCheck> {
        self.proxier.desired().health_checks()
    }
    fn ipvs_programmed(&self) -> (usize, usize) {
        self.proxier.ipvs_programmed()
    }
    fn ipvs_requests(&self) -> ipvs_netlink::OpCounts {
        self.kernel.counters().ipvs_requests
    }
    fn refused_services(&self) -> usize {
        self.proxier.refused_services()
    }
    fn take_refusals(&mut self) -> Vec<Refusal> {
        self.proxier.take_refusals()
    }
}

impl std::fmt::Debug for FamilyProxier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FamilyProxier")
            .field("family", &self.proxier.family())
            .finish_non_exhaustive()
    }
}

/// Why the loop returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// `Input::Shutdown` or every sender dropped.
    Shutdown,
    /// `once` was set and the first sync finished; `ok` tells whether it had no error.
    Once {
        /// The sync had no error.
        ok: bool,
    },
}

/// Runs until shutdown (or after the first sync with `once`).
pub fn run(
    rx: &Receiver<Input>,
    store: &mut Store,
    families: &mut Vec<Box<dyn Backend + Send>>,
    mut node_addresses: BTreeSet<IpAddr>,
    cfg: LoopConfig,
    observer: &dyn SyncObserver,
) -> Exit {
    let mut last_sync: Option<Instant> = None;
    // With `once`: every sync so far had no error.
    let mut once_ok = true;
    let mut next_full = Instant::now() + cfg.sync_period;
    // Services with changes not synced yet: (Service changes, EndpointSlice changes).
    let mut pending_services: BTreeSet<ServiceName> = BTreeSet::new();
    let mut pending_endpoints: BTreeSet<ServiceName> = BTreeSet::new();
    let mut gate = NodeGate::new(cfg.node_wait);
    let mut triggers = ProgrammingTriggers::new(SystemTime::now());
    // False while the tracker has not told the node's addresses (Input::NodeAddressesUnknown).
    let mut addresses_known = true;
    loop {
        let now = Instant::now();
        let ready = store.synced() && gate.open(store, now);
        let pending = ready && families.iter().any(|f| f.pending(now));
        let deadline = if pending {
            last_sync.map_or(now, |t| t + cfg.min_sync_period)
        } else {
            let retry = families.iter().filter_map(|f| f.retry_due()).min();
            let d = retry.map_or(next_full, |r| r.min(next_full));
            gate.deadline().map_or(d, |g| g.min(d))
        };
        let first = if deadline <= now {
            None
        } else {
            observer.waiting(deadline);
            match rx.recv_timeout(deadline - now) {
                Ok(m) => Some(m),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return Exit::Shutdown,
            }
        };
        observer.working();
        // Apply everything queued so far (a burst becomes one sync).
        let mut batch: Vec<Input> = first.into_iter().collect();
        while let Ok(m) = rx.try_recv() {
            batch.push(m);
        }
        for m in batch {
            match m {
                Input::Source(ev) => {
                    let trigger = ProgrammingTriggers::of_event(&ev);
                    let ch = store.apply(ev);
                    if !ch.is_empty() {
                        if let Some((family, at)) = trigger {
                            triggers.record(family, at);
                        }
                        observer.queued(&ch);
                        pending_services.extend(ch.services.iter().cloned());
                        pending_endpoints.extend(ch.endpoints.iter().cloned());
                        observer.pending(pending_services.len(), pending_endpoints.len());
                        for f in families.iter_mut() {
                            f.note(&ch);
                        }
                    }
                }
                Input::NodeAddressesUnknown => {
                    if addresses_known {
                        tracing::warn!(
                            "the node's addresses are not known: NodePorts use the Node \
                             object's addresses until they are"
                        );
                        addresses_known = false;
                        for f in families.iter_mut() {
                            f.note_node_addresses();
                        }
                    }
                }
                Input::NodeAddresses(addrs) => {
                    if addrs != node_addresses || !addresses_known {
                        addresses_known = true;
                        node_addresses = addrs;
                        for f in families.iter_mut() {
                            f.note_node_addresses();
                        }
                    }
                }
                Input::LinkDeleted => {
                    tracing::warn!("kube-ipvs0 was deleted; repairing");
                    for f in families.iter_mut() {
                        f.request_full();
                    }
                }
                Input::AddBackend(NewBackend(mut b)) => {
                    let family = b.family();
                    if families.iter().any(|f| f.family() == family) {
                        tracing::warn!(family = ?family, "a backend for this family runs already");
                        continue;
                    }
                    tracing::info!(family = ?family, "serving one more IP family");
                    b.request_full();
                    observer.family_added(family);
                    families.push(b);
                }
                Input::Shutdown => return Exit::Shutdown,
            }
        }
        let now = Instant::now();
        if now >= next_full {
            next_full = now + cfg.sync_period;
            for f in families.iter_mut() {
                f.periodic();
            }
        }
        if !store.synced() || !gate.open(store, now) {
            continue;
        }
        if last_sync.is_some_and(|t| now < t + cfg.min_sync_period) {
            continue;
        }
        if !families.iter().any(|f| f.pending(now)) {
            continue;
        }
        let mut all_ok = true;
        // Every family that synced ran a full sync without error: the drift check just
        // happened, so the next periodic one is due a whole period later (upstream's
        // BoundedFrequencyRunner counts its maxInterval from the last run too). Without this a
        // first sync longer than the period (10,000 services in the emulated benchmark VM) was
        // followed at once by a second full read of everything it had just programmed.
        let mut all_full_ok = true;
        let fallback;
        let addresses = if addresses_known {
            &node_addresses
        } else {
            fallback = node_object_addresses(store);
            &fallback
        };
        // At most one full sync a step: a second family's full sync (seconds at 5,000 Services in
        // the emulated VM, even with nothing of its family) waits for the next step, so the
        // changes that arrived during the first one are programmed before it, not after both.
        let mut ran_full = false;
        let mut deferred = false;
        // Some family programs changes: the work `min_sync_period` paces (see `Backend::paced`).
        let mut paced = false;
        for f in families.iter_mut() {
            if !f.pending(now) {
                continue;
            }
            if ran_full && f.full_due(now) {
                deferred = true;
                all_full_ok = false;
                continue;
            }
            paced |= f.paced(now);
            ran_full |= f.full_due(now);
            let programmed = triggers.take(f.family());
            let report = f.sync(store, addresses);
            log_report(f.family(), &report);
            all_ok &= report.ok();
            all_full_ok &= report.ok() && report.kind == SyncKind::Full;
            observer.synced(f.family(), &report, f.as_ref());
            if report.ok() && !programmed.is_empty() {
                observer.network_programmed(f.family(), &programmed);
            }
            let rejected = f.take_rejections();
            if !rejected.is_empty() {
                observer.rejected(f.family(), &rejected, store);
            }
            let refused = f.take_refusals();
            if !refused.is_empty() {
                observer.refused(f.family(), &refused);
            }
        }
        if paced {
            last_sync = Some(Instant::now());
        }
        if all_full_ok {
            next_full = Instant::now() + cfg.sync_period;
        }
        // Like kube-proxy, whose sync drains its change trackers whatever the outcome (once every
        // family has synced them).
        if !deferred && (!pending_services.is_empty() || !pending_endpoints.is_empty()) {
            pending_services.clear();
            pending_endpoints.clear();
            observer.pending(0, 0);
        }
        // `--once` ends after every family's first full sync (a deferred one runs next step).
        once_ok &= all_ok;
        if cfg.once && !deferred {
            return Exit::Once { ok: once_ok };
        }
    }
}

/// The Node object's InternalIP and ExternalIP addresses: the node's addresses while the
/// tracker does not know them (its first dump failed). Upstream kube-proxy takes the node IPs
/// from the Node object (`cmd/kube-proxy/app/server.go`, `getNodeIPs` / `detectNodeIPs`); the
/// tracker's live addresses replace them as soon as it has some.
pub fn node_object_addresses(store: &Store) -> BTreeSet<IpAddr> {
    model::NodeInfo::from_node("", store.node(), BTreeSet::new())
        .primary_ips
        .into_iter()
        .collect()
}

fn log_report(family: Family, r: &SyncReport) {
    tracing::info!(
        family = ?family,
        kind = ?r.kind,
        services = r.services_derived,
        ipvs_ops = r.ipvs_ops,
        drained = r.drained,
        address_ops = r.address_ops,
        ipset_changes = r.ipset_changes,
        iptables_restored = r.iptables_restored,
        errors = r.errors.len(),
        refused = r.refused.values().sum::<usize>(),
        elapsed_ms = r.duration.as_millis() as u64,
        phases = %r.phases_text(),
        "sync done"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::discovery::v1::EndpointSlice;

    fn slice_at(address_type: &str, at: Option<&str>) -> Box<EndpointSlice> {
        let mut s = EndpointSlice {
            address_type: address_type.to_string(),
            ..Default::default()
        };
        if let Some(at) = at {
            s.metadata.annotations = Some(
                [(
                    model::LAST_CHANGE_TRIGGER_TIME_ANNOTATION.to_string(),
                    at.to_string(),
                )]
                .into(),
            );
        }
        Box::new(s)
    }

    /// A backend whose syncs take `delay`, full when asked (and the first), recording each.
    struct SlowBackend {
        full: bool,
        delay: Duration,
        log: std::sync::Arc<std::sync::Mutex<Vec<SyncKind>>>,
    }

    impl Backend for SlowBackend {
        fn family(&self) -> Family {
            Family::Inet
        }
        fn note(&mut self, _: &Changes) {}
        fn note_node_addresses(&mut self) {}
        fn request_full(&mut self) {
            self.full = true;
        }
        fn pending(&self, _: Instant) -> bool {
            self.full
        }
        fn retry_due(&self) -> Option<Instant> {
            None
        }
        fn sync(&mut self, _: &Store, _: &BTreeSet<IpAddr>) -> SyncReport {
            std::thread::sleep(self.delay);
            let kind = if self.full {
                SyncKind::Full
            } else {
                SyncKind::Incremental
            };
            self.full = false;
            self.log.lock().unwrap().push(kind);
            SyncReport::new(kind)
        }
    }

    /// Sends the start and the end of the Service and EndpointSlice lists: the store is synced.
    fn send_lists(tx: &std::sync::mpsc::SyncSender<Input>) {
        for k in [Kind::Service, Kind::EndpointSlice] {
            tx.send(Input::Source(SourceEvent::Init(k))).unwrap();
            tx.send(Input::Source(SourceEvent::InitDone(k))).unwrap();
        }
    }

    /// The Service `default/web` arriving from a source.
    fn web_service() -> Input {
        let svc = k8s_openapi::api::core::v1::Service {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some("web".into()),
                namespace: Some("default".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        Input::Source(SourceEvent::Apply(Object::from(&svc)))
    }

    /// Polls `done` every 5 ms until it holds (the test's watcher thread).
    fn wait_for(done: impl Fn() -> bool) {
        while !done() {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Runs the loop on an empty store until `watcher` shuts it down.
    fn run_to_shutdown(
        rx: &Receiver<Input>,
        families: &mut Vec<Box<dyn Backend + Send>>,
        cfg: LoopConfig,
        watcher: std::thread::JoinHandle<()>,
    ) {
        let mut store = Store::new();
        let exit = run(rx, &mut store, families, BTreeSet::new(), cfg, &NoObserver);
        watcher.join().unwrap();
        assert!(matches!(exit, Exit::Shutdown));
    }

    /// Issue #18 item 4: a first sync that takes longer than `sync_period` is not followed at
    /// once by another full sync; the next one is due a period after it.
    #[test]
    fn slow_first_sync_is_not_followed_by_an_immediate_full_resync() {
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut families: Vec<Box<dyn Backend + Send>> = vec![Box::new(SlowBackend {
            full: true,
            delay: Duration::from_millis(1500),
            log: log.clone(),
        })];
        let cfg = LoopConfig {
            min_sync_period: Duration::from_millis(10),
            sync_period: Duration::from_secs(1),
            once: false,
            node_wait: Duration::ZERO,
        };
        let (tx, rx) = std::sync::mpsc::sync_channel(16);
        send_lists(&tx);
        let watcher = {
            let log = log.clone();
            std::thread::spawn(move || {
                // Once the first sync is done, a little less than a period passes, then stop.
                while log.lock().unwrap().is_empty() {
                    std::thread::sleep(Duration::from_millis(10));
                }
                std::thread::sleep(Duration::from_millis(300));
                tx.send(Input::Shutdown).unwrap();
            })
        };
        run_to_shutdown(&rx, &mut families, cfg, watcher);
        // Before: the period had run out during the first sync, so a second full sync (another
        // 1.5 s) started right after it.
        assert_eq!(*log.lock().unwrap(), vec![SyncKind::Full]);
    }

    /// The (family, kind) of each sync, in order, shared by the backends of a test.
    type SyncLog = std::sync::Arc<std::sync::Mutex<Vec<(Family, SyncKind)>>>;
    /// Set when a full sync starts.
    type Flag = std::sync::Arc<std::sync::atomic::AtomicBool>;

    impl FamilyBackend {
        /// A backend of `family` with a full sync due, recording into `log`.
        fn boxed(
            family: Family,
            delay: Duration,
            syncing: &Flag,
            log: &SyncLog,
        ) -> Box<dyn Backend + Send> {
            Box::new(FamilyBackend {
                family,
                full: true,
                dirty: false,
                delay,
                syncing: syncing.clone(),
                log: log.clone(),
            })
        }
    }

    /// A backend of `family` whose full syncs take `delay`; a change makes it pending for an
    /// incremental sync. Records (family, kind) of each sync in a shared log.
    struct FamilyBackend {
        family: Family,
        full: bool,
        dirty: bool,
        delay: Duration,
        syncing: Flag,
        log: SyncLog,
    }

    impl Backend for FamilyBackend {
        fn family(&self) -> Family {
            self.family
        }
        fn note(&mut self, _: &Changes) {
            self.dirty = true;
        }
        fn note_node_addresses(&mut self) {}
        fn request_full(&mut self) {
            self.full = true;
        }
        fn pending(&self, _: Instant) -> bool {
            self.full || self.dirty
        }
        fn full_due(&self, _: Instant) -> bool {
            self.full
        }
        fn retry_due(&self) -> Option<Instant> {
            None
        }
        fn sync(&mut self, _: &Store, _: &BTreeSet<IpAddr>) -> SyncReport {
            let kind = if self.full {
                self.syncing
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                std::thread::sleep(self.delay);
                SyncKind::Full
            } else {
                SyncKind::Incremental
            };
            (self.full, self.dirty) = (false, false);
            self.log.lock().unwrap().push((self.family, kind));
            SyncReport::new(kind)
        }
    }

    /// A change that arrives during one family's full sync is programmed before the other
    /// family's full sync runs, not after it: at most one full sync per step.
    #[test]
    fn a_change_waits_for_one_full_sync_not_for_every_familys() {
        let (log, syncing) = (SyncLog::default(), Flag::default());
        let mut families = vec![
            FamilyBackend::boxed(Family::Inet, Duration::from_millis(500), &syncing, &log),
            FamilyBackend::boxed(Family::Inet6, Duration::ZERO, &syncing, &log),
        ];
        let cfg = LoopConfig {
            min_sync_period: Duration::from_millis(10),
            sync_period: Duration::from_secs(60),
            once: false,
            node_wait: Duration::ZERO,
        };
        let (tx, rx) = std::sync::mpsc::sync_channel(16);
        send_lists(&tx);
        let watcher = {
            let (log, syncing) = (log.clone(), syncing.clone());
            std::thread::spawn(move || {
                // During the IPv4 full sync, a Service arrives.
                wait_for(|| syncing.load(std::sync::atomic::Ordering::SeqCst));
                tx.send(web_service()).unwrap();
                wait_for(|| log.lock().unwrap().len() >= 3);
                tx.send(Input::Shutdown).unwrap();
            })
        };
        run_to_shutdown(&rx, &mut families, cfg, watcher);
        // Before: IPv4 full, IPv6 full, then the change (it waited for both full syncs).
        assert_eq!(
            log.lock().unwrap()[..3],
            [
                (Family::Inet, SyncKind::Full),
                (Family::Inet, SyncKind::Incremental),
                (Family::Inet6, SyncKind::Full),
            ]
        );
    }

    /// A backend whose first sync is full and schedules a drain check `drain_after` later; a
    /// change makes it pending. Records what each sync did and when.
    struct DrainBackend {
        full: bool,
        dirty: bool,
        drain_due: Option<Instant>,
        drain_after: Duration,
        log: std::sync::Arc<std::sync::Mutex<Vec<(&'static str, Instant)>>>,
    }

    impl Backend for DrainBackend {
        fn family(&self) -> Family {
            Family::Inet
        }
        fn note(&mut self, _: &Changes) {
            self.dirty = true;
        }
        fn note_node_addresses(&mut self) {}
        fn request_full(&mut self) {}
        fn pending(&self, now: Instant) -> bool {
            self.paced(now) || self.drain_due.is_some_and(|t| now >= t)
        }
        fn paced(&self, _: Instant) -> bool {
            self.full || self.dirty
        }
        fn retry_due(&self) -> Option<Instant> {
            self.drain_due
        }
        fn sync(&mut self, _: &Store, _: &BTreeSet<IpAddr>) -> SyncReport {
            let now = Instant::now();
            let what = if self.full {
                self.drain_due = Some(now + self.drain_after);
                "full"
            } else if self.dirty {
                "change"
            } else {
                self.drain_due = None;
                "drain"
            };
            (self.full, self.dirty) = (false, false);
            self.log.lock().unwrap().push((what, now));
            SyncReport::new(SyncKind::Incremental)
        }
    }

    /// A change right after a step that only checked draining real servers is programmed at
    /// once, not a whole `min_sync_period` later: in the peers benchmark (minSyncPeriod 1 s)
    /// ten of 30 endpoint changes waited 0.5-0.9 s behind such a step.
    #[test]
    fn a_drain_only_step_does_not_hold_the_next_change_for_min_sync_period() {
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let min = Duration::from_secs(2);
        let mut families: Vec<Box<dyn Backend + Send>> = vec![Box::new(DrainBackend {
            full: true,
            dirty: false,
            drain_due: None,
            drain_after: min + Duration::from_millis(200),
            log: log.clone(),
        })];
        let cfg = LoopConfig {
            min_sync_period: min,
            sync_period: Duration::from_secs(600),
            once: false,
            node_wait: Duration::ZERO,
        };
        let (tx, rx) = std::sync::mpsc::sync_channel(16);
        send_lists(&tx);
        let watcher = {
            let log = log.clone();
            std::thread::spawn(move || {
                // Right after the drain check, a Service arrives.
                wait_for(|| log.lock().unwrap().iter().any(|(w, _)| *w == "drain"));
                tx.send(web_service()).unwrap();
                wait_for(|| log.lock().unwrap().len() >= 3);
                tx.send(Input::Shutdown).unwrap();
            })
        };
        run_to_shutdown(&rx, &mut families, cfg, watcher);
        let log = log.lock().unwrap();
        let what: Vec<&str> = log.iter().map(|(w, _)| *w).collect();
        assert_eq!(what, ["full", "drain", "change"]);
        // Before: the change waited until `min` after the drain step (the loop sleeps to that
        // deadline, so never less).
        let held = log[2].1.duration_since(log[1].1);
        assert!(
            held < min,
            "the change waited {held:?} after the drain step"
        );
    }

    /// `--once` returns after every family's full sync, not after the first step (which runs
    /// one family's only): the oracle's `--once` runs left the IPv6 scenarios unprogrammed.
    #[test]
    fn once_returns_after_every_familys_full_sync() {
        let (log, syncing) = (SyncLog::default(), Flag::default());
        let mut families: Vec<Box<dyn Backend + Send>> = [Family::Inet, Family::Inet6]
            .into_iter()
            .map(|family| FamilyBackend::boxed(family, Duration::ZERO, &syncing, &log))
            .collect();
        let cfg = LoopConfig {
            min_sync_period: Duration::from_millis(10),
            sync_period: Duration::from_secs(60),
            once: true,
            node_wait: Duration::ZERO,
        };
        let (tx, rx) = std::sync::mpsc::sync_channel(16);
        send_lists(&tx);
        let mut store = Store::new();
        let exit = run(
            &rx,
            &mut store,
            &mut families,
            BTreeSet::new(),
            cfg,
            &NoObserver,
        );
        assert_eq!(exit, Exit::Once { ok: true });
        assert_eq!(
            *log.lock().unwrap(),
            [
                (Family::Inet, SyncKind::Full),
                (Family::Inet6, SyncKind::Full)
            ]
        );
    }

    /// Records the loop's liveness hooks and its syncs, in order.
    #[derive(Default)]
    struct Steps(std::sync::Mutex<Vec<(&'static str, Option<Duration>)>>);

    impl SyncObserver for Steps {
        fn waiting(&self, until: Instant) {
            let left = until.saturating_duration_since(Instant::now());
            self.0.lock().unwrap().push(("waiting", Some(left)));
        }
        fn working(&self) {
            self.0.lock().unwrap().push(("working", None));
        }
        fn synced(&self, _: Family, _: &SyncReport, _: &dyn Backend) {
            self.0.lock().unwrap().push(("synced", None));
        }
    }

    /// `/livez` relies on these hooks: every sync runs inside a step the loop announced with
    /// `working` (so a sync that never returns leaves the loop "working" since its start), and
    /// every wait announces its deadline, at most a sync period away.
    #[test]
    fn syncs_run_inside_working_steps_and_waits_announce_bounded_deadlines() {
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut families: Vec<Box<dyn Backend + Send>> = vec![Box::new(SlowBackend {
            full: true,
            delay: Duration::ZERO,
            log: log.clone(),
        })];
        let cfg = LoopConfig {
            min_sync_period: Duration::from_millis(10),
            sync_period: Duration::from_secs(1),
            once: false,
            node_wait: Duration::ZERO,
        };
        let (tx, rx) = std::sync::mpsc::sync_channel(16);
        let steps = Steps::default();
        let watcher = {
            let log = log.clone();
            std::thread::spawn(move || {
                // List, then stop after two syncs (the second is the periodic full one).
                for k in [Kind::Service, Kind::EndpointSlice] {
                    tx.send(Input::Source(SourceEvent::Init(k))).unwrap();
                    tx.send(Input::Source(SourceEvent::InitDone(k))).unwrap();
                }
                while log.lock().unwrap().len() < 2 {
                    std::thread::sleep(Duration::from_millis(10));
                }
                tx.send(Input::Shutdown).unwrap();
            })
        };
        let mut store = Store::new();
        let exit = run(&rx, &mut store, &mut families, BTreeSet::new(), cfg, &steps);
        watcher.join().unwrap();
        assert!(matches!(exit, Exit::Shutdown));
        let seen = steps.0.lock().unwrap().clone();
        assert_eq!(
            seen.iter().filter(|(h, _)| *h == "synced").count(),
            2,
            "{seen:?}"
        );
        let mut last_hook = None;
        for (hook, left) in &seen {
            match *hook {
                "synced" => assert_eq!(last_hook, Some("working"), "{seen:?}"),
                "waiting" => {
                    assert!(left.is_some_and(|l| l <= cfg.sync_period), "{seen:?}");
                    last_hook = Some("waiting");
                }
                _ => last_hook = Some("working"),
            }
        }
        assert_eq!(seen.first().map(|s| s.0), Some("waiting"), "{seen:?}");
    }

    #[test]
    fn trigger_of_added_or_updated_slices_only() {
        let at = "2026-01-02T03:04:05.5Z";
        let want = SystemTime::UNIX_EPOCH + Duration::from_millis(1_767_323_045_500);
        for ev in [
            SourceEvent::Apply(Object::from(*slice_at("IPv4", Some(at)))),
            SourceEvent::InitApply(Object::from(*slice_at("IPv4", Some(at)))),
        ] {
            assert_eq!(
                ProgrammingTriggers::of_event(&ev),
                Some((Family::Inet, want))
            );
        }
        let v6 = SourceEvent::Apply(Object::from(*slice_at("IPv6", Some(at))));
        assert_eq!(
            ProgrammingTriggers::of_event(&v6),
            Some((Family::Inet6, want))
        );
        // A deletion's annotation dates the slice's last update, not the deletion.
        let del = SourceEvent::Delete(Object::from(*slice_at("IPv4", Some(at))));
        assert_eq!(ProgrammingTriggers::of_event(&del), None);
        for (ty, value) in [
            ("FQDN", Some(at)),
            ("IPv4", None),
            ("IPv4", Some("yesterday")),
        ] {
            let ev = SourceEvent::Apply(Object::from(*slice_at(ty, value)));
            assert_eq!(ProgrammingTriggers::of_event(&ev), None, "{ty} {value:?}");
        }
    }

    #[test]
    fn triggers_before_the_start_are_ignored_and_taken_per_family() {
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let mut t = ProgrammingTriggers::new(start);
        t.record(Family::Inet, start - Duration::from_secs(1));
        t.record(Family::Inet, start);
        t.record(Family::Inet, start + Duration::from_secs(1));
        t.record(Family::Inet6, start + Duration::from_secs(2));
        assert_eq!(t.take(Family::Inet), vec![start + Duration::from_secs(1)]);
        assert!(t.take(Family::Inet).is_empty());
        assert_eq!(t.take(Family::Inet6), vec![start + Duration::from_secs(2)]);
    }

    #[test]
    fn pending_triggers_are_bounded() {
        let start = SystemTime::UNIX_EPOCH;
        let mut t = ProgrammingTriggers::new(start);
        for i in 0..MAX_PENDING_TRIGGERS + 10 {
            let fam = if i % 2 == 0 {
                Family::Inet
            } else {
                Family::Inet6
            };
            t.record(fam, start + Duration::from_secs(1 + i as u64));
        }
        let n = t.take(Family::Inet).len() + t.take(Family::Inet6).len();
        assert_eq!(n, MAX_PENDING_TRIGGERS);
    }
}
