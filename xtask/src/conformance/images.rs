//! Container images as OCI archives, built here from local binaries (nothing is pulled).
//!
//! Each image is one uncompressed layer: a root file system assembled with [`Tree`] (host
//! binaries with the libraries `ldd` lists, like the VM image) and tarred by GNU tar with fixed
//! owners and mtimes; the config, manifest and `index.json` are written here. The index names
//! the image (`io.containerd.image.name`), so `ctr images import` stores it under exactly the
//! name a pod spec asks for and the kubelet never pulls.
//!
//! - `agnhost` and `pause` under the names `test/utils/image/manifest.go` pins, `busybox` too;
//!   agnhost's image also has the tools its tests exec (a shell, curl, nc, nslookup/dig, ip, ss).
//! - `kube-ipvs`: the release binary plus the Debian packages `Containerfile`'s runtime stage
//!   installs, read from `Containerfile` itself (so the two stay one recipe).
//! - `kube-proxy` (the upstream reference): the binary `cargo xtask kube` built, with the same
//!   tools (iptables, ipset, conntrack).
//! - CoreDNS.

use crate::error::{Context, Error, Result};
use crate::host::{self, Apt};
use crate::image::{Node, Tree};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// agnhost as the e2e framework names it (`test/utils/image/manifest.go`).
pub const AGNHOST: &str = "registry.k8s.io/e2e-test-images/agnhost:2.66.1";
/// The sandbox image (`manifest.go` and the kubelet's default).
pub const PAUSE: &str = "registry.k8s.io/pause:3.10.2";
/// busybox as the e2e framework names it.
pub const BUSYBOX: &str = "registry.k8s.io/e2e-test-images/busybox:1.37.0-2";
/// The locally built kube-ipvs image (the overlay's `images[]` points here).
pub const KUBE_IPVS: &str = "localhost/kube-ipvs:conformance";
/// The upstream kube-proxy image, named as kubeadm names it.
pub const KUBE_PROXY: &str = "registry.k8s.io/kube-proxy:v1.37.2";
/// CoreDNS, named as kubeadm names it.
pub const COREDNS: &str = "registry.k8s.io/coredns/coredns:v1.15.0";

/// Bumped when an image's recipe changes (part of the images' cache stamp).
const RECIPE: u32 = 2;

/// Tools the agnhost image carries for the commands e2e tests exec in it.
const AGNHOST_TOOLS: &[&str] = &[
    "dash", "curl", "nc", "nslookup", "dig", "ip", "ss", "socat", "timeout", "wget",
];

/// Debian's `wget`, ahead of busybox's in the agnhost and busybox images: the e2e tests run
/// `wget -q -O - -T 1 http://VIP:PORT` (`verifyServeHostnameServiceUp`) and `wget -T 5 -qO-`
/// (`checkReachabilityFromPod`), and Debian's static busybox 1.35.0 dies of SIGSEGV on `-T`
/// when its root has no NSS modules (reproduced in a chroot holding only it and libc: rc 139;
/// without `-T` it works). The shell then prints "Segmentation fault" instead of a pod name.
const WGET: &str = "wget";

/// What an image runs.
pub struct Spec<'a> {
    /// Full reference (`registry/name:tag`).
    pub name: &'a str,
    /// ENTRYPOINT.
    pub entrypoint: &'a [&'a str],
    /// CMD.
    pub cmd: &'a [&'a str],
}

fn sha256_file(p: &Path) -> Result<String> {
    let out = host::output(Command::new("sha256sum").arg(p))?;
    out.split_whitespace()
        .next()
        .map(str::to_string)
        .ok_or_else(|| Error::Parse(format!("sha256sum {}: {out}", p.display())))
}

/// Stores `bytes` as a blob of the layout at `dir`; returns (digest, size).
fn put_blob(dir: &Path, bytes: &[u8]) -> Result<(String, usize)> {
    let tmp = dir.join("blob.tmp");
    fs::write(&tmp, bytes).ctx(|| format!("writing {}", tmp.display()))?;
    let hex = sha256_file(&tmp)?;
    let dst = dir.join("blobs/sha256").join(&hex);
    fs::rename(&tmp, &dst).ctx(|| format!("storing {}", dst.display()))?;
    Ok((format!("sha256:{hex}"), bytes.len()))
}

/// Adds `rootfs` as a one-layer image named `spec.name` to the OCI layout at `layout` (its
/// `blobs/`); returns the manifest's descriptor for the layout's `index.json`.
pub fn add_image(rootfs: &Path, spec: &Spec<'_>, layout: &Path) -> Result<serde_json::Value> {
    let blobs = layout.join("blobs/sha256");
    fs::create_dir_all(&blobs).ctx(|| format!("creating {}", blobs.display()))?;
    let layer = layout.join("layer.tar");
    host::output(
        Command::new("tar")
            .args([
                "--sort=name",
                "--numeric-owner",
                "--owner=0",
                "--group=0",
                "--mtime=@0",
                "--format=gnu",
                "-C",
            ])
            .arg(rootfs)
            .arg("-cf")
            .arg(&layer)
            .arg("."),
    )?;
    let layer_hex = sha256_file(&layer)?;
    let layer_size = fs::metadata(&layer).ctx(|| "stat layer")?.len();
    fs::rename(&layer, blobs.join(&layer_hex)).ctx(|| "storing the layer")?;
    let layer_digest = format!("sha256:{layer_hex}");
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": spec.entrypoint,
            "Cmd": spec.cmd,
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "WorkingDir": "/",
        },
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    });
    let (config_digest, config_size) = put_blob(layout, config.to_string().as_bytes())?;
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_size,
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": layer_digest,
            "size": layer_size,
        }],
    });
    let (manifest_digest, manifest_size) = put_blob(layout, manifest.to_string().as_bytes())?;
    let tag = spec.name.rsplit_once(':').map_or("latest", |(_, t)| t);
    Ok(serde_json::json!({
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": manifest_digest,
        "size": manifest_size,
        "platform": {"architecture": "amd64", "os": "linux"},
        "annotations": {
            "io.containerd.image.name": spec.name,
            "org.opencontainers.image.ref.name": tag,
        },
    }))
}

/// Writes the layout's `index.json` (one entry per image) and tars the layout into the OCI
/// archive `out` (`ctr images import` takes it whole: every image under its name).
pub fn write_archive(layout: &Path, manifests: &[serde_json::Value], out: &Path) -> Result<()> {
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": manifests,
    });
    fs::write(layout.join("index.json"), index.to_string()).ctx(|| "writing index.json")?;
    fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .ctx(|| "writing oci-layout")?;
    let tmp = out.with_extension("tmp");
    host::output(
        Command::new("tar")
            .args([
                "--sort=name",
                "--numeric-owner",
                "--owner=0",
                "--group=0",
                "-C",
            ])
            .arg(layout)
            .arg("-cf")
            .arg(&tmp)
            .args(["oci-layout", "index.json", "blobs"]),
    )?;
    fs::rename(&tmp, out).ctx(|| format!("writing {}", out.display()))
}

/// Minimal `/etc` for an image (users, hosts lookup order).
fn base_etc(t: &mut Tree) {
    let data = |s: &str| Node::Data {
        bytes: s.as_bytes().to_vec(),
        mode: 0o644,
    };
    t.insert(
        "etc/passwd",
        data("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"),
    );
    t.insert("etc/group", data("root:x:0:\nnogroup:x:65534:\n"));
    t.insert(
        "etc/nsswitch.conf",
        data("passwd: files\ngroup: files\nhosts: files dns\nservices: files\nprotocols: files\n"),
    );
    for d in ["tmp", "root", "proc", "sys", "dev", "run", "var/run"] {
        t.insert(d, Node::Dir(if d == "tmp" { 0o1777 } else { 0o755 }));
    }
    for f in ["/etc/protocols", "/etc/services", "/etc/ethertypes"] {
        if Path::new(f).exists() {
            let _ = t.add_host(Path::new(f));
        }
    }
}

/// busybox applets for every name the tree does not have yet.
fn busybox_applets(t: &mut Tree) -> Result<()> {
    t.add_host(Path::new("/bin/busybox"))?;
    let list = host::output(Command::new("/bin/busybox").arg("--list-full"))?;
    for applet in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if !t.contains(applet) {
            t.insert(applet, Node::Symlink("/bin/busybox".into()));
        }
    }
    Ok(())
}

/// The Debian packages `Containerfile`'s runtime stage installs (its last `apt-get install`).
pub fn containerfile_packages(containerfile: &str) -> Vec<String> {
    let joined = containerfile.replace("\\\n", " ");
    let Some(line) = joined.lines().rev().find(|l| l.contains("apt-get install")) else {
        return Vec::new();
    };
    let after = line.split("apt-get install").nth(1).unwrap_or_default();
    after
        .split("&&")
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .filter(|w| !w.starts_with('-'))
        .map(str::to_string)
        .collect()
}

/// Every file (not directory) a Debian package put outside `/usr/share`, plus the
/// `update-alternatives` links that point at them (e.g. `/usr/sbin/iptables`).
fn package_files(pkg: &str) -> Result<Vec<PathBuf>> {
    let list = host::output(Command::new("dpkg").args(["-L", pkg]))?;
    let mut files: Vec<PathBuf> = list
        .lines()
        .map(PathBuf::from)
        .filter(|p| !p.starts_with("/usr/share") && !p.is_dir() && p.exists())
        .collect();
    for e in fs::read_dir("/etc/alternatives")
        .into_iter()
        .flatten()
        .flatten()
    {
        let target = fs::read_link(e.path()).unwrap_or_default();
        if files.contains(&target) {
            let name = e.file_name();
            for d in ["/usr/sbin", "/usr/bin", "/sbin", "/bin"] {
                let link = Path::new(d).join(&name);
                if fs::read_link(&link).is_ok_and(|t| t == e.path()) {
                    files.push(link);
                }
            }
        }
    }
    Ok(files)
}

/// The runtime tools of `Containerfile` (installed on the host first when missing).
fn add_containerfile_tools(t: &mut Tree, apt: &mut Apt) -> Result<Vec<String>> {
    let cf = host::workspace_root().join("Containerfile");
    let text = fs::read_to_string(&cf).ctx(|| format!("reading {}", cf.display()))?;
    let pkgs = containerfile_packages(&text);
    if pkgs.is_empty() {
        return Err(Error::Parse(format!(
            "{}: no `apt-get install` line",
            cf.display()
        )));
    }
    let missing: Vec<&str> = pkgs
        .iter()
        .map(String::as_str)
        .filter(|p| {
            !Command::new("dpkg")
                .args(["-s", p])
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .collect();
    if !missing.is_empty() {
        apt.install(&missing)?;
    }
    for p in &pkgs {
        for f in package_files(p)? {
            t.add_host(&f)?;
        }
    }
    Ok(pkgs)
}

/// The images, as one OCI archive.
pub struct Images {
    /// The image names it holds.
    pub names: Vec<&'static str>,
    /// The archive (`images.tar`).
    pub archive: PathBuf,
}

/// Collects images into one layout, then one archive.
struct Bundle {
    dir: PathBuf,
    layout: PathBuf,
    manifests: Vec<serde_json::Value>,
    names: Vec<&'static str>,
}

impl Bundle {
    fn new(dir: &Path) -> Result<Self> {
        let layout = dir.join("layout");
        let _ = fs::remove_dir_all(&layout);
        fs::create_dir_all(&layout).ctx(|| format!("creating {}", layout.display()))?;
        Ok(Bundle {
            dir: dir.to_path_buf(),
            layout,
            manifests: Vec::new(),
            names: Vec::new(),
        })
    }

    fn add(
        &mut self,
        spec: &Spec<'static>,
        fill: impl FnOnce(&mut Tree) -> Result<()>,
    ) -> Result<()> {
        let root = self.dir.join("rootfs");
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).ctx(|| format!("creating {}", root.display()))?;
        let mut t = Tree::new();
        base_etc(&mut t);
        fill(&mut t)?;
        t.materialize(&root)?;
        self.manifests.push(add_image(&root, spec, &self.layout)?);
        self.names.push(spec.name);
        let _ = fs::remove_dir_all(&root);
        Ok(())
    }

    fn finish(self) -> Result<Images> {
        let archive = self.dir.join("images.tar");
        write_archive(&self.layout, &self.manifests, &archive)?;
        let _ = fs::remove_dir_all(&self.layout);
        Ok(Images {
            names: self.names,
            archive,
        })
    }
}

/// Only the pause image (what a node needs to run any pod), for `--up-only`.
pub fn build_pause_only(dir: &Path, bin: &Path) -> Result<Images> {
    if !bin.join("pause").is_file() {
        super::build::build_pause(bin)?;
    }
    let mut b = Bundle::new(dir)?;
    b.add(
        &Spec {
            name: PAUSE,
            entrypoint: &["/pause"],
            cmd: &[],
        },
        |t| t.add_file_as(&bin.join("pause"), "/pause", None),
    )?;
    b.finish()
}

/// Builds every image archive into `dir` from the binaries in `bin` (conformance build),
/// `kube_bin` (`cargo xtask kube`) and the kube-ipvs release binary.
pub fn build_all(
    dir: &Path,
    bin: &Path,
    kube_bin: &Path,
    kube_ipvs: &Path,
    apt: &mut Apt,
) -> Result<Images> {
    fs::create_dir_all(dir).ctx(|| format!("creating {}", dir.display()))?;
    let started = std::time::Instant::now();
    // Reused while every input is unchanged (path, size, mtime of each binary and of
    // Containerfile, and this recipe's version).
    let mut stamp = format!("recipe {RECIPE}\n");
    let cf = host::workspace_root().join("Containerfile");
    let inputs = [
        bin.join("pause"),
        bin.join("agnhost"),
        bin.join("coredns"),
        kube_bin.join("kube-proxy"),
        kube_ipvs.to_path_buf(),
        cf,
        PathBuf::from("/var/lib/dpkg/status"),
    ];
    for i in &inputs {
        let m = fs::metadata(i).ctx(|| format!("reading {}", i.display()))?;
        stamp.push_str(&format!(
            "{} {} {:?}\n",
            i.display(),
            m.len(),
            m.modified().ok()
        ));
    }
    let (archive, stamp_path) = (dir.join("images.tar"), dir.join("images.stamp"));
    if archive.is_file() && fs::read_to_string(&stamp_path).is_ok_and(|s| s == stamp) {
        return Ok(Images {
            names: vec![PAUSE, AGNHOST, BUSYBOX, COREDNS, KUBE_IPVS, KUBE_PROXY],
            archive,
        });
    }
    let _ = fs::remove_file(&stamp_path);
    let mut bundle = Bundle::new(dir)?;
    let file_as = |t: &mut Tree, src: PathBuf, dest: &str| t.add_file_as(&src, dest, None);

    bundle.add(
        &Spec {
            name: PAUSE,
            entrypoint: &["/pause"],
            cmd: &[],
        },
        |t| file_as(t, bin.join("pause"), "/pause"),
    )?;

    bundle.add(
        &Spec {
            name: AGNHOST,
            entrypoint: &["/agnhost"],
            cmd: &["pause"],
        },
        |t| {
            file_as(t, bin.join("agnhost"), "/agnhost")?;
            for tool in AGNHOST_TOOLS {
                let p = host::which(tool).ok_or_else(|| {
                    Error::Usage(format!("host tool `{tool}` missing for the agnhost image"))
                })?;
                t.add_host(&p)?;
            }
            t.insert("bin/sh", Node::Symlink("dash".into()));
            busybox_applets(t)
        },
    )?;

    bundle.add(
        &Spec {
            name: BUSYBOX,
            entrypoint: &[],
            cmd: &["sh"],
        },
        |t| {
            let wget = host::which(WGET).ok_or_else(|| {
                Error::Usage(format!("host tool `{WGET}` missing for the busybox image"))
            })?;
            t.add_host(&wget)?;
            busybox_applets(t)
        },
    )?;

    bundle.add(
        &Spec {
            name: COREDNS,
            entrypoint: &["/coredns"],
            cmd: &[],
        },
        |t| file_as(t, bin.join("coredns"), "/coredns"),
    )?;

    let mut tools = Vec::new();
    bundle.add(
        &Spec {
            name: KUBE_IPVS,
            entrypoint: &["/usr/local/bin/kube-ipvs"],
            cmd: &[],
        },
        |t| {
            tools = add_containerfile_tools(t, apt)?;
            t.add_host(Path::new("/etc/ssl/certs"))?;
            file_as(t, kube_ipvs.to_path_buf(), "/usr/local/bin/kube-ipvs")
        },
    )?;

    bundle.add(
        &Spec {
            name: KUBE_PROXY,
            entrypoint: &[],
            cmd: &["/usr/local/bin/kube-proxy"],
        },
        |t| {
            add_containerfile_tools(t, apt)?;
            file_as(t, kube_bin.join("kube-proxy"), "/usr/local/bin/kube-proxy")
        },
    )?;
    let images = bundle.finish()?;
    fs::write(&stamp_path, stamp).ctx(|| "writing images.stamp")?;
    eprintln!(
        "xtask: conformance: images {} ({:.0} MB; kube-ipvs image packages from Containerfile: {}) in {:.1} s",
        images.names.join(" "),
        fs::metadata(&images.archive).map(|m| m.len()).unwrap_or(0) as f64 / 1e6,
        tools.join(" "),
        started.elapsed().as_secs_f64()
    );
    Ok(images)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packages_come_from_the_runtime_stage() {
        let cf = "FROM rust AS build\nRUN apt-get install -y foo\nFROM debian\n\
                  RUN apt-get update \\\n && DEBIAN_FRONTEND=noninteractive apt-get install -y \
                  --no-install-recommends \\\n      ipvsadm ipset iptables \\\n && rm -rf x\n";
        assert_eq!(containerfile_packages(cf), ["ipvsadm", "ipset", "iptables"]);
    }

    #[test]
    fn the_shipped_containerfile_names_its_tools() {
        let text = fs::read_to_string(host::workspace_root().join("Containerfile")).unwrap();
        let pkgs = containerfile_packages(&text);
        for p in ["ipvsadm", "ipset", "iptables"] {
            assert!(pkgs.iter().any(|x| x == p), "{pkgs:?}");
        }
    }
}
