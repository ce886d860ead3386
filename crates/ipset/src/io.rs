//! IO: run `ipset` (optionally inside a network namespace) to read and apply state, one process
//! per read and one `ipset restore -exist` per apply (plus one per rejected line, bounded).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::entry::Entry;
use crate::process::{self, Output};
use crate::state::{parse_save, restore_lines, IpsetDiff, IpsetState, LineOrigin};
use crate::{Error, Result};

/// How `ipset` is started: which binary, and optionally inside `ip netns exec NAME`.
#[derive(Debug, Clone)]
pub struct Runner {
    /// The ipset program (looked up in `PATH` when it has no `/`).
    pub ipset: PathBuf,
    /// Run inside this named network namespace (via `ip netns exec`).
    pub netns: Option<String>,
}

impl Default for Runner {
    fn default() -> Self {
        Runner {
            ipset: PathBuf::from("ipset"),
            netns: None,
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
            netns: Some(name.into()),
            ..Runner::default()
        }
    }

    fn run(&self, args: &[&str], stdin: Option<&str>) -> Result<Output> {
        let out = process::run(self.netns.as_deref(), self.ipset.as_os_str(), args, stdin)?;
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
    /// Restore lines in the diff.
    pub lines: usize,
    /// Processes spawned for this apply.
    pub processes: u64,
    /// Lines the kernel (or ipset) rejected; all other lines were applied.
    pub rejected: Vec<Rejected>,
}

/// The ipset applier.
#[derive(Debug)]
pub struct Ipset {
    runner: Runner,
    spawned: AtomicU64,
    max_retries: usize,
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
            max_retries: 8,
        }
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

    /// Read the sets named in `owned` (absent ones are simply missing from the result) with one
    /// `ipset save`. Sets not in `owned` are never read.
    pub fn read(&self, owned: &[String]) -> Result<IpsetState> {
        let owned: BTreeSet<&str> = owned.iter().map(String::as_str).collect();
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

    /// Apply a diff with one `ipset restore -exist`. If ipset rejects a line, that line (or, for
    /// a set that cannot be created, that set's lines) is reported in
    /// [`ApplyReport::rejected`] and the rest is sent again, so one bad entry never stops the
    /// batch. An empty diff runs nothing.
    pub fn apply(&self, diff: &IpsetDiff) -> Result<ApplyReport> {
        let lines = restore_lines(diff);
        let mut report = ApplyReport {
            lines: lines.len(),
            ..ApplyReport::default()
        };
        if lines.is_empty() {
            return Ok(report);
        }
        let mut active = vec![true; lines.len()];
        let mut retries = 0usize;
        loop {
            let mut script = String::new();
            let mut index = Vec::new(); // script line number - 1 → lines index
            for (i, (l, _)) in lines.iter().enumerate() {
                if active[i] {
                    script.push_str(l);
                    script.push('\n');
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
            let (line, origin) = &lines[bad];
            active[bad] = false;
            let mut rejected = Rejected {
                set: origin.set().to_string(),
                entry: None,
                owner: String::new(),
                line: line.clone(),
                message: message.clone(),
                skipped: 0,
            };
            match origin {
                LineOrigin::Add(c) | LineOrigin::Del(c) => {
                    rejected.entry = Some(c.entry.clone());
                    rejected.owner = c.owner.clone();
                }
                LineOrigin::DestroyForRecreate(set) | LineOrigin::Create(set) => {
                    // The set cannot be (re)made: its members cannot go in either.
                    for (i, (_, o)) in lines.iter().enumerate() {
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
            netns: None,
        });
        let err = ipset.read(&[]).unwrap_err();
        assert!(matches!(err, Error::MissingBinary { .. }), "{err}");
        assert!(err.to_string().contains("ipset-kube-ipvs-test"), "{err}");
    }
}
