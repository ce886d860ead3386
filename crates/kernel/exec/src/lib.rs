//! Running a tool: directly or inside `ip netns exec NAME`, with optional standard input, its
//! output collected, a time limit, and a program that is not installed told apart from other
//! failures.
//!
//! Shared by the ipset crate (`ipset`) and the iptables crate (`iptables-save`,
//! `iptables-restore`) through [`Runner`]; each maps [`Error`] onto its own error type.
//!
//! Every call has a time limit. The program runs as the leader of its own process group, so a
//! program that forks is stopped whole: when the limit passes, the group gets `SIGKILL`, the
//! program is reaped (never left a zombie) and the call fails with [`Error::Timeout`] naming the
//! command line and the limit. Standard input is written and standard output and error are read
//! by helper threads, so a program that never reads its input (or never closes its output) can
//! never block the caller past the limit.
//!
//! A runner [`Runner::while_busy`] tells slow from stuck: the limit then bounds each window in
//! which the program makes no progress (uses less than [`BUSY_SHARE`] of it in CPU time),
//! and a program that keeps computing runs on, window after window, up to a ceiling. Each
//! window granted that way is recorded for [`last_busy`] (the daemon's `/livez` reads it: a sync
//! step waiting on a busy program is not wedged).

use std::ffi::OsStr;
use std::io::{Read, Write as _};
use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

/// How long a killed program may take to be reaped before the call returns anyway (the
/// waiting thread still reaps it when it finally dies: a process stuck in the kernel cannot
/// be killed until it leaves it).
const REAP_GRACE: Duration = Duration::from_secs(5);

/// Default time limit of one program ([`Runner::default`]). The ipset and iptables crates
/// give their reasons for this value at their own `DEFAULT_TIMEOUT`s (the slowest call each
/// makes, measured), and both are configurable (`--ipset-timeout`, `--iptables-timeout`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// The share of a window's wall time a program must spend on the CPU (its own user and
/// system time, and its waited-for children's) to count as busy under [`Runner::while_busy`]:
/// 5 %. A program blocked in the kernel (a held lock, a hung device), sleeping, or polling a
/// lock file (`iptables-restore -w`) uses next to none; one that computes gets at least its
/// cgroup's share of a loaded node (the DaemonSet requests a tenth of a core).
pub const BUSY_SHARE: f64 = 0.05;

/// How often, at most, the CPU of a program run [`Runner::while_busy`] is sampled inside a
/// window (three times a window when that is shorter): a busy program is recorded for
/// [`last_busy`] at least this often, far inside the daemon's 60 s liveness bound whatever
/// `--iptables-timeout` is.
pub const BUSY_POLL: Duration = Duration::from_secs(10);

/// Clock ticks per second of the times in `/proc/PID/stat` (`USER_HZ`): 100 on every
/// architecture Linux runs kube-ipvs on (x86_64, aarch64), whatever the kernel's `HZ`.
const USER_HZ: f64 = 100.0;

/// When a program last proved busy (see [`last_busy`]).
static LAST_BUSY: Mutex<Option<Instant>> = Mutex::new(None);

/// The last moment a program run by this process under [`Runner::while_busy`] was found busy
/// and given another window (`None`: never). A caller that waits on such a program (the
/// daemon's sync loop) is making progress up to this moment.
pub fn last_busy() -> Option<Instant> {
    *LAST_BUSY.lock().unwrap_or_else(PoisonError::into_inner)
}

fn record_busy(at: Instant) {
    let mut last = LAST_BUSY.lock().unwrap_or_else(PoisonError::into_inner);
    if last.is_none_or(|l| l < at) {
        *last = Some(at);
    }
}

/// Where and for how long programs run: directly or inside `ip netns exec NAME`, each with a
/// time limit.
#[derive(Debug, Clone)]
pub struct Runner {
    /// Run inside this named network namespace (via `ip netns exec`).
    pub netns: Option<String>,
    /// Time limit of one process (default [`DEFAULT_TIMEOUT`]): past it the process (with its
    /// process group) is killed and the call fails with [`Error::Timeout`]. Under
    /// [`Runner::while_busy`], the limit of each window without progress instead.
    pub timeout: Duration,
    /// `Some(ceiling)`: a program still busy when its limit passes gets another window, up to
    /// `ceiling` from its start ([`Runner::while_busy`]).
    pub busy_ceiling: Option<Duration>,
}

impl Default for Runner {
    fn default() -> Self {
        Runner {
            netns: None,
            timeout: DEFAULT_TIMEOUT,
            busy_ceiling: None,
        }
    }
}

impl Runner {
    /// Run in the current namespace.
    pub fn new() -> Runner {
        Runner::default()
    }

    /// Run inside the named network namespace.
    pub fn in_netns(name: impl Into<String>) -> Runner {
        Runner {
            netns: Some(name.into()),
            ..Runner::default()
        }
    }

    /// The same runner with another time limit per process.
    pub fn with_timeout(mut self, timeout: Duration) -> Runner {
        self.timeout = timeout;
        self
    }

    /// The same runner telling slow from stuck: when the time limit passes, a program that
    /// spent at least [`BUSY_SHARE`] of that window on the CPU is computing, not stuck, and gets
    /// another window of the same length, and so on until `ceiling` from its start (at least
    /// the limit itself); one that did not is killed. For programs whose work grows with their
    /// input faster than any fixed limit allows (`iptables-nft-restore` of a large table).
    pub fn while_busy(mut self, ceiling: Duration) -> Runner {
        self.busy_ceiling = Some(ceiling.max(self.timeout));
        self
    }

    /// Runs `program args` with optional standard input: [`run`] with this runner's namespace
    /// and time limit (and, under [`Runner::while_busy`], its ceiling).
    pub fn run(
        &self,
        program: &OsStr,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<Output, Error> {
        let limit = Limit {
            window: self.timeout,
            busy_ceiling: self.busy_ceiling,
        };
        run_limited(self.netns.as_deref(), program, args, stdin, limit)
    }
}

/// How long one call may run: `window` at a time, renewed while the program is busy up to
/// `busy_ceiling` (`None`: one window only).
#[derive(Debug, Clone, Copy)]
struct Limit {
    window: Duration,
    busy_ceiling: Option<Duration>,
}

/// Errors starting a program or waiting for it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The named program (or `ip`, to enter a namespace) is not installed or not executable.
    #[error("required program {0:?} not found ({1})")]
    MissingBinary(String, #[source] std::io::Error),
    /// Starting or waiting for the shown command line failed for another reason.
    #[error("running {0}: {1}")]
    Io(String, #[source] std::io::Error),
    /// The command did not finish within its time limit; its process group was killed and the
    /// program reaped.
    #[error("{command} did not finish within {limit:?}; killed")]
    Timeout {
        /// The command line.
        command: String,
        /// The time limit it exceeded.
        limit: Duration,
    },
}

/// A program that ran to its end (successfully or not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// The command line, for messages (`ip netns exec NS prog args…`).
    pub command: String,
    /// Whether it exited with status 0.
    pub success: bool,
    /// Its standard output.
    pub stdout: Vec<u8>,
    /// Its standard error, decoded lossily and trimmed.
    pub stderr: String,
}

/// Run `program args`, inside `ip netns exec NETNS` when `netns` is given, with `stdin` written
/// to its standard input (none: `/dev/null`), and wait for it for at most `timeout`.
///
/// A program that cannot be started because it does not exist is [`Error::MissingBinary`]: the
/// program itself, or `ip` when entering a namespace, or the program again when `ip netns exec`
/// reports that it could not execute it. A program that has not exited and closed its output
/// within `timeout` (it, or a process it started in its process group) is killed with its
/// whole process group and reaped: [`Error::Timeout`].
pub fn run(
    netns: Option<&str>,
    program: &OsStr,
    args: &[&str],
    stdin: Option<&str>,
    timeout: Duration,
) -> Result<Output, Error> {
    let limit = Limit {
        window: timeout,
        busy_ceiling: None,
    };
    run_limited(netns, program, args, stdin, limit)
}

fn run_limited(
    netns: Option<&str>,
    program: &OsStr,
    args: &[&str],
    stdin: Option<&str>,
    limit: Limit,
) -> Result<Output, Error> {
    let prog = program.to_string_lossy().into_owned();
    let mut shown = String::new();
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(program);
            shown.push_str(&format!("ip netns exec {ns} "));
            c
        }
        None => Command::new(program),
    };
    cmd.args(args);
    shown.push_str(&prog);
    for a in args {
        shown.push(' ');
        shown.push_str(a);
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    // Its own process group: a timeout kills whatever it started too.
    cmd.process_group(0);
    let child = cmd.spawn().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            let binary = if netns.is_some() { "ip" } else { &prog };
            Error::MissingBinary(binary.to_string(), e)
        } else {
            Error::Io(shown.clone(), e)
        }
    })?;
    let (status, stdout, stderr) = match supervise(child, stdin, limit) {
        Ok(done) => done,
        Err(Stop::Timeout(limit)) => {
            tracing::warn!(command = %shown, limit = ?limit,
                "command did not finish in time; killed its process group");
            return Err(Error::Timeout {
                command: shown,
                limit,
            });
        }
        Err(Stop::Ceiling { ceiling, cpu }) => {
            tracing::warn!(command = %shown, ceiling = ?ceiling, cpu_seconds = cpu,
                "command still busy at its ceiling; killed its process group");
            return Err(Error::Timeout {
                command: shown,
                limit: ceiling,
            });
        }
        Err(Stop::Io(e)) => return Err(Error::Io(shown, e)),
    };
    let stderr = String::from_utf8_lossy(&stderr).trim().to_string();
    // `ip netns exec` could not start the program inside the namespace.
    if !status.success() && stderr.contains("exec of") && stderr.contains("No such file") {
        let source = std::io::Error::new(std::io::ErrorKind::NotFound, stderr);
        return Err(Error::MissingBinary(prog, source));
    }
    Ok(Output {
        command: shown,
        success: status.success(),
        stdout,
        stderr,
    })
}

/// Why [`supervise`] gave up.
enum Stop {
    /// A window passed without the program finishing (or, under a busy ceiling, without its
    /// using the CPU): the window's length.
    Timeout(Duration),
    /// Busy all along, but its ceiling passed; the CPU seconds it had used.
    Ceiling {
        ceiling: Duration,
        cpu: f64,
    },
    Io(std::io::Error),
}

/// Whether `cpu_seconds` spent over `span` of wall time make a busy program ([`BUSY_SHARE`]).
fn busy(cpu_seconds: f64, span: Duration) -> bool {
    cpu_seconds >= span.as_secs_f64() * BUSY_SHARE
}

/// CPU seconds of process `pid` and its waited-for children (`/proc/PID/stat`: utime, stime,
/// cutime, cstime); `None` when it is gone or the file does not parse.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses; fields after the last
    // ')' start at the state (field 3), so utime (field 14) is the 12th of them.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields
        .get(11..15)?
        .iter()
        .map(|f| f.parse::<f64>().ok())
        .sum::<Option<f64>>()?;
    Some(ticks / USER_HZ)
}

/// What the helper threads of one call report.
enum Event {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exited(std::io::Result<ExitStatus>),
}

/// Reads `pipe` to its end from a helper thread and reports it through `tx`.
fn read_all(
    pipe: Option<impl Read + Send + 'static>,
    tx: mpsc::SyncSender<Event>,
    wrap: fn(Vec<u8>) -> Event,
) {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_end(&mut buf);
        }
        let _ = tx.send(wrap(buf));
    });
}

/// Feeds `stdin`, collects the output and reaps `child` from helper threads (which own the
/// pipes and the child), until its limit's window passes (a window too long to represent: no
/// limit); then, under a busy ceiling, renews the window while the child was busy in the last
/// one (and the ceiling has not passed); else kills the child's process group and waits (at
/// most [`REAP_GRACE`]) for the waiting thread to reap the child.
fn supervise(
    mut child: Child,
    stdin: Option<&str>,
    limit: Limit,
) -> Result<(ExitStatus, Vec<u8>, Vec<u8>), Stop> {
    let start = Instant::now();
    // `None`: a limit too far in the future to represent, i.e. none.
    let mut deadline = start.checked_add(limit.window);
    // The ceiling's length and the instant it passes.
    let ceiling = limit
        .busy_ceiling
        .and_then(|c| Some((c, start.checked_add(c)?)));
    let pid = child.id();
    // Under a busy ceiling, the CPU is also sampled every `poll` inside a window, so a busy
    // program is recorded for `last_busy` that often whatever the window's length.
    let poll = limit
        .busy_ceiling
        .map(|_| (limit.window / 3).min(BUSY_POLL));
    let mut next_poll = poll.and_then(|p| start.checked_add(p));
    let (mut window_cpu, mut poll_cpu) = (0.0, 0.0);
    let pgid = i32::try_from(pid).ok().map(Pid::from_raw);
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        let text = text.to_owned();
        // A write error (EPIPE) means the program exited early (or was killed); its stderr
        // says why.
        std::thread::spawn(move || {
            let _ = pipe.write_all(text.as_bytes());
        });
    }
    // Exactly three events per call: a sender never blocks.
    let (tx, rx) = mpsc::sync_channel::<Event>(3);
    read_all(child.stdout.take(), tx.clone(), Event::Stdout);
    read_all(child.stderr.take(), tx.clone(), Event::Stderr);
    // The waiting thread owns the child: it reaps it whatever happens to this call.
    std::thread::spawn(move || {
        let _ = tx.send(Event::Exited(child.wait()));
    });
    let (mut status, mut stdout, mut stderr) = (None, None, None);
    while status.is_none() || stdout.is_none() || stderr.is_none() {
        let wake = match (deadline, next_poll) {
            (Some(d), Some(p)) => Some(d.min(p)),
            (d, p) => d.or(p),
        };
        let event = match wake {
            Some(w) => rx.recv_timeout(w.saturating_duration_since(Instant::now())),
            None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
        };
        match event {
            Ok(Event::Stdout(b)) => stdout = Some(b),
            Ok(Event::Stderr(b)) => stderr = Some(b),
            Ok(Event::Exited(r)) => status = Some(r.map_err(Stop::Io)?),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let now = Instant::now();
                if let (Some(p), Some(poll)) = (next_poll, poll) {
                    if now >= p && deadline.is_none_or(|d| now < d) {
                        // A sample inside the window: recorded when busy since the last one.
                        if let Some(cpu) = cpu_seconds(pid) {
                            if busy(cpu - poll_cpu, poll) {
                                record_busy(now);
                            }
                            poll_cpu = cpu;
                        }
                        next_poll = now.checked_add(poll);
                        continue;
                    }
                }
                let mut stop = Stop::Timeout(limit.window);
                if let (Some((ceiling_len, ceiling)), Some(cpu)) = (ceiling, cpu_seconds(pid)) {
                    let busy = busy(cpu - window_cpu, limit.window);
                    if busy && now < ceiling {
                        // Computing, not stuck: another window, at most to the ceiling.
                        (window_cpu, poll_cpu) = (cpu, cpu);
                        deadline = Some(
                            now.checked_add(limit.window)
                                .map_or(ceiling, |d| d.min(ceiling)),
                        );
                        next_poll = poll.and_then(|p| now.checked_add(p));
                        record_busy(now);
                        continue;
                    }
                    if busy {
                        stop = Stop::Ceiling {
                            ceiling: ceiling_len,
                            cpu,
                        };
                    }
                }
                // The group outlives its leader while a member runs, so this reaches a
                // program's children even after the program itself exited.
                if let Some(pgid) = pgid {
                    let _ = killpg(pgid, Signal::SIGKILL);
                }
                if status.is_none() {
                    let grace = Instant::now() + REAP_GRACE;
                    while let Ok(ev) =
                        rx.recv_timeout(grace.saturating_duration_since(Instant::now()))
                    {
                        if matches!(ev, Event::Exited(_)) {
                            break;
                        }
                    }
                }
                return Err(stop);
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(Stop::Io(std::io::Error::other(
                    "a helper thread of the command ended without reporting",
                )))
            }
        }
    }
    match (status, stdout, stderr) {
        (Some(status), Some(stdout), Some(stderr)) => Ok((status, stdout, stderr)),
        _ => Err(Stop::Io(std::io::Error::other("incomplete command result"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Far above what the quick programs here need; the timeout tests use their own.
    const LIMIT: Duration = Duration::from_secs(60);

    /// A short limit for programs that hang (they would run for 60 s).
    const SHORT: Duration = Duration::from_millis(300);

    /// The state letter of `/proc/PID/stat` (`None` when the process is gone).
    fn proc_state(pid: u32) -> Option<char> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // "pid (comm) S ..." — comm may contain spaces; the state follows the last ')'.
        stat.rsplit_once(')')?.1.trim_start().chars().next()
    }

    /// Waits (bounded) until `pid` no longer runs: gone, or a zombie of another parent
    /// (a killed grandchild is reparented; its reaping is not ours).
    fn wait_not_running(pid: u32) -> Option<char> {
        for _ in 0..200 {
            match proc_state(pid) {
                None => return None,
                Some('Z') => return Some('Z'),
                Some(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
        proc_state(pid)
    }

    fn pids_from(file: &std::path::Path) -> Vec<u32> {
        std::fs::read_to_string(file)
            .unwrap()
            .split_whitespace()
            .map(|p| p.parse().unwrap())
            .collect()
    }

    fn temp_file(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("kube-ipvs-process-{}-{name}", std::process::id()))
    }

    #[test]
    fn hanging_program_times_out_and_its_process_group_is_killed_and_reaped() {
        let file = temp_file("hang");
        let script = format!(
            "sleep 60 & echo $$ $! > {}.tmp && mv {0}.tmp {0}; wait",
            file.display()
        );
        let err = run(None, OsStr::new("sh"), &["-c", &script], None, SHORT).unwrap_err();
        match &err {
            Error::Timeout { command, limit } => {
                assert!(command.starts_with("sh -c sleep 60"), "{command}");
                assert_eq!(*limit, SHORT);
            }
            other => panic!("expected a timeout, got {other}"),
        }
        assert!(
            err.to_string().contains("did not finish within 300ms"),
            "{err}"
        );
        let pids = pids_from(&file);
        let _ = std::fs::remove_file(&file);
        assert_eq!(pids.len(), 2, "{pids:?}");
        // The program itself is ours to reap: gone, not a zombie.
        assert_eq!(proc_state(pids[0]), None, "the program was not reaped");
        // What it started was killed with it (gone, or a zombie of init awaiting reaping).
        assert!(
            matches!(wait_not_running(pids[1]), None | Some('Z')),
            "its child still runs: {:?}",
            proc_state(pids[1])
        );
    }

    #[test]
    fn a_child_holding_the_output_open_after_the_program_exits_times_out_and_is_killed() {
        let file = temp_file("orphan");
        let script = format!(
            "sleep 60 & echo $! > {}.tmp && mv {0}.tmp {0}; exit 0",
            file.display()
        );
        let err = run(None, OsStr::new("sh"), &["-c", &script], None, SHORT).unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        let pids = pids_from(&file);
        let _ = std::fs::remove_file(&file);
        assert!(
            matches!(wait_not_running(pids[0]), None | Some('Z')),
            "the background child still runs: {:?}",
            proc_state(pids[0])
        );
    }

    /// A shell that computes (forks `date` in a loop) for about three seconds.
    const BUSY_3S: &str =
        "end=$(( $(date +%s) + 3 )); while [ $(date +%s) -lt $end ]; do :; done; echo done";

    #[test]
    fn a_busy_program_runs_past_its_limit_while_busy_and_is_recorded() {
        let window = Duration::from_millis(500);
        let t0 = Instant::now();
        let out = Runner::new()
            .with_timeout(window)
            .while_busy(Duration::from_secs(60))
            .run(OsStr::new("sh"), &["-c", BUSY_3S], None)
            .unwrap();
        assert!(out.success, "{}", out.stderr);
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "done");
        assert!(t0.elapsed() > Duration::from_secs(1), "{:?}", t0.elapsed());
        assert!(last_busy().is_some_and(|b| b > t0), "{:?}", last_busy());
        // The same program under a plain limit is killed at it.
        let err = Runner::new()
            .with_timeout(window)
            .run(OsStr::new("sh"), &["-c", BUSY_3S], None)
            .unwrap_err();
        assert!(
            matches!(err, Error::Timeout { limit, .. } if limit == window),
            "{err}"
        );
    }

    #[test]
    fn a_busy_program_is_recorded_inside_its_first_window() {
        // Busy for 4-5 s inside a 9 s window: no window ends, the samples (every 3 s) record
        // it.
        let t0 = Instant::now();
        let out = Runner::new()
            .with_timeout(Duration::from_secs(9))
            .while_busy(Duration::from_secs(60))
            .run(
                OsStr::new("sh"),
                &[
                    "-c",
                    "end=$(( $(date +%s) + 5 )); while [ $(date +%s) -lt $end ]; do :; done",
                ],
                None,
            )
            .unwrap();
        assert!(out.success, "{}", out.stderr);
        assert!(last_busy().is_some_and(|b| b > t0), "{:?}", last_busy());
    }

    #[test]
    fn an_idle_program_is_killed_after_one_window_even_while_busy_is_allowed() {
        let t0 = Instant::now();
        let err = Runner::new()
            .with_timeout(SHORT)
            .while_busy(Duration::from_secs(60))
            .run(OsStr::new("sleep"), &["60"], None)
            .unwrap_err();
        assert!(
            matches!(err, Error::Timeout { limit, .. } if limit == SHORT),
            "{err}"
        );
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    }

    #[test]
    fn a_program_busy_forever_is_killed_at_its_ceiling() {
        let ceiling = Duration::from_millis(1500);
        let t0 = Instant::now();
        let err = Runner::new()
            .with_timeout(SHORT)
            .while_busy(ceiling)
            .run(OsStr::new("sh"), &["-c", "while :; do :; done"], None)
            .unwrap_err();
        let took = t0.elapsed();
        assert!(
            matches!(err, Error::Timeout { limit, .. } if limit == ceiling),
            "{err}"
        );
        assert!(
            took >= ceiling && took < Duration::from_secs(15),
            "{took:?}"
        );
    }

    #[test]
    fn cpu_seconds_reads_this_process() {
        // This test process has run code: a parseable, non-negative figure.
        let cpu = cpu_seconds(std::process::id()).unwrap();
        assert!(cpu >= 0.0, "{cpu}");
        assert_eq!(cpu_seconds(u32::MAX), None);
    }

    #[test]
    fn program_that_never_reads_a_large_stdin_times_out() {
        // More than a pipe holds: a writer on the calling thread would block for good.
        let input = "x".repeat(4 << 20);
        let err = run(None, OsStr::new("sleep"), &["60"], Some(&input), SHORT).unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
    }

    #[test]
    fn large_input_and_output_flow_at_the_same_time() {
        // `cat` writes while it reads: input and output both exceed a pipe's buffer.
        let input = "0123456789abcdef\n".repeat(1 << 16);
        let out = run(None, OsStr::new("cat"), &[], Some(&input), LIMIT).unwrap();
        assert!(out.success);
        assert_eq!(out.stdout.len(), input.len());
        assert_eq!(out.stdout, input.as_bytes());
    }

    #[test]
    fn a_limit_too_large_to_represent_means_none() {
        let out = run(None, OsStr::new("true"), &[], None, Duration::MAX).unwrap();
        assert!(out.success);
    }

    #[test]
    fn missing_program_inside_a_time_limit_is_still_missing_binary() {
        let err = run(None, OsStr::new("/nonexistent/x"), &[], Some("a"), SHORT).unwrap_err();
        assert!(matches!(err, Error::MissingBinary(..)), "{err}");
    }

    #[test]
    fn missing_program_is_missing_binary() {
        let err = run(
            None,
            OsStr::new("/nonexistent/kube-ipvs-process-test"),
            &[],
            None,
            LIMIT,
        )
        .unwrap_err();
        assert!(
            matches!(&err, Error::MissingBinary(binary, _) if binary == "/nonexistent/kube-ipvs-process-test"),
            "{err}"
        );
    }

    #[test]
    fn collects_output_and_feeds_stdin() {
        let out = run(
            None,
            OsStr::new("sh"),
            &["-c", "cat; echo oops >&2; exit 3"],
            Some("hi\n"),
            LIMIT,
        )
        .unwrap();
        assert_eq!(out.command, "sh -c cat; echo oops >&2; exit 3");
        assert!(!out.success);
        assert_eq!(out.stdout, b"hi\n");
        assert_eq!(out.stderr, "oops");
    }
}
