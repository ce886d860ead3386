//! The one-shot commands: `plan` (read once, print) and `--cleanup`.

use super::*;

/// Reads every object once: from `--source-dir`, or a full list from the API server.
async fn load_store(config: &Config) -> Result<model::store::Store> {
    let mut store = model::store::Store::new();
    match &config.source_dir {
        Some(dir) => {
            let loaded = StaticDirSource::new(dir.clone(), config.node_name.clone()).load()?;
            for e in &loaded.errors {
                tracing::warn!("{e}");
            }
            for ev in loaded.snapshot.events() {
                store.apply(ev);
            }
        }
        None => {
            let client = kube_client(&config.kube).await?;
            let (tx, mut rx) = mpsc::channel::<SourceEvent>(1024);
            let (health_tx, _health_rx) =
                tokio::sync::watch::channel(::watch::kube::SourceHealth::default());
            let node = config.node_name.clone();
            let task = tokio::spawn(async move {
                ::watch::kube::run(client, node, tx, health_tx).await;
            });
            let mut node_listed = false;
            while let Some(ev) = rx.recv().await {
                if ev == SourceEvent::InitDone(Kind::Node) {
                    node_listed = true;
                }
                store.apply(ev);
                if store.synced() && node_listed {
                    break;
                }
            }
            task.abort();
        }
    }
    Ok(store)
}

/// Prints what the node should have (`plan`), or what a sync would change (`plan --diff`).
pub async fn plan(
    config: &Config,
    diff: bool,
    section: Option<&str>,
    out: &mut dyn Write,
) -> Result<()> {
    use proxier::plan::Section;
    let section: Option<Section> = match section {
        Some(s) => Some(s.parse().map_err(Error::Unsupported)?),
        None => None,
    };
    let store = load_store(config).await?;
    let tracker = node_address_tracker().await;
    let node_ips = tracker
        .as_ref()
        .map(|t| t.current().node_ips())
        .unwrap_or_default();
    let families = crate::engine::families(config, &node_ips);
    if config.mode == ProxyMode::Iptables {
        if diff {
            return Err(Error::Unsupported(
                "plan --diff compares IPVS-mode state with the kernel; in iptables mode use \
                 plan --section iptables"
                    .into(),
            ));
        }
        let mut plans = Vec::new();
        for &family in &families {
            plans.push(proxier::plan::iptables_mode_plan(
                crate::engine::proxy_config(config, family),
                crate::engine::rules_config(config, true),
                &config.node_name,
                &store,
                &node_ips,
            )?);
        }
        out.write_all(proxier::plan::render(&plans, section).as_bytes())?;
        return Ok(());
    }
    if diff {
        let mut writes = Vec::new();
        for &family in &families {
            let mut backend = crate::engine::ipvs_kernel(config, family).await?;
            let mut p = proxier::ipvs_mode::Proxier::new(
                crate::engine::proxy_config(config, family),
                crate::engine::rules_config(config, true),
                config.node_name.clone(),
            );
            let w = tokio::task::block_in_place(|| {
                let mut dry = proxier::plan::DryRun::new(&mut backend);
                let report = p.sync(&store, &node_ips, &mut dry);
                for e in &report.errors {
                    tracing::warn!("{e}");
                }
                dry.writes
            });
            writes.extend(w);
        }
        for w in writes {
            writeln!(out, "{w}")?;
        }
        return Ok(());
    }
    let mut plans = Vec::new();
    for &family in &families {
        let mut p = proxier::ipvs_mode::Proxier::new(
            crate::engine::proxy_config(config, family),
            crate::engine::rules_config(config, true),
            config.node_name.clone(),
        );
        plans.push(p.plan(&store, &node_ips)?);
        let (bad, _) = (p.rejections().current(), ());
        if bad > 0 {
            tracing::warn!(
                objects = bad,
                "some objects were skipped as invalid (see above)"
            );
        }
    }
    out.write_all(proxier::plan::render(&plans, section).as_bytes())?;
    Ok(())
}

/// `--cleanup`: removes what kube-ipvs programmed in either mode (IPVS services it owns,
/// kube-ipvs0, its chains and ipsets). Idempotent.
pub async fn cleanup(config: &Config) -> Result<()> {
    let tracker = node_address_tracker().await;
    let node_ips = tracker
        .as_ref()
        .map(|t| t.current().node_ips())
        .unwrap_or_default();
    let mut families = crate::engine::families(config, &node_ips);
    if !families.contains(&ipvs_netlink::Family::Inet6) {
        families.push(ipvs_netlink::Family::Inet6);
    }
    let netif_handle = netif::Netif::new().await.ok();
    let rt = tokio::runtime::Handle::current();
    let done = tokio::task::block_in_place(|| {
        crate::engine::cleanup(config, &families, None, netif_handle.as_ref(), &rt)
    });
    for d in done {
        tracing::info!("cleanup: {d}");
    }
    Ok(())
}
