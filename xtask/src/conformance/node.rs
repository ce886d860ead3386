//! A Kubernetes node in the test VM: containerd (runc, CNI bridge), the kubelet, and the images
//! imported under their upstream names.
//!
//! The guest root is the VM runner's initramfs plus this node's files; the images come on a
//! read-only virtio disk (one OCI archive, imported at boot), the kubelet's and containerd's
//! state lives on an ext4 virtio disk (a sparse file; cadvisor finds no file system info for
//! `rootfs` or tmpfs). What a node on an initramfs needs beyond a stock one: runc's `NoPivotRoot`
//! (there is no root to pivot from), the
//! `overlay` module for containerd's snapshotter (loaded from the kernel package by path, the
//! shared base image does not carry it), `br_netfilter` with `bridge-nf-call-iptables=1` so
//! bridged pod-to-pod traffic through a Service is NATed, and `hairpinMode` on the CNI bridge.
//! The guest's stdout carries progress lines, its stderr the kubelet's and containerd's logs
//! (the run directory keeps both, live).

use super::cluster::{self, CP_IP, DNS_IP};
use super::images::PAUSE;
use crate::error::{Context, Result};
use crate::vm::{self, Extra, VmConfig};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

/// Guest memory (MiB): the initramfs (~0.6 GB with the images), the images again in
/// containerd's content store and snapshots, the kubelet, containerd and the test pods.
pub const NODE_MEM_MB: u32 = 5120;

/// The state disk's size (sparse: only what the node writes takes host disk).
const STATE_DISK_BYTES: u64 = 8 << 30;

/// containerd's configuration (v3 format, containerd 2.x).
fn containerd_toml() -> String {
    format!(
        r#"version = 3
root = "/var/lib/containerd"
state = "/run/containerd"

[grpc]
  address = "/run/containerd/containerd.sock"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE}"

[plugins.'io.containerd.cri.v1.runtime']
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        NoPivotRoot = true
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/opt/cni/bin"]
    conf_dir = "/etc/cni/net.d"
"#
    )
}

/// The CNI network: a bridge with hairpin mode, host-local IPAM over the node's pod CIDR, and
/// portmap for hostPort.
fn cni_conflist(n: u32) -> String {
    let cidr = cluster::pod_cidr(n);
    let gw = format!("10.244.{n}.1");
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "conformance",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": cidr, "gateway": gw}]],
                    "routes": [{"dst": "0.0.0.0/0"}]
                }
            },
            {"type": "portmap", "capabilities": {"portMappings": true}}
        ]
    })
    .to_string()
}

fn kubelet_yaml(n: u32) -> String {
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: false
  x509:
    clientCAFile: /etc/kubernetes/pki/ca.crt
authorization:
  mode: AlwaysAllow
cgroupDriver: cgroupfs
clusterDNS: [{DNS_IP}]
clusterDomain: cluster.local
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
failSwapOn: false
podCIDR: {cidr}
resolvConf: /etc/resolv.conf
readOnlyPort: 0
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 50Mi
  nodefs.available: 1%
  imagefs.available: 1%
  nodefs.inodesFree: 1%
shutdownGracePeriod: 0s
"#,
        cidr = cluster::pod_cidr(n)
    )
}

/// The node's boot script (dash), run as the VM's command.
fn node_script(n: u32, nodes: u32, release: &str) -> String {
    let ip = cluster::node_ip(n);
    let name = cluster::node_name(n);
    let mut routes = String::new();
    for m in (1..=nodes).filter(|m| *m != n) {
        routes.push_str(&format!(
            "ip route add {} via {}\n",
            cluster::pod_cidr(m),
            cluster::node_ip(m)
        ));
    }
    format!(
        r#"set -u
say() {{ echo "node-{n}: $(cut -d' ' -f1 /proc/uptime) s: $*"; }}
say boot
insmod /lib/modules/{release}/extra/overlay.ko || say "overlay module: failed"
modprobe -a br_netfilter virtio_pci virtio_net
i=0; while ! ip link show eth0 >/dev/null 2>&1 && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
ip link set eth0 up
ip addr add {ip}/24 dev eth0
ip route add default via {CP_IP}
{routes}hostname {name}
echo "127.0.0.1 localhost {name}" > /etc/hosts
echo "nameserver {CP_IP}" > /etc/resolv.conf
echo 1 > /proc/sys/net/ipv4/ip_forward
echo 1 > /proc/sys/net/bridge/bridge-nf-call-iptables
echo 1 > /proc/sys/net/bridge/bridge-nf-call-ip6tables
cat /proc/sys/kernel/random/uuid | tr -d - > /etc/machine-id
insmod /lib/modules/{release}/extra/virtio_blk.ko || say "virtio_blk module: failed"
i=0; while ! [ -b /dev/vdb ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
mkdir -p /var/lib /var/log && mount -t ext4 /dev/vdb /var/lib || say "state disk: mount failed"
mkdir -p /var/lib/log && mount --bind /var/lib/log /var/log
mkdir -p /var/lib/kubelet /var/lib/containerd /var/log/pods /var/log/containers /run/containerd
for c in cpuset cpu io memory pids hugetlb; do echo "+$c" > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || say "cgroup controller $c: unavailable"; done
say network and mounts ready
/usr/local/bin/containerd --config /etc/containerd/config.toml 2>&1 | awk '{{print "containerd: " $0; fflush()}}' >&2 &
i=0; while ! [ -S /run/containerd/containerd.sock ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
[ -f /var/lib/containerd/.images-imported ] || /usr/local/bin/ctr -n k8s.io images import --platform linux/amd64 /dev/vda >/dev/null || say "image import failed"
say images: $(/usr/local/bin/ctr -n k8s.io images ls -q | grep -v '^sha256' | tr '\n' ' ')
/usr/local/bin/kubelet --config=/etc/kubernetes/kubelet.yaml \
  --kubeconfig=/etc/kubernetes/kubelet.kubeconfig \
  --hostname-override={name} --node-ip={ip} --v=2 2>&1 \
  | awk '{{print "kubelet: " $0; fflush()}}' >&2 &
say kubelet started
while sleep 5; do
  pidof kubelet >/dev/null || {{ say "kubelet exited"; exit 1; }}
  pidof containerd >/dev/null || {{ say "containerd exited"; exit 1; }}
done
"#
    )
}

/// A node VM being started or running (its thread runs QEMU until stopped).
pub struct Node {
    /// 1-based index.
    pub n: u32,
    /// The run directory (console, stdout, stderr).
    pub dir: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<vm::VmOutcome>>>,
    /// The VM thread's error, once it ended with one (read while the thread is not joined).
    failed: Arc<std::sync::Mutex<Option<String>>>,
}

/// Everything a node's guest files come from.
pub struct NodeInputs<'a> {
    /// Conformance binaries (kubelet, containerd, ...).
    pub bin: &'a Path,
    /// The OCI archive with every image (attached read-only as the VM's first disk).
    pub images: &'a Path,
    /// The control plane's CA certificate (PEM).
    pub ca_pem: &'a str,
    /// The kernel's module tree (for `overlay.ko`) and its release.
    pub kernel_modules: &'a Path,
    /// The kernel release.
    pub release: &'a str,
    /// How many nodes the cluster has.
    pub nodes: u32,
    /// A state disk with the images already imported ([`golden_state`]), copied per node.
    pub golden: Option<&'a Path>,
}

/// A sparse ext4 file (the guest kernel has ext4 built in): the node's `/var/lib`, so cadvisor
/// sees a real block device under the kubelet's and containerd's directories (it has no file
/// system info for tmpfs), and unpacked images are not held in guest memory.
fn new_state_disk(state: &Path) -> Result<()> {
    let disk = fs::File::create(state).ctx(|| format!("creating {}", state.display()))?;
    disk.set_len(STATE_DISK_BYTES)
        .ctx(|| format!("sizing {}", state.display()))?;
    drop(disk);
    crate::host::output(
        std::process::Command::new("mkfs.ext4")
            .args([
                "-q",
                "-F",
                "-E",
                "lazy_itable_init=1,lazy_journal_init=1",
                "-L",
                "node-state",
            ])
            .arg(state),
    )
    .map(|_| ())
}

/// The host script that imports the images into a fresh state disk: in a private mount
/// namespace, the disk is loop-mounted at `/var/lib` (the path the node's containerd uses) and
/// a host containerd (the same binary, CRI disabled) imports the archive, then stops.
fn golden_script(bin: &Path, disk: &Path, images: &Path, run: &Path) -> String {
    let (bin, disk, images, run) = (
        bin.display(),
        disk.display(),
        images.display(),
        run.display(),
    );
    format!(
        r#"set -eu
mount --make-rprivate /
mount -o loop {disk} /var/lib
mkdir -p /var/lib/containerd {run}
cat > {run}/config.toml <<EOT
version = 3
root = "/var/lib/containerd"
state = "{run}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime", "io.containerd.cri.v1.images"]
[grpc]
  address = "{run}/containerd.sock"
EOT
{bin}/containerd --config {run}/config.toml >{run}/containerd.log 2>&1 &
pid=$!
i=0; while ! [ -S {run}/containerd.sock ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
{bin}/ctr --address {run}/containerd.sock -n k8s.io images import --platform linux/amd64 {images} >/dev/null
{bin}/ctr --address {run}/containerd.sock -n k8s.io images ls -q | grep -v '^sha256'
kill $pid; wait $pid || true
touch /var/lib/containerd/.images-imported
umount /var/lib
"#
    )
}

/// A state disk with every image imported, made once per image archive on the host (seconds;
/// the same import under TCG on a loaded machine took over ten minutes) and cached next to the
/// archive: each node starts from a sparse copy. Returns its path.
pub fn golden_state(input: &NodeInputs<'_>) -> Result<PathBuf> {
    let dir = input.images.parent().unwrap_or(Path::new("."));
    let golden = dir.join("state-golden.ext4");
    let stamp = dir.join("state-golden.stamp");
    let want = fs::read_to_string(dir.join("images.stamp")).unwrap_or_default();
    if golden.is_file() && fs::read_to_string(&stamp).is_ok_and(|s| s == want) {
        return Ok(golden);
    }
    let _ = fs::remove_file(&stamp);
    let started = std::time::Instant::now();
    let tmp = dir.join("state-golden.tmp");
    new_state_disk(&tmp)?;
    let run = dir.join("golden-run");
    let _ = fs::remove_dir_all(&run);
    let out = super::run_limited(
        std::process::Command::new("unshare")
            .args(["-m", "sh", "-c"])
            .arg(golden_script(input.bin, &tmp, input.images, &run)),
        None,
        Duration::from_secs(900),
    )?;
    fs::rename(&tmp, &golden).ctx(|| "installing the golden state disk")?;
    fs::write(&stamp, want).ctx(|| "writing state-golden.stamp")?;
    eprintln!(
        "xtask: conformance: images imported into {} in {:.0} s: {}",
        golden.display(),
        started.elapsed().as_secs_f64(),
        out.split_whitespace().collect::<Vec<_>>().join(" ")
    );
    Ok(golden)
}

impl Node {
    /// Writes node `n`'s files under `dir` and boots its VM in the cluster's namespace.
    pub fn start(n: u32, dir: &Path, ns: &str, input: &NodeInputs<'_>) -> Result<Self> {
        let _ = fs::remove_dir_all(dir);
        let files = dir.join("files");
        fs::create_dir_all(&files).ctx(|| format!("creating {}", files.display()))?;
        let w = |name: &str, text: &str| -> Result<PathBuf> {
            let p = files.join(name);
            fs::write(&p, text).ctx(|| format!("writing {}", p.display()))?;
            Ok(p)
        };
        let mut f: Vec<(PathBuf, String)> = vec![
            (
                w("config.toml", &containerd_toml())?,
                "/etc/containerd/config.toml".into(),
            ),
            (
                w("10-conformance.conflist", &cni_conflist(n))?,
                "/etc/cni/net.d/10-conformance.conflist".into(),
            ),
            (
                w("kubelet.yaml", &kubelet_yaml(n))?,
                "/etc/kubernetes/kubelet.yaml".into(),
            ),
            (
                w("kubelet.kubeconfig", &cluster::kubeconfig(input.ca_pem))?,
                "/etc/kubernetes/kubelet.kubeconfig".into(),
            ),
            (
                w("ca.crt", input.ca_pem)?,
                "/etc/kubernetes/pki/ca.crt".into(),
            ),
            (
                input.kernel_modules.join("kernel/fs/overlayfs/overlay.ko"),
                format!("/lib/modules/{}/extra/overlay.ko", input.release),
            ),
            (
                Path::new("/usr/sbin/runc").to_path_buf(),
                "/usr/sbin/runc".into(),
            ),
        ];
        for b in ["kubelet", "containerd", "containerd-shim-runc-v2", "ctr"] {
            f.push((input.bin.join(b), format!("/usr/local/bin/{b}")));
        }
        for p in ["bridge", "host-local", "loopback", "portmap"] {
            f.push((
                Path::new("/usr/lib/cni").join(p),
                format!("/opt/cni/bin/{p}"),
            ));
        }
        f.push((
            input
                .kernel_modules
                .join("kernel/drivers/block/virtio_blk.ko"),
            format!("/lib/modules/{}/extra/virtio_blk.ko", input.release),
        ));
        // The node's state disk: a sparse file formatted ext4 here (the guest kernel has ext4
        // built in), so cadvisor sees a real block device under the kubelet's and containerd's
        // directories (it has no file system info for tmpfs), and the images' unpacked
        // snapshots are not held in guest memory.
        let state = dir.join("state.ext4");
        match input.golden {
            Some(g) => {
                crate::host::output(
                    std::process::Command::new("cp")
                        .arg("--sparse=always")
                        .arg(g)
                        .arg(&state),
                )?;
            }
            None => new_state_disk(&state)?,
        }
        let cfg = VmConfig {
            mem_mb: NODE_MEM_MB,
            cpus: 2,
            timeout: Duration::from_secs(6 * 3600),
            files: f,
            net_fwd: None,
            env: Vec::new(),
            cwd: None,
            script: node_script(n, input.nodes, input.release),
            echo: false,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let extra = Extra {
            netns: Some(ns.to_string()),
            qemu_args: vec![
                "-drive".into(),
                format!(
                    "file={},format=raw,if=virtio,readonly=on",
                    input.images.display()
                ),
                "-drive".into(),
                format!("file={},format=raw,if=virtio,cache=unsafe", state.display()),
                "-netdev".into(),
                format!("tap,id=n0,ifname=tap{n},script=no,downscript=no"),
                "-device".into(),
                format!("virtio-net-pci,netdev=n0,mac=52:54:00:c0:00:{n:02x}"),
            ],
            run_dir: Some(dir.join("vm")),
            stop: Some(stop.clone()),
        };
        let failed = Arc::new(std::sync::Mutex::new(None));
        let record = failed.clone();
        let thread = std::thread::spawn(move || {
            let r = vm::run_with(&cfg, &extra);
            if let (Err(e), Ok(mut slot)) = (&r, record.lock()) {
                *slot = Some(e.to_string());
            }
            r
        });
        Ok(Node {
            n,
            dir: dir.to_path_buf(),
            stop,
            thread: Some(thread),
            failed,
        })
    }

    /// The guest's progress lines so far.
    pub fn progress(&self) -> String {
        fs::read_to_string(self.dir.join("vm/stdout")).unwrap_or_default()
    }

    /// The VM thread's error, if it ended with one.
    pub fn failure(&self) -> Option<String> {
        self.failed.lock().ok().and_then(|s| s.clone())
    }

    /// Whether the VM thread ended (crashed or exited).
    pub fn ended(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Stops the VM and returns how it ended.
    pub fn stop(mut self) -> Option<Result<vm::VmOutcome>> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.take().and_then(|t| t.join().ok())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cni_network_hairpins_on_the_nodes_pod_cidr() {
        let v: serde_json::Value = serde_json::from_str(&cni_conflist(2)).unwrap();
        assert_eq!(v["plugins"][0]["hairpinMode"], true);
        assert_eq!(
            v["plugins"][0]["ipam"]["ranges"][0][0]["subnet"],
            "10.244.2.0/24"
        );
    }

    #[test]
    fn node_script_routes_to_the_other_nodes_pods() {
        let s = node_script(1, 2, "6.1.0");
        assert!(
            s.contains("ip route add 10.244.2.0/24 via 192.168.200.12\n"),
            "{s}"
        );
        assert!(!s.contains("10.244.1.0/24 via"), "{s}");
    }
}
