//! The generated cluster: N ClusterIP Services `bench/svc-I` (TCP port 80 → 8080, no selector)
//! with one EndpointSlice of M ready endpoints each, the node `node-1`, and the addresses a
//! change puts in place of an endpoint.
//!
//! Address plan (disjoint ranges, so a kernel object tells which Service it belongs to):
//! ClusterIPs `10.100.0.0 + I` (inside the apiserver's 10.96.0.0/12), endpoints
//! `10.240.0.0 + I*M + R` (the cluster CIDR 10.240.0.0/12), replacements `10.253.0.0 + K`.

use std::net::Ipv4Addr;

use serde_json::{json, Value};

/// The namespace of every generated object.
pub const NAMESPACE: &str = "bench";
/// The node the proxies run as (the VM, 10.0.2.15).
pub const NODE: &str = "node-1";
/// The cluster CIDR every proxy is configured with.
pub const CLUSTER_CIDR: &str = "10.240.0.0/12";
/// The Service port and the endpoints' port.
pub const PORT: u16 = 80;
/// The endpoints' (target) port.
pub const TARGET_PORT: u16 = 8080;

const CLUSTER_IP_BASE: u32 = u32::from_be_bytes([10, 100, 0, 0]);
const ENDPOINT_BASE: u32 = u32::from_be_bytes([10, 240, 0, 0]);
const REPLACEMENT_BASE: u32 = u32::from_be_bytes([10, 253, 0, 0]);

/// Largest N x M the address plan holds (10.240.0.0 .. 10.252.255.255).
pub const MAX_ENDPOINTS: usize = 13 * 65_536;
/// Largest number of changes (replacement addresses) one proxy's run may make.
pub const MAX_CHANGES: usize = 2 * 65_536;

/// The ClusterIP of Service `i`.
pub fn cluster_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(CLUSTER_IP_BASE + i as u32)
}

/// Which Service a ClusterIP belongs to (None outside the generated range).
pub fn service_of(ip: Ipv4Addr, n: usize) -> Option<usize> {
    let i = u32::from(ip).checked_sub(CLUSTER_IP_BASE)? as usize;
    (i < n).then_some(i)
}

/// Endpoint `r` of Service `i` (of `m` each), as generated.
pub fn endpoint(i: usize, m: usize, r: usize) -> Ipv4Addr {
    Ipv4Addr::from(ENDPOINT_BASE + (i * m + r) as u32)
}

/// Whether `ip` is a generated endpoint or a replacement (a pod address of the benchmark).
pub fn is_pod(ip: Ipv4Addr) -> bool {
    let v = u32::from(ip);
    (ENDPOINT_BASE..REPLACEMENT_BASE + MAX_CHANGES as u32).contains(&v)
}

/// The address change `k` of a proxy's run puts in place of an endpoint.
pub fn replacement(k: usize) -> Ipv4Addr {
    Ipv4Addr::from(REPLACEMENT_BASE + (k % MAX_CHANGES) as u32)
}

/// `svc-I`.
pub fn service_name(i: usize) -> String {
    format!("svc-{i}")
}

/// The EndpointSlice's name.
pub fn slice_name(i: usize) -> String {
    format!("svc-{i}-0")
}

/// `bench/svc-I:http`, upstream's service port name (hashes of iptables chain names).
pub fn service_port_name(i: usize) -> String {
    format!("{NAMESPACE}/svc-{i}:http")
}

/// The namespace.
pub fn namespace() -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
}

/// The node object (its addresses are status: [`node_status`]).
pub fn node() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}},
        "spec": {"podCIDR": "10.240.1.0/24", "podCIDRs": ["10.240.1.0/24"]},
    })
}

/// The node's status (server-side applied to the status subresource).
pub fn node_status() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
        "status": {"addresses": [
            {"type": "InternalIP", "address": "10.0.2.15"},
            {"type": "Hostname", "address": NODE},
        ]},
    })
}

/// Service `i`.
pub fn service(i: usize) -> Value {
    let ip = cluster_ip(i).to_string();
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": service_name(i), "namespace": NAMESPACE},
        "spec": {
            "type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip],
            "ports": [{"name": "http", "port": PORT, "protocol": "TCP", "targetPort": TARGET_PORT}],
        },
    })
}

/// The endpoints list of a slice with these addresses (all ready, spread over three nodes).
pub fn endpoints(i: usize, addrs: &[Ipv4Addr]) -> Value {
    Value::Array(
        addrs
            .iter()
            .enumerate()
            .map(|(r, a)| {
                json!({
                    "addresses": [a.to_string()],
                    "conditions": {"ready": true, "serving": true, "terminating": false},
                    "nodeName": format!("node-{}", r % 3),
                    "targetRef": {"kind": "Pod", "name": format!("svc-{i}-pod-{r}"), "namespace": NAMESPACE},
                })
            })
            .collect(),
    )
}

/// The generated addresses of Service `i`.
pub fn addresses(i: usize, m: usize) -> Vec<Ipv4Addr> {
    (0..m).map(|r| endpoint(i, m, r)).collect()
}

/// The EndpointSlice of Service `i` with its generated endpoints.
pub fn slice(i: usize, m: usize) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": slice_name(i), "namespace": NAMESPACE,
            "labels": {
                "kubernetes.io/service-name": service_name(i),
                "endpointslice.kubernetes.io/managed-by": "peers-bench",
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": TARGET_PORT, "protocol": "TCP"}],
        "endpoints": endpoints(i, &addresses(i, m)),
    })
}

/// The merge patch that sets a slice's endpoints to `addrs` (a merge patch replaces the list).
pub fn endpoints_patch(i: usize, addrs: &[Ipv4Addr]) -> Value {
    json!({"endpoints": endpoints(i, addrs)})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_disjoint() {
        assert_eq!(cluster_ip(0), Ipv4Addr::new(10, 100, 0, 0));
        assert_eq!(cluster_ip(300), Ipv4Addr::new(10, 100, 1, 44));
        assert_eq!(service_of(cluster_ip(300), 301), Some(300));
        assert_eq!(service_of(cluster_ip(300), 300), None);
        assert_eq!(endpoint(5000 - 1, 50, 49), Ipv4Addr::new(10, 243, 208, 143));
        assert!(is_pod(endpoint(0, 1, 0)) && is_pod(replacement(7)));
        assert!(!is_pod(cluster_ip(1)));
    }
}
