//! Benchmark driver: ipvs-restore vs `ipvsadm --restore`, ipvs-save vs `ipvsadm -Sn`.
//!
//! Usage:
//!   ipvs-bench gen SERVICES REALS     print a kube-proxy-like table in `ipvsadm -S` format
//!   ipvs-bench run SERVICES REALS     (needs IPVS, root, `ipvsadm` in PATH) time both tools
//!                                     from an empty table and print the ratios
//!
//! `run` uses the `ipvs-restore` and `ipvs-save` binaries next to this one, runs each restore
//! in its own fresh network namespace (needs `ip`), and checks that both restores produce the
//! same `ipvsadm -Sn` output and that both saves agree.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

fn table(services: u32, reals: u32) -> String {
    let mut out = String::with_capacity((services * (reals + 1) * 56) as usize);
    for i in 0..services {
        let vip = format!("10.{}.{}.{}:80", 96 + i / 65536, (i / 256) % 256, i % 256);
        out.push_str(&format!("-A -t {vip} -s rr\n"));
        for j in 0..reals {
            let n = i * reals + j;
            out.push_str(&format!(
                "-a -t {vip} -r 10.{}.{}.{}:8080 -m -w 1\n",
                244 + n / 65536 % 8,
                (n / 256) % 256,
                n % 256
            ));
        }
    }
    out
}

/// A benchmark failure: the message is printed and the driver exits non-zero.
type BenchError = Box<dyn std::error::Error + Send + Sync>;

struct Run {
    elapsed: Duration,
    stdout: Vec<u8>,
}

fn timed(cmd: &mut Command, stdin: Option<&str>) -> Result<Run, BenchError> {
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{cmd:?}: {e}"))?;
    let mut input = child.stdin.take().ok_or("no stdin")?;
    let data = stdin.unwrap_or("").to_owned();
    // Feed stdin from a thread: the child may fill its stdout/stderr pipes before it has read
    // all its input.
    let feeder = std::thread::spawn(move || input.write_all(data.as_bytes()));
    let out = child
        .wait_with_output()
        .map_err(|e| format!("{cmd:?}: {e}"))?;
    let _ = feeder.join();
    let elapsed = start.elapsed();
    if !out.status.success() {
        return Err(format!(
            "{cmd:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(Run {
        elapsed,
        stdout: out.stdout,
    })
}

fn sibling(name: &str) -> Result<PathBuf, BenchError> {
    let exe = std::env::current_exe()?;
    let p = exe.with_file_name(name);
    if p.exists() {
        Ok(p)
    } else {
        Err(format!("{} is missing (build the examples)", p.display()).into())
    }
}

/// A command run inside network namespace `ns` (each namespace has its own IPVS table and
/// its own destination trash list).
fn in_ns(ns: &str, prog: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns]).arg(prog);
    c
}

struct Netns(&'static str);
impl Netns {
    fn new(name: &'static str) -> Result<Netns, BenchError> {
        let _ = Command::new("ip").args(["netns", "del", name]).status();
        timed(Command::new("ip").args(["netns", "add", name]), None)?;
        let ns = Netns(name);
        // IPv4 real servers are only accepted once the namespace has a local routing table.
        timed(
            Command::new("ip").args(["-n", name, "link", "set", "lo", "up"]),
            None,
        )?;
        Ok(ns)
    }
}
impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", self.0]).status();
    }
}

fn run(services: u32, reals: u32) -> Result<(), BenchError> {
    let text = table(services, reals);
    let restore = sibling("ipvs-restore")?;
    let save = sibling("ipvs-save")?;
    // Each tool starts from an empty table in a fresh namespace: the kernel keeps deleted real
    // servers in a per-namespace trash list for ~2 minutes and scans it linearly on every
    // add, so restoring right after a flush in the same namespace would be quadratic.
    let a = Netns::new("ipvsbench-a")?;
    let a_restore = timed(in_ns(a.0, "ipvsadm").arg("--restore"), Some(&text))?;
    let a_save = timed(in_ns(a.0, "ipvsadm").arg("-Sn"), None)?;
    let o_save = timed(&mut in_ns(a.0, &save), None)?;
    if a_save.stdout != o_save.stdout {
        return Err("ipvs-save output differs from ipvsadm -Sn".into());
    }
    // Flush so that this table's rate estimators stop loading the CPU during the next run.
    timed(in_ns(a.0, "ipvsadm").arg("-C"), None)?;
    let b = Netns::new("ipvsbench-b")?;
    let o_restore = timed(&mut in_ns(b.0, &restore), Some(&text))?;
    let after = timed(in_ns(b.0, "ipvsadm").arg("-Sn"), None)?;
    if after.stdout != a_save.stdout {
        return Err("ipvsadm -Sn after ipvs-restore differs from after ipvsadm --restore".into());
    }
    let lines = a_save.stdout.iter().filter(|&&b| b == b'\n').count();
    if lines != (services * (reals + 1)) as usize {
        return Err(format!("expected {} lines, got {lines}", services * (reals + 1)).into());
    }
    timed(in_ns(b.0, "ipvsadm").arg("-C"), None)?;
    let s = |d: Duration| d.as_secs_f64();
    println!("table: {services} services x {reals} reals ({lines} lines)");
    println!(
        "restore: ipvsadm --restore {:.3} s, ipvs-restore {:.3} s, ratio {:.3}",
        s(a_restore.elapsed),
        s(o_restore.elapsed),
        s(o_restore.elapsed) / s(a_restore.elapsed)
    );
    println!(
        "save:    ipvsadm -Sn {:.3} s, ipvs-save {:.3} s, ratio {:.3}",
        s(a_save.elapsed),
        s(o_save.elapsed),
        s(o_save.elapsed) / s(a_save.elapsed)
    );
    println!(
        "{{\"services\":{services},\"reals\":{reals},\"ipvsadm_restore_s\":{:.3},\"ipvs_restore_s\":{:.3},\"ipvsadm_save_s\":{:.3},\"ipvs_save_s\":{:.3}}}",
        s(a_restore.elapsed),
        s(o_restore.elapsed),
        s(a_save.elapsed),
        s(o_save.elapsed)
    );
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, d: u32| -> Option<u32> {
        match args.get(i) {
            Some(s) => s.parse().ok(),
            None => Some(d),
        }
    };
    let (Some(services), Some(reals)) = (num(1, 10_000), num(2, 10)) else {
        eprintln!("ipvs-bench: SERVICES and REALS must be numbers");
        return ExitCode::from(2);
    };
    match args.first().map(String::as_str) {
        Some("gen") => {
            let mut out = std::io::stdout().lock();
            if out.write_all(table(services, reals).as_bytes()).is_err() {
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Some("run") => match run(services, reals) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ipvs-bench: {e}");
                ExitCode::FAILURE
            }
        },
        _ => {
            eprintln!("usage: ipvs-bench gen|run [SERVICES [REALS]]");
            ExitCode::from(2)
        }
    }
}
