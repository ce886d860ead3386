//! Chain names (upstream's hashing scheme) and the probabilities of the endpoint rules.

use super::*;

pub(super) fn hash16(input: &str) -> String {
    let digest = Sha256::digest(input.as_bytes());
    let enc = data_encoding::BASE32.encode(&digest);
    enc.chars().take(16).collect()
}

/// Upstream's `portProtoHash`: base32(sha256(name + protocol))[..16].
pub fn port_proto_hash(service_port_name: &str, protocol: Protocol) -> String {
    hash16(&format!("{service_port_name}{}", protocol.as_str()))
}

/// `KUBE-SVC-…` of a service port (`ns/name:port`, or `ns/name` when the port is unnamed).
pub fn svc_chain(service_port_name: &str, protocol: Protocol) -> String {
    format!("KUBE-SVC-{}", port_proto_hash(service_port_name, protocol))
}

/// `KUBE-SVL-…` (local endpoints only).
pub fn svl_chain(service_port_name: &str, protocol: Protocol) -> String {
    format!("KUBE-SVL-{}", port_proto_hash(service_port_name, protocol))
}

/// `KUBE-EXT-…` (external traffic).
pub fn ext_chain(service_port_name: &str, protocol: Protocol) -> String {
    format!("KUBE-EXT-{}", port_proto_hash(service_port_name, protocol))
}

/// `KUBE-FW-…` (load-balancer source ranges).
pub fn fw_chain(service_port_name: &str, protocol: Protocol) -> String {
    format!("KUBE-FW-{}", port_proto_hash(service_port_name, protocol))
}

/// `ip:port`, IPv6 in brackets.
pub fn endpoint_string(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(a) => format!("{a}:{port}"),
        IpAddr::V6(a) => format!("[{a}]:{port}"),
    }
}

/// `KUBE-SEP-…` of one endpoint of a service port.
pub fn sep_chain(service_port_name: &str, protocol: Protocol, ip: IpAddr, port: u16) -> String {
    format!(
        "KUBE-SEP-{}",
        hash16(&format!(
            "{service_port_name}{}{}",
            protocol.as_str(),
            endpoint_string(ip, port)
        ))
    )
}

/// Number of precomputed probability strings (endpoints per service port beyond this are
/// formatted on demand).
pub(super) const PRECOMPUTED: usize = 1000;

/// The `--probability` argument for picking one of `n` remaining endpoints, `%0.10f` of 1/n
/// like upstream; precomputed for n up to 1,000.
pub fn probability(n: usize) -> String {
    static TABLE: OnceLock<Vec<String>> = OnceLock::new();
    let table = TABLE.get_or_init(|| {
        (0..=PRECOMPUTED)
            .map(|i| format!("{:.10}", 1.0 / (i.max(1) as f64)))
            .collect()
    });
    match table.get(n) {
        Some(s) => s.clone(),
        None => format!("{:.10}", 1.0 / (n.max(1) as f64)),
    }
}
