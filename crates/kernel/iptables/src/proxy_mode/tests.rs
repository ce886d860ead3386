//! Unit tests of the iptables proxy mode's rendering.

use super::*;

#[test]
fn chain_names_match_upstream_hashes() {
    // Chain names seen on every kubeadm cluster (kube-proxy iptables mode).
    assert_eq!(
        svc_chain("default/kubernetes:https", Protocol::Tcp),
        "KUBE-SVC-NPX46M4PTMTKRN6Y"
    );
    assert_eq!(
        svc_chain("kube-system/kube-dns:dns", Protocol::Udp),
        "KUBE-SVC-TCOU7JCQXEZGVUNU"
    );
    assert_eq!(
        svc_chain("kube-system/kube-dns:dns-tcp", Protocol::Tcp),
        "KUBE-SVC-ERIFXISQEP7F7OF4"
    );
    assert_eq!(
        svc_chain("kube-system/kube-dns:metrics", Protocol::Tcp),
        "KUBE-SVC-JD5MR3NA4I4DYORP"
    );
    let sep = sep_chain(
        "default/kubernetes:https",
        Protocol::Tcp,
        "192.168.0.10".parse().unwrap_or(IpAddr::from([0, 0, 0, 0])),
        6443,
    );
    assert!(sep.starts_with("KUBE-SEP-") && sep.len() == 25, "{sep}");
}

#[test]
fn probabilities_are_upstreams_strings() {
    assert_eq!(probability(2), "0.5000000000");
    assert_eq!(probability(3), "0.3333333333");
    assert_eq!(probability(1000), "0.0010000000");
    assert_eq!(probability(1001), "0.0009990010");
}

#[test]
fn leftover_cleanup_deletes_references_then_chains() {
    let saved = "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-NODE-PORT - [0:0]\n\
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
-A PREROUTING -j KUBE-NODE-PORT\n\
-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT\n\
-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT\nCOMMIT\n";
    let owns = |c: &str| c == "KUBE-NODE-PORT" || c == "KUBE-SERVICES";
    let shared = |c: &str| c == "KUBE-SERVICES";
    let owned_rule = |s: &str| s.contains("--match-set KUBE-");
    let (text, removed, deleted) = leftover_cleanup(
        Table::Nat,
        saved,
        &Ownership {
            owns: &owns,
            shared: &shared,
            owned_rule: &owned_rule,
        },
    )
    .unwrap_or_default();
    assert_eq!(
        text,
        "*nat\n:KUBE-NODE-PORT - [0:0]\n-D PREROUTING -j KUBE-NODE-PORT\n-F KUBE-SERVICES\n-X KUBE-NODE-PORT\nCOMMIT\n"
    );
    assert_eq!(removed, vec!["KUBE-NODE-PORT", "KUBE-SERVICES (flushed)"]);
    assert_eq!(deleted, 1);
    let clean = "*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n";
    assert!(leftover_cleanup(
        Table::Nat,
        clean,
        &Ownership {
            owns: &owns,
            shared: &shared,
            owned_rule: &owned_rule
        }
    )
    .is_none());
}
