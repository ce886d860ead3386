//! Test helpers: a uniquely named network namespace that is removed on drop, `ip` inside it,
//! and running async code on a thread that has entered it.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::fs::File;
use std::future::Future;
use std::net::IpAddr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use netif::NodeAddressSet;
use nix::sched::{setns, CloneFlags};
use tokio::sync::watch;

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A network namespace created with `ip netns add`, deleted on drop (also when a test fails).
pub struct NetNs(Ns);

/// A cheap, cloneable name of a namespace (no ownership), for use inside test closures.
#[derive(Clone, Debug)]
pub struct Ns {
    pub name: String,
}

impl std::ops::Deref for NetNs {
    type Target = Ns;
    fn deref(&self) -> &Ns {
        &self.0
    }
}

impl NetNs {
    pub fn new(tag: &str) -> Self {
        let name = format!(
            "netif-{}-{}-{tag}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let out = Command::new("ip")
            .args(["netns", "add", &name])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "ip netns add {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let ns = Self(Ns { name });
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// Run `f` on a new thread that has entered this namespace, inside a current-thread tokio
    /// runtime (sockets opened there belong to the namespace).
    pub fn run<F, Fut, T>(&self, f: F) -> T
    where
        F: FnOnce(Ns) -> Fut + Send + 'static,
        Fut: Future<Output = T>,
        T: Send + 'static,
    {
        let path = format!("/run/netns/{}", self.name);
        let ns = self.0.clone();
        let h = std::thread::spawn(move || {
            let fd = File::open(&path).unwrap();
            setns(&fd, CloneFlags::CLONE_NEWNET).unwrap();
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(f(ns))
        });
        match h.join() {
            Ok(v) => v,
            Err(e) => std::panic::resume_unwind(e),
        }
    }
}

impl Ns {
    /// Run `ip -n NS ARGS`, returning stdout or stderr.
    pub fn try_ip(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new("ip")
            .arg("-n")
            .arg(&self.name)
            .args(args)
            .output()
            .unwrap();
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// Run `ip -n NS ARGS` and insist on success.
    pub fn ip(&self, args: &[&str]) -> String {
        self.try_ip(args)
            .unwrap_or_else(|e| panic!("ip {args:?} in {}: {e}", self.name))
    }

    /// Run a shell command inside the namespace.
    pub fn sh(&self, script: &str) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.name, "sh", "-c", script])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{script}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
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

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Parses addresses.
pub fn ips(items: &[&str]) -> BTreeSet<IpAddr> {
    items.iter().map(|s| s.parse().unwrap()).collect()
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
