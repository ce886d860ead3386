//! The handover between modes: the other mode's state (IPVS-mode leftovers when running in
//! iptables mode, iptables-mode chains when running in IPVS mode) is removed only after this
//! mode's first fully successful sync of every family, never before the rules that replace it
//! are in place.
//!
//! Upstream kube-proxy (`platformCleanup` in `cmd/kube-proxy/app/server_linux.go`) does not
//! remove the other iptables-based mode's rules at start at all (only with `--cleanup`, or
//! when switching to nftables): the new mode's own sync takes the traffic over and the old
//! rules stay behind unused. kube-ipvs matches the part that matters — nothing the node routes
//! with is removed before its replacement is programmed — and then removes the leftovers, so
//! a fallback does not leave kube-ipvs0 and the KUBE-* sets behind.
//!
//! The sync loop's observer calls [`FirstSync::record`] after every sync; [`spawn_cleanup`]
//! waits for it and then runs [`crate::engine::cleanup`] on a blocking thread.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use ipvs_netlink::Family;

use crate::config::{Config, ProxyMode};

/// Fires once every family has had one fully successful sync.
#[derive(Debug)]
pub struct FirstSync {
    pending: Mutex<BTreeSet<Family>>,
    done: tokio::sync::watch::Sender<bool>,
}

impl FirstSync {
    /// Waits for a successful sync of each of `families`.
    pub fn new(families: &[Family]) -> Arc<FirstSync> {
        let (done, _) = tokio::sync::watch::channel(families.is_empty());
        Arc::new(FirstSync {
            pending: Mutex::new(families.iter().copied().collect()),
            done,
        })
    }

    /// A sync of `family` finished; `ok`: without any error.
    pub fn record(&self, family: Family, ok: bool) {
        if !ok {
            return;
        }
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if pending.remove(&family) && pending.is_empty() {
            self.done.send_replace(true);
        }
    }

    /// True once every family synced successfully.
    pub fn fired(&self) -> bool {
        *self.done.borrow()
    }

    /// Waits until [`Self::fired`].
    pub async fn wait(&self) {
        let mut rx = self.done.subscribe();
        // The sender lives in `self`, so the channel cannot close while this waits.
        let _ = rx.wait_for(|done| *done).await;
    }
}

/// The deferred cleanup of the other mode's state.
#[derive(Debug)]
pub struct DeferredCleanup {
    task: tokio::task::JoinHandle<()>,
    first: Arc<FirstSync>,
}

/// Starts waiting for `first` and then removes what the mode other than `mode` left behind
/// (see [`crate::engine::cleanup`]), logging each removal.
pub fn spawn_cleanup(
    config: Config,
    families: Vec<Family>,
    mode: ProxyMode,
    netif: Option<netif::Netif>,
    first: Arc<FirstSync>,
) -> DeferredCleanup {
    let fired = first.clone();
    let task = tokio::spawn(async move {
        fired.wait().await;
        let rt = tokio::runtime::Handle::current();
        let run = tokio::task::spawn_blocking(move || {
            crate::engine::cleanup(&config, &families, Some(mode), netif.as_ref(), &rt)
        });
        match run.await {
            Ok(removed) => {
                for r in &removed {
                    tracing::info!(
                        "handover cleanup after the first successful {} sync: {r}",
                        mode.as_str()
                    );
                }
            }
            Err(e) => tracing::error!(error = %e, "handover cleanup task failed"),
        }
    });
    DeferredCleanup { task, first }
}

impl DeferredCleanup {
    /// At shutdown: once the first successful sync happened, the cleanup runs to its end
    /// (also with `--once`, whose loop ends right after that sync); one still waiting for it is
    /// dropped (the leftovers stay for the next start).
    pub async fn finish(self) {
        if self.first.fired() {
            let _ = self.task.await;
        } else {
            self.task.abort();
            let _ = self.task.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fires_after_every_family_succeeded_once() {
        let f = FirstSync::new(&[Family::Inet, Family::Inet6]);
        assert!(!f.fired());
        f.record(Family::Inet, false);
        f.record(Family::Inet6, true);
        assert!(!f.fired(), "IPv4 has not succeeded yet");
        f.record(Family::Inet, true);
        assert!(f.fired());
        // Later failures do not undo it.
        f.record(Family::Inet, false);
        assert!(f.fired());
        assert!(FirstSync::new(&[]).fired());
    }

    #[tokio::test]
    async fn wait_returns_once_fired() {
        let f = FirstSync::new(&[Family::Inet]);
        let f2 = f.clone();
        let waiter = tokio::spawn(async move { f2.wait().await });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        f.record(Family::Inet, true);
        waiter.await.unwrap();
    }
}
