//! Applies an `ipvsadm -S` formatted table (or any `ipvsadm --restore` input) from stdin
//! through the pipelined batch API.
//!
//! Usage: `ipvs-restore [--flush] < table`. The whole input is parsed first: a bad line is
//! reported with its number and nothing is applied. Every operation is then sent; failures are
//! reported per line and the exit status is 1 if any failed.

use std::io::Read;
use std::process::ExitCode;

use ipvs_netlink::Op;

fn main() -> ExitCode {
    let mut flush = false;
    for a in std::env::args().skip(1) {
        match a.as_str() {
            "--flush" | "-C" => flush = true,
            _ => {
                eprintln!(
                    "ipvs-restore: unknown argument {a:?} (usage: ipvs-restore [--flush] < table)"
                );
                return ExitCode::from(2);
            }
        }
    }
    let mut text = String::new();
    if let Err(e) = std::io::stdin().read_to_string(&mut text) {
        eprintln!("ipvs-restore: reading stdin: {e}");
        return ExitCode::from(2);
    }
    let parsed = match ipvs_netlink::savefmt::parse_commands_with_lines(&text) {
        Ok(ops) => ops,
        Err(e) => {
            eprintln!("ipvs-restore: {e}; nothing applied");
            return ExitCode::from(2);
        }
    };
    let mut ops = Vec::with_capacity(parsed.len() + 1);
    let mut lines = Vec::with_capacity(parsed.len() + 1);
    if flush {
        ops.push(Op::Flush);
        lines.push(0);
    }
    for (line, op) in parsed {
        ops.push(op);
        lines.push(line);
    }
    let mut client = match ipvs_netlink::Client::new() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ipvs-restore: {e}");
            return ExitCode::from(2);
        }
    };
    let results = client.apply(&ops);
    let mut failed = 0usize;
    for (i, r) in results.iter().enumerate() {
        if let Err(e) = r {
            failed += 1;
            let what = match lines[i] {
                0 => "--flush".to_owned(),
                n => format!("line {n}"),
            };
            eprintln!("ipvs-restore: {what}: {e}");
        }
    }
    if failed > 0 {
        eprintln!("ipvs-restore: {failed} of {} operations failed", ops.len());
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
