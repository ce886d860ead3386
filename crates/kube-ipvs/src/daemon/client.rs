//! The API client with its time limits and request budget, and the API source's health.

use super::*;

/// Time limit of connecting to the API server (TCP and TLS): kube-rs's default, and the
/// dialer timeout client-go (upstream kube-proxy's client) uses.
pub const KUBE_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Time limit of writing one request to the API server (kube-rs's default is 295 s; a request
/// is a few kilobytes, so a write that stalls this long is a dead connection).
pub const KUBE_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest time without any byte from the API server on a connection with a request in flight
/// (counted from the request's write: `reset_reader_on_write`, as kube-rs recommends with a
/// read timeout).
///
/// It must exceed the server-side watch timeout (kube-runtime's default 290 s, which
/// kube-ipvs keeps): a quiet watch legitimately sends nothing until the server closes it, and
/// kube-runtime's own watch idle timeout (290 s + 5 s) must fire first, so a watch reconnects
/// cleanly. So 300 s: it is the backstop for everything else (the initial lists, Event posts)
/// against an API server that accepted a request and never answers it.
pub const KUBE_READ_TIMEOUT: Duration = Duration::from_secs(300);

/// Builds a Kubernetes client: `--kubeconfig` file, else in-cluster / `$KUBECONFIG` inference;
/// `--master` overrides the server URL. Connections get the configured connect, write and read
/// timeouts (by default [`KUBE_CONNECT_TIMEOUT`], [`KUBE_WRITE_TIMEOUT`], [`KUBE_READ_TIMEOUT`]).
pub async fn kube_client(cfg: &KubeClientConfig) -> Result<kube::Client> {
    let kerr = |e: &dyn std::fmt::Display| Error::Kube(e.to_string());
    let mut config = match (&cfg.kubeconfig, &cfg.master) {
        (Some(path), _) => {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| kerr(&e))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| kerr(&e))?
        }
        (None, Some(master)) => kube::Config::new(master.parse().map_err(|e| kerr(&e))?),
        (None, None) => kube::Config::infer().await.map_err(|e| kerr(&e))?,
    };
    if let Some(master) = &cfg.master {
        config.cluster_url = master
            .parse()
            .map_err(|e| Error::Kube(format!("--master {master:?}: {e}")))?;
    }
    config.connect_timeout = Some(cfg.connect_timeout);
    config.write_timeout = Some(cfg.write_timeout);
    config.read_timeout = Some(cfg.read_timeout);
    config.reset_reader_on_write = true;
    if config.cluster_url.scheme_str() == Some("http") && config.root_cert.is_none() {
        // Plain HTTP never uses TLS: an empty root set keeps the client from loading the
        // system trust store, which minimal images (and the test VM) do not have.
        config.root_cert = Some(Vec::new());
    }
    // clientConnection.qps/burst, like client-go's token bucket (see `client_limit`).
    let builder = kube::client::ClientBuilder::try_from(config).map_err(|e| kerr(&e))?;
    Ok(builder
        .with_layer(&crate::client_limit::QpsLayer::new(cfg.qps, cfg.burst))
        .build())
}

/// How long a watch error keeps the source failing without a newer one. kube-runtime's default
/// backoff retries at most every 30 s plus up to as much jitter, so an unreachable API server
/// produces a newer error within this; a watch that reconnects silently (no change to report)
/// stops producing errors and counts as recovered after it.
pub const SOURCE_ERROR_FRESH: std::time::Duration = std::time::Duration::from_secs(65);

/// Feeds the API source's health (watch errors) into `/healthz` and the source's age metric: the
/// source is failing from its first watch error while errors keep coming (each within
/// [`SOURCE_ERROR_FRESH`] of the last) or a kind has never been listed; a successful event of
/// every failing kind (a relist, a change) ends it at once.
pub async fn forward_source_health(
    mut rx: tokio::sync::watch::Receiver<::watch::kube::SourceHealth>,
    health: Arc<ProxyHealth>,
    metrics: Arc<Metrics>,
) {
    let mut failing = false;
    loop {
        let (errors, last_error, synced) = {
            let h = rx.borrow_and_update();
            let kinds = [&h.services, &h.endpoint_slices, &h.node];
            let failing_kind = |k: &::watch::kube::KindHealth| {
                k.consecutive_errors > 0
                    && (!k.synced
                        || k.last_error
                            .as_ref()
                            .is_some_and(|(at, _)| at.elapsed() < SOURCE_ERROR_FRESH))
            };
            let errors = kinds.iter().any(|k| failing_kind(k));
            let last_error = kinds
                .iter()
                .filter(|k| failing_kind(k))
                .filter_map(|k| k.last_error.clone())
                .max_by_key(|(at, _)| *at)
                .map(|(_, e)| e)
                .unwrap_or_default();
            (errors, last_error, h.synced())
        };
        if errors {
            if !failing {
                tracing::warn!(error = %last_error, "API source failing; serving the last known state");
            }
            failing = true;
            health.source_failing_at(std::time::SystemTime::now(), &last_error);
            metrics.set_source_ok(false);
        } else {
            if failing {
                tracing::info!("API source healthy again");
            }
            failing = false;
            health.source_ok();
            metrics.set_source_ok(synced);
        }
        // Re-evaluated on every change, and every few seconds (errors age out).
        tokio::select! {
            changed = rx.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            () = tokio::time::sleep(std::time::Duration::from_secs(5)) => {}
        }
    }
}

/// How long the start waits to read this node's Node object (for its families).
const NODE_FACTS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// This node's Node object's addresses and podCIDRs, read once at start (one list with a
/// `metadata.name` field selector: the DaemonSet may list and watch Nodes, not get them), for
/// at most 10 s; empty when it cannot be read (the families are then decided from the
/// configuration and the node's addresses).
pub async fn read_node_facts(client: &kube::Client, node_name: &str) -> crate::engine::NodeFacts {
    let api: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
    let params = kube::api::ListParams::default().fields(&format!("metadata.name={node_name}"));
    match tokio::time::timeout(NODE_FACTS_TIMEOUT, api.list(&params)).await {
        Ok(Ok(list)) => list
            .items
            .first()
            .map(crate::engine::NodeFacts::of)
            .unwrap_or_default(),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cannot read this node's Node object for its IP families");
            crate::engine::NodeFacts::default()
        }
        Err(_) => {
            tracing::warn!(after = ?NODE_FACTS_TIMEOUT,
                "reading this node's Node object for its IP families timed out");
            crate::engine::NodeFacts::default()
        }
    }
}
