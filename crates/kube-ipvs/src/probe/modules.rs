//! Loading kernel modules with `modprobe`, bounded in time.

use super::*;

/// What `modprobe -- MODULE` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModuleLoad {
    /// It exited 0.
    Loaded,
    /// There is no `modprobe` to run (not found, not executable).
    NoModprobe,
    /// It exited non-zero (the code; `None` when killed by a signal).
    Failed(Option<i32>),
    /// It ran longer than [`MODPROBE_TIMEOUT`] and was killed.
    TimedOut,
}

impl std::fmt::Display for ModuleLoad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModuleLoad::Loaded => f.write_str("modprobe succeeded"),
            ModuleLoad::NoModprobe => f.write_str("no modprobe to run"),
            ModuleLoad::Failed(Some(c)) => write!(f, "modprobe failed with exit code {c}"),
            ModuleLoad::Failed(None) => f.write_str("modprobe was killed by a signal"),
            ModuleLoad::TimedOut => write!(f, "modprobe timed out after {MODPROBE_TIMEOUT:?}"),
        }
    }
}

/// Runs `modprobe -- module` as a child process, killed after `timeout`.
pub fn modprobe(module: &str, timeout: Duration) -> ModuleLoad {
    run_tool("modprobe", module, timeout)
}

/// Runs `program -- arg`, killed after `timeout`.
pub(super) fn run_tool(program: &str, arg: &str, timeout: Duration) -> ModuleLoad {
    let module = arg;
    let child = Command::new(program)
        .args(["--", arg])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(module, error = %e, "cannot run {program}");
            return ModuleLoad::NoModprobe;
        }
    };
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return ModuleLoad::Loaded,
            Ok(Some(status)) => return ModuleLoad::Failed(status.code()),
            Ok(None) if start.elapsed() >= timeout => {
                let _ = child.kill();
                let _ = child.wait();
                return ModuleLoad::TimedOut;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                return ModuleLoad::Failed(None);
            }
        }
    }
}
