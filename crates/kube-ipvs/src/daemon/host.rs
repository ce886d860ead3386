//! The process on its host: termination signals, the OOM score and the node-address tracker.

pub(super) async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut term), Ok(mut int)) => tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        },
        _ => {
            // Without signal handlers, wait for Ctrl-C the portable way.
            let _ = tokio::signal::ctrl_c().await;
            "SIGINT"
        }
    }
}

/// Writes `/proc/self/oom_score_adj` like upstream (a failure, e.g. without
/// CAP_SYS_RESOURCE, is only logged).
pub fn apply_oom_score_adj(value: i32) {
    match std::fs::write("/proc/self/oom_score_adj", value.to_string()) {
        Ok(()) => tracing::debug!(value, "set oom_score_adj"),
        Err(e) => tracing::warn!(value, "cannot set oom_score_adj: {e}"),
    }
}

/// The node's interface addresses (not kube-ipvs0's), from one rtnetlink dump via the tracker.
pub(super) async fn node_address_tracker() -> Option<netif::NodeAddresses> {
    match netif::NodeAddresses::start().await {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!(error = %e, "cannot track node addresses; NodePorts use the Node's addresses");
            None
        }
    }
}
