//! `cargo xtask dist`: a release build of the `kube-ipvs` binary in `target/dist/kube-ipvs`.
//!
//! Static musl (`x86_64-unknown-linux-musl`) when that Rust target is installed; otherwise the
//! host's gnu target (dynamically linked against glibc), with a note saying so. No toolchain is
//! downloaded.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{Error, Result};
use crate::host::workspace_root;

/// The static target used when installed.
pub const MUSL: &str = "x86_64-unknown-linux-musl";

/// Whether `target` appears in `rustup target list --installed` output.
pub fn installed(list: &str, target: &str) -> bool {
    list.lines().any(|l| l.trim() == target)
}

fn installed_targets() -> String {
    Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// Where cargo puts the release binary for `target` (`None`: the host target).
pub fn built_path(target_dir: &Path, target: Option<&str>) -> PathBuf {
    match target {
        Some(t) => target_dir.join(t).join("release/kube-ipvs"),
        None => target_dir.join("release/kube-ipvs"),
    }
}

/// `cargo xtask dist [--gnu]`.
pub fn dist_cmd(args: &[String]) -> Result<u8> {
    let mut force_gnu = false;
    for a in args {
        match a.as_str() {
            "--gnu" => force_gnu = true,
            other => {
                return Err(Error::Usage(format!(
                    "unknown dist option `{other}` (usage: cargo xtask dist [--gnu])"
                )))
            }
        }
    }
    let root = workspace_root();
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let target = if !force_gnu && installed(&installed_targets(), MUSL) {
        Some(MUSL)
    } else {
        if !force_gnu {
            eprintln!(
                "xtask dist: the {MUSL} target is not installed (`rustup target add {MUSL}`); \
                 building for the host's gnu target instead (dynamically linked against glibc)"
            );
        }
        None
    };
    let mut cmd = crate::host::cargo();
    cmd.current_dir(&root).args([
        "build",
        "--release",
        "--locked",
        "-p",
        "kube-ipvs",
        "--bin",
        "kube-ipvs",
    ]);
    if let Some(t) = target {
        cmd.args(["--target", t]);
    }
    let shown = format!("{cmd:?}");
    eprintln!("xtask: + {shown}");
    let status = cmd.status().map_err(|e| Error::Io {
        context: format!("running {shown}"),
        source: e,
    })?;
    if !status.success() {
        return Err(Error::Command {
            cmd: shown,
            detail: format!("exited with {status}"),
        });
    }
    let built = built_path(&target_dir, target);
    let out_dir = target_dir.join("dist");
    std::fs::create_dir_all(&out_dir).map_err(|e| Error::Io {
        context: format!("creating {}", out_dir.display()),
        source: e,
    })?;
    let out = out_dir.join("kube-ipvs");
    std::fs::copy(&built, &out).map_err(|e| Error::Io {
        context: format!("copying {} to {}", built.display(), out.display()),
        source: e,
    })?;
    let size = std::fs::metadata(&out)
        .map(|m| m.len())
        .map_err(|e| Error::Io {
            context: format!("stat {}", out.display()),
            source: e,
        })?;
    println!(
        "{} ({:.1} MB, {})",
        out.display(),
        size as f64 / 1e6,
        target.unwrap_or("host gnu target, dynamically linked")
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn musl_detection_reads_rustup_output() {
        let list = "x86_64-unknown-linux-gnu\nx86_64-unknown-linux-musl\n";
        assert!(installed(list, MUSL));
        assert!(!installed("x86_64-unknown-linux-gnu\n", MUSL));
        assert!(!installed("", MUSL));
    }

    #[test]
    fn binary_paths_per_target() {
        let t = Path::new("/t");
        assert_eq!(built_path(t, None), Path::new("/t/release/kube-ipvs"));
        assert_eq!(
            built_path(t, Some(MUSL)),
            Path::new("/t/x86_64-unknown-linux-musl/release/kube-ipvs")
        );
    }
}
