//! The host half: the real control plane (testkit's etcd + kube-apiserver), the objects loaded
//! as fast as the apiserver takes them (creates in parallel, timed on their own), and a
//! kubeconfig for the VM, which reaches the apiserver at 10.0.2.100 (QEMU's forward to the
//! same port; the serving certificate names that address).

use std::io::Read;
use std::time::Instant;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};
use testkit::control_plane::ControlPlane;

use crate::objects::{self, NAMESPACE, NODE};
use crate::{api, io, BenchError, Res};

/// Creates in flight at once (the admin is `system:masters`, which API Priority and Fairness
/// exempts; the apiserver's own default limit is 200 mutating requests in flight).
const CONCURRENCY: usize = 48;

fn typed<T: serde::de::DeserializeOwned>(v: Value) -> Res<T> {
    serde_json::from_value(v).map_err(|e| BenchError::Check(format!("generated object: {e}")))
}

async fn load(kubeconfig: &str, n: usize, m: usize) -> Res<Value> {
    let c = crate::client(kubeconfig).await?;
    let pp = PostParams::default();
    Api::<Namespace>::all(c.clone())
        .create(&pp, &typed(objects::namespace())?)
        .await
        .map_err(api("creating the namespace"))?;
    let nodes = Api::<Node>::all(c.clone());
    nodes
        .create(&pp, &typed(objects::node())?)
        .await
        .map_err(api("creating the node"))?;
    nodes
        .patch_status(
            NODE,
            &PatchParams::apply("peers-bench").force(),
            &Patch::Apply(objects::node_status()),
        )
        .await
        .map_err(api("node status"))?;
    let services = Api::<Service>::namespaced(c.clone(), NAMESPACE);
    let slices = Api::<EndpointSlice>::namespaced(c.clone(), NAMESPACE);
    let t0 = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| {
            let (services, pp) = (&services, &pp);
            async move {
                services
                    .create(pp, &typed(objects::service(i))?)
                    .await
                    .map_err(api("creating a Service"))
            }
        })
        .buffer_unordered(CONCURRENCY)
        .try_for_each(|_| async { Ok(()) })
        .await?;
    let services_s = t0.elapsed().as_secs_f64();
    futures::stream::iter(0..n)
        .map(|i| {
            let (slices, pp) = (&slices, &pp);
            async move {
                slices
                    .create(pp, &typed(objects::slice(i, m))?)
                    .await
                    .map_err(api("creating an EndpointSlice"))
            }
        })
        .buffer_unordered(CONCURRENCY)
        .try_for_each(|_| async { Ok(()) })
        .await?;
    let load_s = t0.elapsed().as_secs_f64();
    eprintln!(
        "peers-bench: loaded {n} Services ({services_s:.1} s) and {n} EndpointSlices of {m} \
         endpoints in {load_s:.1} s ({:.0} objects/s, {CONCURRENCY} in flight)",
        (2 * n) as f64 / load_s
    );
    Ok(json!({"load_s": load_s, "load_services_s": services_s, "load_concurrency": CONCURRENCY}))
}

/// Starts the control plane, loads the objects, prints `PEERS-READY {...}` and serves until
/// stdin closes (the caller's end of the pipe: also when the caller dies).
pub fn run(n: usize, m: usize) -> Res<()> {
    let cp = ControlPlane::start()?;
    let admin = cp.admin_kubeconfig().display().to_string();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(io("tokio runtime"))?;
    let mut ready = rt.block_on(load(&admin, n, m))?;
    let text = std::fs::read_to_string(&admin).map_err(io("reading the admin kubeconfig"))?;
    let guest = cp.dir().join("guest.kubeconfig");
    std::fs::write(
        &guest,
        text.replace(&cp.server_url(), &format!("https://10.0.2.100:{}", cp.port)),
    )
    .map_err(io("writing the guest kubeconfig"))?;
    ready["port"] = json!(cp.port);
    ready["ca"] = json!(cp.ca_file().display().to_string());
    ready["kubeconfig"] = json!(guest.display().to_string());
    ready["services"] = json!(n);
    ready["endpoints"] = json!(m);
    println!("PEERS-READY {ready}");
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    drop(rt);
    drop(cp);
    Ok(())
}
