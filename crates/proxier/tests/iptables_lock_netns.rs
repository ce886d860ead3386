//! iptables mode with the xtables lock held by another program (root, host kernel,
//! iptables-legacy, in a network namespace): the sync fails as an iptables failure of that sync
//! (reported, rules untouched) instead of hanging, and the next sync after the lock is free
//! programs the rules.
//!
//! Its own test binary: it points iptables at a private lock file through `XTABLES_LOCKFILE`,
//! set once for this process, so holding the lock never stalls iptables elsewhere on the host.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod fixtures;

use std::collections::BTreeSet;
use std::net::IpAddr;

use fixtures::*;
use iptables::{Backend, Family, Iptables, Runner};
use nix::fcntl::{Flock, FlockArg};
use proxier::iptables_mode::IptablesProxier;
use proxier::ipvs_mode::RulesConfig;
use testkit::netns::Netns;

#[test]
#[ignore = "netns"]
fn netns_sync_with_the_xtables_lock_held_fails_as_iptables_then_recovers() {
    let lockfile =
        std::env::temp_dir().join(format!("kube-ipvs-ctl-xtables-{}.lock", std::process::id()));
    // The only test in this binary: no other thread reads the environment concurrently.
    std::env::set_var("XTABLES_LOCKFILE", &lockfile);
    let node = Netns::new(&format!("ctl-xtlock-{}", std::process::id())).unwrap();
    let store = synced_store(
        vec![svc("default", "web", "10.96.0.10")
            .node_port("http", 80, "TCP", 30080)
            .build()],
        vec![slice("default", "web", "web-1")
            .port("http", 8080, "TCP")
            .ep("10.244.1.1", "node-b", C::Ready)
            .ep("10.244.1.2", "node-b", C::Ready)
            .build()],
    );
    let addrs: BTreeSet<IpAddr> = ["192.168.50.1".parse().unwrap()].into_iter().collect();
    let ipt = Iptables::new(Backend::Legacy, Family::Inet, Runner::in_netns(node.name()));
    let mut p = IptablesProxier::new(cfg4(), RulesConfig::default(), NODE, Box::new(ipt));

    let file = std::fs::File::create(&lockfile).unwrap();
    let held = Flock::lock(file, FlockArg::LockExclusive)
        .map_err(|(_, e)| e)
        .unwrap();
    let r = p.sync(&store, &addrs);
    assert!(!r.ok(), "a sync under a held lock succeeded: {r:?}");
    assert!(r.iptables_restore_failed, "{r:?}");
    assert!(
        r.errors.iter().any(|e| e.contains("xtables lock")),
        "the lock is not named: {:?}",
        r.errors
    );
    let saved = node.run(&["iptables-legacy-save", "-t", "nat"]).unwrap();
    assert!(
        !saved.contains("KUBE-SVC-"),
        "rules written under a held lock:\n{saved}"
    );

    drop(held);
    let r = p.sync(&store, &addrs);
    assert!(r.ok(), "{r:?}");
    let saved = node.run(&["iptables-legacy-save", "-t", "nat"]).unwrap();
    assert!(saved.contains(":KUBE-SVC-"), "{saved}");
    let _ = std::fs::remove_file(&lockfile);
}
