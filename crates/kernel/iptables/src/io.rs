//! IO: run iptables-restore / iptables-save (optionally inside a network namespace), applying a
//! rule set only when its text changed and keeping the jumps from built-in chains unique.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::time::Duration;

use ipset::Family;

use crate::backend::{parse_version, pick_backend, random_fully_supported, Backend};
use crate::rules::{RuleSet, Table};
use crate::{Error, Result};

/// Seconds `iptables-restore` waits for the xtables lock before it gives up: upstream's
/// `WaitSecondsValue` ("5"), passed as `-w 5` (kube-proxy `pkg/util/iptables/iptables.go`,
/// `getIPTablesRestoreWaitFlag`). Before `-w` took a value, restore waited for the lock
/// forever.
pub const XTABLES_WAIT_SECONDS: u32 = 5;

/// Microseconds between two attempts to take the xtables lock: upstream's
/// `WaitIntervalUsecondsValue` ("100000"), passed as `-W 100000` (same function).
pub const XTABLES_WAIT_INTERVAL_MICROS: u32 = 100_000;

/// How long one iptables program may run by default before it is killed (with its process
/// group) and the call fails with [`Error::Timeout`]: the outer bound around the lock wait.
///
/// Why 30 s: a restore waits at most [`XTABLES_WAIT_SECONDS`] for the lock and then applies its
/// payload; in IPVS mode that payload is a few dozen rules, and in the benchmark
/// (docs/benchmarks.md) a first sync's iptables work took under two seconds even in the
/// emulated test VM. Thirty seconds is far above that, so only a program that is stuck hits it,
/// and it is no longer than the default `syncPeriod`, so a stuck program fails its sync before
/// the next one is due. `--iptables-timeout` changes it. `iptables-restore` runs under it
/// window by window while busy ([`RESTORE_BUSY_CEILING`]). Upstream kube-proxy bounds only the
/// lock wait, not the program.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long one `iptables-restore` (or `iptables-save`) of an [`Iptables`] applier may run in
/// all while it keeps computing ([`Runner::while_busy`], set by [`Iptables::new`]: each window
/// of the time limit in which it used the CPU renews the limit; a window without is a stuck
/// program, killed).
///
/// Why: iptables mode's first restore writes the whole table, and `iptables-nft-restore`
/// 1.8.9's time grows faster than the table. Measured on the 2-core host (a netns, the payload
/// of `kube-ipvs plan --proxy-mode iptables` for N Services of 10 endpoints): 1,000 Services
/// (42,000 lines) 2.6 s, 2,500 (105,000) 21.9 s, 5,000 (210,000) 153 s. A fixed 30 s limit
/// killed every restore past about 3,000 such Services and retried it forever, so the node was
/// never programmed (upstream, without a limit, converges). 20 minutes leaves room for about
/// twice that last table on such a machine; a program still busy then is killed all the same.
pub const RESTORE_BUSY_CEILING: Duration = Duration::from_secs(20 * 60);

/// How programs are started: directly or inside `ip netns exec NAME`, and how long one may
/// run (default [`DEFAULT_TIMEOUT`]): the `exec` crate's runner, which the ipset crate uses too.
pub use exec::Runner;

// The runner's default time limit is the one documented (and reasoned) above.
const _: () = assert!(DEFAULT_TIMEOUT.as_nanos() == exec::DEFAULT_TIMEOUT.as_nanos());

/// Runs `prog args` with optional stdin; returns (success, stdout, stderr, shown command).
fn run(
    runner: &Runner,
    prog: &str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<(bool, String, String, String)> {
    let out = runner.run(OsStr::new(prog), args, stdin)?;
    Ok((
        out.success,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        out.stderr,
        out.command,
    ))
}

/// What [`Iptables::apply`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Tables restored (their text changed, or a forced resync).
    pub restored: Vec<Table>,
    /// Tables skipped because their text had not changed.
    pub unchanged: Vec<Table>,
    /// Jump rules inserted into built-in chains.
    pub jumps_added: usize,
    /// Duplicate jump rules removed.
    pub jumps_removed: usize,
    /// Processes spawned by this call.
    pub processes: u64,
}

/// The iptables applier for one family on one backend.
#[derive(Debug)]
pub struct Iptables {
    runner: Runner,
    backend: Backend,
    family: Family,
    last: BTreeMap<Table, String>,
    jumps_checked: BTreeSet<Table>,
    spawned: u64,
    /// The version detection already read from `iptables --version`, when that program is this
    /// backend (so [`Iptables::version`] does not run it again).
    version: Option<(u32, u32, u32)>,
    /// Tables as detection read them (its one `*-save` of this backend; a table it did not
    /// show is empty), standing in for the first [`Iptables::apply`]'s read of each, so a start
    /// reads every table once. Cleared by [`Iptables::force_resync`] once something was applied;
    /// without a detection (or when the backend's save failed) the first apply reads as before.
    detected_tables: BTreeMap<Table, String>,
}

/// Splits the output of an `iptables-save` of every table into `*TABLE … COMMIT` sections by
/// table name (tables other than nat, filter, mangle and raw are left out).
pub fn split_tables(save: &str) -> BTreeMap<Table, String> {
    let mut out = BTreeMap::new();
    let mut current: Option<(Table, String)> = None;
    for line in save.lines() {
        if let Some(name) = line.strip_prefix('*') {
            current = [Table::Nat, Table::Filter, Table::Mangle, Table::Raw]
                .into_iter()
                .find(|t| t.as_str() == name.trim())
                .map(|t| (t, String::new()));
        }
        if let Some((_, text)) = current.as_mut() {
            text.push_str(line);
            text.push('\n');
        }
        if line.trim_end() == "COMMIT" {
            if let Some((t, text)) = current.take() {
                out.insert(t, text);
            }
        }
    }
    out
}

fn kernel_support_problem(stderr: &str) -> Option<String> {
    let s = stderr.to_ascii_lowercase();
    if s.contains("do you need to insmod")
        || s.contains("can't initialize")
        || s.contains("couldn't load match")
        || s.contains("couldn't load target")
        || s.contains("protocol not supported")
    {
        Some(stderr.trim().to_string())
    } else {
        None
    }
}

/// iptables' message when it stopped waiting for the xtables lock ("Another app is currently
/// holding the xtables lock. Stopped waiting after 5s.").
fn lock_held(stderr: &str) -> bool {
    stderr.contains("holding the xtables lock") || stderr.contains("Stopped waiting after")
}

/// Find the failing line in iptables-restore's error output (`line N failed` when COMMIT fails,
/// `Error occurred at line: N` when a rule cannot be parsed).
fn failed_line(stderr: &str) -> Option<usize> {
    let digits = |s: &str| -> Option<usize> {
        let n: String = s
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect();
        n.parse().ok()
    };
    if let Some(pos) = stderr.find("Error occurred at line:") {
        return digits(&stderr[pos + "Error occurred at line:".len()..]);
    }
    let pos = stderr.find("line ")?;
    let rest = &stderr[pos + 5..];
    let n = digits(rest)?;
    let after = rest
        .trim_start()
        .trim_start_matches(|c: char| c.is_ascii_digit());
    if after.trim_start().starts_with("failed") {
        Some(n)
    } else {
        None
    }
}

impl Iptables {
    /// An applier for a known backend.
    pub fn new(backend: Backend, family: Family, runner: Runner) -> Iptables {
        Iptables {
            // Slow is not stuck: a save or restore that keeps computing runs on past the
            // runner's limit (see RESTORE_BUSY_CEILING).
            runner: runner.while_busy(RESTORE_BUSY_CEILING),
            backend,
            family,
            last: BTreeMap::new(),
            jumps_checked: BTreeSet::new(),
            spawned: 0,
            version: None,
            detected_tables: BTreeMap::new(),
        }
    }

    /// Detect the backend like kubelet does (which backend already holds Kubernetes chains,
    /// else what `iptables --version` says) and return an applier for it.
    ///
    /// Three processes: one `*-save` of every table per backend (like kubelet's
    /// iptables-wrapper; it also loads no legacy table module that is not loaded yet) and
    /// `iptables --version`. What they printed is kept: the version when `iptables` is the
    /// chosen backend, and the chosen backend's tables for the first [`Iptables::apply`].
    pub fn detect(family: Family, runner: Runner) -> Result<Iptables> {
        let prefix = match family {
            Family::Inet => "iptables",
            Family::Inet6 => "ip6tables",
        };
        // The start-up saves read whatever the node already holds: after a restart of
        // iptables mode on a large node that is the whole table, so they run under the same
        // busy rule as the applier's own saves (RESTORE_BUSY_CEILING).
        let runner = runner.while_busy(RESTORE_BUSY_CEILING);
        let mut spawned = 0;
        let mut save = |b: Backend| -> Option<String> {
            spawned += 1;
            match run(&runner, &b.save_program(family), &[], None) {
                Ok((true, out, _, _)) => Some(out),
                _ => None,
            }
        };
        let legacy = save(Backend::Legacy);
        let nft = save(Backend::Nft);
        spawned += 1;
        let default = match run(&runner, prefix, &["--version"], None) {
            Ok((true, out, _, _)) => parse_version(&out),
            _ => None,
        };
        if legacy.is_none() && nft.is_none() {
            return Err(Error::MissingBinary {
                binary: format!(
                    "{} / {}",
                    Backend::Nft.save_program(family),
                    Backend::Legacy.save_program(family)
                ),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "neither backend's save program ran",
                ),
            });
        }
        let backend = pick_backend(
            legacy.as_deref(),
            nft.as_deref(),
            default.and_then(|(_, b)| b),
        );
        tracing::info!(?backend, ?family, "iptables backend selected");
        let mut ipt = Iptables::new(backend, family, runner);
        ipt.spawned = spawned;
        ipt.version = default.and_then(|(v, b)| (b == Some(backend)).then_some(v));
        let chosen = match backend {
            Backend::Legacy => legacy,
            Backend::Nft => nft,
        };
        if let Some(text) = chosen {
            // A table its save does not show does not exist (nft) or is not loaded (legacy):
            // reading it alone would show no rule either.
            let mut tables = split_tables(&text);
            for t in [Table::Nat, Table::Filter, Table::Mangle, Table::Raw] {
                tables.entry(t).or_default();
            }
            ipt.detected_tables = tables;
        }
        Ok(ipt)
    }

    /// The backend in use.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The family.
    pub fn family(&self) -> Family {
        self.family
    }

    /// Processes spawned so far (tests use this to prove an unchanged apply runs nothing).
    pub fn processes_spawned(&self) -> u64 {
        self.spawned
    }

    fn run(
        &mut self,
        prog: &str,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<(bool, String, String, String)> {
        self.spawned += 1;
        run(&self.runner, prog, args, stdin)
    }

    /// The iptables version of this backend (e.g. (1, 8, 9)); no process when detection
    /// already read it.
    pub fn version(&mut self) -> Result<(u32, u32, u32)> {
        if let Some(v) = self.version {
            return Ok(v);
        }
        let prog = self.backend.program(self.family);
        let (ok, out, err, shown) = self.run(&prog, &["--version"], None)?;
        if !ok {
            return Err(Error::CommandFailed {
                command: shown,
                stderr: err,
            });
        }
        let v = parse_version(&out)
            .map(|(v, _)| v)
            .ok_or_else(|| Error::Parse(format!("{shown}: {out:?}")))?;
        self.version = Some(v);
        Ok(v)
    }

    /// Whether MASQUERADE `--random-fully` is supported (iptables ≥ 1.6.2).
    pub fn supports_random_fully(&mut self) -> Result<bool> {
        Ok(random_fully_supported(self.version()?))
    }

    /// `iptables-save -t TABLE`, under the same busy rule as a restore
    /// ([`RESTORE_BUSY_CEILING`]): its output grows with the table too.
    pub fn save(&mut self, table: Table) -> Result<String> {
        let prog = self.backend.save_program(self.family);
        let (ok, out, err, shown) = self.run(&prog, &["-t", table.as_str()], None)?;
        if !ok {
            if let Some(k) = kernel_support_problem(&err) {
                return Err(Error::KernelSupport(format!("{shown}: {k}")));
            }
            return Err(Error::CommandFailed {
                command: shown,
                stderr: err,
            });
        }
        Ok(out)
    }

    /// `iptables -w 5 -W 100000 -t TABLE -S CHAIN`: one chain's rules in `iptables-save`'s rule
    /// format (`-A CHAIN ...`, after `-P` or `-N` for the chain). With the nft backend only that
    /// chain is fetched from the kernel (a built-in chain of a 42,000-rule nat table listed in
    /// 9 ms on the 2-core host where `iptables-save -t nat` took 1.25 s), which is what the
    /// iptables mode's periodic check reads. A chain that does not exist is an error.
    pub fn list_chain(&mut self, table: Table, chain: &str) -> Result<String> {
        let prog = self.backend.program(self.family);
        let wait = XTABLES_WAIT_SECONDS.to_string();
        let interval = XTABLES_WAIT_INTERVAL_MICROS.to_string();
        let (ok, out, err, shown) = self.run(
            &prog,
            &[
                "-w",
                &wait,
                "-W",
                &interval,
                "-t",
                table.as_str(),
                "-S",
                chain,
            ],
            None,
        )?;
        if ok {
            return Ok(out);
        }
        if lock_held(&err) {
            return Err(Error::LockTimeout {
                command: shown,
                stderr: err,
            });
        }
        if let Some(k) = kernel_support_problem(&err) {
            return Err(Error::KernelSupport(format!("{shown}: {k}")));
        }
        Err(Error::CommandFailed {
            command: shown,
            stderr: err,
        })
    }

    /// Run one `iptables-restore --noflush -w 5 -W 100000` with `text` (a full `*table …
    /// COMMIT` payload), unconditionally. The generic entry point other proxy modes use.
    ///
    /// The lock flags are upstream's (`getIPTablesRestoreWaitFlag` in kube-proxy's
    /// `pkg/util/iptables`, for iptables ≥ 1.6.2): wait at most [`XTABLES_WAIT_SECONDS`] for the
    /// xtables lock, trying every [`XTABLES_WAIT_INTERVAL_MICROS`] µs; a lock still held then
    /// is [`Error::LockTimeout`] (the nft backend takes no lock and ignores them). The runner's
    /// time limit bounds each window in which the program does not compute, and
    /// [`RESTORE_BUSY_CEILING`] the whole call: [`Error::Timeout`].
    pub fn apply_restore(&mut self, table: Table, text: &str) -> Result<()> {
        let prog = self.backend.restore_program(self.family);
        let wait = XTABLES_WAIT_SECONDS.to_string();
        let interval = XTABLES_WAIT_INTERVAL_MICROS.to_string();
        let (ok, _, err, shown) = self.run(
            &prog,
            &["--noflush", "-w", &wait, "-W", &interval],
            Some(text),
        )?;
        if ok {
            return Ok(());
        }
        if lock_held(&err) {
            return Err(Error::LockTimeout {
                command: shown,
                stderr: err,
            });
        }
        if let Some(k) = kernel_support_problem(&err) {
            return Err(Error::KernelSupport(format!(
                "{shown} (table {table}): {k}"
            )));
        }
        let line = failed_line(&err).map(|n| {
            (
                n,
                text.lines()
                    .nth(n.saturating_sub(1))
                    .unwrap_or_default()
                    .to_string(),
            )
        });
        Err(Error::RestoreFailed {
            command: shown,
            table,
            line,
            stderr: err,
        })
    }

    /// Forget what was applied: the next [`Iptables::apply`] restores every table and re-checks
    /// the jumps (drift repair).
    ///
    /// Before the first apply, detection's read of the tables is as fresh as a new one (a
    /// daemon's first sync is a full one and forces a resync), so it stays in use; after an
    /// apply the tables are read again.
    pub fn force_resync(&mut self) {
        if !self.jumps_checked.is_empty() || !self.last.is_empty() {
            self.detected_tables.clear();
        }
        self.last.clear();
        self.jumps_checked.clear();
    }

    /// Apply a rule set: one restore per table whose text changed since the last successful
    /// apply (none when nothing changed). The first time (and after [`Iptables::force_resync`])
    /// the table is read once to add missing jumps and remove duplicate ones in the same restore.
    pub fn apply(&mut self, rules: &RuleSet) -> Result<ApplyOutcome> {
        let start = self.spawned;
        let mut outcome = ApplyOutcome::default();
        for &table in rules.tables.keys() {
            let Some(text) = rules.restore_text(table) else {
                continue;
            };
            let check_jumps = !self.jumps_checked.contains(&table);
            if !check_jumps && self.last.get(&table) == Some(&text) {
                outcome.unchanged.push(table);
                continue;
            }
            let mut full = text.clone();
            let mut added = 0;
            let mut removed = 0;
            if check_jumps {
                // The first apply after detection uses what detection just read; a table it
                // did not see (or any later check) is read now. Someone else's change in
                // between is repaired by the next full resync, like any later drift.
                let saved = match self.detected_tables.remove(&table) {
                    Some(text) => text,
                    None => self.save(table)?,
                };
                let mut extra = String::new();
                for j in rules.jumps.iter().filter(|j| j.table == table) {
                    let want = j.save_line();
                    let n = saved.lines().filter(|l| l.trim_end() == want).count();
                    if n == 0 {
                        extra.push_str(&format!("-I {} {}\n", j.from, j.spec()));
                        added += 1;
                    }
                    for _ in 1..n {
                        extra.push_str(&format!("-D {} {}\n", j.from, j.spec()));
                        removed += 1;
                    }
                }
                if let Some(body) = full.strip_suffix("COMMIT\n") {
                    full = format!("{body}{extra}COMMIT\n");
                }
                // A drift check that finds the kernel already holding exactly our chains, rules
                // and jumps writes nothing.
                if added == 0 && removed == 0 && chains_match(rules, table, &saved) {
                    self.last.insert(table, text);
                    self.jumps_checked.insert(table);
                    outcome.unchanged.push(table);
                    continue;
                }
            }
            self.apply_restore(table, &full)?;
            self.last.insert(table, text);
            self.jumps_checked.insert(table);
            outcome.restored.push(table);
            outcome.jumps_added += added;
            outcome.jumps_removed += removed;
        }
        outcome.processes = self.spawned - start;
        Ok(outcome)
    }

    /// Remove the rule set's jumps and chains (for `--cleanup` and mode handover): per table one
    /// read and, if anything of ours is there, one restore.
    pub fn cleanup(&mut self, rules: &RuleSet) -> Result<()> {
        for (&table, (chains, _)) in &rules.tables {
            let saved = self.save(table)?;
            let present: Vec<&String> = chains
                .iter()
                .filter(|c| saved.lines().any(|l| l.starts_with(&format!(":{c} "))))
                .collect();
            let mut text = format!("*{table}\n");
            for c in &present {
                text.push_str(&format!(":{c} - [0:0]\n"));
            }
            let mut any = !present.is_empty();
            for j in rules.jumps.iter().filter(|j| j.table == table) {
                let want = j.save_line();
                for _ in saved.lines().filter(|l| l.trim_end() == want) {
                    text.push_str(&format!("-D {} {}\n", j.from, j.spec()));
                    any = true;
                }
            }
            for c in &present {
                text.push_str(&format!("-X {c}\n"));
            }
            text.push_str("COMMIT\n");
            if any {
                self.apply_restore(table, &text)?;
            }
        }
        self.force_resync();
        Ok(())
    }
}

/// True when `saved` (`iptables-save -t TABLE`) shows every chain of `rules` for `table` with
/// exactly its rules, in order (chain by chain: iptables-save groups rules by chain). Lines are
/// compared as iptables-save prints them (it escapes `'` in comments as `\'`), so any other
/// difference in rendering just means a restore, never a missed repair.
fn chains_match(rules: &RuleSet, table: Table, saved: &str) -> bool {
    let Some((chains, lines)) = rules.tables.get(&table) else {
        return true;
    };
    let chain_of = |l: &str| -> Option<String> {
        l.strip_prefix("-A ")
            .and_then(|rest| rest.split_whitespace().next())
            .map(str::to_string)
    };
    for c in chains {
        if !saved.lines().any(|l| l.starts_with(&format!(":{c} "))) {
            return false;
        }
        let have: Vec<String> = saved
            .lines()
            .filter(|l| chain_of(l).as_deref() == Some(c.as_str()))
            .map(|l| l.trim_end().replace("\\'", "'"))
            .collect();
        let want: Vec<&str> = lines
            .iter()
            .filter(|l| chain_of(l).as_deref() == Some(c.as_str()))
            .map(|l| l.trim_end())
            .collect();
        if have.len() != want.len() || have.iter().zip(&want).any(|(a, b)| a != b) {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_failed_line() {
        assert_eq!(failed_line("iptables-restore: line 4 failed"), Some(4));
        assert_eq!(
            failed_line(
                "iptables-nft-restore: line 12 failed: No chain/target/match by that name."
            ),
            Some(12)
        );
        assert_eq!(failed_line("Bad argument `x'"), None);
        assert_eq!(
            failed_line("iptables-restore v1.8.9 (legacy): Set NO-SUCH-SET doesn't exist.\n\nError occurred at line: 4\nTry `iptables-restore -h'"),
            Some(4)
        );
    }

    #[test]
    fn recognises_kernel_support_messages() {
        assert!(kernel_support_problem(
            "iptables-restore v1.8.9 (legacy): can't initialize iptables table `nat': Table does not exist (do you need to insmod?)"
        )
        .is_some());
        assert!(
            kernel_support_problem("Couldn't load match `set':No such file or directory").is_some()
        );
        assert!(kernel_support_problem("line 3 failed").is_none());
    }

    #[test]
    fn recognises_the_lock_message() {
        assert!(lock_held(
            "Another app is currently holding the xtables lock. Stopped waiting after 5s."
        ));
        assert!(!lock_held("iptables-restore: line 4 failed"));
    }

    #[test]
    fn splits_a_save_of_every_table() {
        let save = "# Generated by iptables-nft-save v1.8.9\n*mangle\n:PREROUTING ACCEPT [0:0]\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n# Completed\n\
                    *nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n\
                    *security\n:INPUT ACCEPT [0:0]\nCOMMIT\n*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n";
        let t = split_tables(save);
        assert_eq!(
            t.keys().copied().collect::<Vec<_>>(),
            [Table::Nat, Table::Filter, Table::Mangle]
        );
        assert_eq!(
            t[&Table::Nat],
            "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n"
        );
        assert!(t[&Table::Mangle].contains(":KUBE-IPTABLES-HINT"));
        assert!(split_tables("").is_empty());
        // A section cut off before COMMIT is not a table read.
        assert!(split_tables("*nat\n:PREROUTING ACCEPT [0:0]\n").is_empty());
    }

    #[test]
    fn missing_binary_is_a_clear_error() {
        let r = Runner::new();
        let err = run(
            &r,
            "/nonexistent/iptables-kube-ipvs-test-restore",
            &[],
            None,
        )
        .unwrap_err();
        assert!(matches!(err, Error::MissingBinary { .. }), "{err}");
        assert!(err.to_string().contains("iptables-kube-ipvs-test-restore"));
    }
}
