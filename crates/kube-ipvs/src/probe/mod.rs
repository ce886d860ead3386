//! Can IPVS mode run on this node? Decided at start without ever tearing a working node down.
//!
//! - [`probe_with`] classifies the probe (upstream kube-proxy's `canUseIPVSProxier` in
//!   `pkg/proxy/ipvs/proxier.go`: create and delete a virtual server 198.51.100.0:20000/TCP with
//!   the configured scheduler) into [`ProbeError::Absent`] (the "IPVS" generic netlink family does
//!   not resolve and `modprobe -- ip_vs` does not make it resolve), [`ProbeError::SchedulerMissing`]
//!   (the kernel answers ENOENT for the scheduler and `modprobe -- ip_vs_SCHED` does not help) and
//!   [`ProbeError::Transient`] (everything else: EBUSY, EPERM from a seccomp profile, ENOMEM, a
//!   timeout, a malformed reply). Loading the modules with `modprobe` first is what upstream did
//!   before 1.26 (`LinuxKernelHandler.GetModules`: `modprobe -- MODULE` for each module IPVS mode
//!   needs, the scheduler's `ip_vs_SCHED` included); since then it relies on the kernel's
//!   autoload, which `modprobe` here only backs up.
//! - [`decide`]: absent or scheduler-less IPVS falls back to iptables mode (pre-1.26 upstream
//!   fell back when a module was missing; since 1.26 it exits, which `--ipvs-fallback=false`
//!   selects); a transient error is retried and never falls back; IPVS state already on the node
//!   (kube-ipvs0, owned virtual servers) is a strong signal to stay, like upstream's check that a
//!   virtual server with the configured scheduler exists ("most likely a kube-proxy re-start").
//! - [`select_mode`]: the daemon's loop around both: retries with jittered exponential backoff
//!   (1 s doubling to 30 s) for as long as it takes, a warning and
//!   `kube_ipvs_ipvs_probe_failures_total{kind}` per failed attempt, `/healthz` and `/livez` 503
//!   with the reason until the probe succeeds. Nothing is removed meanwhile.
//! - [`load_modules`]: `kube-ipvs load-modules`, the DaemonSet's init container (only
//!   `CAP_SYS_MODULE`, the host's `/lib/modules` read-only), loads upstream's module list and the
//!   configured scheduler's before the daemon starts, for kernels whose `ip_vs` does not
//!   autoload; it never fails, so a node without the modules still starts the daemon, which
//!   then falls back loudly.
//! - The test-only fault hook `KUBE_IPVS_FAULT_PROBE` ([`FaultPlan`]) makes the real binary's
//!   probe fail on purpose; inert unless set, logged loudly when set.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ipvs_netlink::error::libc_errno;
use ipvs_netlink::{Family, Op, Protocol, Service, ServiceKey};

use crate::config::{Config, ProxyMode};
use crate::error::{Error, FieldError};

mod classify;
mod decide;
mod fault;
mod modules;
mod select;

pub use classify::*;
pub use decide::*;
pub use fault::*;
pub use modules::*;
pub use select::*;

/// The environment variable of the test-only probe fault hook.
pub const FAULT_ENV: &str = "KUBE_IPVS_FAULT_PROBE";
/// The address upstream kube-proxy probes IPVS with (TEST-NET-2, never a real service).
const PROBE_ADDR: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::new(198, 51, 100, 0));
/// The port of the probe virtual server.
const PROBE_PORT: u16 = 20000;
/// How long one `modprobe` may take before it is killed (and counts as failed).
pub const MODPROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// First retry delay of a failed probe.
pub const BACKOFF_BASE: Duration = Duration::from_secs(1);
/// Longest retry delay of a failed probe.
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(errno: i32) -> ipvs_netlink::Error {
        ipvs_netlink::Error::Kernel {
            op: ipvs_netlink::error::OpKind::NewService,
            errno,
        }
    }

    /// Runs [`probe_with`] over scripted answers; returns the result and the modules loaded.
    fn run(
        opens: Vec<Result<(), ipvs_netlink::Error>>,
        creates: Vec<Result<(), ipvs_netlink::Error>>,
        module: ModuleLoad,
    ) -> (Result<(), ProbeError>, Vec<String>) {
        let mut opens = opens.into_iter();
        let mut creates = creates.into_iter();
        let mut loaded = Vec::new();
        let r = probe_with(
            "rr",
            || opens.next().expect("an unexpected open"),
            |_: &mut (), s| {
                assert_eq!(s, "rr");
                creates.next().expect("an unexpected create")
            },
            |m| {
                loaded.push(m.to_string());
                module
            },
        );
        (r, loaded)
    }

    #[test]
    fn absent_only_when_the_family_stays_missing_after_modprobe() {
        use ipvs_netlink::Error::FamilyMissing;
        // Missing, modprobe fails, still missing: absent.
        let (r, loaded) = run(
            vec![Err(FamilyMissing), Err(FamilyMissing)],
            vec![],
            ModuleLoad::Failed(Some(1)),
        );
        assert_eq!(r, Err(ProbeError::Absent(ModuleLoad::Failed(Some(1)))));
        assert_eq!(loaded, ["ip_vs"]);
        // No modprobe binary counts as "cannot be loaded" too.
        let (r, _) = run(
            vec![Err(FamilyMissing), Err(FamilyMissing)],
            vec![],
            ModuleLoad::NoModprobe,
        );
        assert_eq!(r.unwrap_err().kind(), "absent");
        // modprobe loads it: the family resolves and the probe goes on.
        let (r, loaded) = run(
            vec![Err(FamilyMissing), Ok(())],
            vec![Ok(())],
            ModuleLoad::Loaded,
        );
        assert_eq!(r, Ok(()));
        assert_eq!(loaded, ["ip_vs"]);
        // The re-resolve fails otherwise: transient, not absent.
        let (r, _) = run(
            vec![Err(FamilyMissing), Err(kernel(16))],
            vec![],
            ModuleLoad::Loaded,
        );
        assert_eq!(r.unwrap_err().kind(), "ebusy");
    }

    #[test]
    fn every_other_open_error_is_transient() {
        for (errno, kind) in [
            (16, "ebusy"),
            (1, "eperm"),
            (12, "enomem"),
            (110, "etimedout"),
        ] {
            let (r, loaded) = run(vec![Err(kernel(errno))], vec![], ModuleLoad::Loaded);
            let e = r.unwrap_err();
            assert!(matches!(e, ProbeError::Transient(_)), "{e:?}");
            assert_eq!(e.kind(), kind);
            assert!(loaded.is_empty(), "no modprobe for a transient error");
        }
        // A socket error (EPERM from a seccomp profile at socket()) keeps its errno.
        let io = ipvs_netlink::Error::Io {
            what: "connect",
            source: std::io::Error::from_raw_os_error(1),
        };
        let (r, _) = run(vec![Err(io)], vec![], ModuleLoad::Loaded);
        assert_eq!(r.unwrap_err().kind(), "eperm");
        // A reply that never came: transient, without an errno.
        let no_reply = ipvs_netlink::Error::NoReply {
            op: ipvs_netlink::error::OpKind::ResolveFamily,
        };
        let (r, _) = run(vec![Err(no_reply)], vec![], ModuleLoad::Loaded);
        assert_eq!(r.unwrap_err().kind(), "protocol");
        // An unknown errno gets the catch-all label (bounded cardinality).
        let (r, _) = run(vec![Err(kernel(99))], vec![], ModuleLoad::Loaded);
        assert_eq!(r.unwrap_err().kind(), "errno");
    }

    #[test]
    fn scheduler_missing_only_after_modprobe_of_its_module() {
        let (r, loaded) = run(
            vec![Ok(())],
            vec![Err(kernel(2)), Err(kernel(2))],
            ModuleLoad::Failed(Some(1)),
        );
        assert_eq!(
            r,
            Err(ProbeError::SchedulerMissing {
                scheduler: "rr".into(),
                module: ModuleLoad::Failed(Some(1)),
            })
        );
        assert_eq!(loaded, ["ip_vs_rr"]);
        // The module loads: IPVS is usable.
        let (r, _) = run(
            vec![Ok(())],
            vec![Err(kernel(2)), Ok(())],
            ModuleLoad::Loaded,
        );
        assert_eq!(r, Ok(()));
        // Other virtual-server errors are transient (EBUSY, ENOMEM).
        for errno in [16, 12] {
            let (r, loaded) = run(vec![Ok(())], vec![Err(kernel(errno))], ModuleLoad::Loaded);
            assert!(matches!(r, Err(ProbeError::Transient(_))), "{r:?}");
            assert!(loaded.is_empty());
        }
    }

    #[test]
    fn every_kind_is_in_the_fixed_label_set() {
        let all: Vec<&str> = kinds().collect();
        let mut errors: Vec<ProbeError> = (0..200)
            .map(|errno| {
                ProbeError::Transient(Transient {
                    step: ProbeStep::Open,
                    errno: Some(errno),
                    detail: String::new(),
                })
            })
            .collect();
        errors.push(ProbeError::Absent(ModuleLoad::TimedOut));
        errors.push(ProbeError::SchedulerMissing {
            scheduler: "x".into(),
            module: ModuleLoad::Loaded,
        });
        errors.push(ProbeError::Transient(Transient {
            step: ProbeStep::State,
            errno: None,
            detail: String::new(),
        }));
        for e in &errors {
            assert!(all.contains(&e.kind()), "{e:?} -> {}", e.kind());
        }
        assert_eq!(all.len(), 12);
    }

    #[test]
    fn decisions() {
        let transient = Err(ProbeError::Transient(Transient {
            step: ProbeStep::Open,
            errno: Some(16),
            detail: String::new(),
        }));
        let absent = Err(ProbeError::Absent(ModuleLoad::NoModprobe));
        let sched = Err(ProbeError::SchedulerMissing {
            scheduler: "mh".into(),
            module: ModuleLoad::NoModprobe,
        });
        let clean = Some(NodeIpvsState::default());
        let link_only = Some(NodeIpvsState {
            dummy_link: true,
            owned_services: 0,
        });
        let serving = Some(NodeIpvsState {
            dummy_link: true,
            owned_services: 12,
        });
        for fallback in [true, false] {
            let give_up = if fallback {
                Decision::Fallback
            } else {
                Decision::Fail
            };
            for state in [None, clean, link_only, serving] {
                assert_eq!(decide(&Ok(()), state, fallback), Decision::Ipvs);
                // Transient: always retried, never a fallback, whatever the state.
                assert_eq!(decide(&transient, state, fallback), Decision::Retry);
            }
            // Absent: falls back (or fails) unless virtual servers were seen, which IPVS
            // being absent rules out (so the contradiction is retried), or the state is unknown.
            assert_eq!(decide(&absent, clean, fallback), give_up);
            assert_eq!(decide(&absent, link_only, fallback), give_up);
            assert_eq!(decide(&absent, serving, fallback), Decision::Retry);
            assert_eq!(decide(&absent, None, fallback), Decision::Retry);
            // Scheduler missing: any IPVS state on the node holds the fallback back.
            assert_eq!(decide(&sched, clean, fallback), give_up);
            assert_eq!(decide(&sched, link_only, fallback), Decision::Retry);
            assert_eq!(decide(&sched, serving, fallback), Decision::Retry);
            assert_eq!(decide(&sched, None, fallback), Decision::Retry);
        }
    }

    #[test]
    fn backoff_doubles_from_one_second_to_thirty_with_bounded_jitter() {
        let d = |attempt, jitter| backoff(attempt, BACKOFF_BASE, BACKOFF_MAX, jitter);
        let mid: Vec<u64> = (1..=8).map(|a| d(a, 0.5).as_secs()).collect();
        assert_eq!(mid, [1, 2, 4, 8, 16, 30, 30, 30]);
        // Jitter stays within ±20 % and never exceeds the cap.
        assert_eq!(d(1, 0.0), Duration::from_millis(800));
        assert_eq!(d(1, 1.0), Duration::from_millis(1200));
        assert_eq!(d(3, 0.0), Duration::from_millis(3200));
        for attempt in [6, 7, 100, u32::MAX] {
            assert_eq!(d(attempt, 1.0), BACKOFF_MAX);
            assert_eq!(d(attempt, 0.0), Duration::from_secs(24));
        }
        for _ in 0..100 {
            let j = jitter();
            assert!((0.0..=1.0).contains(&j), "{j}");
        }
    }

    #[test]
    fn fault_hook_values() {
        let p: FaultPlan = "ebusy:3".parse().unwrap();
        assert_eq!(
            p,
            FaultPlan {
                fault: InjectedFault::Errno(16),
                remaining: Some(3)
            }
        );
        let p: FaultPlan = "absent".parse().unwrap();
        assert_eq!(p.fault, InjectedFault::Absent);
        assert_eq!(p.remaining, None);
        assert_eq!(
            "scheduler:1".parse::<FaultPlan>().unwrap().fault,
            InjectedFault::SchedulerMissing
        );
        for bad in ["", "ebusy:", "ebusy:x", "enoent", "EBUSY", "ebusy:-1"] {
            let e = bad.parse::<FaultPlan>().unwrap_err();
            assert_eq!(e.field, FAULT_ENV, "{bad}");
        }
    }

    #[test]
    fn prober_injects_the_first_n_probes_then_probes_for_real() {
        let mut p = Prober::new(
            "rr",
            Some(FaultPlan {
                fault: InjectedFault::Errno(16),
                remaining: Some(2),
            }),
        );
        assert_eq!(p.take_fault(), Some(InjectedFault::Errno(16)));
        let (r, absent) = p.probe();
        assert_eq!(r.unwrap_err().kind(), "ebusy");
        assert!(!absent);
        assert_eq!(p.take_fault(), None, "the fault is spent");
        let mut always = Prober::new(
            "rr",
            Some(FaultPlan {
                fault: InjectedFault::Absent,
                remaining: None,
            }),
        );
        for _ in 0..3 {
            let (r, absent) = always.probe();
            assert_eq!(r.unwrap_err().kind(), "absent");
            assert!(absent);
        }
        assert_eq!(Prober::new("rr", None).take_fault(), None);
    }

    #[test]
    fn required_modules_are_upstreams_list_plus_the_scheduler() {
        assert_eq!(
            required_modules("rr"),
            ["ip_vs", "ip_vs_rr", "ip_vs_wrr", "ip_vs_sh", "nf_conntrack"]
        );
        assert_eq!(
            required_modules("mh"),
            [
                "ip_vs",
                "ip_vs_rr",
                "ip_vs_wrr",
                "ip_vs_sh",
                "ip_vs_mh",
                "nf_conntrack"
            ]
        );
    }

    fn config(flags: &[(&str, &str)]) -> Config {
        let flags: Vec<_> = flags
            .iter()
            .map(|(f, v)| {
                let st = crate::settings::SETTINGS
                    .iter()
                    .find(|s| s.flag == Some(*f))
                    .unwrap();
                (st, v.to_string())
            })
            .collect();
        crate::config::from_sources(None, &flags, || Ok("node-a".into()))
            .unwrap()
            .config
    }

    #[test]
    fn load_modules_tries_every_module_and_never_fails() {
        let cfg = config(&[("ipvs-scheduler", "lc")]);
        let mut tried = Vec::new();
        let report = load_modules(&cfg, |m| {
            tried.push(m.to_string());
            if m == "ip_vs_lc" || m == "nf_conntrack" {
                ModuleLoad::Failed(Some(1))
            } else {
                ModuleLoad::Loaded
            }
        });
        assert_eq!(
            tried,
            [
                "ip_vs",
                "ip_vs_rr",
                "ip_vs_wrr",
                "ip_vs_sh",
                "ip_vs_lc",
                "nf_conntrack"
            ]
        );
        assert_eq!(report.failed(), ["ip_vs_lc", "nf_conntrack"]);
        // Nothing loads (no capability): every module is still tried, one report each.
        let report = load_modules(&cfg, |_| ModuleLoad::NoModprobe);
        assert_eq!(report.modules.len(), 6);
        assert_eq!(report.failed().len(), 6);
        // iptables mode needs nothing.
        let cfg = config(&[("proxy-mode", "iptables")]);
        let report = load_modules(&cfg, |m| panic!("loaded {m} in iptables mode"));
        assert!(report.modules.is_empty());
    }

    #[test]
    fn modprobe_outcomes_of_a_real_child() {
        // No such module: modprobe runs and fails (or is not installed here).
        let r = modprobe("kube_ipvs_no_such_module", MODPROBE_TIMEOUT);
        assert!(
            matches!(r, ModuleLoad::Failed(Some(c)) if c != 0) || r == ModuleLoad::NoModprobe,
            "{r:?}"
        );
        // A child that hangs is killed at the timeout; a missing binary is NoModprobe.
        assert_eq!(
            run_tool("sleep", "30", Duration::from_millis(100)),
            ModuleLoad::TimedOut
        );
        assert_eq!(run_tool("true", "x", MODPROBE_TIMEOUT), ModuleLoad::Loaded);
        assert_eq!(
            run_tool("/nonexistent/modprobe", "ip_vs", MODPROBE_TIMEOUT),
            ModuleLoad::NoModprobe
        );
    }
}
