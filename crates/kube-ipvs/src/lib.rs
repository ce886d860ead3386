//! kube-ipvs: the binary's library part: CLI, config, HTTP health and metrics, mode selection,
//! and the daemon seams the sync engine plugs into.
//!
//! `main` only calls [`run`]; tests drive the modules directly.

pub mod allocator;
pub mod cli;
pub mod client_limit;
pub mod config;
pub mod config_watch;
pub mod daemon;
pub mod duration;
pub mod engine;
pub mod error;
pub mod events;
pub mod handover;
pub mod health;
pub mod http;
pub mod localhost;
pub mod logging;
pub mod metrics;
pub mod mode;
pub mod probe;
pub mod service_health;
pub mod settings;

pub use error::{Error, Result};

use cli::{Action, Args};

/// Runs one parsed invocation to completion.
pub fn run(args: Args) -> Result<()> {
    if args.action == Action::PrintDefaults {
        let mut out = std::io::stdout().lock();
        std::io::Write::write_all(&mut out, settings::render_defaults().as_bytes())?;
        return Ok(());
    }
    let loaded = config::load(&args)?;
    logging::init(loaded.config.verbosity, loaded.config.log_format)?;
    for w in &loaded.warnings {
        tracing::warn!("config: {w}");
    }
    let config = loaded.config;
    match args.action {
        Action::LoadModules => {
            probe::load_modules(&config, |m| probe::modprobe(m, probe::MODPROBE_TIMEOUT));
            Ok(())
        }
        Action::Plan { diff, section } => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let mut out = std::io::stdout().lock();
                daemon::plan(&config, diff, section.as_deref(), &mut out).await
            })
        }
        _ => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            rt.block_on(async move {
                if config.cleanup {
                    daemon::cleanup(&config).await
                } else {
                    daemon::run_daemon(config).await
                }
            })
        }
    }
}
