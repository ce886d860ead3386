//! The docs are checked against the code so they cannot drift:
//! - `docs/configuration.md`'s settings table is generated from `kube_ipvs::settings::SETTINGS`
//!   (run with `UPDATE_DOCS=1` to rewrite it; on mismatch the expected text is printed);
//! - every metric named in `docs/` is one kube-ipvs exports, and `docs/operations.md` names every
//!   metric kube-ipvs exports;
//! - every `--flag` in a `kube-ipvs ...` command in `docs/` and README.md exists;
//! - every KubeProxyConfiguration field path named in `docs/` exists;
//! - README.md links every page in `docs/`, and the links resolve.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::PathBuf;

use kube_ipvs::settings::{Setting, Support, Ty, SETTINGS};

const BEGIN: &str = "<!-- BEGIN GENERATED SETTINGS: cargo test -p kube-ipvs --test docs (UPDATE_DOCS=1 rewrites) -->";
const END: &str = "<!-- END GENERATED SETTINGS -->";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn doc_pages() -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = std::fs::read_dir(repo().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .map(|p| {
            let name = format!("docs/{}", p.file_name().unwrap().to_string_lossy());
            (name, std::fs::read_to_string(&p).unwrap())
        })
        .collect();
    v.sort();
    v
}

fn ty_name(t: Ty) -> &'static str {
    match t {
        Ty::Bool => "bool",
        Ty::Int => "int",
        Ty::Float => "float",
        Ty::Str => "string",
        Ty::Duration => "duration",
        Ty::List => "list",
        Ty::BoolMap => "map",
        Ty::Opaque => "object",
    }
}

/// Upstream kube-proxy's flag for a kube-ipvs flag (same name unless listed).
fn upstream_flag(st: &Setting) -> String {
    match st.flag {
        Some("log-format") => "`--logging-format`".into(),
        Some("v") => "`-v`".into(),
        Some(f) if st.field.is_some() || ["config", "master", "cleanup"].contains(&f) => {
            format!("`--{f}`")
        }
        Some(_) => "none (kube-ipvs only)".into(),
        None => "none (file only)".into(),
    }
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|")
}

/// The settings table as it must appear in docs/configuration.md.
fn render_table() -> String {
    let mut out = String::new();
    out.push_str(BEGIN);
    out.push_str("\n\n| Field | Flag | Type | Default | Upstream flag | Status | kube-ipvs |\n");
    out.push_str("|---|---|---|---|---|---|---|\n");
    for st in SETTINGS {
        let field = st
            .field
            .map(|f| format!("`{f}`"))
            .unwrap_or_else(|| "— (command line only)".into());
        let mut flag = st
            .flag
            .map(|f| {
                if f.len() == 1 {
                    format!("`-{f}`")
                } else {
                    format!("`--{f}`")
                }
            })
            .unwrap_or_else(|| "—".into());
        for a in st.aliases {
            flag.push_str(&format!(", `--{a}`"));
        }
        let default = if st.default.is_empty() {
            "`\"\"`".to_string()
        } else {
            format!("`{}`", st.default)
        };
        let note = match st.support {
            Support::Yes => st.help.to_string(),
            Support::Ignored(why) => format!("**ignored** (warns when set): {why}"),
            Support::Silent => format!("ignored silently: {}", st.help),
        };
        // Applied, or not applicable to kube-ipvs (accepted, with a warning when set).
        // Values kube-ipvs cannot apply are rejected with an error naming the field (the
        // help text lists them).
        let status = match st.support {
            Support::Yes => "applied",
            Support::Ignored(_) => "not applicable",
            Support::Silent => "not applicable (silent)",
        };
        out.push_str(&format!(
            "| {field} | {flag} | {} | {default} | {} | {status} | {} |\n",
            ty_name(st.ty),
            upstream_flag(st),
            cell(&note)
        ));
    }
    out.push('\n');
    out.push_str(END);
    out
}

#[test]
fn configuration_table_is_generated_from_the_settings() {
    let path = repo().join("docs/configuration.md");
    let text = std::fs::read_to_string(&path).unwrap();
    let want = render_table();
    let (Some(b), Some(e)) = (text.find(BEGIN), text.find(END)) else {
        panic!("docs/configuration.md lacks the generated-table markers:\n{BEGIN}\n...\n{END}");
    };
    let have = &text[b..e + END.len()];
    if have != want {
        if std::env::var_os("UPDATE_DOCS").is_some() {
            let new = format!("{}{want}{}", &text[..b], &text[e + END.len()..]);
            std::fs::write(&path, new).unwrap();
            println!("docs/configuration.md: table rewritten");
            return;
        }
        panic!(
            "docs/configuration.md's settings table is stale; rerun with UPDATE_DOCS=1 or paste:\n{want}"
        );
    }
    let rows = want
        .lines()
        .filter(|l| l.starts_with("| `") || l.starts_with("| —"))
        .count();
    println!("settings table: {rows} rows, {} settings", SETTINGS.len());
    assert_eq!(rows, SETTINGS.len());
}

/// Identifier-like tokens of `text` starting with one of `prefixes`.
/// Words of `text` that start with one of `prefixes`; a hyphen joins words, so the domain in an
/// annotation (`kube-ipvs.io/scheduler`) is not read as a field (`ipvs.io`).
fn tokens<'a>(text: &'a str, prefixes: &[&str]) -> BTreeSet<&'a str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-'))
        .map(|t| t.trim_end_matches('.'))
        .filter(|t| prefixes.iter().any(|p| t.starts_with(p)))
        .collect()
}

/// The metric names exported (counters with `_total`, info with `_info`), from the encoder.
fn exported() -> BTreeSet<String> {
    use kube_ipvs::metrics::*;
    let m = Metrics::new();
    // Families print nothing until they have a series: give each one.
    m.set_proxy_mode(kube_ipvs::config::ProxyMode::Ipvs);
    let sub = SubsystemLabel {
        subsystem: "ipvs".into(),
    };
    m.drift_repairs_total.get_or_create(&sub).inc();
    m.sync_errors_total.get_or_create(&sub).inc();
    m.invalid_objects_total
        .get_or_create(&InvalidObjectLabels {
            kind: "Service".into(),
            reason: "x".into(),
        })
        .inc();
    m.ipvs_requests_total
        .get_or_create(&OpLabel {
            op: "new_service".into(),
        })
        .inc();
    m.init_families(&[ipvs_netlink::Family::Inet]);
    // The per-family histograms print only once a family has a series.
    m.record_sync(
        ipvs_netlink::Family::Inet,
        proxier::ipvs_mode::SyncKind::Full,
        0.01,
    );
    m.record_sync(
        ipvs_netlink::Family::Inet,
        proxier::ipvs_mode::SyncKind::Incremental,
        0.01,
    );
    m.record_queued(ipvs_netlink::Family::Inet);
    m.record_conntrack(ipvs_netlink::Family::Inet, Some(0.001), 0);
    m.record_network_programmed(ipvs_netlink::Family::Inet, &[std::time::SystemTime::now()]);
    let code = CodeLabel { code: "200".into() };
    m.proxy_healthz_total.get_or_create(&code).inc();
    m.proxy_livez_total.get_or_create(&code).inc();
    let text = m.encode().unwrap();
    let mut names = BTreeSet::new();
    for l in text.lines() {
        if let Some(rest) = l.strip_prefix("# TYPE ") {
            let mut w = rest.split_whitespace();
            let (name, kind) = (w.next().unwrap(), w.next().unwrap());
            let name = match kind {
                "counter" => format!("{name}_total"),
                "info" => format!("{name}_info"),
                _ => name.to_string(),
            };
            names.insert(name);
        }
    }
    names
}

#[test]
fn metric_names_in_the_docs_exist_and_operations_lists_them_all() {
    let exported = exported();
    assert!(exported.len() > 15, "{exported:?}");
    let mut checked = 0;
    for (page, text) in doc_pages() {
        for t in tokens(&text, &["kubeproxy_", "kube_ipvs_"]) {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| t.strip_suffix(s))
                .filter(|b| exported.contains(*b))
                .unwrap_or(t);
            assert!(exported.contains(base), "{page} names unknown metric {t}");
            checked += 1;
        }
    }
    let ops = read("docs/operations.md");
    let missing: Vec<_> = exported
        .iter()
        .filter(|m| !ops.contains(m.as_str()))
        .collect();
    println!(
        "metrics: {} exported, {checked} mentions checked, {} missing from operations.md",
        exported.len(),
        missing.len()
    );
    assert!(
        missing.is_empty(),
        "docs/operations.md does not describe {missing:?}"
    );
}

#[test]
fn kube_ipvs_flags_in_the_docs_exist() {
    let cmd = kube_ipvs::cli::command();
    let mut known: BTreeSet<String> = cmd
        .get_arguments()
        .filter_map(|a| a.get_long().map(String::from))
        .collect();
    for sub in cmd.get_subcommands() {
        known.extend(
            sub.get_arguments()
                .filter_map(|a| a.get_long().map(String::from)),
        );
    }
    known.extend(["help".to_string(), "version".to_string()]);
    let mut pages = doc_pages();
    pages.push(("README.md".into(), read("README.md")));
    let (mut attempted, mut ok) = (0, 0);
    for (page, text) in pages {
        // Command lines that run kube-ipvs: in code blocks or inline code.
        for line in text.lines() {
            for seg in line.split('`') {
                let Some(pos) = seg.find("kube-ipvs ") else {
                    continue;
                };
                // `cargo test -p kube-ipvs ...` names the package, not the binary;
                // `cargo xtask conformance --proxy kube-ipvs ...` names a proxy under test.
                let before = &seg[..pos];
                if before.ends_with("-p ")
                    || before.ends_with("--proxy ")
                    || (before.ends_with('/') && !before.ends_with("./"))
                {
                    continue;
                }
                let cmdline = &seg[pos..];
                if !(cmdline.starts_with("kube-ipvs --")
                    || cmdline.starts_with("kube-ipvs plan")
                    || cmdline.starts_with("kube-ipvs config")
                    || cmdline.starts_with("kube-ipvs load-modules")
                    || cmdline.starts_with("kube-ipvs -"))
                {
                    continue;
                }
                for w in cmdline.split_whitespace() {
                    if w == "|" || w == "#" || w == "&&" || w == "--" {
                        break;
                    }
                    let Some(flag) = w.strip_prefix("--") else {
                        continue;
                    };
                    let flag = flag.split('=').next().unwrap();
                    attempted += 1;
                    assert!(
                        known.contains(flag),
                        "{page}: unknown flag --{flag} in `{cmdline}`"
                    );
                    ok += 1;
                }
            }
        }
    }
    println!(
        "flags in docs: {attempted} attempted, {ok} succeeded, {} failed",
        attempted - ok
    );
    assert!(attempted > 10);
}

#[test]
fn config_fields_in_the_docs_exist() {
    let prefixes = [
        "ipvs.",
        "iptables.",
        "conntrack.",
        "clientConnection.",
        "logging.",
        "detectLocal.",
        "nftables.",
        "winkernel.",
    ];
    let mut n = 0;
    for (page, text) in doc_pages() {
        for t in tokens(&text, &prefixes) {
            // File names like iptables.md are not fields.
            if t.ends_with(".md") || t.ends_with(".rs") {
                continue;
            }
            assert!(
                kube_ipvs::settings::by_field(t).is_some(),
                "{page} names unknown config field {t}"
            );
            n += 1;
        }
    }
    println!("config field mentions checked: {n}");
    assert!(n > 5);
}

#[test]
fn readme_links_every_doc_page() {
    let readme = read("README.md");
    // The two set-up commands stay as they are.
    assert!(readme.contains("cargo run -p kube-ipvs -- plan --source-dir examples/"));
    assert!(readme.contains("cargo xtask test "));
    let pages = doc_pages();
    assert!(
        pages.len() >= 6,
        "{:?}",
        pages.iter().map(|p| &p.0).collect::<Vec<_>>()
    );
    for (page, _) in &pages {
        assert!(
            readme.contains(&format!("]({page})")),
            "README.md does not link {page}"
        );
    }
    // Every relative .md link in README and docs resolves.
    let mut all = pages.clone();
    all.push(("README.md".into(), readme));
    let mut links = 0;
    for (page, text) in all {
        let base = repo().join(&page);
        let dir = base.parent().unwrap();
        for part in text.split("](").skip(1) {
            let target = part.split(')').next().unwrap();
            if target.starts_with("http") || target.starts_with('#') {
                continue;
            }
            let file = target.split('#').next().unwrap();
            assert!(dir.join(file).exists(), "{page}: broken link {target}");
            links += 1;
        }
    }
    println!("relative links checked: {links}");
}
