//! Child processes: a time limit on every command (openssl, kubectl), failures with their
//! output, and the stop of etcd and the apiserver (SIGTERM, then SIGKILL after 20 s).

use super::*;

fn show(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs `cmd` to completion with `stdin` fed, killing it after `limit`.
pub fn run_with_timeout(
    cmd: &mut Command,
    stdin: Option<&[u8]>,
    limit: Duration,
) -> Result<Output> {
    let shown = show(cmd);
    let mut child = io_ctx(
        cmd.stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn(),
        || format!("starting `{shown}`"),
    )?;
    if let (Some(data), Some(mut w)) = (stdin, child.stdin.take()) {
        use std::io::Write;
        let data = data.to_vec();
        std::thread::spawn(move || {
            let _ = w.write_all(&data);
        });
    }
    let mut so = child.stdout.take();
    let mut se = child.stderr.take();
    let out_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        if let Some(s) = so.as_mut() {
            let _ = s.read_to_end(&mut v);
        }
        v
    });
    let err_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        if let Some(s) = se.as_mut() {
            let _ = s.read_to_end(&mut v);
        }
        v
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = io_ctx(child.try_wait(), || format!("waiting for `{shown}`"))? {
            break s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(ControlPlaneError::Timeout(format!(
                "`{shown}` killed after {} s",
                limit.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Ok(Output {
        status,
        stdout: out_t.join().unwrap_or_default(),
        stderr: err_t.join().unwrap_or_default(),
    })
}

/// Like [`run_with_timeout`], failing unless the command exits 0; returns stdout.
pub(super) fn run_ok(cmd: &mut Command, stdin: Option<&[u8]>) -> Result<String> {
    let shown = show(cmd);
    let out = run_with_timeout(cmd, stdin, CMD_TIMEOUT)?;
    if !out.status.success() {
        return Err(ControlPlaneError::Command {
            cmd: shown,
            status: out.status.to_string(),
            stderr: format!(
                "{}{}",
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&out.stdout)
            ),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub(super) fn stop(mut c: Child) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(c.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        if let Ok(Some(_)) = c.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = c.kill();
    let _ = c.wait();
}
