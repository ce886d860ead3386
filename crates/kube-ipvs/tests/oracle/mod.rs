//! The differential test's comparison, shared by `kube_oracle.rs` (upstream kube-proxy and
//! kube-ipvs on a clean node) and `kube_migration.rs` (the node switched from one to the
//! other): the node-state dump (guest shell functions and their parser), the allowed
//! differences in `allowed-differences.txt` beside this file, and the line diff.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// Shell functions for the guest: `dump PHASE` prints the node state in the format
/// [`parse_dump`] reads (`ipvsadm -Sn`, the addresses on kube-ipvs0, `ipset save` members,
/// `iptables-save` `-A` lines); `wipe` leaves a clean node.
pub const DUMP_SH: &str = "dump() {\n  echo \"@@phase $1 $(cut -d' ' -f1 /proc/uptime)\"\n  \
    echo '@@ipvs'\n  ipvsadm -Sn\n  echo '@@addr'\n  \
    ip -o addr show dev kube-ipvs0 2>/dev/null | awk '$4 !~ /^fe80/ {print $4}'\n  \
    echo '@@ipset'\n  ipset save | grep '^add '\n  echo '@@iptables'\n  iptables-save | grep '^-A'\n  \
    ip6tables-save | grep '^-A' | awk '{print \"[6] \" $0}'\n  echo '@@end'\n}\n\
    wipe() {\n  ipvsadm -C\n  ip link del kube-ipvs0 2>/dev/null\n  \
    for t in filter nat mangle raw; do\n    iptables -t $t -F; iptables -t $t -X\n    \
    ip6tables -t $t -F; ip6tables -t $t -X\n  done\n  ipset destroy 2>/dev/null\n}\n";

/// The sections of a dump, in order.
pub const SECTIONS: [&str; 4] = ["ipvs", "addr", "ipset", "iptables"];

/// Section name → sorted lines, per phase.
pub type Dump = BTreeMap<String, BTreeMap<String, Vec<String>>>;

pub fn parse_dump(text: &str) -> Dump {
    let mut out = Dump::new();
    let (mut phase, mut sec) = (String::new(), String::new());
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("@@phase ") {
            phase = n.split_whitespace().next().unwrap_or_default().to_string();
            out.entry(phase.clone()).or_default();
            sec.clear();
        } else if line == "@@end" {
            sec.clear();
        } else if let Some(name) = line.strip_prefix("@@") {
            // Any other mark (`@@start`, `@@log`, …) ends the section.
            sec.clear();
            if !phase.is_empty() && SECTIONS.contains(&name) {
                sec = name.to_string();
            }
        } else if !sec.is_empty() && !line.trim().is_empty() {
            out.entry(phase.clone())
                .or_default()
                .entry(sec.clone())
                .or_default()
                .push(line.trim().to_string());
        }
    }
    for secs in out.values_mut() {
        for v in secs.values_mut() {
            v.sort();
        }
    }
    out
}

/// One allowed difference: lines of `section` containing `substring`.
#[derive(Debug, Clone)]
pub struct Allowed {
    pub section: String,
    pub substring: String,
}

/// `section<TAB>substring<TAB>reason` lines; `#` comments.
pub fn allowed() -> Vec<Allowed> {
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/oracle/allowed-differences.txt"),
    )
    .unwrap();
    parse_allowed(&text)
}

pub fn parse_allowed(text: &str) -> Vec<Allowed> {
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            assert!(
                f.len() == 3 && !f[2].trim().is_empty() && !f[1].is_empty(),
                "allowed difference needs section, substring and reason: {l}"
            );
            assert!(SECTIONS.contains(&f[0]), "unknown section in: {l}");
            Allowed {
                section: f[0].to_string(),
                substring: f[1].to_string(),
            }
        })
        .collect()
}

/// A line only one side has.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Difference {
    pub section: String,
    /// "upstream" or "kube-ipvs".
    pub side: &'static str,
    pub line: String,
}

/// Decides whether a line belongs to a computed class (an allowed entry whose substring starts
/// with `@`): `(class, side, line)`.
pub type Classes<'a> = &'a dyn Fn(&str, &str, &str) -> bool;

/// No computed classes.
pub fn no_classes(_: &str, _: &str, _: &str) -> bool {
    false
}

/// The lines only one side has, per section, less the allowed ones (a substring entry, or an
/// `@class` entry whose class `classes` says the line is in); with the indexes of the allowed
/// entries that matched anything.
pub fn differences(
    up: &BTreeMap<String, Vec<String>>,
    ours: &BTreeMap<String, Vec<String>>,
    allowed: &[Allowed],
    classes: Classes<'_>,
) -> (Vec<Difference>, BTreeSet<usize>) {
    let mut out = Vec::new();
    let mut used = BTreeSet::new();
    for sec in SECTIONS {
        let a: BTreeSet<&String> = up.get(sec).map(|v| v.iter().collect()).unwrap_or_default();
        let b: BTreeSet<&String> = ours
            .get(sec)
            .map(|v| v.iter().collect())
            .unwrap_or_default();
        let mut check = |l: &String, side: &'static str| {
            let hit = allowed.iter().position(|x| {
                x.section == sec
                    && match x.substring.strip_prefix('@') {
                        Some(_) => classes(&x.substring, side, l),
                        None => l.contains(x.substring.as_str()),
                    }
            });
            match hit {
                Some(i) => {
                    used.insert(i);
                }
                None => out.push(Difference {
                    section: sec.to_string(),
                    side,
                    line: l.clone(),
                }),
            }
        };
        for l in a.difference(&b) {
            check(l, "upstream");
        }
        for l in b.difference(&a) {
            check(l, "kube-ipvs");
        }
    }
    (out, used)
}
