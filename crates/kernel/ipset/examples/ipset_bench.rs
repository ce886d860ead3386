//! Benchmark (root): apply N ipset entries with one `ipset restore` (this crate) versus one
//! `ipset add` process per entry (what upstream kube-proxy does), in a throw-away network
//! namespace. The per-entry run is measured on a sample and extrapolated (it says so).
//!
//! `cargo run -p ipset --example ipset_bench -- [ENTRIES] [PER_ENTRY_SAMPLE]` (defaults 10000 500).

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::time::Instant;

use ipset::{diff, Entry, Family, Ipset, IpsetState, Protocol, Runner, SetKind};

struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let entries: u32 = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(10_000);
    let sample: u32 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(500);
    let ns = Netns(format!("ipset-bench-{}", std::process::id()));
    if !Command::new("ip")
        .args(["netns", "add", &ns.0])
        .status()?
        .success()
    {
        return Err("ip netns add failed (run as root)".into());
    }
    let ipset = Ipset::new(Runner::in_netns(&ns.0));
    let set = SetKind::ClusterIp.name(Family::Inet);
    let entry = |i: u32| {
        Entry::ip_port(
            IpAddr::V4(Ipv4Addr::from(0x0a60_0000 + i / 4)),
            Protocol::Tcp,
            80 + (i % 4) as u16,
        )
    };

    // Create the empty set first so both runs measure only member adds.
    let mut empty = IpsetState::new();
    empty.ensure_set(SetKind::ClusterIp.spec(Family::Inet));
    ipset.apply(&diff(&empty, &IpsetState::new()))?;

    let mut want = empty.clone();
    for i in 0..entries {
        want.insert(&set, entry(i), "bench")?;
    }
    let d = diff(&want, &ipset.read(std::slice::from_ref(&set))?);
    let t = Instant::now();
    let rep = ipset.apply(&d)?;
    let batch = t.elapsed();
    let check = ipset.read(std::slice::from_ref(&set))?;
    if !diff(&want, &check).is_empty() {
        return Err("batched apply did not produce the desired set".into());
    }

    // Per-entry processes, like upstream: `ipset add SET ENTRY -exist`, one process each.
    let other = "BENCH-PER-ENTRY";
    let st = Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns.0,
            "ipset",
            "create",
            other,
            "hash:ip,port",
        ])
        .status()?;
    if !st.success() {
        return Err("ipset create failed".into());
    }
    let t = Instant::now();
    for i in 0..sample {
        let st = Command::new("ip")
            .args([
                "netns",
                "exec",
                &ns.0,
                "ipset",
                "add",
                other,
                &entry(i).to_string(),
                "-exist",
            ])
            .status()?;
        if !st.success() {
            return Err("ipset add failed".into());
        }
    }
    let per_sample = t.elapsed();
    let per_entry = per_sample.as_secs_f64() / f64::from(sample.max(1));
    let extrapolated = per_entry * f64::from(entries);
    // The netns wrapper adds an exec of `ip` to each process; measure it so the comparison
    // can be stated both ways.
    let t = Instant::now();
    for _ in 0..50 {
        Command::new("ip")
            .args(["netns", "exec", &ns.0, "true"])
            .status()?;
    }
    let wrapper = t.elapsed().as_secs_f64() / 50.0;

    println!("entries: {entries}");
    println!(
        "batched (1 ipset restore, {} process): {:.3} s",
        rep.processes,
        batch.as_secs_f64()
    );
    println!(
        "per-entry ipset add: {sample} processes in {:.3} s = {:.2} ms each; \
         extrapolated to {entries}: {extrapolated:.1} s",
        per_sample.as_secs_f64(),
        per_entry * 1000.0
    );
    println!(
        "for reference, `ip netns exec NS true` alone: {:.2} ms per process",
        wrapper * 1000.0
    );
    println!(
        "ratio (per-entry extrapolated / batched): {:.0}x",
        extrapolated / batch.as_secs_f64()
    );
    Ok(())
}
