//! kube-ipvs: an IPVS-native Kubernetes service proxy.

use std::process::ExitCode;

fn main() -> ExitCode {
    if let Some(e) = kube_ipvs::allocator::tune() {
        eprintln!(
            "kube-ipvs: cannot re-execute with {}: {e}; going on with glibc's malloc defaults",
            kube_ipvs::allocator::VAR
        );
    }
    let args = match kube_ipvs::cli::parse(std::env::args_os()) {
        Ok(a) => a,
        Err(e) => {
            // --help and --version are "errors" that print to stdout and succeed.
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    match kube_ipvs::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kube-ipvs: {e}");
            ExitCode::FAILURE
        }
    }
}
