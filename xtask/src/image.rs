//! Guest root file systems: the cached base initramfs and the per-run overlay cpio.

use crate::cpio::CpioWriter;
use crate::error::{Context, Error, Result};
use crate::host;
use crate::kernel::Kernel;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fs;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::{BufWriter, Read};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bump to invalidate every cached base image after changing how it is built.
const IMAGE_FORMAT: u32 = 3;

/// Host tools copied into the base image when the host has them (part of its cache key).
/// `flock` (util-linux) holds the xtables lock in `e2e_xtables_lock`.
const OPTIONAL_TOOLS: &[&str] = &[
    "nft",
    "ipvsadm-save",
    "ipvsadm-restore",
    "ipset-translate",
    "ethtool",
    "flock",
    // e2e_modules.rs runs the DaemonSet's containers with only their capabilities (setpriv) and
    // read-only mounts (unshare -m; util-linux mount: busybox's cannot remount a bind mount).
    "setpriv",
    "unshare",
    "mount",
    // The soak's netlink-failure fault (`strace --inject` on the running daemon).
    "strace",
];

/// Guest PATH (sbin first; busybox applets only fill gaps).
pub const GUEST_PATH: &str = "/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin";

/// One entry of a guest tree.
#[derive(Debug, Clone)]
pub enum Node {
    /// A directory with permission bits.
    Dir(u32),
    /// A file copied from the host.
    File {
        /// Host source.
        src: PathBuf,
        /// Permission bits.
        mode: u32,
    },
    /// A file with literal content.
    Data {
        /// Content.
        bytes: Vec<u8>,
        /// Permission bits.
        mode: u32,
    },
    /// A symlink with its target.
    Symlink(String),
    /// A character device (major, minor).
    CharDev(u32, u32),
}

/// A guest file tree keyed by relative path (`usr/bin/ip`).
#[derive(Default)]
pub struct Tree {
    nodes: BTreeMap<String, Node>,
    /// Top-level merged-usr aliases, e.g. `bin` -> `usr/bin`.
    aliases: Vec<(String, String)>,
    /// Keys the base image already provides (only set for overlays).
    base: HashSet<String>,
}

fn key_of(p: &Path) -> String {
    p.to_string_lossy().trim_start_matches('/').to_string()
}

fn is_elf(p: &Path) -> bool {
    let mut magic = [0u8; 4];
    fs::File::open(p)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map(|()| &magic == b"\x7fELF")
        .unwrap_or(false)
}

/// Shared libraries `ldd` lists for `p` (empty for static or non-ELF files).
pub fn ldd(p: &Path) -> Vec<PathBuf> {
    let Ok(out) = Command::new("ldd").arg(p).output() else {
        return Vec::new();
    };
    if !out.status.success() {
        return Vec::new();
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let path = match l.split_once("=>") {
                Some((_, rhs)) => rhs.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

impl Tree {
    /// A tree that mirrors the host's merged-usr symlinks (`/bin -> usr/bin`, ...).
    pub fn new() -> Self {
        let mut t = Tree::default();
        for d in ["bin", "sbin", "lib", "lib32", "lib64", "libx32"] {
            if let Ok(target) = fs::read_link(Path::new("/").join(d)) {
                let target = key_of(&target);
                t.aliases.push((d.to_string(), target.clone()));
                t.nodes.insert(d.to_string(), Node::Symlink(target));
            }
        }
        t
    }

    /// An overlay for a base image whose keys are `base`.
    pub fn overlay(base: HashSet<String>) -> Self {
        let mut t = Tree::new();
        t.nodes.clear();
        t.base = base;
        t
    }

    /// Map a guest path through the merged-usr aliases.
    pub fn canon(&self, guest: &str) -> String {
        let k = guest.trim_start_matches('/');
        let (first, rest) = k.split_once('/').unwrap_or((k, ""));
        for (a, t) in &self.aliases {
            if a == first && !rest.is_empty() {
                return format!("{t}/{rest}");
            }
        }
        k.to_string()
    }

    fn dirs_for(&mut self, key: &str) {
        let mut acc = String::new();
        let parts: Vec<&str> = key.split('/').collect();
        for part in &parts[..parts.len().saturating_sub(1)] {
            if !acc.is_empty() {
                acc.push('/');
            }
            acc.push_str(part);
            if !self.nodes.contains_key(&acc) {
                self.nodes.insert(acc.clone(), Node::Dir(0o755));
            }
        }
    }

    /// Insert `node` at guest path `guest` (parents created).
    pub fn insert(&mut self, guest: &str, node: Node) {
        let key = self.canon(guest);
        self.dirs_for(&key);
        self.nodes.insert(key, node);
    }

    /// Whether the guest path exists in this tree or the base.
    pub fn contains(&self, guest: &str) -> bool {
        let k = self.canon(guest);
        self.nodes.contains_key(&k) || self.base.contains(&k)
    }

    /// Copy host path `p` to the same guest path, following symlink chains (each link kept).
    pub fn add_host(&mut self, p: &Path) -> Result<()> {
        self.add_host_depth(p, 0)
    }

    fn add_host_depth(&mut self, p: &Path, depth: u32) -> Result<()> {
        if depth > 40 {
            return Err(Error::Usage(format!("symlink loop at {}", p.display())));
        }
        let abs = std::path::absolute(p).ctx(|| format!("resolving {}", p.display()))?;
        let (Some(parent), Some(name)) = (abs.parent(), abs.file_name()) else {
            return Ok(());
        };
        let parent = fs::canonicalize(parent).ctx(|| format!("resolving {}", parent.display()))?;
        let full = parent.join(name);
        let key = key_of(&full);
        if self.nodes.contains_key(&key) || self.base.contains(&key) {
            return Ok(());
        }
        let meta = fs::symlink_metadata(&full).ctx(|| format!("reading {}", full.display()))?;
        if meta.file_type().is_symlink() {
            let target = fs::read_link(&full).ctx(|| format!("reading {}", full.display()))?;
            self.insert(&key, Node::Symlink(target.to_string_lossy().into_owned()));
            let next = if target.is_absolute() {
                target
            } else {
                parent.join(target)
            };
            self.add_host_depth(&next, depth + 1)
        } else if meta.is_dir() {
            self.insert(&key, Node::Dir(meta.permissions().mode() & 0o7777));
            let mut entries: Vec<PathBuf> = fs::read_dir(&full)
                .ctx(|| format!("listing {}", full.display()))?
                .flatten()
                .map(|e| e.path())
                .collect();
            entries.sort();
            for e in entries {
                self.add_host_depth(&e, depth)?;
            }
            Ok(())
        } else {
            self.insert(
                &key,
                Node::File {
                    src: full.clone(),
                    mode: meta.permissions().mode() & 0o7777,
                },
            );
            if is_elf(&full) {
                for lib in ldd(&full) {
                    self.add_host_depth(&lib, depth + 1)?;
                }
            }
            Ok(())
        }
    }

    /// Copy host directory `src` to guest directory `dest` (files, dirs, symlinks).
    pub fn add_dir_as(&mut self, src: &Path, dest: &str) -> Result<()> {
        let mut stack = vec![(src.to_path_buf(), dest.trim_end_matches('/').to_string())];
        while let Some((s, d)) = stack.pop() {
            let meta = fs::symlink_metadata(&s).ctx(|| format!("reading {}", s.display()))?;
            if meta.file_type().is_symlink() {
                let t = fs::read_link(&s).ctx(|| format!("reading {}", s.display()))?;
                self.insert(&d, Node::Symlink(t.to_string_lossy().into_owned()));
            } else if meta.is_dir() {
                self.insert(&d, Node::Dir(meta.permissions().mode() & 0o7777));
                for e in fs::read_dir(&s)
                    .ctx(|| format!("listing {}", s.display()))?
                    .flatten()
                {
                    let name = e.file_name().to_string_lossy().into_owned();
                    stack.push((e.path(), format!("{d}/{name}")));
                }
            } else {
                let mode = meta.permissions().mode() & 0o7777;
                self.insert(&d, Node::File { src: s, mode });
            }
        }
        Ok(())
    }

    /// Copy one host file to guest path `dest`; ELF files get their libraries (unless the base
    /// has them) and, when `strip_cache` is given, a debug-stripped copy is used.
    pub fn add_file_as(
        &mut self,
        src: &Path,
        dest: &str,
        strip_cache: Option<&Path>,
    ) -> Result<()> {
        let meta = fs::metadata(src).ctx(|| format!("reading {}", src.display()))?;
        if meta.is_dir() {
            return self.add_dir_as(src, dest);
        }
        let mode = meta.permissions().mode() & 0o7777;
        let mut from = src.to_path_buf();
        if is_elf(src) {
            if let Some(dir) = strip_cache {
                from = stripped(src, &meta, dir)?;
            }
            for lib in ldd(src) {
                self.add_host(&lib)?;
            }
        }
        self.insert(dest, Node::File { src: from, mode });
        Ok(())
    }

    /// Write the tree as a directory tree under `root` (a container image's root file system).
    pub fn materialize(&self, root: &Path) -> Result<()> {
        for (k, n) in &self.nodes {
            let p = root.join(k);
            match n {
                Node::Dir(m) => {
                    fs::create_dir_all(&p).ctx(|| format!("creating {}", p.display()))?;
                    fs::set_permissions(&p, fs::Permissions::from_mode(*m))
                        .ctx(|| format!("chmod {}", p.display()))?;
                }
                Node::File { src, mode } => {
                    fs::copy(src, &p).ctx(|| format!("copying {}", src.display()))?;
                    fs::set_permissions(&p, fs::Permissions::from_mode(*mode))
                        .ctx(|| format!("chmod {}", p.display()))?;
                }
                Node::Data { bytes, mode } => {
                    fs::write(&p, bytes).ctx(|| format!("writing {}", p.display()))?;
                    fs::set_permissions(&p, fs::Permissions::from_mode(*mode))
                        .ctx(|| format!("chmod {}", p.display()))?;
                }
                Node::Symlink(t) => {
                    let _ = fs::remove_file(&p);
                    std::os::unix::fs::symlink(t, &p).ctx(|| format!("linking {}", p.display()))?;
                }
                // Device nodes come from the container runtime.
                Node::CharDev(..) => {}
            }
        }
        Ok(())
    }

    /// All keys (for the base manifest).
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.nodes.keys()
    }

    /// Write the tree as a newc archive to `out`, skipping directories the base already has.
    pub fn write_cpio(&self, out: &Path) -> Result<u64> {
        let f = fs::File::create(out).ctx(|| format!("creating {}", out.display()))?;
        let mut w = CpioWriter::new(BufWriter::with_capacity(1 << 20, f));
        let io =
            |r: std::io::Result<()>, k: &str| r.ctx(|| format!("writing {k} to {}", out.display()));
        let mut total = 0;
        for (k, n) in &self.nodes {
            match n {
                Node::Dir(m) => {
                    if !self.base.contains(k) {
                        io(w.dir(k, *m), k)?;
                    }
                }
                Node::File { src, mode } => {
                    let mut f = fs::File::open(src).ctx(|| format!("opening {}", src.display()))?;
                    let len = f
                        .metadata()
                        .ctx(|| format!("stat {}", src.display()))?
                        .len();
                    total += len;
                    io(w.file(k, *mode, len, &mut f), k)?;
                }
                Node::Data { bytes, mode } => {
                    total += bytes.len() as u64;
                    io(w.file(k, *mode, bytes.len() as u64, &mut &bytes[..]), k)?;
                }
                Node::Symlink(t) => io(w.symlink(k, t), k)?,
                Node::CharDev(a, b) => io(w.char_dev(k, 0o600, *a, *b), k)?,
            }
        }
        w.finish().ctx(|| format!("finishing {}", out.display()))?;
        Ok(total)
    }
}

/// Delete stripped copies unused for `max_age` (every rebuild of a test binary leaves one).
pub fn prune_stripped(dir: &Path, max_age: std::time::Duration) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > max_age);
        if old {
            let _ = fs::remove_file(e.path());
        }
    }
}

/// A debug-stripped copy of `src` in `dir`, cached by path, size and mtime.
fn stripped(src: &Path, meta: &fs::Metadata, dir: &Path) -> Result<PathBuf> {
    if meta.len() < 1 << 20 || host::which("objcopy").is_none() {
        return Ok(src.to_path_buf());
    }
    let mut h = DefaultHasher::new();
    (src, meta.len(), meta.mtime(), meta.mtime_nsec()).hash(&mut h);
    let name = src
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let out = dir.join(format!("{name}-{:016x}", h.finish()));
    if out.exists() {
        // Mark as recently used so pruning keeps it.
        if let Ok(f) = fs::File::options().append(true).open(&out) {
            let _ = f.set_modified(std::time::SystemTime::now());
        }
        return Ok(out);
    }
    fs::create_dir_all(dir).ctx(|| format!("creating {}", dir.display()))?;
    // One temporary name per call: node VMs of one run start on threads of one process and
    // strip the same binary at once (a name by process id alone had the second rename find
    // its file already moved).
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let tmp = dir.join(format!(
        ".{name}.{}.{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let ok = Command::new("objcopy")
        .arg("--strip-debug")
        .arg(src)
        .arg(&tmp)
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        let _ = fs::remove_file(&tmp);
        return Ok(src.to_path_buf());
    }
    fs::rename(&tmp, &out).ctx(|| format!("renaming into {}", out.display()))?;
    Ok(out)
}

/// Modules (by path prefix inside `lib/modules/<release>/`) the guest gets, with dependencies.
const MODULE_PREFIXES: &[&str] = &[
    "kernel/net/netfilter/",
    "kernel/net/ipv4/netfilter/",
    "kernel/net/ipv6/netfilter/",
    "kernel/net/bridge/",
];
/// Single modules (by name) the guest gets, with dependencies.
const MODULE_NAMES: &[&str] = &[
    "dummy",
    "veth",
    "macvlan",
    "ipvlan",
    "tun",
    "virtio_net",
    "virtio_pci",
    "8021q",
    // SCTP sockets for the SCTP data-path test (same kernel build: the cloud flavour ships it).
    "sctp",
];

fn module_name(rel: &str) -> &str {
    let file = rel.rsplit('/').next().unwrap_or(rel);
    file.split(".ko").next().unwrap_or(file)
}

/// Select the module subset (with its `modules.dep` closure) and run `depmod -b` on it.
/// Returns the staging root that contains `lib/modules/<release>`.
pub fn stage_modules(kernel: &Kernel, cache: &Path) -> Result<PathBuf> {
    let mut h = DefaultHasher::new();
    (IMAGE_FORMAT, MODULE_PREFIXES, MODULE_NAMES, &kernel.release).hash(&mut h);
    let dir = cache.join(format!("modules-{}-{:016x}", kernel.release, h.finish()));
    if dir.join(".complete").exists() {
        return Ok(dir);
    }
    let dep_file = kernel.modules.join("modules.dep");
    let deps_text =
        fs::read_to_string(&dep_file).ctx(|| format!("reading {}", dep_file.display()))?;
    let mut deps: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for line in deps_text.lines() {
        if let Some((m, d)) = line.split_once(':') {
            deps.insert(m.trim(), d.split_whitespace().collect());
        }
    }
    let mut want: Vec<&str> = deps
        .keys()
        .copied()
        .filter(|m| {
            MODULE_PREFIXES.iter().any(|p| m.starts_with(p))
                || MODULE_NAMES.contains(&module_name(m))
        })
        .collect();
    let mut chosen: BTreeSet<&str> = BTreeSet::new();
    while let Some(m) = want.pop() {
        if chosen.insert(m) {
            want.extend(deps.get(m).into_iter().flatten().copied());
        }
    }
    let tmp = cache.join(format!(".modules-tmp-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    let root = tmp.join("lib/modules").join(&kernel.release);
    for m in &chosen {
        let dst = root.join(m);
        if let Some(p) = dst.parent() {
            fs::create_dir_all(p).ctx(|| format!("creating {}", p.display()))?;
        }
        fs::copy(kernel.modules.join(m), &dst).ctx(|| format!("copying module {m}"))?;
    }
    for f in [
        "modules.builtin",
        "modules.builtin.modinfo",
        "modules.order",
    ] {
        let src = kernel.modules.join(f);
        if src.exists() {
            fs::copy(&src, root.join(f)).ctx(|| format!("copying {f}"))?;
        }
    }
    host::output(
        Command::new("depmod")
            .arg("-b")
            .arg(&tmp)
            .arg(&kernel.release),
    )?;
    fs::write(tmp.join(".complete"), format!("{} modules\n", chosen.len()))
        .ctx(|| "marking modules")?;
    if fs::rename(&tmp, &dir).is_err() && !dir.join(".complete").exists() {
        return Err(Error::Kernel(format!(
            "cannot move modules into {}",
            dir.display()
        )));
    }
    let _ = fs::remove_dir_all(&tmp);
    Ok(dir)
}

/// The guest's PID 1.
const INIT: &str = r#"#!/bin/busybox sh
# kube-ipvs xtask guest init: mount, load modules, run /xtask/cmd under dash, report, power off.
B=/bin/busybox
$B mount -t proc proc /proc
$B mount -t sysfs sysfs /sys
$B mount -t devtmpfs devtmpfs /dev
$B mkdir -p /dev/pts /dev/shm /run/netns /tmp /var/tmp
$B mount -t devpts devpts /dev/pts
$B mount -t tmpfs tmpfs /dev/shm
$B mount -t tmpfs tmpfs /run
$B mkdir -p /run/netns /run/xtables
$B mount -t bpf bpf /sys/fs/bpf 2>/dev/null
$B mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
$B chmod 1777 /tmp /var/tmp
echo /usr/sbin/modprobe > /proc/sys/kernel/modprobe
/usr/sbin/modprobe -a ip_vs ip_vs_rr ip_vs_wrr ip_vs_sh nf_conntrack dummy veth ip_set \
  || echo "xtask-init: modprobe failed"
/usr/sbin/ip link set lo up
$B hostname xtask-vm
for t in ttyS1 ttyS2 ttyS3; do $B stty -F /dev/$t raw -echo 115200; done
if [ -f /xtask/net ]; then
  /usr/sbin/modprobe virtio_pci; /usr/sbin/modprobe virtio_net
  /usr/sbin/ip link set eth0 up && /usr/sbin/ip addr add 10.0.2.15/24 dev eth0 \
    && /usr/sbin/ip route add default via 10.0.2.2
fi
echo "ready $($B cut -d" " -f1 /proc/uptime)" > /dev/ttyS3
/usr/bin/dash /xtask/cmd </dev/null >/dev/ttyS1 2>/dev/ttyS2
echo "rc=$?" > /dev/ttyS3
$B sync
$B poweroff -f
"#;

/// A built base image.
pub struct Base {
    /// The cpio file.
    pub path: PathBuf,
    /// Every path it contains.
    pub keys: HashSet<String>,
}

fn required(tree: &mut Tree, name: &str) -> Result<()> {
    let p = host::which(name).ok_or_else(|| {
        Error::Usage(format!(
            "host tool `{name}` not found (needed in the VM image)"
        ))
    })?;
    tree.add_host(&p)
}

/// Build (or reuse from the cache) the base initramfs for `kernel`.
pub fn ensure_base(kernel: &Kernel, cache: &Path) -> Result<Base> {
    let modules = stage_modules(kernel, cache)?;
    // Cheap cache key: everything the image is made of changes either this file's recipe, the
    // kernel, or the host's package database (any install/upgrade rewrites dpkg's status file).
    let mut h = DefaultHasher::new();
    (
        IMAGE_FORMAT,
        INIT,
        OPTIONAL_TOOLS,
        &kernel.release,
        &modules,
    )
        .hash(&mut h);
    for f in [
        "/var/lib/dpkg/status",
        "/bin/busybox",
        "/etc/protocols",
        "/etc/services",
    ] {
        if let Ok(m) = fs::metadata(f) {
            (f, m.len(), m.mtime(), m.mtime_nsec()).hash(&mut h);
        }
    }
    let fp = format!("{:016x}", h.finish());
    let path = cache.join(format!("base-{fp}.cpio"));
    let list_path = cache.join(format!("base-{fp}.list"));
    if path.exists() {
        if let Ok(text) = fs::read_to_string(&list_path) {
            let keys = text.lines().map(str::to_string).collect();
            return Ok(Base { path, keys });
        }
    }
    let started = std::time::Instant::now();
    let mut t = Tree::new();
    for d in [
        "dev",
        "proc",
        "sys",
        "run",
        "root",
        "etc",
        "mnt",
        "var",
        "usr/local/bin",
    ] {
        t.insert(d, Node::Dir(0o755));
    }
    t.insert("tmp", Node::Dir(0o1777));
    t.insert("var/run", Node::Symlink("/run".into()));
    t.insert("dev/console", Node::CharDev(5, 1));
    t.insert("dev/null", Node::CharDev(1, 3));
    t.add_host(Path::new("/bin/busybox"))?;
    t.add_host(Path::new("/usr/bin/dash"))?;
    t.insert("usr/bin/sh", Node::Symlink("dash".into()));
    for tool in [
        "ip",
        "ss",
        "ipvsadm",
        "ipset",
        "conntrack",
        "kmod",
        "modprobe",
        "depmod",
        "lsmod",
        "insmod",
        "rmmod",
        "iptables",
        "iptables-save",
        "iptables-restore",
        "ip6tables",
        "ip6tables-save",
        "ip6tables-restore",
        "iptables-legacy",
        "iptables-legacy-save",
        "iptables-legacy-restore",
        "ip6tables-legacy",
        "ip6tables-legacy-save",
        "ip6tables-legacy-restore",
        "iptables-nft",
        "iptables-nft-save",
        "iptables-nft-restore",
        "ip6tables-nft",
        "ip6tables-nft-save",
        "ip6tables-nft-restore",
        "xtables-legacy-multi",
        "xtables-nft-multi",
    ] {
        required(&mut t, tool)?;
    }
    for optional in OPTIONAL_TOOLS {
        if let Some(p) = host::which(optional) {
            t.add_host(&p)?;
        }
    }
    let xt = Path::new("/usr/lib/x86_64-linux-gnu/xtables");
    if xt.is_dir() {
        t.add_host(xt)?;
    }
    for f in [
        "/etc/protocols",
        "/etc/services",
        "/etc/ethertypes",
        "/etc/ld.so.cache",
        "/etc/iproute2",
    ] {
        if Path::new(f).exists() {
            t.add_host(Path::new(f))?;
        }
    }
    let data = |s: &str| Node::Data {
        bytes: s.as_bytes().to_vec(),
        mode: 0o644,
    };
    t.insert("etc/passwd", data("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"));
    t.insert("etc/group", data("root:x:0:\nnogroup:x:65534:\n"));
    t.insert("etc/hosts", data("127.0.0.1\tlocalhost\n::1\tlocalhost\n"));
    t.insert(
        "etc/nsswitch.conf",
        data("passwd: files\ngroup: files\nhosts: files\nservices: files\nprotocols: files\n"),
    );
    // busybox applets fill the gaps (nc, wget, httpd, timeout, sleep, ...); real tools win.
    let list = host::output(Command::new("/bin/busybox").arg("--list-full"))?;
    for applet in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if !t.contains(applet) {
            t.insert(applet, Node::Symlink("/bin/busybox".into()));
        }
    }
    t.add_dir_as(
        &modules.join("lib/modules").join(&kernel.release),
        &format!("lib/modules/{}", kernel.release),
    )?;
    t.insert(
        "init",
        Node::Data {
            bytes: INIT.as_bytes().to_vec(),
            mode: 0o755,
        },
    );

    let keys: HashSet<String> = t.keys().cloned().collect();
    {
        let tmp = cache.join(format!(".base-{fp}.{}", std::process::id()));
        let bytes = t.write_cpio(&tmp)?;
        let mut listing: Vec<&String> = keys.iter().collect();
        listing.sort();
        let text: String = listing.iter().map(|k| format!("{k}\n")).collect();
        let tmp_list = cache.join(format!(".base-{fp}.list.{}", std::process::id()));
        fs::write(&tmp_list, text).ctx(|| format!("writing {}", tmp_list.display()))?;
        fs::rename(&tmp_list, &list_path)
            .ctx(|| format!("renaming into {}", list_path.display()))?;
        fs::rename(&tmp, &path).ctx(|| format!("renaming into {}", path.display()))?;
        // Older base images are no longer reachable by any key; drop them (a concurrent run that
        // still reads one keeps its open file).
        for e in fs::read_dir(cache).into_iter().flatten().flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with("base-") && !n.starts_with(&format!("base-{fp}.")) {
                let _ = fs::remove_file(e.path());
            }
        }
        eprintln!(
            "xtask: built base image {} for {} ({} entries, {:.1} MB) in {:.1} s",
            path.display(),
            kernel.package,
            keys.len(),
            bytes as f64 / 1e6,
            started.elapsed().as_secs_f64()
        );
    }
    Ok(Base { path, keys })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_threads_strip_the_same_binary_at_once() {
        if host::which("objcopy").is_none() {
            eprintln!("no objcopy: nothing to strip");
            return;
        }
        // This test binary: an ELF file with debug sections, over the 1 MiB threshold.
        let src = std::env::current_exe().unwrap();
        let meta = fs::metadata(&src).unwrap();
        let dir = std::env::temp_dir().join(format!("xtask-strip-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let start = std::sync::Barrier::new(2);
        let got: Vec<PathBuf> = std::thread::scope(|s| {
            let a = s.spawn(|| {
                start.wait();
                stripped(&src, &meta, &dir)
            });
            let b = s.spawn(|| {
                start.wait();
                stripped(&src, &meta, &dir)
            });
            [a.join().unwrap(), b.join().unwrap()]
                .into_iter()
                .map(|r| r.unwrap())
                .collect()
        });
        assert_eq!(got[0], got[1]);
        assert_ne!(got[0], src, "a stripped copy, not the source");
        assert!(fs::metadata(&got[0]).unwrap().len() < meta.len());
        // Nothing left behind but the copy.
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn merged_usr_paths_are_canonical() {
        let t = Tree::new();
        if fs::read_link("/bin").is_ok() {
            assert_eq!(t.canon("/bin/ip"), "usr/bin/ip");
            assert_eq!(t.canon("bin"), "bin");
        }
        assert_eq!(t.canon("/work/x"), "work/x");
    }

    #[test]
    fn ldd_finds_libc_of_a_dynamic_binary() {
        let libs = ldd(Path::new("/usr/sbin/ipset"));
        assert!(
            libs.iter().any(|l| l.to_string_lossy().contains("libc.so")),
            "{libs:?}"
        );
        assert!(
            ldd(Path::new("/bin/busybox")).is_empty(),
            "busybox is static"
        );
    }

    #[test]
    fn add_host_keeps_symlink_chains() {
        let mut t = Tree::new();
        t.add_host(Path::new("/usr/sbin/iptables")).unwrap();
        let real = fs::canonicalize("/usr/sbin/iptables").unwrap();
        assert!(t.nodes.contains_key(&key_of(&real)));
        assert!(matches!(
            t.nodes.get("usr/sbin/iptables"),
            Some(Node::Symlink(_))
        ));
    }

    #[test]
    fn module_names() {
        assert_eq!(module_name("kernel/drivers/net/dummy.ko"), "dummy");
        assert_eq!(
            module_name("kernel/net/netfilter/ipvs/ip_vs_rr.ko.xz"),
            "ip_vs_rr"
        );
    }
}
