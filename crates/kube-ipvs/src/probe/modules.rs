//! Loading kernel modules with `modprobe`, bounded in time: the probe's own attempt, and
//! `kube-ipvs load-modules` (the DaemonSet's init container) loading what IPVS mode needs.

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

/// The modules IPVS mode needs with `scheduler`: upstream kube-proxy's list before 1.26
/// (`GetRequiredIPVSModules` in `pkg/util/ipvs/kernelcheck_linux.go`: `ip_vs`, `ip_vs_rr`,
/// `ip_vs_wrr`, `ip_vs_sh`, `nf_conntrack`) plus the scheduler's own module, as upstream's
/// `CanUseIPVSProxier` required it. `ip_vs` first: the schedulers depend on it.
pub fn required_modules(scheduler: &str) -> Vec<String> {
    let mut out: Vec<String> = ["ip_vs", "ip_vs_rr", "ip_vs_wrr", "ip_vs_sh"]
        .map(String::from)
        .into();
    let own = format!("ip_vs_{scheduler}");
    if !scheduler.is_empty() && !out.contains(&own) {
        out.push(own);
    }
    out.push("nf_conntrack".into());
    out
}

/// What [`load_modules`] did, module by module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModulesReport {
    /// Each module with what `modprobe` did, in load order.
    pub modules: Vec<(String, ModuleLoad)>,
}

impl ModulesReport {
    /// The modules that did not load.
    pub fn failed(&self) -> Vec<&str> {
        self.modules
            .iter()
            .filter(|(_, r)| *r != ModuleLoad::Loaded)
            .map(|(m, _)| m.as_str())
            .collect()
    }
}

/// `kube-ipvs load-modules` (the DaemonSet's init container, which alone has `CAP_SYS_MODULE`
/// and the host's `/lib/modules`, read-only): loads [`required_modules`] of the configured
/// scheduler in IPVS mode (nothing in iptables mode) with `load`, one `modprobe` each, logging
/// each outcome. Never an error: a module that cannot be loaded is logged as a warning and the
/// daemon's IPVS probe then decides (it retries `modprobe` itself and falls back loudly: log,
/// Node Event, metrics). Kernels whose `ip_vs` autoloads from its generic netlink family do not
/// need this; older ones do, and the daemon's container cannot load modules.
pub fn load_modules(config: &Config, mut load: impl FnMut(&str) -> ModuleLoad) -> ModulesReport {
    let modules = match config.mode {
        ProxyMode::Iptables => Vec::new(),
        ProxyMode::Ipvs => required_modules(&config.ipvs.scheduler),
    };
    if modules.is_empty() {
        tracing::info!(
            mode = config.mode.as_str(),
            "load-modules: nothing to load in this mode"
        );
    }
    let mut report = ModulesReport {
        modules: Vec::new(),
    };
    for m in modules {
        let r = load(&m);
        if r == ModuleLoad::Loaded {
            tracing::info!(module = %m, "load-modules: loaded (or already there)");
        } else {
            tracing::warn!(
                module = %m,
                result = %r,
                "load-modules: CANNOT LOAD MODULE (needs CAP_SYS_MODULE and the host's \
                 /lib/modules); the daemon starts anyway and its IPVS probe decides (falls back \
                 to iptables mode loudly if IPVS stays unusable)"
            );
        }
        report.modules.push((m, r));
    }
    let failed = report.failed();
    tracing::info!(
        attempted = report.modules.len(),
        loaded = report.modules.len() - failed.len(),
        failed = failed.len(),
        "load-modules: done{}",
        if failed.is_empty() {
            String::new()
        } else {
            format!(" (not loaded: {})", failed.join(" "))
        }
    );
    report
}
