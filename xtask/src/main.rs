//! Project automation: `cargo xtask vm|test|e2e|bench|soak|dist|kube`.

mod bench;
mod conformance;
mod cpio;
mod deny;
mod dist;
mod error;
mod host;
mod image;
mod kernel;
mod kube;
mod soak;
mod test;
mod vm;

use error::{Error, Result};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

const USAGE: &str = "\
usage:
  cargo xtask vm [--mem M] [--cpus N] [--file SRC[:DEST]]... [--env K=V]... [--cwd DIR (default: current dir)]
                 [--timeout SECS] [--net-fwd HOSTPORT] -- CMD...
  cargo xtask test [--stage fmt|clippy|deny|unit|netns|kube|vm]... [-p PKG]... [--timeout SECS]
  cargo xtask e2e [--filter SUBSTRING] [-p PKG]... [--timeout SECS]
  cargo xtask bench ...
  cargo xtask soak [--minutes N (default 20)] [--seed S] [--mem M]   (not part of test/CI)
  cargo xtask dist [--gnu]
  cargo xtask kube [--check]   (build kube-apiserver, kube-proxy, kubectl, etcd into ~/.cache/kube-ipvs)
  cargo xtask conformance [--proxy P]... [--focus REGEX] [--skip REGEX] [--nodes 1|2] [--procs N] [--list] [--build-only] [--table]
                 (upstream's Service e2e tests on VM nodes; P: kube-ipvs, kube-ipvs-iptables, upstream-ipvs, upstream-nftables)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match dispatch(&args) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("xtask: error: {e}");
            ExitCode::from(2)
        }
    }
}

fn dispatch(args: &[String]) -> Result<u8> {
    let Some((cmd, rest)) = args.split_first() else {
        eprintln!("{USAGE}");
        return Ok(2);
    };
    match cmd.as_str() {
        "vm" => vm_cmd(rest),
        "test" => test::test_cmd(rest),
        "e2e" => test::e2e_cmd(rest),
        "bench" => bench::bench(rest),
        "soak" => soak::soak_cmd(rest),
        "dist" => dist::dist_cmd(rest),
        "kube" => kube::kube_cmd(rest),
        "conformance" => conformance::conformance_cmd(rest),
        "__fwd" => {
            let port = rest
                .first()
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| Error::Usage("__fwd PORT".into()))?;
            vm::forward(port)
        }
        "help" | "-h" | "--help" => {
            println!("{USAGE}");
            Ok(0)
        }
        other => Err(Error::Usage(format!(
            "unknown subcommand `{other}`\n{USAGE}"
        ))),
    }
}

/// Parse a memory size: `2048`, `2048M`, `2G` (MiB).
fn parse_mem(s: &str) -> Result<u32> {
    let bad = || Error::Usage(format!("bad --mem value `{s}` (e.g. 1024, 2G)"));
    let (num, mult) = match s.chars().last() {
        Some('G' | 'g') => (&s[..s.len() - 1], 1024),
        Some('M' | 'm') => (&s[..s.len() - 1], 1),
        _ => (s, 1),
    };
    num.parse::<u32>().map(|n| n * mult).map_err(|_| bad())
}

/// Take the value of option `name` from the iterator.
pub fn value<'a>(it: &mut impl Iterator<Item = &'a String>, name: &str) -> Result<&'a String> {
    it.next()
        .ok_or_else(|| Error::Usage(format!("{name} needs a value")))
}

/// Parse `--file SRC[:DEST]` into (source, absolute guest destination).
fn parse_file(spec: &str) -> Result<(PathBuf, String)> {
    let (src, dest) = match spec.split_once(':') {
        Some((s, d)) => (s, Some(d.to_string())),
        None => (spec, None),
    };
    let abs = std::path::absolute(src).map_err(|e| Error::Usage(format!("--file {src}: {e}")))?;
    if !abs.exists() {
        return Err(Error::Usage(format!("--file {src}: no such file")));
    }
    let dest = dest.unwrap_or_else(|| abs.to_string_lossy().into_owned());
    if !dest.starts_with('/') {
        return Err(Error::Usage(format!(
            "--file DEST must be absolute: {dest}"
        )));
    }
    Ok((abs, dest))
}

fn vm_cmd(args: &[String]) -> Result<u8> {
    let mut cfg = vm::VmConfig {
        mem_mb: 1024,
        cpus: 2,
        timeout: Duration::from_secs(20 * 60),
        files: Vec::new(),
        net_fwd: None,
        env: Vec::new(),
        cwd: None,
        script: String::new(),
        echo: true,
    };
    let mut it = args.iter();
    let mut argv: Vec<String> = Vec::new();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--" => {
                argv = it.by_ref().cloned().collect();
                break;
            }
            "--mem" => cfg.mem_mb = parse_mem(value(&mut it, a)?)?,
            "--cpus" => {
                cfg.cpus = value(&mut it, a)?
                    .parse()
                    .map_err(|_| Error::Usage("--cpus N".into()))?
            }
            "--timeout" => {
                let secs: u64 = value(&mut it, a)?
                    .parse()
                    .map_err(|_| Error::Usage("--timeout SECS".into()))?;
                cfg.timeout = Duration::from_secs(secs);
            }
            "--file" => cfg.files.push(parse_file(value(&mut it, a)?)?),
            "--env" => {
                let kv = value(&mut it, a)?;
                let (k, v) = kv
                    .split_once('=')
                    .ok_or_else(|| Error::Usage("--env K=V".into()))?;
                cfg.env.push((k.to_string(), v.to_string()));
            }
            "--cwd" => cfg.cwd = Some(value(&mut it, a)?.clone()),
            "--net-fwd" => {
                cfg.net_fwd = Some(
                    value(&mut it, a)?
                        .parse()
                        .map_err(|_| Error::Usage("--net-fwd PORT".into()))?,
                )
            }
            other => {
                return Err(Error::Usage(format!(
                    "unknown vm option `{other}`\n{USAGE}"
                )))
            }
        }
    }
    if argv.is_empty() {
        return Err(Error::Usage(format!(
            "vm needs a command after `--`\n{USAGE}"
        )));
    }
    for k in ["RUST_BACKTRACE", "RUST_LOG"] {
        if let Ok(v) = std::env::var(k) {
            cfg.env.push((k.to_string(), v));
        }
    }
    if cfg.cwd.is_none() {
        cfg.cwd = std::env::current_dir()
            .ok()
            .map(|d| d.to_string_lossy().into_owned());
    }
    cfg.script = vm::argv_script(&argv);
    let out = vm::run(&cfg)?;
    eprintln!(
        "xtask vm: exit {} (initrd {:.0} MB, prepare {:.1} s, boot {:.1} s, total {:.1} s)",
        out.code,
        out.initrd_bytes as f64 / 1e6,
        out.prepare.as_secs_f64(),
        out.boot.as_secs_f64(),
        out.total.as_secs_f64()
    );
    Ok(u8::try_from(out.code.clamp(0, 255)).unwrap_or(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_sizes() {
        assert_eq!(parse_mem("2G").unwrap(), 2048);
        assert_eq!(parse_mem("512M").unwrap(), 512);
        assert_eq!(parse_mem("300").unwrap(), 300);
        assert!(parse_mem("lots").is_err());
    }

    #[test]
    fn file_spec_defaults_to_absolute_source() {
        let (src, dest) = parse_file("Cargo.toml").unwrap();
        assert!(src.is_absolute());
        assert_eq!(dest, src.to_string_lossy());
        let (_, dest) = parse_file("Cargo.toml:/etc/x.toml").unwrap();
        assert_eq!(dest, "/etc/x.toml");
        assert!(parse_file("Cargo.toml:rel").is_err());
        assert!(parse_file("/does/not/exist").is_err());
    }
}
