//! Addresses and ranges read as upstream reads them ([`parse_ip_sloppy`],
//! [`parse_cidr_sloppy`]). Pure.
//!
//! Before Kubernetes 1.33 (`StrictIPCIDRValidation`) the API server validated Service and
//! EndpointSlice addresses with `netutils.ParseIPSloppy`/`ParseCIDRSloppy` (k8s.io/utils/net),
//! so objects written then may still hold IPv4 octets with leading zeros (`010.0.0.7`) and
//! IPv4-mapped IPv6 addresses (`::ffff:1.2.3.4`). kube-proxy reads every address with those
//! same functions (`newBaseServiceInfo` in pkg/proxy/serviceport.go, `MapIPsByIPFamily` and
//! `MapCIDRsByIPFamily` in pkg/proxy/util, `addEndpoints` in pkg/proxy/endpointslicecache.go),
//! and so does kube-ipvs:
//!
//! - leading zeros are decimal, never octal: `010.0.0.7` is 10.0.0.7 (`ParseIPSloppy` strips
//!   them from a trailing dotted quad, and from the prefix length after it, then parses
//!   strictly);
//! - an IPv4-mapped IPv6 address is the IPv4 address it maps (Go's `net.IP` keeps it in
//!   16 bytes, and `netutils.IPFamilyOf` calls it IPv4 because `To4()` succeeds), so
//!   `::ffff:1.2.3.4` is 1.2.3.4, and `::ffff:1.2.3.0/120` is 1.2.3.0/24 (upstream would pass
//!   `1.2.3.0/120` on to ipset, which refuses it).

use std::net::IpAddr;

use ipnet::{IpNet, Ipv4Net};

/// `s` as an address, read like `netutils.ParseIPSloppy` (leading zeros are decimal), with an
/// IPv4-mapped IPv6 address read as IPv4. `None` when it is no address.
pub fn parse_ip_sloppy(s: &str) -> Option<IpAddr> {
    let ip = match s.parse::<IpAddr>() {
        Ok(ip) => ip,
        Err(_) => strip_zeros(s)?.parse::<IpAddr>().ok()?,
    };
    Some(unmap(ip))
}

/// `s` as a network, read like `netutils.ParseCIDRSloppy` (leading zeros are decimal; host
/// bits are cleared, as `net.ParseCIDR` does), with an IPv4-mapped IPv6 network of prefix 96
/// or more read as the IPv4 network it maps. `None` when it is no CIDR.
pub fn parse_cidr_sloppy(s: &str) -> Option<IpNet> {
    let net = match s.parse::<IpNet>() {
        Ok(n) => n,
        Err(_) => strip_zeros(s)?.parse::<IpNet>().ok()?,
    }
    .trunc();
    Some(match net {
        IpNet::V6(n) if n.prefix_len() >= 96 => match n.addr().to_ipv4_mapped() {
            Some(v4) => Ipv4Net::new(v4, n.prefix_len() - 96)
                .map(IpNet::V4)
                .unwrap_or(net),
            None => net,
        },
        other => other,
    })
}

/// True when `net` admits every source of its family (`0.0.0.0/0`, `::/0`): upstream's
/// `proxyutil.IsZeroCIDR`.
pub fn is_zero_cidr(net: &IpNet) -> bool {
    net.prefix_len() == 0
}

fn unmap(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// `ParseIPSloppy`'s rewrite: when `s` ends with a dotted quad of decimal fields (at its start
/// or after a `:`), optionally followed by `/` and a decimal prefix length, the leading zeros
/// of each of those numbers are removed (`0*(0|[1-9][0-9]*)`). `None` when there is no such
/// quad (the strict parse already failed, and would fail the same way again).
fn strip_zeros(s: &str) -> Option<String> {
    let (addr, prefix) = match s.split_once('/') {
        Some((a, p)) => (a, Some(p)),
        None => (s, None),
    };
    let start = addr.rfind(':').map_or(0, |i| i + 1);
    let quad = &addr[start..];
    let fields: Vec<&str> = quad.split('.').collect();
    let decimal = |f: &str| !f.is_empty() && f.bytes().all(|b| b.is_ascii_digit());
    if fields.len() != 4 || !fields.iter().all(|f| decimal(f)) {
        return None;
    }
    if prefix.is_some_and(|p| !decimal(p)) {
        return None;
    }
    let trim = |f: &str| -> String {
        let t = f.trim_start_matches('0');
        if t.is_empty() { "0" } else { t }.to_string()
    };
    let mut out = String::with_capacity(s.len());
    out.push_str(&addr[..start]);
    out.push_str(&fields.iter().map(|f| trim(f)).collect::<Vec<_>>().join("."));
    if let Some(p) = prefix {
        out.push('/');
        out.push_str(&trim(p));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Option<String> {
        parse_ip_sloppy(s).map(|i| i.to_string())
    }

    fn net(s: &str) -> Option<String> {
        parse_cidr_sloppy(s).map(|n| n.to_string())
    }

    #[test]
    fn leading_zeros_are_decimal() {
        assert_eq!(ip("010.0.0.7").as_deref(), Some("10.0.0.7"));
        assert_eq!(ip("010.000.000.007").as_deref(), Some("10.0.0.7"));
        assert_eq!(ip("0010.0.0.08").as_deref(), Some("10.0.0.8"));
        assert_eq!(ip("::ffff:010.0.0.7").as_deref(), Some("10.0.0.7"));
        assert_eq!(ip("fd00::010.0.0.7").as_deref(), Some("fd00::a00:7"));
        assert_eq!(net("010.0.0.0/08").as_deref(), Some("10.0.0.0/8"));
        assert_eq!(
            net("192.168.001.000/024").as_deref(),
            Some("192.168.1.0/24")
        );
    }

    #[test]
    fn strict_forms_are_unchanged() {
        assert_eq!(ip("10.0.0.7").as_deref(), Some("10.0.0.7"));
        assert_eq!(ip("0.0.0.0").as_deref(), Some("0.0.0.0"));
        assert_eq!(ip("fd00::1").as_deref(), Some("fd00::1"));
        assert_eq!(net("10.1.2.3/8").as_deref(), Some("10.0.0.0/8"));
        assert_eq!(net("fd00::1/64").as_deref(), Some("fd00::/64"));
        // Go's ParseCIDR reads the prefix length with leading zeros too.
        assert_eq!(net("fd00::/064").as_deref(), Some("fd00::/64"));
        assert_eq!(net("0.0.0.0/0").as_deref(), Some("0.0.0.0/0"));
        assert_eq!(net("::/0").as_deref(), Some("::/0"));
    }

    #[test]
    fn ipv4_mapped_ipv6_is_ipv4() {
        assert_eq!(ip("::ffff:1.2.3.4").as_deref(), Some("1.2.3.4"));
        assert_eq!(ip("::ffff:102:304").as_deref(), Some("1.2.3.4"));
        assert_eq!(net("::ffff:1.2.3.0/120").as_deref(), Some("1.2.3.0/24"));
        assert_eq!(net("::ffff:0.0.0.0/96").as_deref(), Some("0.0.0.0/0"));
        // Below /96 the mapping prefix itself is cut: an IPv6 network.
        assert_eq!(net("::ffff:1.2.3.4/80").as_deref(), Some("::/80"));
        // IPv4-compatible (deprecated) and NAT64 addresses stay IPv6, as in Go.
        assert_eq!(ip("::1.2.3.4").as_deref(), Some("::102:304"));
        assert_eq!(ip("64:ff9b::1.2.3.4").as_deref(), Some("64:ff9b::102:304"));
    }

    #[test]
    fn garbage_is_refused() {
        for s in [
            "",
            " ",
            "None",
            "10.0.0.256",
            "10.0.0",
            "10.0.0.7.1",
            "1O.0.0.7",
            "10.0.0.7 ",
            " 10.0.0.7",
            "10.0.0.7/33",
            "10.0.0.0/-1",
            "10.0.0.0/8/8",
            "fe80::1%eth0",
            "0x0a.0.0.7",
            "10.0.0.07a",
            ":::1.2.3.4",
        ] {
            assert_eq!(ip(s), None, "{s:?}");
        }
        for s in [
            "",
            "10.0.0.0/33",
            "10.0.0.0/",
            "10.0.0.0/x",
            "10.0.0.0/ 8",
            "fd00::/129",
            "10.0.0.0/+8",
            "300.0.0.0/8",
        ] {
            assert_eq!(net(s), None, "{s:?}");
        }
    }

    #[test]
    fn zero_cidrs() {
        for s in [
            "0.0.0.0/0",
            "::/0",
            "10.0.0.0/0",
            "000.0.0.0/00",
            "::ffff:0.0.0.0/96",
        ] {
            assert!(is_zero_cidr(&parse_cidr_sloppy(s).unwrap()), "{s}");
        }
        for s in ["0.0.0.0/1", "::/1", "10.0.0.0/8"] {
            assert!(!is_zero_cidr(&parse_cidr_sloppy(s).unwrap()), "{s}");
        }
    }
}
