//! Logging with tracing: klog-like `-v` levels, text or JSON lines on stderr.
//!
//! `-v 0`/`1`: info; `2`/`3`: debug for kube-ipvs's crates; `4`/`5`: trace for kube-ipvs's
//! crates; `6+`: trace everywhere. `RUST_LOG`, if set, overrides the level mapping.

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;
use crate::error::{Error, Result};

const OUR_CRATES: &[&str] = &[
    "kube_ipvs",
    "controller",
    "ipvs_netlink",
    "netif",
    "ipset",
    "iptables",
];

/// The `EnvFilter` directives for a klog verbosity.
pub fn filter_for(verbosity: u8) -> String {
    let ours = |level: &str| {
        OUR_CRATES
            .iter()
            .map(|c| format!("{c}={level}"))
            .collect::<Vec<_>>()
            .join(",")
    };
    match verbosity {
        0 | 1 => "info".to_string(),
        2 | 3 => format!("info,{}", ours("debug")),
        4 | 5 => format!("info,{}", ours("trace")),
        _ => "trace".to_string(),
    }
}

/// Installs the global subscriber.
pub fn init(verbosity: u8, format: LogFormat) -> Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.is_empty() => EnvFilter::try_new(v),
        _ => EnvFilter::try_new(filter_for(verbosity)),
    }
    .map_err(|e| Error::Logging(e.to_string()))?;
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let res = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    res.map_err(|e| Error::Logging(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbosity_mapping_parses() {
        for v in [0u8, 1, 2, 3, 4, 5, 6, 10] {
            EnvFilter::try_new(filter_for(v)).unwrap();
        }
        assert_eq!(filter_for(1), "info");
        assert!(filter_for(2).contains("controller=debug"));
        assert!(filter_for(4).contains("kube_ipvs=trace"));
        assert_eq!(filter_for(9), "trace");
    }
}
