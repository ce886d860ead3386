//! Test helpers: a uniquely named network namespace (testkit's) that is removed on drop, `ip`
//! inside it, running async code on a thread that has entered it, and applying address diffs
//! with the request counts and `ip` cross-checks the tests share.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use netif::{diff_addresses, AddrDiff, Netif, NodeAddressSet, DUMMY_LINK};
use testkit::netns::Netns;
use tokio::sync::watch;

/// A network namespace (`testkit::netns::Netns`: created with `ip netns add`, `lo` up), deleted
/// on drop (also when a test fails).
pub struct NetNs(Ns);

/// A cheap, cloneable handle of the namespace, for use inside test closures.
#[derive(Clone, Debug)]
pub struct Ns(Arc<Netns>);

impl std::ops::Deref for NetNs {
    type Target = Ns;
    fn deref(&self) -> &Ns {
        &self.0
    }
}

impl NetNs {
    pub fn new(tag: &str) -> Self {
        let ns = Netns::new(&format!("netif-{tag}"))
            .unwrap_or_else(|e| panic!("ip netns add (needs root): {e}"));
        Self(Ns(Arc::new(ns)))
    }

    /// Run `f` on a new thread that has entered this namespace, inside a current-thread tokio
    /// runtime (sockets opened there belong to the namespace).
    pub fn run<F, Fut, T>(&self, f: F) -> T
    where
        F: FnOnce(Ns) -> Fut + Send + 'static,
        Fut: Future<Output = T>,
        T: Send + 'static,
    {
        let ns = self.0.clone();
        let Ns(netns) = &self.0;
        let h = netns
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                Ok(rt.block_on(f(ns)))
            })
            .unwrap();
        match h.join() {
            Ok(v) => v.unwrap(),
            Err(e) => std::panic::resume_unwind(e),
        }
    }
}

impl Ns {
    /// Run `ip -n NS ARGS`, returning stdout or the error (with stderr).
    pub fn try_ip(&self, args: &[&str]) -> std::io::Result<String> {
        self.0.ip(args)
    }

    /// Run `ip -n NS ARGS` and insist on success.
    pub fn ip(&self, args: &[&str]) -> String {
        self.try_ip(args)
            .unwrap_or_else(|e| panic!("ip {args:?} in {}: {e}", self.0.name()))
    }

    /// Interface index of a link, from `ip -o link show`.
    pub fn ifindex(&self, link: &str) -> u32 {
        let out = self.ip(&["-o", "link", "show", "dev", link]);
        out.split(':').next().unwrap().trim().parse().unwrap()
    }

    /// Addresses on a link as "ADDR/PREFIX" strings, from `ip -o addr show`.
    pub fn addrs(&self, link: &str) -> Vec<String> {
        let out = self.ip(&["-o", "addr", "show", "dev", link]);
        let mut v: Vec<String> = out
            .lines()
            .filter_map(|l| {
                let mut it = l.split_whitespace();
                it.find(|w| *w == "inet" || *w == "inet6")
                    .and_then(|_| it.next())
                    .map(str::to_string)
            })
            .collect();
        v.sort();
        v
    }
}

/// Parses addresses.
pub fn ips(items: &[&str]) -> BTreeSet<IpAddr> {
    items.iter().map(|s| s.parse().unwrap()).collect()
}

/// Applies `diff`, asserting it took exactly `requests` requests, every change succeeded and
/// `ip` then lists exactly `want` on kube-ipvs0.
pub async fn apply_all(n: &Netif, ns: &Ns, diff: &AddrDiff, requests: u64, want: &[&str]) {
    let before = n.requests_sent();
    let res = n.apply(diff).await;
    assert_eq!(n.requests_sent() - before, requests);
    assert!(res.iter().all(|(_, r)| r.is_ok()), "{res:?}");
    assert_eq!(ns.addrs(DUMMY_LINK), want);
}

/// Reads the addresses back, asserts they are `desired` and that applying the (empty) diff
/// sends no request at all; returns what was read.
pub async fn unchanged_sends_nothing(n: &Netif, desired: &BTreeSet<IpAddr>) -> BTreeSet<IpAddr> {
    let current = n.addresses().await.unwrap();
    assert_eq!(current, *desired);
    let before = n.requests_sent();
    assert!(n.apply(&diff_addresses(desired, &current)).await.is_empty());
    assert_eq!(n.requests_sent(), before);
    current
}

/// Wait (at most 1 s per change notification) until `pred` holds for the tracked set.
pub async fn wait_for(
    rx: &mut watch::Receiver<NodeAddressSet>,
    what: &str,
    pred: impl Fn(&NodeAddressSet) -> bool,
) -> NodeAddressSet {
    loop {
        if pred(&rx.borrow_and_update()) {
            return rx.borrow().clone();
        }
        match tokio::time::timeout(Duration::from_secs(1), rx.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => panic!("tracker stopped while waiting for {what}"),
            Err(_) => panic!(
                "no change within 1 s while waiting for {what}: {:?}",
                rx.borrow()
            ),
        }
    }
}
