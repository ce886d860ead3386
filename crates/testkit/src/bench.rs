//! Running a benchmark driver (a crate example that prints one `BENCH-JSON {...}` line) from a
//! smoke test, and reading its figures.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

/// The example `name` built next to the running test binary
/// (`target/<profile>/deps/TEST-HASH` → `target/<profile>/examples/NAME`); `package` names the
/// crate in the message when it is missing.
pub fn example(name: &str, package: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap();
    let p = dir.join("examples").join(name);
    assert!(
        p.exists(),
        "{} missing: build it with `cargo build -p {package} --examples`",
        p.display()
    );
    p
}

/// Runs the example `name` of `package` with `args` (its output is printed), requires success
/// and returns its `BENCH-JSON` line.
pub fn run(name: &str, package: &str, args: &[&str]) -> Value {
    let out = Command::new(example(name, package))
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "{name} {args:?}: {}\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("BENCH-JSON "))
        .expect("a BENCH-JSON line");
    serde_json::from_str(line).unwrap()
}

/// The count at JSON pointer `ptr`.
pub fn count(v: &Value, ptr: &str) -> u64 {
    v.pointer(ptr)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("{ptr} missing or not a count in {v}"))
}

/// The number (seconds) at JSON pointer `ptr`.
pub fn secs(v: &Value, ptr: &str) -> f64 {
    v.pointer(ptr)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("{ptr} missing in {v}"))
}

/// A command a benchmark driver ran did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// It could not be started or waited for.
    #[error("{what} {prog}: {source}")]
    Io {
        /// `starting` or `waiting for`.
        what: &'static str,
        /// The program.
        prog: String,
        /// The cause.
        source: std::io::Error,
    },
    /// It exited unsuccessfully.
    #[error("{command} failed: {reason}")]
    Failed {
        /// Program and arguments.
        command: String,
        /// Exit status and standard error.
        reason: String,
    },
}

/// Runs `prog` with `args` in the calling thread's network namespace, feeding `stdin` (empty
/// when `None`); returns the elapsed time and standard output of a successful run.
pub fn run_cmd(
    prog: &str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<(std::time::Duration, String), CommandError> {
    use std::io::Write;
    use std::process::Stdio;
    let io = |what, source| CommandError::Io {
        what,
        prog: prog.to_string(),
        source,
    };
    let start = std::time::Instant::now();
    let mut child = Command::new(prog)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| io("starting", e))?;
    let feeder = child.stdin.take().map(|mut input| {
        let data = stdin.unwrap_or("").to_owned();
        std::thread::spawn(move || input.write_all(data.as_bytes()))
    });
    let out = child.wait_with_output().map_err(|e| io("waiting for", e))?;
    if let Some(f) = feeder {
        let _ = f.join();
    }
    let elapsed = start.elapsed();
    if !out.status.success() {
        return Err(CommandError::Failed {
            command: format!("{prog} {args:?}"),
            reason: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok((elapsed, String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// The sum of the Prometheus text samples whose lines start with `prefix` (a metric name, or
/// a name with the start of its labels: `name{reason="x"`); 0 when none.
pub fn metric_sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A `kB` field of `/proc/PID/status` (`VmRSS`, `VmHWM`, `RssAnon`, ...); 0 when absent.
pub fn proc_status_kb(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// User + system CPU seconds of process `pid`, its waited-for children included
/// (`utime + stime + cutime + cstime` of `/proc/PID/stat`, in the kernel's fixed
/// `USER_HZ` = 100 ticks per second); None when the process is gone.
pub fn proc_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces and parentheses): state is
    // field 3, utime field 14, so index 11 from here.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f
        .get(11..15)?
        .iter()
        .map(|v| v.parse::<u64>().ok())
        .sum::<Option<u64>>()?;
    Some(ticks as f64 / 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_figures() {
        let me = std::process::id();
        assert!(proc_status_kb(me, "VmRSS") > 0);
        // RSS first: the peak read after it is at least that RSS (read the other way round,
        // other test threads' allocations in between made it fail).
        let rss = proc_status_kb(me, "VmRSS");
        assert!(proc_status_kb(me, "VmHWM") >= rss);
        assert_eq!(proc_status_kb(me, "NoSuchField"), 0);
        // Burn a little CPU so the figure cannot be a constant.
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(50) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        assert!(x > 0);
        assert!(proc_cpu_seconds(me).is_some_and(|s| s > 0.0));
        assert_eq!(proc_cpu_seconds(u32::MAX), None);
    }
}
