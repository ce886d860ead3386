//! IO: read and apply state, optionally inside a network namespace. Sets are read over the
//! kernel's ipset netlink protocol (one LIST request per owned set, no process; `ipset save`
//! when netlink cannot be used); members are added and deleted over it too (pipelined, no
//! process), and sets are created, recreated and destroyed by one `ipset restore -exist` per
//! apply (plus one per rejected line, bounded), which also takes the members when netlink is
//! unavailable or the diff destroys a set.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::entry::Entry;
use crate::state::{parse_save, restore_lines, IpsetDiff, IpsetState, LineOrigin};
use crate::{Error, Result};
use exec::Output;

mod list;
mod members;

pub use members::netlink_eligible;
use members::NetlinkState;

/// Largest diff (members added plus deleted) [`Ipset::apply`] sends over netlink by default:
/// no limit.
///
/// Small diffs (an incremental sync touches a handful of members per changed service) take
/// well under a millisecond this way, while one `ipset restore` process costs ~50 ms whatever
/// its size. Bulk loads gain too: 50,000 members (10,000 ClusterIP services, 3 local endpoints
/// each) took 11.2–13.7 s with `ipset restore` and 2.6–2.9 s as pipelined requests from a debug
/// build in the test VM (QEMU TCG; 0.80–0.85 s against 0.28–0.34 s on the host), because `ipset`
/// spends that time parsing its input, not in the kernel. Sets are still created, recreated and destroyed by
/// `ipset restore` (the one path that knows every set type's options).
pub const NETLINK_MAX_MEMBERS: usize = usize::MAX;

/// How long one `ipset` process may run by default before it is killed (with its process
/// group) and the call fails with [`Error::Timeout`].
///
/// Why 30 s: the slowest call is a first sync's `ipset restore` of every member. Measured on
/// the 2-core host: 100,000 `hash:ip,port` members restored in 0.71 s and saved in 0.40 s; in
/// the benchmark (docs/benchmarks.md, P5) 10,000 members took 4.1 s in the emulated (TCG)
/// test VM, which is tens of times slower than hardware. Thirty seconds leaves room for that on a
/// slow or loaded node, so only an `ipset` that is stuck (a kernel lock, a hung
/// `ip netns exec`) hits it, and it is no longer than the default `syncPeriod`, so a stuck
/// process fails its sync before the next one is due. Upstream kube-proxy runs ipset with no
/// limit at all. `--ipset-timeout` changes it.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// How `ipset` is started: which binary, optionally inside `ip netns exec NAME`, and how long
/// one process may run.
#[derive(Debug, Clone)]
pub struct Runner {
    /// The ipset program (looked up in `PATH` when it has no `/`).
    pub ipset: PathBuf,
    /// Namespace and time limit of one process (default [`DEFAULT_TIMEOUT`]): past it the
    /// process (with its process group) is killed and the call fails with [`Error::Timeout`].
    pub exec: exec::Runner,
}

impl Default for Runner {
    fn default() -> Self {
        Runner {
            ipset: PathBuf::from("ipset"),
            exec: exec::Runner::new().with_timeout(DEFAULT_TIMEOUT),
        }
    }
}

impl Runner {
    /// Run `ipset` from `PATH` in the current namespace.
    pub fn new() -> Runner {
        Runner::default()
    }

    /// Run `ipset` inside the named network namespace.
    pub fn in_netns(name: impl Into<String>) -> Runner {
        Runner {
            exec: exec::Runner::in_netns(name).with_timeout(DEFAULT_TIMEOUT),
            ..Runner::default()
        }
    }

    /// The same runner with another time limit per process.
    pub fn with_timeout(mut self, timeout: Duration) -> Runner {
        self.exec.timeout = timeout;
        self
    }

    fn run(&self, args: &[&str], stdin: Option<&str>) -> Result<Output> {
        let out = self.exec.run(self.ipset.as_os_str(), args, stdin)?;
        if !out.success {
            if let Some(k) = kernel_support_problem(&out.stderr) {
                return Err(Error::KernelSupport(k));
            }
        }
        Ok(out)
    }
}

/// Recognise ipset's messages about missing kernel support.
fn kernel_support_problem(stderr: &str) -> Option<String> {
    let s = stderr.to_ascii_lowercase();
    if s.contains("cannot open session to kernel")
        || s.contains("kernel support protocol versions")
        || s.contains("ipset protocol error")
        || s.contains("protocol not supported")
    {
        return Some(format!(
            "the kernel has no ip_set (CONFIG_IP_SET) support: {}",
            stderr.trim()
        ));
    }
    if s.contains("set type") && s.contains("not supported") {
        return Some(format!(
            "the kernel lacks an ipset set type kube-ipvs needs: {}",
            stderr.trim()
        ));
    }
    None
}

/// An entry (or set operation) the kernel rejected, with the object it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// Set the line touched.
    pub set: String,
    /// The member, for add/del lines.
    pub entry: Option<Entry>,
    /// Owner label given when the entry was inserted ("" if none).
    pub owner: String,
    /// The restore line.
    pub line: String,
    /// ipset's message.
    pub message: String,
    /// Other lines dropped with it (members of a set that could not be (re)created).
    pub skipped: usize,
}

/// Result of [`Ipset::apply`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApplyReport {
    /// Restore lines in the diff (for the netlink path: members added or deleted).
    pub lines: usize,
    /// Processes spawned for this apply.
    pub processes: u64,
    /// Netlink requests sent for this apply (0 when it went through `ipset restore`).
    pub requests: u64,
    /// Lines the kernel (or ipset) rejected; all other lines were applied.
    pub rejected: Vec<Rejected>,
}

/// The ipset applier.
pub struct Ipset {
    runner: Runner,
    spawned: AtomicU64,
    requests: AtomicU64,
    max_retries: usize,
    netlink_max: usize,
    netlink: Mutex<NetlinkState>,
}

impl std::fmt::Debug for Ipset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ipset")
            .field("runner", &self.runner)
            .field("spawned", &self.spawned)
            .field("requests", &self.requests)
            .field("max_retries", &self.max_retries)
            .field("netlink_max", &self.netlink_max)
            .finish_non_exhaustive()
    }
}

impl Default for Ipset {
    fn default() -> Self {
        Ipset::new(Runner::new())
    }
}

impl Ipset {
    /// An applier using `runner`. After a rejected line the rest is retried; at most 8 retries
    /// per apply by default.
    pub fn new(runner: Runner) -> Ipset {
        Ipset {
            runner,
            spawned: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            max_retries: 8,
            netlink_max: NETLINK_MAX_MEMBERS,
            netlink: Mutex::new(NetlinkState::Closed),
        }
    }

    /// Change the largest member-only diff sent over netlink instead of `ipset restore`
    /// (default [`NETLINK_MAX_MEMBERS`]; 0 turns netlink off: every apply is one
    /// `ipset restore` and every read `ipset list -n` + `ipset save`).
    pub fn with_netlink_threshold(mut self, members: usize) -> Ipset {
        self.netlink_max = members;
        self
    }

    /// The largest member-only diff sent over netlink.
    pub fn netlink_threshold(&self) -> usize {
        self.netlink_max
    }

    /// Netlink requests sent so far by this applier (the protocol probe and one per member
    /// added or deleted over netlink).
    pub fn netlink_requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Opens the netlink socket and agrees on the protocol version now (one request), instead
    /// of on the first small apply; returns whether the netlink path is usable. Applying works
    /// without calling this.
    pub fn prepare_netlink(&self) -> bool {
        if self.netlink_max == 0 {
            return false;
        }
        matches!(*self.channel(), NetlinkState::Open(_))
    }

    /// Whether [`Ipset::apply`] sends the members of `diff` over netlink (when the kernel can be
    /// spoken to): see [`netlink_eligible`], with [`Ipset::netlink_threshold`].
    pub fn uses_netlink(&self, diff: &IpsetDiff) -> bool {
        netlink_eligible(diff, self.netlink_max)
    }

    /// Change how many times one apply may drop a rejected line and retry.
    pub fn with_max_retries(mut self, n: usize) -> Ipset {
        self.max_retries = n;
        self
    }

    /// The runner.
    pub fn runner(&self) -> &Runner {
        &self.runner
    }

    /// Processes spawned so far by this applier.
    pub fn processes_spawned(&self) -> u64 {
        self.spawned.load(Ordering::Relaxed)
    }

    fn run(&self, args: &[&str], stdin: Option<&str>) -> Result<Output> {
        self.spawned.fetch_add(1, Ordering::Relaxed);
        self.runner.run(args, stdin)
    }

    /// `ipset version` output (checks the binary and kernel support).
    pub fn version(&self) -> Result<String> {
        let out = self.run(&["version"], None)?;
        if !out.success {
            return Err(Error::CommandFailed {
                command: out.command,
                stderr: out.stderr,
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// Read the sets named in `owned` (absent ones are simply missing from the result).
    ///
    /// Over netlink (unless the threshold is 0): one `IPSET_CMD_LIST` request per owned set,
    /// decoded in process; no other set's members are read. Otherwise, or when that read
    /// fails, one `ipset list -n`, then one `ipset save` only when one of them exists (which
    /// prints every set of the namespace, parsed for the owned ones only). Why: the periodic
    /// drift check's ipset step was one `ipset save` of ~25,000 members at 5,000 Services,
    /// 5.3 s (IPv4) and 6.1 s (IPv6, whose own sets were empty) in the emulated benchmark VM,
    /// and every change waited behind it.
    pub fn read(&self, owned: &[String]) -> Result<IpsetState> {
        let owned: BTreeSet<&str> = owned.iter().map(String::as_str).collect();
        if self.netlink_max > 0 {
            if let Some(st) = self.read_netlink(&owned) {
                return Ok(st);
            }
        }
        self.read_save(&owned)
    }

    /// The read with the `ipset` program: `ipset list -n`, then `ipset save` when an owned set
    /// exists.
    fn read_save(&self, owned: &BTreeSet<&str>) -> Result<IpsetState> {
        let out = self.run(&["list", "-n"], None)?;
        if !out.success {
            return Err(Error::CommandFailed {
                command: out.command,
                stderr: out.stderr,
            });
        }
        let names = String::from_utf8_lossy(&out.stdout);
        if !names.lines().any(|n| owned.contains(n.trim())) {
            return Ok(IpsetState::new());
        }
        let out = self.run(&["save"], None)?;
        if !out.success {
            return Err(Error::CommandFailed {
                command: out.command,
                stderr: out.stderr,
            });
        }
        let text = String::from_utf8(out.stdout)
            .map_err(|_| Error::Parse("ipset save printed non-UTF-8 text".into()))?;
        parse_save(&text, |n| owned.contains(n))
    }

    /// Apply a diff. A small diff that only adds and deletes members (see
    /// [`Ipset::uses_netlink`]) goes over netlink, one pipelined request per member; anything
    /// else (or when netlink is unavailable) with one `ipset restore -exist`.
    ///
    /// Both paths have `-exist` semantics (adding a present member and deleting an absent one
    /// succeed) and report alike: a member (or restore line) the kernel rejects is reported in
    /// [`ApplyReport::rejected`] with its owner and line, and everything else is applied; with
    /// restore, a set that cannot be created is reported with its members skipped. An empty
    /// diff runs nothing.
    pub fn apply(&self, diff: &IpsetDiff) -> Result<ApplyReport> {
        let lines = restore_lines(diff);
        if lines.is_empty() {
            return Ok(ApplyReport::default());
        }
        if !self.uses_netlink(diff) || !self.prepare_netlink() {
            return self.apply_restore(lines);
        }
        // Sets first (one restore, only when the diff creates or recreates one), then the
        // members over netlink; a set that could not be made takes its members with it.
        let (structure, members): (Vec<_>, Vec<_>) =
            lines.into_iter().partition(|o| o.member().is_none());
        let mut report = if structure.is_empty() {
            ApplyReport::default()
        } else {
            self.apply_restore(structure)?
        };
        let unmade: BTreeSet<String> = report
            .rejected
            .iter()
            .filter(|r| r.entry.is_none())
            .map(|r| r.set.clone())
            .collect();
        let (members, skipped): (Vec<_>, Vec<_>) =
            members.into_iter().partition(|o| !unmade.contains(o.set()));
        for o in &skipped {
            if let Some(r) = report.rejected.iter_mut().find(|r| r.set == o.set()) {
                r.skipped += 1;
            }
        }
        if members.is_empty() {
            return Ok(report);
        }
        let more = match self.apply_netlink(&members) {
            Some(r) => r,
            None => self.apply_restore(members)?,
        };
        report.lines += more.lines;
        report.processes += more.processes;
        report.requests += more.requests;
        report.rejected.extend(more.rejected);
        Ok(report)
    }

    /// The restore path: one `ipset restore -exist`. If ipset rejects a line, that line (or,
    /// for a set that cannot be created, that set's lines) is reported in
    /// [`ApplyReport::rejected`] and the rest is sent again, so one bad entry never stops the
    /// batch.
    fn apply_restore(&self, lines: Vec<LineOrigin<'_>>) -> Result<ApplyReport> {
        let mut report = ApplyReport {
            lines: lines.len(),
            ..ApplyReport::default()
        };
        let mut active = vec![true; lines.len()];
        let mut retries = 0usize;
        loop {
            let mut script = String::new();
            let mut index = Vec::new(); // script line number - 1 → lines index
            for (i, l) in lines.iter().enumerate() {
                if active[i] {
                    let _ = writeln!(script, "{l}");
                    index.push(i);
                }
            }
            if index.is_empty() {
                return Ok(report);
            }
            let Output {
                command: shown,
                success,
                stderr,
                ..
            } = self.run(&["restore", "-exist"], Some(&script))?;
            report.processes += 1;
            if success {
                return Ok(report);
            }
            let Some((no, message)) = parse_error_line(&stderr) else {
                return Err(Error::CommandFailed {
                    command: shown,
                    stderr,
                });
            };
            let Some(&bad) = no.checked_sub(1).and_then(|n| index.get(n)) else {
                return Err(Error::CommandFailed {
                    command: shown,
                    stderr,
                });
            };
            let origin = lines[bad];
            active[bad] = false;
            let mut rejected = rejected(&origin, message.clone());
            match origin {
                LineOrigin::Add(_) | LineOrigin::Del(_) => {}
                LineOrigin::DestroyForRecreate(spec) | LineOrigin::Create(spec) => {
                    let set = spec.name.as_str();
                    // The set cannot be (re)made: its members cannot go in either.
                    for (i, o) in lines.iter().enumerate() {
                        if active[i] && o.set() == set && !matches!(o, LineOrigin::Destroy(_)) {
                            active[i] = false;
                            rejected.skipped += 1;
                        }
                    }
                    if message.contains("in use") {
                        rejected.message = format!(
                            "{message} (set {set} has the wrong type and is still referenced, \
                             e.g. by iptables rules; remove the references first)"
                        );
                    }
                }
                LineOrigin::Destroy(_) => {}
            }
            tracing::warn!(set = %rejected.set, line = %rejected.line, owner = %rejected.owner,
                message = %rejected.message, "ipset rejected a line; retrying without it");
            report.rejected.push(rejected);
            retries += 1;
            if retries > self.max_retries {
                return Err(Error::CommandFailed {
                    command: shown,
                    stderr: format!(
                        "gave up after {} rejected lines, last: {stderr}",
                        report.rejected.len()
                    ),
                });
            }
        }
    }
}

/// A rejected line, with the member and its owner for a member line.
fn rejected(origin: &LineOrigin<'_>, message: String) -> Rejected {
    let (entry, owner) = match origin.member() {
        Some(c) => (Some(c.entry.clone()), c.owner.to_string()),
        None => (None, String::new()),
    };
    Rejected {
        set: origin.set().to_string(),
        entry,
        owner,
        line: origin.to_string(),
        message,
        skipped: 0,
    }
}

/// Find ipset's `Error in line N: message`.
fn parse_error_line(stderr: &str) -> Option<(usize, String)> {
    for l in stderr.lines() {
        if let Some(pos) = l.find("Error in line ") {
            let rest = &l[pos + "Error in line ".len()..];
            let (n, msg) = rest.split_once(':')?;
            let n = n.trim().parse().ok()?;
            return Some((n, msg.trim().to_string()));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_error_line() {
        let e = "ipset v7.17: Error in line 3: The value of the CIDR parameter of the IP address is invalid";
        assert_eq!(
            parse_error_line(e),
            Some((
                3,
                "The value of the CIDR parameter of the IP address is invalid".to_string()
            ))
        );
        assert_eq!(
            parse_error_line("ipset v7.17: Syntax error: '70000' is out of range 0-65535"),
            None
        );
        assert_eq!(parse_error_line("Error in line x: y"), None);
    }

    #[test]
    fn recognises_kernel_support_messages() {
        assert!(kernel_support_problem("ipset v7.17: Cannot open session to kernel.").is_some());
        assert!(kernel_support_problem(
            "ipset v7.17: Kernel error received: set type not supported"
        )
        .is_some());
        assert!(kernel_support_problem("Error in line 2: Element cannot be added").is_none());
    }

    #[test]
    fn missing_binary_is_a_clear_error() {
        let ipset = Ipset::new(Runner {
            ipset: PathBuf::from("/nonexistent/ipset-kube-ipvs-test"),
            ..Runner::default()
        });
        let err = ipset.version().unwrap_err();
        assert!(matches!(err, Error::MissingBinary { .. }), "{err}");
        assert!(err.to_string().contains("ipset-kube-ipvs-test"), "{err}");
    }

    /// An `ipset` that hangs (a script standing in for the program): every kind of call
    /// fails with a timeout naming the command, instead of blocking the sync.
    #[test]
    fn hanging_ipset_times_out() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("kube-ipvs-ipset-hang-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fake = dir.join("ipset");
        std::fs::write(&fake, "#!/bin/sh\nexec sleep 60\n").unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let limit = Duration::from_millis(300);
        let ipset = Ipset::new(
            Runner {
                ipset: fake.clone(),
                ..Runner::default()
            }
            .with_timeout(limit),
        )
        .with_netlink_threshold(0);
        let err = ipset.read(&[]).unwrap_err();
        assert!(
            matches!(&err, Error::Timeout { command, limit: l } if command.ends_with("ipset list -n") && *l == limit),
            "{err}"
        );
        let mut diff = IpsetDiff::default();
        diff.destroys.push("KUBE-TEST".to_string());
        let err = ipset.apply(&diff).unwrap_err();
        assert!(
            matches!(&err, Error::Timeout { command, .. } if command.ends_with("ipset restore -exist")),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
