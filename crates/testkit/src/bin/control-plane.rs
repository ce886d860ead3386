//! `control-plane`: the real etcd + kube-apiserver of `testkit::control_plane` as a standalone
//! process, for trying things by hand and for driving the test VM against it.
//!
//! `control-plane [--apply FILE]...`: starts the control plane (binaries from `cargo xtask kube`),
//! applies the files as admin, prints `server URL`, `dir DIR`, `admin KUBECONFIG` lines, then
//! serves until its standard input closes (Ctrl-D) and stops etcd and the apiserver.

use std::io::{Read, Write};

use testkit::control_plane::ControlPlane;

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut files = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match (a.as_str(), it.next()) {
            ("--apply", Some(f)) => files.push(f.clone()),
            _ => {
                eprintln!("usage: control-plane [--apply FILE]...");
                return std::process::ExitCode::from(2);
            }
        }
    }
    let cp = match ControlPlane::start() {
        Ok(cp) => cp,
        Err(e) => {
            eprintln!("control-plane: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    for f in &files {
        if let Err(e) = cp.kubectl(&["apply", "-f", f]) {
            eprintln!("control-plane: {f}: {e}");
        }
    }
    let mut out = std::io::stdout();
    let _ = writeln!(out, "server {}", cp.server_url());
    let _ = writeln!(out, "dir {}", cp.dir().display());
    let _ = writeln!(out, "admin {}", cp.admin_kubeconfig().display());
    let _ = out.flush();
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    std::process::ExitCode::SUCCESS
}
