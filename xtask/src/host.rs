//! Host helpers: running commands, root detection, installing apt packages on first use.

use crate::error::{Context, Error, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Host packages the VM runner and the test stages need, with a file that proves each is present.
pub const HOST_PACKAGES: &[(&str, &str)] = &[
    ("qemu-system-x86", "/usr/bin/qemu-system-x86_64"),
    ("busybox-static", "/bin/busybox"),
    ("ipvsadm", "/usr/sbin/ipvsadm"),
    ("ipset", "/usr/sbin/ipset"),
    ("iptables", "/usr/sbin/xtables-legacy-multi"),
    ("kmod", "/usr/bin/kmod"),
    ("conntrack", "/usr/sbin/conntrack"),
    ("iproute2", "/usr/bin/ss"),
    ("cpio", "/usr/bin/cpio"),
    ("dash", "/usr/bin/dash"),
    ("binutils", "/usr/bin/objcopy"),
    // `nft` in the guest (image.rs OPTIONAL_TOOLS): upstream kube-proxy's nftables mode runs
    // it, and `cargo xtask bench peers` counts that mode's rules with it.
    ("nftables", "/usr/sbin/nft"),
    // `strace` in the guest (image.rs OPTIONAL_TOOLS): the soak's netlink-failure fault injects
    // errors into the running release binary's `sendto` calls.
    ("strace", "/usr/bin/strace"),
];

/// A `cargo` command for a nested build: the `cargo` running xtask, without the variables
/// cargo set for running xtask itself (`CARGO_MANIFEST_DIR`, `CARGO_PKG_NAME`, ...). Build
/// scripts such as ring's say `rerun-if-env-changed` for them, so a build run from xtask and
/// one run from a shell would otherwise each invalidate the other's: ring, rustls, kube and the
/// fat-LTO kube-ipvs rebuilt every time (28 minutes for a release build on a loaded 2-core
/// host).
pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    for (k, _) in std::env::vars_os() {
        let Some(k) = k.to_str() else { continue };
        if is_cargo_run_var(k) {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// Whether `cargo run` sets `name` for the program it runs (and a shell has none of it).
fn is_cargo_run_var(name: &str) -> bool {
    name.starts_with("CARGO_PKG_")
        || matches!(
            name,
            "CARGO_MANIFEST_DIR"
                | "CARGO_MANIFEST_PATH"
                | "CARGO_MANIFEST_LINKS"
                | "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_PRIMARY_PACKAGE"
        )
}

/// Whether the effective uid is 0 (read from /proc, no libc needed).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

/// Render a command for messages.
pub fn show(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Run `cmd`, fail with its stderr tail unless it exits 0, return its stdout.
pub fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().map_err(|e| Error::Command {
        cmd: show(cmd),
        detail: format!("cannot start: {e}"),
    })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(15).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return Err(Error::Command {
            cmd: show(cmd),
            detail: format!("{}\n{}", out.status, tail.join("\n")),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Run `cmd` with inherited stdio; fail unless it exits 0.
pub fn status(cmd: &mut Command) -> Result<()> {
    let st = cmd.status().map_err(|e| Error::Command {
        cmd: show(cmd),
        detail: format!("cannot start: {e}"),
    })?;
    if st.success() {
        Ok(())
    } else {
        Err(Error::Command {
            cmd: show(cmd),
            detail: st.to_string(),
        })
    }
}

/// Find an executable in PATH (plus the sbin directories, which a non-root PATH may lack).
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
        .map(|d| Path::new(d).join(name))
        .find(|p| is_executable(p));
    found
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// apt access with "update at most once per run".
#[derive(Default)]
pub struct Apt {
    updated: bool,
}

impl Apt {
    /// `apt-get update`, at most once per xtask run.
    pub fn update(&mut self) -> Result<()> {
        if self.updated {
            return Ok(());
        }
        require_apt()?;
        if !is_root() {
            return Err(Error::NotRoot(
                "apt-get update is needed (run `cargo xtask` as root once)".into(),
            ));
        }
        eprintln!("xtask: apt-get update");
        status(
            Command::new("apt-get")
                .args(["update", "-qq"])
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )
        .map_err(|e| Error::Apt(format!("apt-get update failed: {e}")))?;
        self.updated = true;
        Ok(())
    }

    /// Install the packages in [`HOST_PACKAGES`] that are missing.
    pub fn ensure_host_packages(&mut self) -> Result<()> {
        let missing: Vec<&str> = HOST_PACKAGES
            .iter()
            .filter(|(_, probe)| !Path::new(probe).exists())
            .map(|(pkg, _)| *pkg)
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        self.install(&missing)
    }

    /// `apt-get install -y PKGS` (updating the lists once first).
    pub fn install(&mut self, pkgs: &[&str]) -> Result<()> {
        require_apt()?;
        if !is_root() {
            return Err(Error::NotRoot(format!(
                "missing host packages: {} (run as root, or `apt-get install {}`)",
                pkgs.join(" "),
                pkgs.join(" ")
            )));
        }
        self.update()?;
        eprintln!("xtask: apt-get install {}", pkgs.join(" "));
        status(
            Command::new("apt-get")
                .args(["install", "-y", "-qq", "--no-install-recommends"])
                .args(pkgs)
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )
        .map_err(|e| Error::Apt(format!("installing {}: {e}", pkgs.join(" "))))
    }
}

fn require_apt() -> Result<()> {
    for tool in ["apt-get", "apt-cache", "dpkg-deb"] {
        if which(tool).is_none() {
            return Err(Error::Apt(format!(
                "`{tool}` not found: the VM runner needs a Debian/Ubuntu host with apt"
            )));
        }
    }
    Ok(())
}

/// Workspace root (the parent of the xtask crate).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// Cargo's target directory (honours CARGO_TARGET_DIR).
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) => {
            let d = PathBuf::from(d);
            if d.is_absolute() {
                d
            } else {
                workspace_root().join(d)
            }
        }
        None => workspace_root().join("target"),
    }
}

/// `target/xtask-cache/`, created on demand.
pub fn cache_dir() -> Result<PathBuf> {
    let d = target_dir().join("xtask-cache");
    std::fs::create_dir_all(&d).ctx(|| format!("creating {}", d.display()))?;
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_cargo_drops_what_cargo_run_set_and_keeps_the_users_settings() {
        assert!(is_cargo_run_var("CARGO_MANIFEST_DIR"));
        assert!(is_cargo_run_var("CARGO_PKG_VERSION_MAJOR"));
        for kept in [
            "CARGO_HOME",
            "CARGO_TARGET_DIR",
            "CARGO_INCREMENTAL",
            "CARGO",
        ] {
            assert!(!is_cargo_run_var(kept), "{kept}");
        }
        // `cargo test` sets CARGO_MANIFEST_DIR for this process, as `cargo xtask` does.
        assert!(std::env::var_os("CARGO_MANIFEST_DIR").is_some());
        let cmd = cargo();
        let removed: Vec<_> = cmd
            .get_envs()
            .filter(|(_, v)| v.is_none())
            .map(|(k, _)| k.to_string_lossy().into_owned())
            .collect();
        assert!(
            removed.iter().any(|k| k == "CARGO_MANIFEST_DIR"),
            "{removed:?}"
        );
        assert!(removed.iter().any(|k| k == "CARGO_PKG_NAME"), "{removed:?}");
        assert!(removed.iter().all(|k| is_cargo_run_var(k)), "{removed:?}");
    }

    #[test]
    fn failing_command_reports_stderr() {
        let err = output(Command::new("sh").args(["-c", "echo boom >&2; exit 3"])).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("boom"), "{msg}");
        assert!(msg.contains('3'), "{msg}");
    }

    #[test]
    fn root_detection_matches_id() {
        let id = output(Command::new("id").arg("-u")).unwrap();
        assert_eq!(is_root(), id.trim() == "0");
    }
}
