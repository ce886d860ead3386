//! Issue #32, end to end in the VM: a Service whose programming the real kernel refuses (it
//! asks for the `ovf` scheduler, whose module is made unavailable, so `IPVS_CMD_NEW_SERVICE`
//! answers ENOENT) is isolated: the daemon programs every other Service, `/healthz` stays 200
//! for many health windows, the refusal is counted once under fixed labels, and once the
//! module is back the retry programs the Service.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod e2e;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::Command;
use std::time::Duration;

use e2e::{tcp_name, wait_until, Ep, Lab, Port, Svc, HEALTHZ};

const SYNC_PERIOD_S: u64 = 2;
const WAIT: Duration = Duration::from_secs(120);
const MODULE: &str = "ip_vs_ovf";

/// A kernel module file moved out of `modprobe`'s way for the test's duration (the guest is
/// throw-away, but later tests in the same boot may want the module).
struct HiddenModule {
    path: String,
}

impl HiddenModule {
    fn hide(name: &str) -> HiddenModule {
        let _ = Command::new("rmmod").arg(name).status();
        let out = Command::new("sh")
            .args([
                "-c",
                &format!("find /lib/modules -name '{name}.ko*' | head -n1"),
            ])
            .output()
            .unwrap();
        let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert!(!path.is_empty(), "{name} not found under /lib/modules");
        std::fs::rename(&path, format!("{path}.hidden")).unwrap();
        let loaded = Command::new("modprobe").arg(name).status().unwrap();
        assert!(!loaded.success(), "{name} still loads");
        HiddenModule { path }
    }
}

impl Drop for HiddenModule {
    fn drop(&mut self) {
        let _ = std::fs::rename(format!("{}.hidden", self.path), &self.path);
    }
}

/// The HTTP status line of `GET /healthz` inside the node's namespace.
fn healthz_status(lab: &Lab) -> String {
    let addr: SocketAddr = HEALTHZ.parse().unwrap();
    lab.node
        .enter(move || {
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            write!(
                s,
                "GET /healthz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
            )?;
            let mut raw = String::new();
            s.read_to_string(&mut raw)?;
            Ok(raw)
        })
        .unwrap_or_default()
}

fn full_syncs(lab: &Lab) -> usize {
    lab.sync_lines()
        .iter()
        .filter(|l| l.contains("family=Inet ") && l.contains("kind=Full"))
        .count()
}

#[test]
#[ignore = "vm"]
fn vm_e2e_kernel_refused_service_is_isolated_and_healthz_stays_200() {
    let hidden = HiddenModule::hide(MODULE);
    let mut lab = Lab::new("refused");
    let a = lab.add_pod("a", 1, false);
    let client = lab.add_pod("client", 2, false);
    let pod = lab.pods[a].ip;
    let good = Svc::new(
        "good",
        Ipv4Addr::new(10, 96, 160, 1),
        vec![Port::new("TCP", 80)],
    )
    .eps(vec![Ep::local(pod)]);
    let bad = Svc::new(
        "bad",
        Ipv4Addr::new(10, 96, 160, 2),
        vec![Port::new("TCP", 80)],
    )
    .eps(vec![Ep::local(pod)]);
    let bad_yaml = bad.yaml().replacen(
        "metadata: {name: bad, namespace: default}",
        "metadata: {name: bad, namespace: default, annotations: {kube-ipvs.io/scheduler: ovf}}",
        1,
    );
    assert!(
        bad_yaml.contains("kube-ipvs.io/scheduler: ovf"),
        "{bad_yaml}"
    );
    lab.write("good", &good.yaml());
    lab.write("bad", &bad_yaml);
    lab.start_daemon(&[
        "--ipvs-sync-period",
        &format!("{SYNC_PERIOD_S}s"),
        "--cluster-cidr",
        "10.244.0.0/16",
    ]);

    lab.wait_metrics("kube_ipvs_refused_services 1", WAIT);
    lab.wait_ipvs(&["-A -t 10.96.160.1:80 -s rr"], WAIT);
    let to = SocketAddr::from(([10, 96, 160, 1], 80));
    let got = tcp_name(&lab.pods[client].ns, to, Duration::from_secs(5));
    println!("good: {got:?}");
    assert_eq!(got.name(), Some("a"), "the other Service is served");
    assert!(
        !lab.ipvs_save().contains("10.96.160.2:80"),
        "{}",
        lab.ipvs_save()
    );

    // Many health windows (2 x syncPeriod each) of full syncs: still 200.
    let before = full_syncs(&lab);
    assert!(
        wait_until(WAIT, || full_syncs(&lab) >= before + 6),
        "no full syncs: {}",
        e2e::tail(&lab.log_text(), 30)
    );
    let status = healthz_status(&lab);
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    let m = lab.metrics();
    assert_eq!(
        e2e::metric_value(
            &m,
            "kube_ipvs_kernel_refusals_total{subsystem=\"ipvs\",reason=\"enoent\"}"
        ),
        1.0,
        "{m}"
    );
    assert!(
        lab.log_text()
            .contains("the kernel refuses this Service's programming"),
        "{}",
        e2e::tail(&lab.log_text(), 30)
    );

    // The module is back: the next retry programs the Service and ends the isolation.
    drop(hidden);
    lab.wait_ipvs(&["-A -t 10.96.160.2:80 -s ovf"], WAIT);
    lab.wait_metrics("kube_ipvs_refused_services 0", WAIT);
    let status = healthz_status(&lab);
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    assert_eq!(lab.stop(), Some(0));
}
