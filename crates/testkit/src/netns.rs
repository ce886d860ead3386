//! Network-namespace helpers: "pods" and test hosts joined by veth.
//!
//! Everything shells out to iproute2 (`ip netns add/exec/del`, `ip -n NS ...`), so a failing
//! step reports the real tool's error. Code that must open sockets inside a namespace runs on a
//! thread that has `setns(2)`-ed into it ([`Netns::spawn`], [`Netns::enter`]); sockets keep the
//! namespace they were created in.

use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

static SEQ: AtomicU32 = AtomicU32::new(0);

fn next_seq() -> u32 {
    SEQ.fetch_add(1, Ordering::Relaxed)
}

fn check(cmd: &mut Command) -> io::Result<String> {
    let out: Output = cmd.output().map_err(|e| {
        io::Error::new(e.kind(), format!("cannot run {:?}: {e}", cmd.get_program()))
    })?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "{:?} {:?} failed ({}): {}",
            cmd.get_program(),
            cmd.get_args().collect::<Vec<_>>(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Run `ip ARGS` in the current namespace.
pub fn ip(args: &[&str]) -> io::Result<String> {
    check(Command::new("ip").args(args))
}

/// A named network namespace (`ip netns add`), deleted when dropped.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Create `testkit-<tag>-<pid>-<seq>` with `lo` up.
    pub fn new(tag: &str) -> io::Result<Self> {
        let name = format!("testkit-{tag}-{}-{}", std::process::id(), next_seq());
        ip(&["netns", "add", &name])?;
        let ns = Netns { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The namespace name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `/run/netns/<name>`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// `ip -n NAME ARGS`.
    pub fn ip(&self, args: &[&str]) -> io::Result<String> {
        check(Command::new("ip").arg("-n").arg(&self.name).args(args))
    }

    /// A command that runs `program` inside the namespace (`ip netns exec NAME program`).
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec"]).arg(&self.name).arg(program);
        c
    }

    /// Run `argv` inside the namespace; error (with stderr) unless it exits 0; return stdout.
    pub fn run(&self, argv: &[&str]) -> io::Result<String> {
        let (prog, rest) = argv
            .split_first()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "empty argv"))?;
        check(self.command(prog).args(rest))
    }

    /// Run a shell script inside the namespace (`sh -c SCRIPT`); error (with stderr) unless it
    /// exits 0; return stdout.
    pub fn sh(&self, script: &str) -> io::Result<String> {
        self.run(&["sh", "-c", script])
    }

    /// Set a sysctl inside the namespace, e.g. `("net.ipv4.ip_forward", "1")`.
    pub fn sysctl(&self, key: &str, value: &str) -> io::Result<()> {
        self.run(&["sysctl", "-q", "-w", &format!("{key}={value}")])
            .map(|_| ())
    }

    /// Spawn a thread whose network namespace is this one, running `f`.
    pub fn spawn<F, T>(&self, f: F) -> io::Result<JoinHandle<io::Result<T>>>
    where
        F: FnOnce() -> io::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let file = std::fs::File::open(self.path())?;
        Ok(std::thread::spawn(move || {
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| io::Error::other(format!("setns: {e}")))?;
            f()
        }))
    }

    /// Run `f` inside the namespace (on a helper thread) and return its result.
    pub fn enter<F, T>(&self, f: F) -> io::Result<T>
    where
        F: FnOnce() -> io::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        self.spawn(f)?
            .join()
            .map_err(|_| io::Error::other("thread inside the namespace panicked"))?
    }

    /// `(rx_bytes, tx_bytes)` of an interface, from `ip -s -j link show`.
    pub fn link_stats(&self, ifname: &str) -> io::Result<(u64, u64)> {
        let out = self.ip(&["-s", "-j", "link", "show", "dev", ifname])?;
        let v: serde_json::Value = serde_json::from_str(&out)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        let s = &v[0]["stats64"];
        match (s["rx"]["bytes"].as_u64(), s["tx"]["bytes"].as_u64()) {
            (Some(rx), Some(tx)) => Ok((rx, tx)),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("no stats64 for {ifname}: {out}"),
            )),
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Create a veth pair with `a_if` in `a` and `b_if` in `b`, both up. Interface names are only
/// unique per namespace, so parallel tests do not collide.
pub fn veth_pair(a: &Netns, a_if: &str, b: &Netns, b_if: &str) -> io::Result<()> {
    a.ip(&[
        "link",
        "add",
        a_if,
        "type",
        "veth",
        "peer",
        "name",
        b_if,
        "netns",
        b.name(),
    ])?;
    a.ip(&["link", "set", a_if, "up"])?;
    b.ip(&["link", "set", b_if, "up"])?;
    Ok(())
}

/// A "pod": its own namespace with `eth0` (an IPv4 /32, default route via 169.254.1.1) whose
/// veth peer sits in a host namespace with proxy ARP and a `/32` route to the pod — the layout
/// the kube-ipvs data path is tested against.
///
/// Proxy ARP only answers when the host namespace has a route out of another interface for the
/// pod's gateway, so give the host namespace a default route (e.g. via [`Pod::uplink`] or a
/// dummy `node0` in the VM).
#[derive(Debug)]
pub struct Pod {
    /// The pod's namespace (dropped, and so deleted, with the pod).
    pub ns: Netns,
    /// The pod's address.
    pub ip: Ipv4Addr,
    /// Host-side interface name (in the host namespace).
    pub host_if: String,
    host_ns: Option<String>,
}

impl Pod {
    /// Create a pod with address `ip`, attached to `host` (None: the current namespace).
    pub fn new(host: Option<&Netns>, ip: Ipv4Addr) -> io::Result<Pod> {
        let ns = Netns::new("pod")?;
        let host_if = format!("tkp{}x{}", std::process::id() % 100_000, next_seq());
        // Made before the links, so a failing step still removes the host side on drop.
        let pod = Pod {
            ns,
            ip,
            host_if,
            host_ns: host.map(|h| h.name().to_string()),
        };
        attach_pod(host, &pod.ns, &pod.host_if, ip)?;
        Ok(pod)
    }

    /// Give `host` a default route through a veth "uplink" whose far end is a throw-away
    /// namespace, so proxy ARP answers there (hosts without a dummy link type).
    pub fn uplink(host: &Netns) -> io::Result<Netns> {
        let far = Netns::new("uplink")?;
        veth_pair(host, "uplink0", &far, "uplink1")?;
        host.ip(&["addr", "add", "192.168.255.1/30", "dev", "uplink0"])?;
        far.ip(&["addr", "add", "192.168.255.2/30", "dev", "uplink1"])?;
        host.ip(&["route", "add", "default", "via", "192.168.255.2"])?;
        Ok(far)
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        // Deleting the pod namespace removes eth0 and with it the host-side peer; be explicit in
        // case the namespace is still held open.
        let mut c = Command::new("ip");
        if let Some(h) = &self.host_ns {
            c.args(["-n", h]);
        }
        let _ = c.args(["link", "del", &self.host_if]).output();
    }
}

/// Wire the namespace `pod` up as a pod with address `ip` on `host` (None: the current
/// namespace), the way [`Pod::new`] does: a veth pair `host_if` (in `host`) / `eth0` (in `pod`),
/// proxy ARP and a `/32` route to `ip` on the host side, and in the pod `ip/32` on `eth0` with a
/// default route via 169.254.1.1.
pub fn attach_pod(
    host: Option<&Netns>,
    pod: &Netns,
    host_if: &str,
    ip: Ipv4Addr,
) -> io::Result<()> {
    let host_ip = |args: &[&str]| match host {
        Some(h) => h.ip(args),
        None => self::ip(args),
    };
    host_ip(&[
        "link",
        "add",
        host_if,
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        pod.name(),
    ])?;
    host_ip(&["link", "set", host_if, "up"])?;
    let sysctl = format!("net.ipv4.conf.{host_if}.proxy_arp=1");
    match host {
        Some(h) => h.run(&["sysctl", "-q", "-w", &sysctl])?,
        None => check(Command::new("sysctl").args(["-q", "-w", &sysctl]))?,
    };
    host_ip(&["route", "add", &format!("{ip}/32"), "dev", host_if])?;
    pod.ip(&["addr", "add", &format!("{ip}/32"), "dev", "eth0"])?;
    pod.ip(&["link", "set", "eth0", "up"])?;
    pod.ip(&[
        "route",
        "add",
        "169.254.1.1",
        "dev",
        "eth0",
        "scope",
        "link",
    ])?;
    pod.ip(&[
        "route",
        "add",
        "default",
        "via",
        "169.254.1.1",
        "dev",
        "eth0",
    ])?;
    Ok(())
}

/// A TCP echo server on a thread inside a namespace; stops when dropped.
#[derive(Debug)]
pub struct EchoServer {
    /// The bound address.
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<io::Result<()>>>,
}

impl EchoServer {
    /// Listen on `addr` (port 0 picks one) inside `ns` and echo every connection.
    pub fn start(ns: &Netns, addr: SocketAddr) -> io::Result<EchoServer> {
        let listener = ns.enter(move || {
            let l = TcpListener::bind(addr)?;
            l.set_nonblocking(true)?;
            Ok(l)
        })?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || -> io::Result<()> {
            while !flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        std::thread::spawn(move || echo(conn));
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        });
        Ok(EchoServer {
            addr,
            stop,
            thread: Some(thread),
        })
    }
}

fn echo(mut conn: TcpStream) -> io::Result<()> {
    conn.set_nonblocking(false)?;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            return conn.shutdown(std::net::Shutdown::Write);
        }
        conn.write_all(&buf[..n])?;
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Connect to `to` from inside `ns`, send `payload`, read the echo back and return it.
pub fn echo_roundtrip(ns: &Netns, to: SocketAddr, payload: Vec<u8>) -> io::Result<Vec<u8>> {
    ns.enter(move || {
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(10))?;
        let mut rd = s.try_clone()?;
        let reader = std::thread::spawn(move || -> io::Result<Vec<u8>> {
            let mut back = Vec::new();
            rd.read_to_end(&mut back)?;
            Ok(back)
        });
        s.write_all(&payload)?;
        s.shutdown(std::net::Shutdown::Write)?;
        reader
            .join()
            .map_err(|_| io::Error::other("reader panicked"))?
    })
}
