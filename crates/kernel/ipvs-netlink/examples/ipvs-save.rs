//! Prints the kernel IPVS table in `ipvsadm -Sn` format.
//!
//! Usage: `ipvs-save [-n]` (output is always numeric; `-n` is accepted for compatibility).

use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    for a in std::env::args().skip(1) {
        if a != "-n" && a != "-S" && a != "-Sn" {
            eprintln!("ipvs-save: unknown argument {a:?} (usage: ipvs-save [-n])");
            return ExitCode::from(2);
        }
    }
    let mut client = match ipvs_netlink::Client::new() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ipvs-save: {e}");
            return ExitCode::from(2);
        }
    };
    let table = match client.dump() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("ipvs-save: {e}");
            return ExitCode::FAILURE;
        }
    };
    let text = ipvs_netlink::savefmt::render(&table);
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        eprintln!("ipvs-save: write: {e}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
