//! Command line: kube-proxy's flags (generated from the settings table) plus subcommands.
//!
//! `kube-ipvs [FLAGS]` runs the daemon; `kube-ipvs plan [--diff] [FLAGS]` prints what would be
//! programmed; `kube-ipvs load-modules [FLAGS]` loads the kernel modules IPVS mode needs (the
//! DaemonSet's init container); `kube-ipvs config print-defaults` (hidden) prints the settings
//! table. Flags are
//! global, so they may come before or after the subcommand. Boolean flags follow Go's flag
//! package: `--masquerade-all`, `--masquerade-all=true`, `--ipvs-fallback=false`.

use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command};

use crate::settings::{Setting, Ty, SETTINGS};

/// What the invocation asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Run the proxy (also `--once` and `--cleanup`, which are config fields).
    Run,
    /// Print the desired state (and with `diff`, the difference to the kernel's).
    Plan {
        /// `--diff`: compare with what is programmed.
        diff: bool,
        /// `--section NAME`: print only this section (ipvs, addresses, ipsets, iptables).
        section: Option<String>,
    },
    /// Load the kernel modules the configured mode needs with `modprobe` and exit 0, whatever
    /// loaded (the DaemonSet's init container; see [`crate::probe::load_modules`]).
    LoadModules,
    /// Print the settings table and exit.
    PrintDefaults,
}

/// A parsed command line: the action and the setting flags given, in table order.
#[derive(Debug, Clone)]
pub struct Args {
    /// What to do.
    pub action: Action,
    /// The flags given on the command line with their raw text (last occurrence wins).
    pub flags: Vec<(&'static Setting, String)>,
}

impl Args {
    /// The raw text of a flag given on the command line.
    pub fn flag(&self, name: &str) -> Option<&str> {
        self.flags
            .iter()
            .find(|(s, _)| s.flag == Some(name))
            .map(|(_, v)| v.as_str())
    }
}

fn setting_arg(st: &'static Setting, flag: &'static str) -> Arg {
    let default = if st.default.is_empty() {
        String::new()
    } else {
        format!(" [default: {}]", st.default)
    };
    let mut arg = Arg::new(flag)
        .long(flag)
        .help(format!("{}{default}", st.help))
        .global(true)
        .action(ArgAction::Set);
    for a in st.aliases {
        arg = arg.visible_alias(*a);
    }
    arg = match st.ty {
        Ty::Bool => arg
            .num_args(0..=1)
            .require_equals(true)
            .default_missing_value("true")
            .value_name("BOOL"),
        Ty::Duration => arg.value_name("DURATION"),
        Ty::Int => arg.value_name("INT").allow_negative_numbers(true),
        Ty::Float => arg.value_name("FLOAT"),
        Ty::List => arg.value_name("LIST"),
        Ty::BoolMap => arg.value_name("KEY=BOOL,..."),
        Ty::Str | Ty::Opaque => arg.value_name("STRING"),
    };
    if flag == "v" {
        arg = arg.short('v').value_name("LEVEL");
    }
    arg
}

/// The clap command.
pub fn command() -> Command {
    let mut cmd = Command::new("kube-ipvs")
        .version(env!("CARGO_PKG_VERSION"))
        .about("An IPVS-native Kubernetes service proxy (drop-in for kube-proxy's IPVS mode)")
        .subcommand(
            Command::new("plan")
                .about("Print the IPVS services, addresses, ipsets and rules this node should have")
                .arg(
                    Arg::new("diff")
                        .long("diff")
                        .action(ArgAction::SetTrue)
                        .help("Show the difference to what the kernel has now"),
                )
                .arg(
                    Arg::new("section")
                        .long("section")
                        .value_parser(["ipvs", "addresses", "ipsets", "iptables"])
                        .help("Print only this section, in its tool's own format (e.g. `ipvs` for `ipvsadm --restore`)"),
                ),
        )
        .subcommand(
            Command::new("load-modules").about(
                "Load the kernel modules IPVS mode needs (ip_vs, the configured scheduler's, \
                 ip_vs_rr/wrr/sh, nf_conntrack) with modprobe; exits 0 even when some cannot be \
                 loaded (the daemon then reports it and falls back loudly)",
            ),
        )
        .subcommand(
            Command::new("config")
                .hide(true)
                .about("Configuration helpers")
                .subcommand_required(true)
                .subcommand(
                    Command::new("print-defaults")
                        .about("Print every setting with its flag and default"),
                ),
        );
    for st in SETTINGS {
        if let Some(flag) = st.flag {
            cmd = cmd.arg(setting_arg(st, flag));
        }
    }
    cmd
}

fn collect(m: &ArgMatches) -> Vec<(&'static Setting, String)> {
    let mut out = Vec::new();
    for st in SETTINGS {
        let Some(flag) = st.flag else { continue };
        if m.value_source(flag) != Some(ValueSource::CommandLine) {
            continue;
        }
        if let Some(v) = m.get_one::<String>(flag) {
            out.push((st, v.clone()));
        }
    }
    out
}

/// Parses `args` (the first item is the program name).
pub fn parse<I, T>(args: I) -> Result<Args, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let m = command().try_get_matches_from(args)?;
    let (action, leaf) = match m.subcommand() {
        Some(("plan", sub)) => (
            Action::Plan {
                diff: sub.get_flag("diff"),
                section: sub.get_one::<String>("section").cloned(),
            },
            sub,
        ),
        Some(("load-modules", sub)) => (Action::LoadModules, sub),
        Some(("config", sub)) => match sub.subcommand() {
            Some((_, leaf)) => (Action::PrintDefaults, leaf),
            None => (Action::PrintDefaults, sub),
        },
        _ => (Action::Run, &m),
    };
    Ok(Args {
        action,
        flags: collect(leaf),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_is_valid() {
        command().debug_assert();
    }

    #[test]
    fn flags_before_and_after_subcommand_and_go_bools() {
        let a = parse([
            "kube-ipvs",
            "--ipvs-scheduler",
            "wrr",
            "plan",
            "--source-dir=examples/",
            "--masquerade-all",
            "--ipvs-fallback=false",
            "-v",
            "4",
            "--oom-score-adj",
            "-500",
        ])
        .unwrap();
        assert_eq!(
            a.action,
            Action::Plan {
                diff: false,
                section: None
            }
        );
        assert_eq!(a.flag("ipvs-scheduler"), Some("wrr"));
        assert_eq!(a.flag("source-dir"), Some("examples/"));
        assert_eq!(a.flag("masquerade-all"), Some("true"));
        assert_eq!(a.flag("ipvs-fallback"), Some("false"));
        assert_eq!(a.flag("v"), Some("4"));
        assert_eq!(a.flag("oom-score-adj"), Some("-500"));
        assert_eq!(a.flag("proxy-mode"), None);
    }

    #[test]
    fn klog_style_verbosity_and_aliases() {
        let a = parse(["kube-ipvs", "--v=2", "--logging-format", "json"]).unwrap();
        assert_eq!(a.action, Action::Run);
        assert_eq!(a.flag("v"), Some("2"));
        assert_eq!(a.flag("log-format"), Some("json"));
        let a = parse(["kube-ipvs", "-v3", "plan", "--diff"]).unwrap();
        assert_eq!(a.flag("v"), Some("3"));
        assert_eq!(
            a.action,
            Action::Plan {
                diff: true,
                section: None
            }
        );
        let a = parse(["kube-ipvs", "config", "print-defaults"]).unwrap();
        assert_eq!(a.action, Action::PrintDefaults);
        let a = parse(["kube-ipvs", "load-modules", "--config=/c.conf"]).unwrap();
        assert_eq!(a.action, Action::LoadModules);
        assert_eq!(a.flag("config"), Some("/c.conf"));
    }

    #[test]
    fn unknown_flags_are_errors() {
        assert!(parse(["kube-ipvs", "--no-such-flag"]).is_err());
        // A bool flag does not swallow the next word.
        assert!(parse(["kube-ipvs", "--once", "false"]).is_err());
    }
}
