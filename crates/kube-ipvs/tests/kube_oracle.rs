//! Differential test against upstream: for seeded, generated scenarios the real kube-apiserver
//! holds the objects, and upstream kube-proxy (`--proxy-mode ipvs`, built by `cargo xtask kube`)
//! and kube-ipvs each program a clean node in the test VM; `ipvsadm -Sn`, the `kube-ipvs0`
//! addresses, `ipset save` members and the iptables rules (`iptables-save`, `-A` lines, sorted)
//! must be equal, but for the differences listed with their reasons in
//! `tests/oracle/allowed-differences.txt`.
//!
//! One VM boot per proxy runs every scenario in turn: the guest applies the scenario with
//! kubectl (the apiserver on the host is reached through QEMU's forwarded 10.0.2.100), runs the
//! proxy until it has synced (kube-proxy: its sync counter in /metrics; kube-ipvs: `--once`),
//! dumps the state, runs the proxy's own `--cleanup`, wipes whatever is left (a clean node for
//! the next scenario), and deletes the objects.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use testkit::control_plane::{run_with_timeout, ControlPlane};

/// Generated scenarios (each a handful of Services with their EndpointSlices); the
/// `KUBE_IPVS_ORACLE_SCENARIOS` environment variable overrides it (`cargo xtask test` runs 8: each
/// scenario costs about 50 s of VM time per proxy under TCG on a busy machine).
const SCENARIOS: u64 = 50;

fn scenario_count() -> u64 {
    std::env::var("KUBE_IPVS_ORACLE_SCENARIOS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(SCENARIOS)
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// xorshift64*: a small deterministic generator (the seed names the scenario).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// The objects of scenario `seed`, in namespace `oracle` (explicit ClusterIPs and NodePorts, so
/// both runs get the same ones).
pub fn scenario(seed: u64) -> String {
    let mut r = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut y = String::new();
    let services = 1 + r.below(6);
    for s in 0..services {
        let name = format!("s{s}");
        let node_port = r.chance(40);
        let ports = 1 + r.below(3);
        let mut port_list = Vec::new();
        for p in 0..ports {
            let proto = if r.chance(30) { "UDP" } else { "TCP" };
            let port = 80 + p * 1000 + r.below(50);
            let target = 8000 + p * 10 + r.below(5);
            port_list.push((format!("p{p}"), proto, port, target));
        }
        let _ = write!(
            y,
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: oracle}}\nspec:\n  \
             type: {}\n  clusterIP: 10.96.{}.{}\n",
            if node_port { "NodePort" } else { "ClusterIP" },
            100 + seed % 100,
            10 + s
        );
        if r.chance(25) {
            let _ = writeln!(y, "  sessionAffinity: ClientIP");
        }
        if r.chance(20) {
            let _ = writeln!(y, "  externalIPs: [\"198.51.100.{}\"]", 10 + s);
        }
        let _ = writeln!(y, "  ports:");
        for (i, (pn, proto, port, target)) in port_list.iter().enumerate() {
            let _ = write!(
                y,
                "  - {{name: {pn}, protocol: {proto}, port: {port}, targetPort: {target}"
            );
            if node_port {
                let _ = write!(
                    y,
                    ", nodePort: {}",
                    30000 + (seed % 100) * 20 + s * 3 + i as u64
                );
            }
            let _ = writeln!(y, "}}");
        }
        let endpoints = r.below(5);
        let _ = write!(
            y,
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  \
             namespace: oracle\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\nports:\n"
        );
        for (pn, proto, _, target) in &port_list {
            let _ = writeln!(y, "- {{name: {pn}, protocol: {proto}, port: {target}}}");
        }
        if endpoints == 0 {
            let _ = writeln!(y, "endpoints: []");
        } else {
            let _ = writeln!(y, "endpoints:");
            for e in 0..endpoints {
                let ready = !r.chance(20);
                let _ = writeln!(
                    y,
                    "- {{addresses: [\"10.244.{}.{}\"], conditions: {{ready: {ready}}}}}",
                    1 + s,
                    10 + e
                );
            }
        }
    }
    y
}

/// The guest script for one proxy: every scenario in turn on a clean node.
fn guest_script(dir: &Path, proxy: &str, kubeconfig: &Path, n: u64) -> String {
    let kc = kubeconfig.display();
    let run = match proxy {
        "kube-proxy" => format!(
            "/k/kube-proxy --kubeconfig {kc} --proxy-mode ipvs --hostname-override node-1 \
             --conntrack-max-per-core 0 --v 0 >/tmp/proxy.log 2>&1 &\n\
             P=$!\ni=0\nwhile [ $i -lt 600 ]; do\n  \
             c=$(timeout 5 busybox wget -q -O - http://127.0.0.1:10249/metrics 2>/dev/null | \
             grep '^kubeproxy_sync_proxy_rules_duration_seconds_count' | cut -d' ' -f2)\n  \
             [ -n \"$c\" ] && [ \"$c\" -ge 1 ] && break\n  sleep 0.2\n  i=$((i+1))\ndone\n"
        ),
        _ => format!(
            "timeout 120 /k/kube-ipvs --kubeconfig {kc} --proxy-mode ipvs --hostname-override node-1 \
             --conntrack-max-per-core 0 --once >/tmp/proxy.log 2>&1 || echo \"@@proxy-failed $?\"\n"
        ),
    };
    // The proxy stops; the wipe after it leaves a clean node for the next scenario.
    let stop = match proxy {
        "kube-proxy" => "kill $P; wait $P 2>/dev/null\n",
        _ => "",
    };
    let mut s = format!(
        "K=\"/k/kubectl --kubeconfig {kc}\"\n$K apply -f {d}/ns.yaml >/dev/null\n",
        d = dir.display()
    );
    for seed in 1..=n {
        let _ = write!(
            s,
            "$K apply -f {d}/s{seed}.yaml >/dev/null || echo '@@apply-failed'\n{run}\
             echo \"@@scenario {seed} $(cut -d' ' -f1 /proc/uptime)\"\necho '@@ipvs'\nipvsadm -Sn\necho '@@addr'\n\
             ip -4 -o addr show dev kube-ipvs0 2>/dev/null | awk '{{print $4}}'\necho '@@ipset'\n\
             ipset save | grep '^add '\necho '@@iptables'\niptables-save | grep '^-A'\necho '@@end'\n\
             {stop}ipvsadm -C\nip link del kube-ipvs0 2>/dev/null\n\
             for t in filter nat mangle raw; do iptables -t $t -F; iptables -t $t -X; done\n\
             ipset destroy 2>/dev/null\n\
             $K delete -f {d}/s{seed}.yaml --wait=false >/dev/null\n",
            d = dir.display()
        );
    }
    s
}

/// Section name → sorted lines, per scenario.
type Dump = BTreeMap<u64, BTreeMap<String, Vec<String>>>;

fn parse_dump(text: &str) -> Dump {
    let mut out = Dump::new();
    let (mut scen, mut sec) = (0u64, String::new());
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("@@scenario ") {
            scen = n.split_whitespace().next().unwrap().parse().unwrap();
            sec.clear();
        } else if line == "@@end" {
            sec.clear();
        } else if let Some(name) = line.strip_prefix("@@") {
            sec = name.to_string();
        } else if !sec.is_empty() && !line.trim().is_empty() {
            out.entry(scen)
                .or_default()
                .entry(sec.clone())
                .or_default()
                .push(line.trim().to_string());
        }
    }
    for secs in out.values_mut() {
        for v in secs.values_mut() {
            v.sort();
        }
    }
    out
}

/// `section<TAB>substring<TAB>reason` lines; `#` comments.
fn allowed() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/oracle/allowed-differences.txt"),
    )
    .unwrap();
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let mut f = l.split('\t');
            let (sec, pat, reason) = (f.next(), f.next(), f.next());
            assert!(
                reason.is_some_and(|r| !r.trim().is_empty()),
                "allowed difference without a reason: {l}"
            );
            (sec.unwrap().to_string(), pat.unwrap().to_string())
        })
        .collect()
}

fn run_vm(port: u16, files: &[(PathBuf, String)], script: &Path) -> String {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(repo())
        .args(["xtask", "vm", "--timeout", "2400", "--net-fwd"])
        .arg(port.to_string());
    for (src, dest) in files {
        cmd.arg("--file").arg(format!("{}:{dest}", src.display()));
    }
    cmd.args(["--", "sh"]).arg(script);
    let out = run_with_timeout(&mut cmd, None, Duration::from_secs(2700)).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "VM failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The lines only one side has, per section, less the allowed ones.
fn differences(
    seed: u64,
    up: &BTreeMap<String, Vec<String>>,
    ours: &BTreeMap<String, Vec<String>>,
    allowed: &[(String, String)],
) -> String {
    let mut report = String::new();
    for sec in ["ipvs", "addr", "ipset", "iptables"] {
        let a = up.get(sec).cloned().unwrap_or_default();
        let b = ours.get(sec).cloned().unwrap_or_default();
        let ok = |l: &String| {
            allowed
                .iter()
                .any(|(s, p)| s == sec && l.contains(p.as_str()))
        };
        for l in a.iter().filter(|l| !b.contains(l) && !ok(l)) {
            let _ = writeln!(report, "scenario {seed} {sec}: only upstream: {l}");
        }
        for l in b.iter().filter(|l| !a.contains(l) && !ok(l)) {
            let _ = writeln!(report, "scenario {seed} {sec}: only kube-ipvs: {l}");
        }
    }
    report
}

#[test]
fn dumps_parse_and_differences_are_reported_unless_allowed() {
    let up = parse_dump(
        "noise\n@@scenario 3 12.5\n@@ipvs\n-A -t 10.96.0.1:443 -s rr\n-a -t 10.96.0.1:443 -r 10.0.2.100:6443 -m -w 1\n\
         @@addr\n10.96.0.1/32\n@@end\ntrailing\n",
    );
    let ours = parse_dump(
        "@@scenario 3 9.1\n@@ipvs\n-a -t 10.96.0.1:443 -r 10.0.2.100:6443 -m -w 1\n-A -t 10.96.0.1:443 -s wrr\n\
         @@addr\n10.96.0.1/32\n@@end\n",
    );
    assert_eq!(up[&3]["addr"], ["10.96.0.1/32"]);
    assert!(!up[&3].contains_key("trailing"));
    let report = differences(3, &up[&3], &ours[&3], &[]);
    assert!(
        report.contains("only upstream: -A -t 10.96.0.1:443 -s rr"),
        "{report}"
    );
    assert!(
        report.contains("only kube-ipvs: -A -t 10.96.0.1:443 -s wrr"),
        "{report}"
    );
    assert_eq!(report.lines().count(), 2, "{report}");
    let rules = [("ipvs".to_string(), "-A -t 10.96.0.1:443".to_string())];
    assert_eq!(differences(3, &up[&3], &ours[&3], &rules), "");
    // The shipped file parses (every entry has a reason).
    let _ = allowed();
    assert!(
        !allowed().is_empty() || allowed().is_empty(),
        "the file parses"
    );
}

#[test]
fn scenarios_are_deterministic_and_varied() {
    assert_eq!(scenario(7), scenario(7));
    assert_ne!(scenario(7), scenario(8));
    let all: String = (1..=SCENARIOS).map(scenario).collect();
    for want in [
        "NodePort",
        "UDP",
        "sessionAffinity",
        "externalIPs",
        "ready: false",
        "endpoints: []",
    ] {
        assert!(all.contains(want), "no scenario has {want}");
    }
}

/// Upstream kube-proxy and kube-ipvs program the same node state for every scenario.
#[test]
#[ignore = "kube"]
fn kube_oracle_kube_proxy_and_kube_ipvs_program_the_same_state() {
    let bin = testkit::control_plane::require_upstream();
    let n = scenario_count();
    let cp = ControlPlane::start().unwrap();
    let dir = cp.dir().join("oracle");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("ns.yaml"),
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: oracle}\n---\n\
         apiVersion: v1\nkind: Node\nmetadata: {name: node-1}\n",
    )
    .unwrap();
    for seed in 1..=n {
        std::fs::write(dir.join(format!("s{seed}.yaml")), scenario(seed)).unwrap();
    }
    let admin = std::fs::read_to_string(cp.admin_kubeconfig()).unwrap();
    let guest_kc = dir.join("guest.kubeconfig");
    std::fs::write(
        &guest_kc,
        admin.replace(&cp.server_url(), &format!("https://10.0.2.100:{}", cp.port)),
    )
    .unwrap();
    let mut files: Vec<(PathBuf, String)> = vec![
        (bin.join("kubectl"), "/k/kubectl".into()),
        (cp.ca_file(), cp.ca_file().display().to_string()),
        (guest_kc.clone(), guest_kc.display().to_string()),
        (
            dir.join("ns.yaml"),
            dir.join("ns.yaml").display().to_string(),
        ),
    ];
    for seed in 1..=n {
        let f = dir.join(format!("s{seed}.yaml"));
        files.push((f.clone(), f.display().to_string()));
    }
    let mut dumps = Vec::new();
    for (proxy, path) in [
        ("kube-proxy", bin.join("kube-proxy")),
        ("kube-ipvs", PathBuf::from(env!("CARGO_BIN_EXE_kube-ipvs"))),
    ] {
        let script = dir.join(format!("{proxy}.sh"));
        std::fs::write(&script, guest_script(&dir, proxy, &guest_kc, n)).unwrap();
        let mut f = files.clone();
        f.push((path, format!("/k/{proxy}")));
        f.push((script.clone(), script.display().to_string()));
        let text = run_vm(cp.port, &f, &script);
        assert!(
            !text.contains("@@apply-failed"),
            "{proxy}: an apply failed:\n{text}"
        );
        assert!(
            !text.contains("@@proxy-failed"),
            "{proxy}: --once failed:\n{text}"
        );
        dumps.push(parse_dump(&text));
    }
    let allowed = allowed();
    let mut report = String::new();
    let mut compared = 0;
    for seed in 1..=n {
        let up = dumps[0].get(&seed).cloned().unwrap_or_default();
        let ours = dumps[1].get(&seed).cloned().unwrap_or_default();
        assert!(
            up.contains_key("ipvs"),
            "kube-proxy programmed nothing in scenario {seed}"
        );
        compared += 1;
        report.push_str(&differences(seed, &up, &ours, &allowed));
    }
    assert_eq!(compared, n);
    eprintln!(
        "kube_oracle: {n} scenarios compared, {} allowed-difference rules",
        allowed.len()
    );
    assert!(
        report.is_empty(),
        "differences not in allowed-differences.txt:\n{report}"
    );
}
