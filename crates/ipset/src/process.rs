//! Running a tool: directly or inside `ip netns exec NAME`, with optional standard input, its
//! output collected, and a program that is not installed told apart from other failures.
//!
//! Shared by this crate's [`crate::Runner`] (`ipset`) and the iptables crate's runner
//! (`iptables-save`, `iptables-restore`); each maps [`Error`] onto its own error type.

use std::ffi::OsStr;
use std::io::Write as _;
use std::process::{Command, Stdio};

/// Errors starting a program or waiting for it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The named program (or `ip`, to enter a namespace) is not installed or not executable.
    #[error("required program {0:?} not found ({1})")]
    MissingBinary(String, #[source] std::io::Error),
    /// Starting or waiting for the shown command line failed for another reason.
    #[error("running {0}: {1}")]
    Io(String, #[source] std::io::Error),
}

/// A program that ran to its end (successfully or not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// The command line, for messages (`ip netns exec NS prog args…`).
    pub command: String,
    /// Whether it exited with status 0.
    pub success: bool,
    /// Its standard output.
    pub stdout: Vec<u8>,
    /// Its standard error, decoded lossily and trimmed.
    pub stderr: String,
}

/// Run `program args`, inside `ip netns exec NETNS` when `netns` is given, with `stdin` written
/// to its standard input (none: `/dev/null`), and wait for it.
///
/// A program that cannot be started because it does not exist is [`Error::MissingBinary`]: the
/// program itself, or `ip` when entering a namespace, or the program again when `ip netns exec`
/// reports that it could not execute it.
pub fn run(
    netns: Option<&str>,
    program: &OsStr,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<Output, Error> {
    let prog = program.to_string_lossy().into_owned();
    let mut shown = String::new();
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(program);
            shown.push_str(&format!("ip netns exec {ns} "));
            c
        }
        None => Command::new(program),
    };
    cmd.args(args);
    shown.push_str(&prog);
    for a in args {
        shown.push(' ');
        shown.push_str(a);
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    let mut child = cmd.spawn().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            let binary = if netns.is_some() { "ip" } else { &prog };
            Error::MissingBinary(binary.to_string(), e)
        } else {
            Error::Io(shown.clone(), e)
        }
    })?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // A write error (EPIPE) means the program exited early; its stderr says why.
        let _ = pipe.write_all(text.as_bytes());
    }
    let out = child
        .wait_with_output()
        .map_err(|e| Error::Io(shown.clone(), e))?;
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    // `ip netns exec` could not start the program inside the namespace.
    if !out.status.success() && stderr.contains("exec of") && stderr.contains("No such file") {
        let source = std::io::Error::new(std::io::ErrorKind::NotFound, stderr);
        return Err(Error::MissingBinary(prog, source));
    }
    Ok(Output {
        command: shown,
        success: out.status.success(),
        stdout: out.stdout,
        stderr,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_program_is_missing_binary() {
        let err = run(
            None,
            OsStr::new("/nonexistent/kube-ipvs-process-test"),
            &[],
            None,
        )
        .unwrap_err();
        assert!(
            matches!(&err, Error::MissingBinary(binary, _) if binary == "/nonexistent/kube-ipvs-process-test"),
            "{err}"
        );
    }

    #[test]
    fn collects_output_and_feeds_stdin() {
        let out = run(
            None,
            OsStr::new("sh"),
            &["-c", "cat; echo oops >&2; exit 3"],
            Some("hi\n"),
        )
        .unwrap();
        assert_eq!(out.command, "sh -c cat; echo oops >&2; exit 3");
        assert!(!out.success);
        assert_eq!(out.stdout, b"hi\n");
        assert_eq!(out.stderr, "oops");
    }
}
