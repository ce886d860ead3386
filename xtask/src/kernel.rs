//! The guest kernel: a Debian cloud kernel package downloaded and unpacked into the cache.

use crate::error::{Context, Error, Result};
use crate::host::{self, Apt};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// An unpacked kernel package.
#[derive(Debug, Clone)]
pub struct Kernel {
    /// Package name, e.g. `linux-image-6.1.0-56-cloud-amd64`.
    pub package: String,
    /// Kernel release, e.g. `6.1.0-56-cloud-amd64`.
    pub release: String,
    /// Path of the bzImage.
    pub vmlinuz: PathBuf,
    /// `.../lib/modules/<release>` inside the unpacked package (depmod already run).
    pub modules: PathBuf,
}

const META_PACKAGE: &str = "linux-image-cloud-amd64";

/// Parse `apt-cache depends linux-image-cloud-amd64` output.
pub fn parse_depends(out: &str) -> Option<String> {
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends:"))
        .map(|p| p.trim().trim_matches(|c| c == '<' || c == '>').to_string())
        .find(|p| p.starts_with("linux-image-") && p.ends_with("-cloud-amd64") && p != META_PACKAGE)
}

/// Pick the highest `linux-image-6.1.0-N-cloud-amd64` from `apt-cache search` output.
pub fn parse_search(out: &str) -> Option<String> {
    out.lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|p| {
            let n = p
                .strip_prefix("linux-image-6.1.0-")?
                .strip_suffix("-cloud-amd64")?;
            Some((n.parse::<u32>().ok()?, p.to_string()))
        })
        .max()
        .map(|(_, p)| p)
}

/// Identifies the state of apt's package lists (changes on every `apt-get update`).
fn apt_lists_key() -> String {
    use std::os::unix::fs::MetadataExt;
    let m = |p: &str| fs::metadata(p).map(|m| (m.mtime(), m.mtime_nsec())).ok();
    format!(
        "{:?} {:?}",
        m("/var/lib/apt/lists"),
        m("/var/cache/apt/pkgcache.bin")
    )
}

/// `resolve_package`, remembered in `memo` until apt's lists change (apt-cache takes ~1 s).
fn resolve_memoized(memo: &Path) -> Option<String> {
    let key = apt_lists_key();
    if let Ok(text) = fs::read_to_string(memo) {
        if let Some((k, pkg)) = text.rsplit_once('\n') {
            if k == key && !pkg.is_empty() {
                return Some(pkg.to_string());
            }
        }
    }
    let pkg = resolve_package()?;
    let _ = fs::write(memo, format!("{key}\n{pkg}"));
    Some(pkg)
}

fn resolve_package() -> Option<String> {
    let dep = Command::new("apt-cache")
        .args(["depends", META_PACKAGE])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| parse_depends(&String::from_utf8_lossy(&o.stdout)));
    dep.or_else(|| {
        Command::new("apt-cache")
            .args([
                "search",
                "--names-only",
                "^linux-image-6.1.0-[0-9]+-cloud-amd64$",
            ])
            .output()
            .ok()
            .and_then(|o| parse_search(&String::from_utf8_lossy(&o.stdout)))
    })
}

fn load(dir: &Path, package: &str) -> Result<Kernel> {
    let boot = dir.join("boot");
    let entries = fs::read_dir(&boot).ctx(|| format!("reading {}", boot.display()))?;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(release) = name.strip_prefix("vmlinuz-") {
            let modules = ["lib/modules", "usr/lib/modules"]
                .iter()
                .map(|m| dir.join(m).join(release))
                .find(|p| p.is_dir())
                .ok_or_else(|| Error::Kernel(format!("{package}: no modules directory")))?;
            return Ok(Kernel {
                package: package.to_string(),
                release: release.to_string(),
                vmlinuz: e.path(),
                modules,
            });
        }
    }
    Err(Error::Kernel(format!(
        "{package}: no boot/vmlinuz-* in the package"
    )))
}

fn cached(kdir: &Path) -> Vec<(PathBuf, String)> {
    let mut v: Vec<(PathBuf, String)> = fs::read_dir(kdir)
        .map(|r| {
            r.flatten()
                .filter(|e| e.path().join(".complete").exists())
                .map(|e| (e.path(), e.file_name().to_string_lossy().into_owned()))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Return the cached kernel, downloading and unpacking it on first use.
pub fn ensure(cache: &Path, apt: &mut Apt) -> Result<Kernel> {
    let kdir = cache.join("kernel");
    fs::create_dir_all(&kdir).ctx(|| format!("creating {}", kdir.display()))?;
    let memo = kdir.join("resolved");
    let mut package = resolve_memoized(&memo);
    if package.is_none() && host::is_root() {
        apt.update()?;
        package = resolve_memoized(&memo);
    }
    let Some(package) = package else {
        if let Some((dir, pkg)) = cached(&kdir).pop() {
            eprintln!("xtask: apt does not list {META_PACKAGE}; using cached {pkg}");
            return load(&dir, &pkg);
        }
        return Err(Error::Kernel(format!(
            "cannot resolve {META_PACKAGE} via `apt-cache depends` or `apt-cache search` \
             (is a Debian bookworm apt source configured? try `apt-get update`)"
        )));
    };
    let dir = kdir.join(&package);
    if dir.join(".complete").exists() {
        return load(&dir, &package);
    }
    match fetch(&kdir, &package, &dir) {
        Ok(()) => load(&dir, &package),
        Err(e) => match cached(&kdir).pop() {
            Some((d, pkg)) => {
                eprintln!("xtask: fetching {package} failed ({e}); using cached {pkg}");
                load(&d, &pkg)
            }
            None => Err(e),
        },
    }
}

fn fetch(kdir: &Path, package: &str, dir: &Path) -> Result<()> {
    let tmp = kdir.join(format!(".tmp-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    let dl = tmp.join("dl");
    let root = tmp.join("root");
    fs::create_dir_all(&dl).ctx(|| format!("creating {}", dl.display()))?;
    eprintln!("xtask: downloading kernel package {package}");
    host::output(
        Command::new("apt-get")
            .args(["download", "-qq", package])
            .current_dir(&dl),
    )
    .map_err(|e| Error::Kernel(format!("apt-get download {package}: {e}")))?;
    let deb = fs::read_dir(&dl)
        .ctx(|| format!("reading {}", dl.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| Error::Kernel(format!("apt-get download {package} produced no .deb")))?;
    host::output(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))
        .map_err(|e| Error::Kernel(format!("unpacking {}: {e}", deb.display())))?;
    let k = load(&root, package)?;
    let base = k
        .modules
        .parent()
        .and_then(Path::parent)
        .and_then(Path::parent)
        .ok_or_else(|| Error::Kernel("odd modules path".into()))?;
    host::output(Command::new("depmod").arg("-b").arg(base).arg(&k.release))?;
    fs::write(root.join(".complete"), package).ctx(|| "marking kernel complete")?;
    let _ = fs::remove_dir_all(&dl);
    if fs::rename(&root, dir).is_err() && !dir.join(".complete").exists() {
        return Err(Error::Kernel(format!(
            "cannot move kernel into {}",
            dir.display()
        )));
    }
    let _ = fs::remove_dir_all(&tmp);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depends_output() {
        let out = "linux-image-cloud-amd64\n  Depends: linux-image-6.1.0-56-cloud-amd64\n";
        assert_eq!(
            parse_depends(out).as_deref(),
            Some("linux-image-6.1.0-56-cloud-amd64")
        );
        assert_eq!(parse_depends("linux-image-cloud-amd64\n"), None);
    }

    #[test]
    fn search_output_picks_highest_abi() {
        let out = "linux-image-6.1.0-9-cloud-amd64 - Linux 6.1 for x86-64 cloud\n\
                   linux-image-6.1.0-56-cloud-amd64 - Linux 6.1 for x86-64 cloud\n\
                   linux-image-6.1.0-56-cloud-amd64-dbg - Debug symbols\n";
        assert_eq!(
            parse_search(out).as_deref(),
            Some("linux-image-6.1.0-56-cloud-amd64")
        );
    }
}
