//! A hung `ipset` in IPVS mode (VM: the real kernel with IPVS, in a fresh network namespace):
//! the sync returns, with the timeout reported as an ipset error of that sync, instead of
//! blocking the sync loop for good; the rest of the kernel is still programmed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod fixtures;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt as _;
use std::time::Duration;

use fixtures::*;
use proxier::ipvs_mode::{Proxier, RulesConfig};
use proxier::kernel::{Kernel, NodeKernel};
use testkit::netns::Netns;

#[test]
#[ignore = "vm"]
fn vm_timeout_of_a_hung_ipset_fails_the_sync_as_an_ipset_error() {
    let dir = std::env::temp_dir().join(format!("kube-ipvs-vm-timeouts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fake = dir.join("ipset");
    std::fs::write(&fake, "#!/bin/sh\nexec sleep 600\n").unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let ns = Netns::new("vm-timeouts").unwrap();
    let limit = Duration::from_millis(500);
    let (errors, services) = ns
        .enter(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()?;
            let ipvs = ipvs_netlink::Client::new().unwrap();
            let netif = rt.block_on(netif::Netif::new()).unwrap();
            let ipset = ipset::Ipset::new(ipset::Runner {
                ipset: fake,
                ..ipset::Runner::default().with_timeout(limit)
            });
            let tables =
                iptables::Iptables::detect(ipvs_netlink::Family::Inet, iptables::Runner::new())
                    .unwrap();
            let mut k = NodeKernel::new(ipvs, netif, ipset, tables, rt.handle().clone());
            let store = synced_store(
                vec![svc("default", "web", "10.96.0.10")
                    .port("http", 80, "TCP")
                    .build()],
                vec![slice("default", "web", "web-1")
                    .port("http", 8080, "TCP")
                    .ep("10.244.1.1", "node-b", C::Ready)
                    .build()],
            );
            let mut p = Proxier::new(cfg4(), RulesConfig::default(), NODE);
            let addrs: BTreeSet<IpAddr> = BTreeSet::new();
            let r = p.sync(&store, &addrs, &mut k);
            let services = k.read_ipvs(ipvs_netlink::Family::Inet).unwrap().len();
            Ok((r.errors, services))
        })
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    println!("errors: {errors:?}");
    assert!(
        errors
            .iter()
            .any(|e| e.contains("ipset") && e.contains("did not finish within 500ms")),
        "no ipset timeout in the sync report: {errors:?}"
    );
    // IPVS does not depend on ipset: the virtual server is programmed all the same.
    assert_eq!(services, 1, "{errors:?}");
}
