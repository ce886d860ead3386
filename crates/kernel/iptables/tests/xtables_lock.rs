//! The xtables lock (`netns_*`, root, host kernel, iptables-legacy): a restore while another
//! program holds the lock gives up after upstream's 5 s wait with a typed error instead of
//! hanging, the process time limit bounds it too, and the same restore succeeds once the lock
//! is free.
//!
//! Its own test binary: it points iptables at a private lock file through `XTABLES_LOCKFILE`
//! (read by iptables-legacy ≥ 1.8.5), set once for this process, so holding the lock never
//! stalls iptables anywhere else on the host.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use iptables::{Backend, Error, Family, Iptables, Runner, Table, XTABLES_WAIT_SECONDS};
use nix::fcntl::{Flock, FlockArg};
use testkit::netns::Netns;

const PAYLOAD: &str = "*nat\n:KUBE-LOCK-TEST - [0:0]\n-A KUBE-LOCK-TEST -j RETURN\nCOMMIT\n";

#[test]
#[ignore = "netns"]
fn netns_restore_with_the_xtables_lock_held_fails_then_succeeds_after_release() {
    let lockfile =
        std::env::temp_dir().join(format!("kube-ipvs-xtables-{}.lock", std::process::id()));
    // The only test in this binary: no other thread reads the environment concurrently.
    std::env::set_var("XTABLES_LOCKFILE", &lockfile);
    let ns = Netns::new("xtlock").unwrap();
    let mut ipt = Iptables::new(Backend::Legacy, Family::Inet, Runner::in_netns(ns.name()));

    // Another program holds the lock (flock(2), as iptables-legacy takes it).
    let file = std::fs::File::create(&lockfile).unwrap();
    let held = Flock::lock(file, FlockArg::LockExclusive)
        .map_err(|(_, e)| e)
        .unwrap();

    // The restore waits upstream's 5 s for it, then gives up with a lock error.
    let err = ipt.apply_restore(Table::Nat, PAYLOAD).unwrap_err();
    match &err {
        Error::LockTimeout { command, stderr } => {
            assert!(
                command.contains("iptables-legacy-restore --noflush -w 5 -W 100000"),
                "{command}"
            );
            assert!(stderr.contains("lock"), "{stderr}");
        }
        other => panic!("expected a lock timeout, got {other}"),
    }
    assert!(
        err.to_string()
            .contains(&format!("waited {XTABLES_WAIT_SECONDS}s")),
        "{err}"
    );

    // A process time limit shorter than the lock wait cuts the wait short: the restore is
    // killed and the call fails with a timeout.
    let mut short = Iptables::new(
        Backend::Legacy,
        Family::Inet,
        Runner::in_netns(ns.name()).with_timeout(Duration::from_secs(1)),
    );
    let err = short.apply_restore(Table::Nat, PAYLOAD).unwrap_err();
    assert!(
        matches!(&err, Error::Timeout { command, limit } if command.contains("iptables-legacy-restore") && *limit == Duration::from_secs(1)),
        "{err}"
    );

    // Nothing was written while the lock was held.
    let saved = ipt.save(Table::Nat).unwrap();
    assert!(!saved.contains("KUBE-LOCK-TEST"), "{saved}");

    // Released: the same restore goes through.
    drop(held);
    ipt.apply_restore(Table::Nat, PAYLOAD).unwrap();
    let saved = ipt.save(Table::Nat).unwrap();
    assert!(saved.contains(":KUBE-LOCK-TEST"), "{saved}");
    assert!(saved.contains("-A KUBE-LOCK-TEST -j RETURN"), "{saved}");
    let _ = std::fs::remove_file(&lockfile);
}
