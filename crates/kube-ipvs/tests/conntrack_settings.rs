//! kube-proxy's `conntrack.*` settings applied by the real binary in its own network namespace:
//! the per-namespace sysctls (timeouts, tcp_be_liberal) change there and not on the host;
//! nf_conntrack_max, which is one value for the whole kernel and read-only outside the initial
//! namespace, is only written when it must grow, so a start in a namespace whose table is big
//! enough works and one that needs a bigger table fails like kube-proxy; the hash size under
//! `--sysfs-root` is raised, and a read-only sysfs is a warning.

// Test helpers outside #[test] fns may unwrap/panic too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Output;

use testkit::netns::Netns;

const BIN: &str = env!("CARGO_BIN_EXE_kube-ipvs");
const NF: &str = "/proc/sys/net/netfilter";

/// The per-namespace sysctls the test sets, with values no kernel or host uses by default.
const TIMEOUTS: [(&str, &str, &str); 5] = [
    (
        "nf_conntrack_tcp_timeout_established",
        "--conntrack-tcp-timeout-established=2h3m7s",
        "7387",
    ),
    (
        "nf_conntrack_tcp_timeout_close_wait",
        "--conntrack-tcp-timeout-close-wait=17m11s",
        "1031",
    ),
    (
        "nf_conntrack_tcp_be_liberal",
        "--conntrack-tcp-be-liberal",
        "1",
    ),
    (
        "nf_conntrack_udp_timeout",
        "--conntrack-udp-timeout=41s",
        "41",
    ),
    (
        "nf_conntrack_udp_timeout_stream",
        "--conntrack-udp-timeout-stream=2m13s",
        "133",
    ),
];

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

fn read(path: impl AsRef<Path>) -> String {
    let path = path.as_ref();
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .to_string()
}

/// The host's (this test process's namespace's) values of everything the test could touch.
fn host_values() -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = TIMEOUTS
        .iter()
        .map(|(name, _, _)| (name.to_string(), read(format!("{NF}/{name}"))))
        .collect();
    v.push((
        "nf_conntrack_max".into(),
        read(format!("{NF}/nf_conntrack_max")),
    ));
    v.push((
        "hashsize".into(),
        read("/sys/module/nf_conntrack/parameters/hashsize"),
    ));
    v
}

/// The host's nf_conntrack_max (the same number in every namespace).
fn global_max() -> u64 {
    read(format!("{NF}/nf_conntrack_max")).parse().unwrap()
}

/// `kube-ipvs --once` on the examples inside `ns`, with `args` (the daemon falls back to its
/// iptables mode where the kernel has no IPVS; the conntrack settings apply in both).
fn once_in(ns: &Netns, args: &[&str]) -> (Output, String) {
    run_once(ns.command(BIN), args)
}

/// Runs `c` (the binary, or a wrapper whose arguments start with it) with `--once` on the
/// examples and `args`; returns its output and stderr.
fn run_once(mut c: std::process::Command, args: &[&str]) -> (Output, String) {
    c.args(["--once", "--source-dir"])
        .arg(examples())
        .args([
            "--hostname-override",
            "node-1",
            "--healthz-bind-address",
            "127.0.0.1:0",
            "--metrics-bind-address",
            "127.0.0.1:0",
        ])
        .args(args)
        .env_remove("RUST_LOG");
    let out = c.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    (out, err)
}

fn ns_read(ns: &Netns, name: &str) -> String {
    ns.run(&["cat", &format!("{NF}/{name}")])
        .unwrap()
        .trim()
        .to_string()
}

fn needs_nf_conntrack() {
    assert!(
        Path::new(NF).join("nf_conntrack_max").exists(),
        "the netns stage needs the nf_conntrack module loaded on the host"
    );
}

#[test]
#[ignore = "netns"]
fn netns_conntrack_timeouts_change_in_the_namespace_not_on_the_host() {
    needs_nf_conntrack();
    let before = host_values();
    let ns = Netns::new("ct-timeouts").unwrap();
    for (name, _, want) in TIMEOUTS {
        assert_ne!(ns_read(&ns, name), want, "{name}: pick another test value");
    }
    // A table size the kernel already has: nothing to write, so this works outside the
    // initial namespace too (maxPerCore 1 x CPUs, at least 1024).
    assert!(global_max() >= 1024);
    let mut args: Vec<&str> = TIMEOUTS.iter().map(|(_, flag, _)| *flag).collect();
    args.extend(["--conntrack-max-per-core=1", "--conntrack-min=1024"]);
    let (out, err) = once_in(&ns, &args);
    assert!(out.status.success(), "{err}");

    for (name, _, want) in TIMEOUTS {
        assert_eq!(ns_read(&ns, name), want, "{name} in the namespace\n{err}");
        // Logged once, as a change.
        let file = format!("{NF}/{name} ");
        let lines = err
            .lines()
            .filter(|l| l.contains("set sysctl") && l.contains(&file))
            .count();
        assert_eq!(lines, 1, "{name}:\n{err}");
    }
    assert!(
        err.contains("nf_conntrack_max is already large enough"),
        "{err}"
    );
    // The host kept every value, nf_conntrack_max and the hash size included.
    assert_eq!(host_values(), before);
    // A second start changes nothing.
    let (out, err) = once_in(&ns, &args);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("set sysctl"), "{err}");
}

#[test]
#[ignore = "netns"]
fn netns_conntrack_max_that_must_grow_outside_the_host_namespace_is_an_error() {
    needs_nf_conntrack();
    let ns = Netns::new("ct-max").unwrap();
    // The kernel makes nf_conntrack_max read-only in every namespace but the initial one. If
    // this kernel did not, the test would raise the host's table: refuse to go on.
    let mode = ns
        .run(&["stat", "-c", "%a", &format!("{NF}/nf_conntrack_max")])
        .unwrap();
    assert_eq!(
        mode.trim(),
        "444",
        "nf_conntrack_max is writable in a namespace here"
    );
    let before = host_values();
    let want = global_max() + 4096;
    let min = format!("--conntrack-min={want}");
    let (out, err) = once_in(
        &ns,
        &[
            "--conntrack-max-per-core=1",
            &min,
            "--conntrack-udp-timeout=41s",
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("could not set conntrack parameters from the configuration"),
        "{err}"
    );
    assert!(err.contains("nf_conntrack_max"), "{err}");
    assert!(err.contains("--conntrack-max-per-core=0"), "{err}");
    // Nothing was programmed: the error comes before the proxy starts.
    assert!(!err.contains("sync done"), "{err}");
    // The other settings were still applied (failures do not stop the rest), in the namespace.
    assert_eq!(ns_read(&ns, "nf_conntrack_udp_timeout"), "41");
    assert_eq!(host_values(), before);

    // With maxPerCore 0 (what kind does) the same start works and leaves the table alone.
    let (out, err) = once_in(&ns, &["--conntrack-max-per-core=0", &min]);
    assert!(out.status.success(), "{err}");
    assert_eq!(host_values(), before);
}

/// A fake sysfs (hash size 1000, 6 online CPUs) in a temporary directory, removed on drop.
struct FakeSys(PathBuf);

impl FakeSys {
    fn new(tag: &str) -> FakeSys {
        let dir = std::env::temp_dir().join(format!("kube-ipvs-ct-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let params = dir.join("module/nf_conntrack/parameters");
        std::fs::create_dir_all(&params).unwrap();
        std::fs::create_dir_all(dir.join("devices/system/cpu")).unwrap();
        std::fs::write(params.join("hashsize"), "1000\n").unwrap();
        std::fs::set_permissions(
            params.join("hashsize"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        std::fs::write(dir.join("devices/system/cpu/online"), "0-5\n").unwrap();
        FakeSys(dir)
    }
    fn hashsize(&self) -> String {
        read(self.0.join("module/nf_conntrack/parameters/hashsize"))
    }
}

impl Drop for FakeSys {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
#[ignore = "netns"]
fn netns_conntrack_hash_size_is_raised_under_the_sysfs_root_and_read_only_sysfs_warns() {
    needs_nf_conntrack();
    let sys = FakeSys::new("hash");
    let root = format!("--sysfs-root={}", sys.0.display());
    // 6 CPUs (from the fake online list) x 1000 = 6000 entries: no bigger than the kernel's
    // table, so nf_conntrack_max stays; the hash size must be 6000 / 4 = 1500.
    assert!(global_max() >= 6000);
    let args = [
        root.as_str(),
        "--conntrack-max-per-core=1000",
        "--conntrack-min=1",
    ];
    let before = host_values();
    let ns = Netns::new("ct-hash").unwrap();
    let (out, err) = once_in(&ns, &args);
    assert!(out.status.success(), "{err}");
    assert_eq!(sys.hashsize(), "1500", "{err}");
    assert!(err.contains("set conntrack hash size"), "{err}");
    // Raised, never lowered: a bigger hash size stays.
    std::fs::write(
        sys.0.join("module/nf_conntrack/parameters/hashsize"),
        "4096\n",
    )
    .unwrap();
    let (out, err) = once_in(&ns, &args);
    assert!(out.status.success(), "{err}");
    assert_eq!(sys.hashsize(), "4096");

    // sysfs mounted read-only (docker issue #24000, or an unprivileged container): the hash
    // size stays, the start goes on with a warning, like kube-proxy's readOnlySysFS case. The
    // bind mount lives in the mount namespace `ip netns exec` makes for this one command.
    std::fs::write(
        sys.0.join("module/nf_conntrack/parameters/hashsize"),
        "1000\n",
    )
    .unwrap();
    let dir = sys.0.display().to_string();
    let script =
        format!("mount --bind {dir} {dir} && mount -o remount,bind,ro {dir} && exec \"$0\" \"$@\"");
    let mut c = ns.command("sh");
    c.args(["-c", &script, BIN]);
    let (out, err) = run_once(c, &args);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("sysfs is read-only"), "{err}");
    assert!(err.contains("sync done"), "{err}");
    assert_eq!(sys.hashsize(), "1000");
    // The mount did not leak out of that command.
    std::fs::write(
        sys.0.join("module/nf_conntrack/parameters/hashsize"),
        "1000\n",
    )
    .unwrap();
    assert_eq!(host_values(), before);
}
