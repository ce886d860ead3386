//! Generic rule-set types: tables, jumps from built-in chains, and restore payload assembly.

use std::collections::BTreeMap;
use std::fmt;

use crate::{Error, Result};

/// An iptables table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Table {
    /// `nat`
    Nat,
    /// `filter`
    Filter,
    /// `mangle`
    Mangle,
    /// `raw`
    Raw,
}

impl Table {
    /// The table name.
    pub fn as_str(self) -> &'static str {
        match self {
            Table::Nat => "nat",
            Table::Filter => "filter",
            Table::Mangle => "mangle",
            Table::Raw => "raw",
        }
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A jump from a built-in chain to one of our chains, kept exactly once at the top of `from`
/// (`-I FROM -m comment --comment "COMMENT" -j TO`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Jump {
    /// Table.
    pub table: Table,
    /// Built-in chain (PREROUTING, OUTPUT, …).
    pub from: String,
    /// Our chain.
    pub to: String,
    /// Comment, as upstream writes it (e.g. "kubernetes service portals").
    pub comment: String,
}

impl Jump {
    /// A jump.
    pub fn new(table: Table, from: &str, to: &str, comment: &str) -> Jump {
        Jump {
            table,
            from: from.to_string(),
            to: to.to_string(),
            comment: comment.to_string(),
        }
    }

    /// The rule spec after the chain name, exactly as `iptables-save` prints it.
    pub fn spec(&self) -> String {
        format!(
            "-m comment --comment {} -j {}",
            quote(&self.comment),
            self.to
        )
    }

    /// The `-A FROM …` line as `iptables-save` prints it.
    pub fn save_line(&self) -> String {
        format!("-A {} {}", self.from, self.spec())
    }
}

/// An interface name as `-i` takes it (both modes' local-traffic detection): 1 to 15
/// characters of letters, digits, `-`, `_` and `.`.
pub(crate) fn iface(s: &str) -> Result<&str> {
    if s.is_empty()
        || s.len() > 15
        || !s
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(Error::InvalidInput(format!("bad interface name {s:?}")));
    }
    Ok(s)
}

/// Quote a comment the way iptables-save does (always in double quotes here).
pub(crate) fn quote(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "'"))
}

/// Everything one proxy mode owns in iptables: per table, its chains (flushed and refilled on
/// every restore) and their rules; plus the jumps into them from built-in chains.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuleSet {
    /// Per table: (our chains in declaration order, rule lines `-A CHAIN …`).
    pub tables: BTreeMap<Table, (Vec<String>, Vec<String>)>,
    /// Jumps from built-in chains.
    pub jumps: Vec<Jump>,
}

impl RuleSet {
    /// Declare a chain we own.
    pub fn chain(&mut self, table: Table, chain: &str) {
        let t = self.tables.entry(table).or_default();
        if !t.0.iter().any(|c| c == chain) {
            t.0.push(chain.to_string());
        }
    }

    /// Append a rule line (`-A CHAIN …`).
    pub fn rule(&mut self, table: Table, line: String) {
        self.tables.entry(table).or_default().1.push(line);
    }

    /// The `iptables-restore --noflush` payload of one table: `*table`, `:CHAIN - [0:0]` for each
    /// of our chains (which flushes them), the rules, `COMMIT`. Built-in chains are never
    /// declared, so nothing else in the table is touched.
    pub fn restore_text(&self, table: Table) -> Option<String> {
        let (chains, rules) = self.tables.get(&table)?;
        let mut s = format!("*{table}\n");
        for c in chains {
            s.push_str(&format!(":{c} - [0:0]\n"));
        }
        for r in rules {
            s.push_str(r);
            s.push('\n');
        }
        s.push_str("COMMIT\n");
        Some(s)
    }

    /// The nat payload (empty string if the rule set has no nat table).
    pub fn nat(&self) -> String {
        self.restore_text(Table::Nat).unwrap_or_default()
    }

    /// The filter payload (empty string if the rule set has no filter table).
    pub fn filter(&self) -> String {
        self.restore_text(Table::Filter).unwrap_or_default()
    }

    /// All payloads plus jumps, for `plan` output.
    pub fn render(&self) -> String {
        let mut s = String::new();
        for t in self.tables.keys() {
            if let Some(text) = self.restore_text(*t) {
                s.push_str(&text);
            }
        }
        for j in &self.jumps {
            s.push_str(&format!(
                "# ensured once in {}: {}\n",
                j.table,
                j.save_line()
            ));
        }
        s
    }
}
