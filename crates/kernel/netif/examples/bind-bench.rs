//! Measures binding N VIPs on kube-ipvs0 with `Netif::apply` (and `ip -batch` for comparison).
//! Run in the VM: `cargo xtask vm -- target/debug/examples/bind-bench 10000`. It creates and
//! finally deletes kube-ipvs0 in the namespace it runs in.

use std::collections::BTreeSet;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, Stdio};
use std::time::Instant;

use netif::{diff_addresses, Netif};

fn vip(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(
        u32::from(Ipv4Addr::new(10, 96, 0, 0)) + 1 + i,
    ))
}

fn ip_batch(script: &str) -> std::io::Result<()> {
    let mut child = Command::new("ip")
        .args(["-batch", "-"])
        .stdin(Stdio::piped())
        .spawn()?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(script.as_bytes())?;
    }
    let st = child.wait()?;
    if st.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!("ip -batch exited with {st}")))
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: u32 = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(10_000);
    let desired: BTreeSet<IpAddr> = (0..n).map(vip).collect();
    let netif = Netif::new().await?;
    netif.ensure_dummy().await?;

    let t = Instant::now();
    let current = netif.addresses().await?;
    let res = netif.apply(&diff_addresses(&desired, &current)).await;
    let add = t.elapsed();
    let failed = res.iter().filter(|(_, r)| r.is_err()).count();

    let t = Instant::now();
    let listed = netif.addresses().await?;
    let list = t.elapsed();

    let before = netif.requests_sent();
    let t = Instant::now();
    let nothing = netif.apply(&diff_addresses(&desired, &listed)).await;
    let noop = t.elapsed();
    let noop_requests = netif.requests_sent() - before;

    let t = Instant::now();
    let res = netif
        .apply(&diff_addresses(&BTreeSet::new(), &listed))
        .await;
    let remove = t.elapsed();
    let failed_rm = res.iter().filter(|(_, r)| r.is_err()).count();

    let script: String = desired
        .iter()
        .map(|a| format!("addr add {a}/32 dev kube-ipvs0\n"))
        .collect();
    let t = Instant::now();
    ip_batch(&script)?;
    let batch = t.elapsed();
    netif.delete_dummy().await?;

    println!(
        "bind-bench n={n}: netif add {:.3}s ({failed} failed), list {:.3}s ({} listed), \
         unchanged {:.3}s ({} results, {noop_requests} requests), remove {:.3}s ({failed_rm} failed); \
         ip -batch add {:.3}s",
        add.as_secs_f64(),
        list.as_secs_f64(),
        listed.len(),
        noop.as_secs_f64(),
        nothing.len(),
        remove.as_secs_f64(),
        batch.as_secs_f64()
    );
    Ok(())
}
