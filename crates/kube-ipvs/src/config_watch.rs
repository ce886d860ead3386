//! Restart on a configuration change, like upstream kube-proxy: the `--config` file is watched
//! and, once its content differs from what the daemon started with, the daemon stops (exit 0,
//! kernel state left in place) so that the DaemonSet restarts it with the new file. SIGHUP asks
//! for the same explicitly.
//!
//! Upstream: `ProxyServer.Run` in cmd/kube-proxy/app/server.go watches the config file with
//! fsnotify (`o.watcher`, `eventHandler`) and stops on a write or rename of it. kube-ipvs
//! watches the file's directory instead of the file, so the atomic symlink swap kubelet uses to
//! update a ConfigMap volume (`..data` → a new timestamped directory) is seen too, and compares
//! contents, so a touch or a swap to identical bytes restarts nothing. A periodic re-read
//! covers a missed notification.

use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

/// How often the file is re-read even without a notification.
const POLL: Duration = Duration::from_secs(60);
/// Notifications closer together than this are one change (an editor's or kubelet's several
/// steps).
const SETTLE: Duration = Duration::from_millis(500);

/// Why the daemon is asked to restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restart {
    /// The configuration file's content changed.
    ConfigChanged(PathBuf),
    /// SIGHUP was received.
    Hangup,
}

impl std::fmt::Display for Restart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Restart::ConfigChanged(p) => write!(f, "configuration file {} changed", p.display()),
            Restart::Hangup => f.write_str("SIGHUP received"),
        }
    }
}

/// Resolves when the daemon should restart: the content of `file` (if any) differs from
/// `initial`, or SIGHUP arrives. Never resolves when there is neither a file nor a SIGHUP
/// handler. The SIGHUP handler is installed by this call (inside a tokio runtime), not when the
/// future is first polled: a SIGHUP during the start (the probe, the first backends) asks for
/// a restart instead of killing the process with the signal's default action.
pub fn restart_requested(
    file: Option<PathBuf>,
    initial: Option<Vec<u8>>,
) -> impl std::future::Future<Output = Restart> {
    let signal = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup());
    async move { wait_restart(signal, file, initial).await }
}

async fn wait_restart(
    signal: std::io::Result<tokio::signal::unix::Signal>,
    file: Option<PathBuf>,
    initial: Option<Vec<u8>>,
) -> Restart {
    let hangup = async {
        match signal {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot handle SIGHUP");
                std::future::pending::<()>().await;
            }
        }
    };
    let changed = async {
        match (file, initial) {
            (Some(f), Some(bytes)) => watch_file(&f, &bytes).await,
            _ => std::future::pending::<PathBuf>().await,
        }
    };
    tokio::select! {
        () = hangup => Restart::Hangup,
        p = changed => Restart::ConfigChanged(p),
    }
}

/// Waits until `file`'s content differs from `initial` (a file that cannot be read counts as
/// unchanged: a ConfigMap swap passes through moments without it).
async fn watch_file(file: &Path, initial: &[u8]) -> PathBuf {
    // A capacity of one wakes the loop; more notifications while one is pending add nothing.
    let (tx, mut rx) = mpsc::channel::<()>(1);
    let dir = file
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_path_buf();
    let watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if let Ok(ev) = res {
            if matches!(ev.kind, notify::EventKind::Access(_)) {
                return;
            }
        }
        let _ = tx.try_send(());
    });
    // Kept alive for as long as this future runs; without it only the poll remains.
    let _watcher = match watcher {
        Ok(mut w) => match w.watch(&dir, RecursiveMode::NonRecursive) {
            Ok(()) => Some(w),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot watch the configuration directory; re-reading it every {POLL:?}");
                None
            }
        },
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch the configuration file; re-reading it every {POLL:?}");
            None
        }
    };
    loop {
        tokio::select! {
            woke = rx.recv() => {
                if woke.is_some() {
                    tokio::time::sleep(SETTLE).await;
                    while rx.try_recv().is_ok() {}
                } else {
                    tokio::time::sleep(POLL).await;
                }
            }
            () = tokio::time::sleep(POLL) => {}
        }
        match tokio::fs::read(file).await {
            Ok(now) if now != initial => return file.to_path_buf(),
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(file = %file.display(), error = %e, "configuration file unreadable; keeping the running configuration")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("kube-ipvs-cfgwatch-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A ConfigMap volume update: the file is a symlink through `..data`, which is swapped
    /// atomically to a new directory. Identical content restarts nothing; new content does.
    #[tokio::test]
    async fn configmap_swap_with_new_content_requests_a_restart_identical_does_not() {
        let d = temp_dir("swap");
        let v1 = d.join("..2026_01");
        std::fs::create_dir(&v1).unwrap();
        std::fs::write(v1.join("config.conf"), "mode: ipvs\n").unwrap();
        std::os::unix::fs::symlink("..2026_01", d.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/config.conf", d.join("config.conf")).unwrap();
        let file = d.join("config.conf");
        let initial = std::fs::read(&file).unwrap();
        let swap = |name: &str, text: &str| {
            let v = d.join(name);
            std::fs::create_dir(&v).unwrap();
            std::fs::write(v.join("config.conf"), text).unwrap();
            let tmp = d.join("..data_tmp");
            std::os::unix::fs::symlink(name, &tmp).unwrap();
            std::fs::rename(&tmp, d.join("..data")).unwrap();
        };
        let watch = tokio::spawn(restart_requested(Some(file.clone()), Some(initial)));
        tokio::time::sleep(Duration::from_millis(300)).await;
        swap("..2026_02", "mode: ipvs\n");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(!watch.is_finished(), "identical content must not restart");
        swap("..2026_03", "mode: iptables\n");
        let why = tokio::time::timeout(Duration::from_secs(30), watch)
            .await
            .expect("a changed configuration must request a restart")
            .unwrap();
        assert_eq!(why, Restart::ConfigChanged(file));
        let _ = std::fs::remove_dir_all(&d);
    }
}
