//! `cargo xtask vm`: boot a throw-away QEMU VM with an IPVS-capable kernel, run a command, stream
//! its output and return its exit code.

use crate::error::{Context, Error, Result};
use crate::host::{self, Apt};
use crate::image::{self, Node, Tree, GUEST_PATH};
use crate::kernel;
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What to run and how big the VM is.
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// Guest memory in MiB.
    pub mem_mb: u32,
    /// Guest CPUs.
    pub cpus: u32,
    /// Kill QEMU after this long.
    pub timeout: Duration,
    /// Host files to copy in: (source, guest destination).
    pub files: Vec<(PathBuf, String)>,
    /// Let the guest reach this host loopback TCP port at 10.0.2.100:PORT.
    pub net_fwd: Option<u16>,
    /// Environment for the command.
    pub env: Vec<(String, String)>,
    /// Working directory in the guest (created if missing).
    pub cwd: Option<String>,
    /// The dash script body to run as the command.
    pub script: String,
    /// Echo the guest's stdout/stderr live.
    pub echo: bool,
}

/// Settings beyond [`VmConfig`] for long-running guests (the conformance node, [`run_with`]).
#[derive(Debug, Default, Clone)]
pub struct Extra {
    /// Run QEMU inside this network namespace (`ip netns exec`).
    pub netns: Option<String>,
    /// More QEMU arguments (e.g. a tap network device).
    pub qemu_args: Vec<String>,
    /// Keep the run's files (console, stdout, stderr) here, live, instead of a throw-away
    /// directory.
    pub run_dir: Option<PathBuf>,
    /// Kill QEMU once this is set (the outcome's code is then -1).
    pub stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

/// How a VM run ended.
#[derive(Debug)]
pub struct VmOutcome {
    /// The command's exit status.
    pub code: i32,
    /// Everything the command wrote to stdout.
    pub stdout: Vec<u8>,
    /// From QEMU start until the guest was ready to run the command.
    pub boot: Duration,
    /// From QEMU start until QEMU exited.
    pub total: Duration,
    /// Time spent preparing (packages, kernel, base image, overlay).
    pub prepare: Duration,
    /// Size of the initrd (base + overlay) in bytes.
    pub initrd_bytes: u64,
}

/// Quote one word for a POSIX shell.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b))
    {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// A dash script that runs `argv` (exec'd, so its exit code is the script's).
pub fn argv_script(argv: &[String]) -> String {
    let words: Vec<String> = argv.iter().map(|a| shell_quote(a)).collect();
    format!("exec {}\n", words.join(" "))
}

fn has_hw_virt() -> bool {
    let flags = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let hw = flags
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
    hw && Path::new("/dev/kvm").exists()
}

struct RunDir(PathBuf);
impl Drop for RunDir {
    fn drop(&mut self) {
        if std::env::var_os("XTASK_KEEP_RUN").is_none() {
            let _ = fs::remove_dir_all(&self.0);
        }
    }
}

/// Remove run directories left by xtask processes that no longer exist (e.g. killed by Ctrl-C).
fn remove_stale_runs(runs: &Path) {
    let Ok(entries) = fs::read_dir(runs) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let pid = name.split('-').next().unwrap_or_default();
        if !pid.is_empty() && !Path::new("/proc").join(pid).exists() {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

fn tail_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Prepare everything and boot the VM.
pub fn run(cfg: &VmConfig) -> Result<VmOutcome> {
    run_with(cfg, &Extra::default())
}

/// What every VM shares, made ready once: the host packages, the guest kernel and the base
/// image (all cached). [`run_with`] does this itself; a caller starting several VMs at once
/// calls it first, so their threads do not install packages or build the same cached image
/// concurrently (two nodes racing for apt's lock or the base image's file failed one of them).
pub fn prepare() -> Result<()> {
    shared().map(|_| ())
}

/// [`prepare`]'s parts: the cache directory, the guest kernel and the base image.
fn shared() -> Result<(PathBuf, kernel::Kernel, image::Base)> {
    let mut apt = Apt::default();
    apt.ensure_host_packages()?;
    let cache = host::cache_dir()?;
    let kernel = kernel::ensure(&cache, &mut apt)?;
    let base = image::ensure_base(&kernel, &cache)?;
    Ok((cache, kernel, base))
}

/// [`run`] with the [`Extra`] settings.
pub fn run_with(cfg: &VmConfig, extra: &Extra) -> Result<VmOutcome> {
    let prep_start = Instant::now();
    let (cache, kernel, base) = shared()?;

    let runs = cache.join("runs");
    remove_stale_runs(&runs);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let dir = match &extra.run_dir {
        Some(d) => RunDir(d.clone()),
        None => RunDir(runs.join(format!("{}-{nanos}", std::process::id()))),
    };
    fs::create_dir_all(&dir.0).ctx(|| format!("creating {}", dir.0.display()))?;

    let mut tree = Tree::overlay(base.keys.clone());
    let strip = cache.join("stripped");
    image::prune_stripped(&strip, Duration::from_secs(6 * 3600));
    for (src, dest) in &cfg.files {
        tree.add_file_as(src, dest, Some(&strip))?;
    }
    let mut script = String::from("# generated by cargo xtask vm\n");
    script.push_str(&format!("export PATH={GUEST_PATH}\nexport HOME=/root\n"));
    for (k, v) in &cfg.env {
        script.push_str(&format!("export {k}={}\n", shell_quote(v)));
    }
    if let Some(cwd) = &cfg.cwd {
        tree.insert(cwd.trim_end_matches('/'), Node::Dir(0o755));
        script.push_str(&format!("cd {} || exit 125\n", shell_quote(cwd)));
    } else {
        script.push_str("cd /root\n");
    }
    script.push_str(&cfg.script);
    tree.insert("root", Node::Dir(0o700));
    tree.insert(
        "xtask/cmd",
        Node::Data {
            bytes: script.into_bytes(),
            mode: 0o755,
        },
    );
    if cfg.net_fwd.is_some() {
        tree.insert(
            "xtask/net",
            Node::Data {
                bytes: Vec::new(),
                mode: 0o644,
            },
        );
    }
    let overlay = dir.0.join("overlay.cpio");
    tree.write_cpio(&overlay)?;
    let initrd = dir.0.join("initrd");
    {
        let mut out = fs::File::create(&initrd).ctx(|| "creating initrd")?;
        for part in [&base.path, &overlay] {
            let mut f = fs::File::open(part).ctx(|| format!("opening {}", part.display()))?;
            std::io::copy(&mut f, &mut out).ctx(|| "writing initrd")?;
        }
    }
    let _ = fs::remove_file(&overlay);
    let prepare = prep_start.elapsed();
    let mut out = boot(cfg, extra, &kernel.vmlinuz, &initrd, &dir.0, prepare);
    if let Ok(o) = out.as_mut() {
        o.initrd_bytes = fs::metadata(&initrd).map(|m| m.len()).unwrap_or(0);
    }
    if extra.run_dir.is_some() {
        // The initrd is big and rebuilt every run; the logs stay.
        let _ = fs::remove_file(&initrd);
        std::mem::forget(dir);
    }
    out
}

fn boot(
    cfg: &VmConfig,
    extra: &Extra,
    vmlinuz: &Path,
    initrd: &Path,
    dir: &Path,
    prepare: Duration,
) -> Result<VmOutcome> {
    let qemu = host::which("qemu-system-x86_64")
        .ok_or_else(|| Error::Qemu("qemu-system-x86_64 not found".into()))?;
    let names = ["console", "stdout", "stderr", "status"];
    for n in names {
        fs::File::create(dir.join(n)).ctx(|| format!("creating {n}"))?;
    }
    let qlog = fs::File::create(dir.join("qemu.log")).ctx(|| "creating qemu.log")?;
    let qlog2 = qlog.try_clone().ctx(|| "cloning qemu.log")?;
    let mut cmd = match &extra.netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(qemu);
            c
        }
        None => Command::new(qemu),
    };
    cmd.args([
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
    ]);
    if has_hw_virt() {
        cmd.args(["-accel", "kvm", "-cpu", "host"]);
    } else {
        cmd.args(["-accel", "tcg,thread=multi", "-cpu", "max"]);
    }
    cmd.arg("-m").arg(cfg.mem_mb.to_string());
    cmd.arg("-smp").arg(cfg.cpus.to_string());
    cmd.arg("-kernel").arg(vmlinuz).arg("-initrd").arg(initrd);
    // no_timer_check: under TCG on a loaded host the guest's IO-APIC timer check can miss its
    // window and panic at boot ("IO-APIC + timer doesn't work"); the check proves nothing for
    // an emulated PIT, and virtualised guests routinely skip it.
    cmd.args([
        "-append",
        "console=ttyS0 quiet panic=-1 oops=panic rdinit=/init 8250.nr_uarts=4 no_timer_check",
    ]);
    for (i, n) in names.iter().enumerate() {
        cmd.arg("-chardev")
            .arg(format!("file,id=s{i},path={}", dir.join(n).display()));
        cmd.arg("-device").arg(format!("isa-serial,chardev=s{i}"));
    }
    if let Some(port) = cfg.net_fwd {
        let me = std::env::current_exe().ctx(|| "locating xtask binary")?;
        cmd.arg("-netdev").arg(format!(
            "user,id=n0,restrict=on,guestfwd=tcp:10.0.2.100:{port}-cmd:{} __fwd {port}",
            me.display()
        ));
        cmd.args(["-device", "virtio-net-pci,netdev=n0"]);
    }
    cmd.args(&extra.qemu_args);
    cmd.stdin(Stdio::null()).stdout(qlog).stderr(qlog2);
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .map_err(|e| Error::Qemu(format!("cannot start: {e}")))?;

    let open = |n: &str| fs::File::open(dir.join(n)).ctx(|| format!("opening {n}"));
    let (mut out_f, mut err_f, mut st_f) = (open("stdout")?, open("stderr")?, open("status")?);
    let mut stdout = Vec::new();
    let mut status = String::new();
    let mut boot_time = None;
    let mut rc_seen_at: Option<Instant> = None;
    let mut buf = Vec::new();
    let mut pump =
        |f: &mut fs::File, to_stdout: bool, capture: Option<&mut Vec<u8>>| -> Result<()> {
            buf.clear();
            f.read_to_end(&mut buf).ctx(|| "reading guest output")?;
            if !buf.is_empty() {
                if cfg.echo {
                    if to_stdout {
                        let mut o = std::io::stdout().lock();
                        let _ = o.write_all(&buf);
                        let _ = o.flush();
                    } else {
                        let _ = std::io::stderr().write_all(&buf);
                    }
                }
                if let Some(c) = capture {
                    c.extend_from_slice(&buf);
                }
            }
            Ok(())
        };
    let exit = loop {
        let exited = child.try_wait().ctx(|| "waiting for qemu")?;
        pump(&mut out_f, true, Some(&mut stdout))?;
        pump(&mut err_f, false, None)?;
        let mut s = String::new();
        st_f.read_to_string(&mut s).ctx(|| "reading status")?;
        status.push_str(&s);
        if boot_time.is_none() && status.contains("ready") {
            boot_time = Some(start.elapsed());
        }
        if rc_seen_at.is_none() && status.contains("rc=") {
            rc_seen_at = Some(Instant::now());
        }
        if let Some(st) = exited {
            break st;
        }
        if extra
            .stop
            .as_ref()
            .is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed))
        {
            let _ = child.kill();
            let _ = child.wait();
            pump(&mut out_f, true, Some(&mut stdout))?;
            return Ok(VmOutcome {
                code: -1,
                stdout,
                boot: boot_time.unwrap_or_default(),
                total: start.elapsed(),
                prepare,
                initrd_bytes: 0,
            });
        }
        let stuck_after_rc = rc_seen_at.is_some_and(|t| t.elapsed() > Duration::from_secs(20));
        if start.elapsed() > cfg.timeout || stuck_after_rc {
            let _ = child.kill();
            let _ = child.wait();
            pump(&mut out_f, true, Some(&mut stdout))?;
            pump(&mut err_f, false, None)?;
            if stuck_after_rc {
                eprintln!("xtask: guest did not power off after the command finished; killed QEMU");
                break std::process::ExitStatus::default();
            }
            let console = fs::read_to_string(dir.join("console")).unwrap_or_default();
            let phase = match boot_time {
                Some(b) => format!(
                    "the command was still running (guest ready after {:.1} s)",
                    b.as_secs_f64()
                ),
                None => "the guest never got to run the command".to_string(),
            };
            return Err(Error::Timeout(format!(
                "VM did not finish within {} s, killed QEMU: {phase}; last console lines:\n{}",
                cfg.timeout.as_secs(),
                tail_lines(&console, 40)
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let total = start.elapsed();
    let mut s = String::new();
    st_f.read_to_string(&mut s).ctx(|| "reading status")?;
    status.push_str(&s);
    let code = status
        .lines()
        .filter_map(|l| l.trim().strip_prefix("rc="))
        .filter_map(|v| v.trim().parse::<i32>().ok())
        .next_back();
    match code {
        Some(code) => Ok(VmOutcome {
            code,
            stdout,
            boot: boot_time.unwrap_or(total),
            total,
            prepare,
            initrd_bytes: 0,
        }),
        None => {
            let console = fs::read_to_string(dir.join("console")).unwrap_or_default();
            let tail = tail_lines(&console, 40);
            if console.contains("Kernel panic") {
                return Err(Error::GuestPanic(tail));
            }
            let qlog = fs::read_to_string(dir.join("qemu.log")).unwrap_or_default();
            Err(Error::Qemu(format!(
                "QEMU exited ({exit}) before the command finished.\nqemu output:\n{}\nlast console lines:\n{tail}",
                tail_lines(&qlog, 20)
            )))
        }
    }
}

/// `xtask __fwd PORT`: connect stdin/stdout to 127.0.0.1:PORT (QEMU guestfwd helper).
pub fn forward(port: u16) -> Result<u8> {
    let sock = std::net::TcpStream::connect(("127.0.0.1", port))
        .ctx(|| format!("connecting to 127.0.0.1:{port}"))?;
    let mut rd = sock.try_clone().ctx(|| "cloning socket")?;
    let mut wr = sock;
    let up = std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut wr);
        let _ = wr.shutdown(std::net::Shutdown::Write);
    });
    // Unbuffered: `Stdout` is line-buffered, which holds back binary data with no newline in
    // it (a TLS handshake stalled behind it; plain HTTP got through line by line).
    use std::os::fd::AsFd;
    let out = std::io::stdout()
        .as_fd()
        .try_clone_to_owned()
        .ctx(|| "duplicating stdout")?;
    let _ = std::io::copy(&mut rd, &mut std::fs::File::from(out));
    let _ = up.join();
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The quoting must survive a real shell round trip.
    #[test]
    fn quoted_argv_round_trips_through_dash() {
        let argv: Vec<String> = ["printf", "%s|", "a b", "it's", "$HOME", "", "x\"y", "*"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let out = Command::new("dash")
            .arg("-c")
            .arg(argv_script(&argv))
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "a b|it's|$HOME||x\"y|*|"
        );
    }

    #[test]
    fn console_tail() {
        assert_eq!(tail_lines("a\nb\nc\n", 2), "b\nc");
        assert_eq!(tail_lines("a", 5), "a");
    }
}
