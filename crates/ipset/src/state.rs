//! Desired/current ipset state, the pure diff between two states, and the `ipset restore` /
//! `ipset save` text formats.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::entry::Entry;
use crate::set::{Family, SetKind, SetSpec, SetType};
use crate::Error;

/// One set: how it is created and its members, each with an opaque owner label (e.g.
/// `"default/web:http"`) used to report which object a kernel-rejected entry came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetState {
    /// Creation parameters.
    pub spec: SetSpec,
    /// Members → owner label (empty when unknown, e.g. read from the kernel).
    pub entries: BTreeMap<Entry, String>,
    /// Set read from the kernel with a type this crate does not model (its name as printed);
    /// such a set is always recreated if desired.
    pub foreign_type: Option<String>,
}

/// A set of ipsets by name (desired, or read from the kernel).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IpsetState {
    sets: BTreeMap<String, SetState>,
}

impl IpsetState {
    /// An empty state (no sets).
    pub fn new() -> IpsetState {
        IpsetState::default()
    }

    /// The 17 kube-proxy sets of `family`, all empty.
    pub fn kube(family: Family) -> IpsetState {
        let mut s = IpsetState::new();
        for k in SetKind::ALL {
            s.ensure_set(k.spec(family));
        }
        s
    }

    /// Declare a set (keeps existing members if a set of that name exists; replaces its spec).
    pub fn ensure_set(&mut self, spec: SetSpec) {
        match self.sets.get_mut(&spec.name) {
            Some(s) => s.spec = spec,
            None => {
                self.sets.insert(
                    spec.name.clone(),
                    SetState {
                        spec,
                        entries: BTreeMap::new(),
                        foreign_type: None,
                    },
                );
            }
        }
    }

    /// Add a member to a declared set. The entry must fit the set's type and family.
    /// Returns whether it was new.
    pub fn insert(&mut self, set: &str, entry: Entry, owner: &str) -> Result<bool, Error> {
        let s = self
            .sets
            .get_mut(set)
            .ok_or_else(|| Error::UnknownSet(set.to_string()))?;
        let entry = entry.normalized();
        if entry.set_type() != s.spec.set_type {
            return Err(Error::InvalidEntry(format!(
                "{entry} ({owner}) does not fit {set} of type {}",
                s.spec.set_type
            )));
        }
        if let Some(f) = entry.family()? {
            if s.spec.set_type.is_hash() && f != s.spec.family {
                return Err(Error::InvalidEntry(format!(
                    "{entry} ({owner}) is not {} as set {set} is",
                    s.spec.family.as_str()
                )));
            }
        }
        Ok(s.entries.insert(entry, owner.to_string()).is_none())
    }

    /// Add a member to one of the 17 kube-proxy sets (declaring it if needed).
    pub fn add(
        &mut self,
        kind: SetKind,
        family: Family,
        entry: Entry,
        owner: &str,
    ) -> Result<bool, Error> {
        let name = kind.name(family);
        if !self.sets.contains_key(&name) {
            self.ensure_set(kind.spec(family));
        }
        self.insert(&name, entry, owner)
    }

    /// A set by name.
    pub fn get(&self, name: &str) -> Option<&SetState> {
        self.sets.get(name)
    }

    /// All sets by name.
    pub fn sets(&self) -> impl Iterator<Item = (&String, &SetState)> {
        self.sets.iter()
    }

    /// Total number of members over all sets.
    pub fn entry_count(&self) -> usize {
        self.sets.values().map(|s| s.entries.len()).sum()
    }

    /// Remove a set entirely (used to model "not present").
    pub fn remove_set(&mut self, name: &str) -> Option<SetState> {
        self.sets.remove(name)
    }
}

/// An entry to add, with its owner label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryChange {
    /// Set name.
    pub set: String,
    /// The member.
    pub entry: Entry,
    /// Owner label ("" when unknown).
    pub owner: String,
}

/// What must change to turn the current state into the desired one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IpsetDiff {
    /// Sets to create (absent now).
    pub creates: Vec<SetSpec>,
    /// Sets of the wrong type/family: destroyed and created again (then filled by `adds`).
    pub recreates: Vec<SetSpec>,
    /// Members to delete.
    pub dels: Vec<EntryChange>,
    /// Members to add.
    pub adds: Vec<EntryChange>,
    /// Sets present now but not desired: destroyed.
    pub destroys: Vec<String>,
}

impl IpsetDiff {
    /// True when nothing has to change.
    pub fn is_empty(&self) -> bool {
        self.creates.is_empty()
            && self.recreates.is_empty()
            && self.dels.is_empty()
            && self.adds.is_empty()
            && self.destroys.is_empty()
    }

    /// Number of operations (restore lines) in the diff.
    pub fn len(&self) -> usize {
        self.creates.len()
            + 2 * self.recreates.len()
            + self.dels.len()
            + self.adds.len()
            + self.destroys.len()
    }
}

/// Compare `desired` with `current` (which should hold only sets the caller owns: sets in
/// `current` that `desired` lacks are destroyed).
pub fn diff(desired: &IpsetState, current: &IpsetState) -> IpsetDiff {
    let mut d = IpsetDiff::default();
    let change = |set: &str, e: &Entry, owner: &str| EntryChange {
        set: set.to_string(),
        entry: e.clone(),
        owner: owner.to_string(),
    };
    for (name, want) in &desired.sets {
        match current.sets.get(name) {
            None => {
                d.creates.push(want.spec.clone());
                d.adds
                    .extend(want.entries.iter().map(|(e, o)| change(name, e, o)));
            }
            Some(have) if have.foreign_type.is_some() || !want.spec.compatible_with(&have.spec) => {
                d.recreates.push(want.spec.clone());
                d.adds
                    .extend(want.entries.iter().map(|(e, o)| change(name, e, o)));
            }
            Some(have) => {
                for (e, o) in &have.entries {
                    if !want.entries.contains_key(e) {
                        d.dels.push(change(name, e, o));
                    }
                }
                for (e, o) in &want.entries {
                    if !have.entries.contains_key(e) {
                        d.adds.push(change(name, e, o));
                    }
                }
            }
        }
    }
    for name in current.sets.keys() {
        if !desired.sets.contains_key(name) {
            d.destroys.push(name.clone());
        }
    }
    d
}

/// Where a line of a restore script came from (to map ipset's "Error in line N").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LineOrigin {
    /// `destroy` of a wrong-type set before recreating it.
    DestroyForRecreate(String),
    /// `create` of a set.
    Create(String),
    /// `del` of a member.
    Del(EntryChange),
    /// `add` of a member.
    Add(EntryChange),
    /// `destroy` of a set no longer desired.
    Destroy(String),
}

impl LineOrigin {
    /// The set the line touches.
    pub fn set(&self) -> &str {
        match self {
            LineOrigin::DestroyForRecreate(s) | LineOrigin::Create(s) | LineOrigin::Destroy(s) => s,
            LineOrigin::Del(c) | LineOrigin::Add(c) => &c.set,
        }
    }
}

/// The restore script lines of a diff, each with its origin, in a safe order: wrong-type sets
/// destroyed, sets created, members deleted, members added, unwanted sets destroyed.
pub fn restore_lines(diff: &IpsetDiff) -> Vec<(String, LineOrigin)> {
    let mut out = Vec::with_capacity(diff.len());
    for s in &diff.recreates {
        out.push((
            format!("destroy {}", s.name),
            LineOrigin::DestroyForRecreate(s.name.clone()),
        ));
    }
    for s in diff.recreates.iter().chain(&diff.creates) {
        out.push((
            format!("create {} {}", s.name, s.create_args()),
            LineOrigin::Create(s.name.clone()),
        ));
    }
    for c in &diff.dels {
        out.push((
            format!("del {} {}", c.set, c.entry),
            LineOrigin::Del(c.clone()),
        ));
    }
    for c in &diff.adds {
        out.push((
            format!("add {} {}", c.set, c.entry),
            LineOrigin::Add(c.clone()),
        ));
    }
    for s in &diff.destroys {
        out.push((format!("destroy {s}"), LineOrigin::Destroy(s.clone())));
    }
    out
}

/// The diff as one `ipset restore -exist` script.
pub fn render_restore(diff: &IpsetDiff) -> String {
    let mut s = String::new();
    for (line, _) in restore_lines(diff) {
        s.push_str(&line);
        s.push('\n');
    }
    s
}

/// A state in `ipset save` format (without the kernel's `bucketsize`/`initval` additions), for
/// `plan` output.
pub fn render_save(state: &IpsetState) -> String {
    let mut s = String::new();
    for (name, set) in &state.sets {
        let _ = writeln!(s, "create {name} {}", set.spec.create_args());
        for e in set.entries.keys() {
            let _ = writeln!(s, "add {name} {e}");
        }
    }
    s
}

/// Parse `ipset save` output, keeping only sets whose name `keep` accepts. An owned set of a
/// type this crate does not model is kept (members skipped) with `foreign_type` set, so the diff
/// recreates it.
pub fn parse_save(text: &str, keep: impl Fn(&str) -> bool) -> Result<IpsetState, Error> {
    let mut st = IpsetState::new();
    // sets whose type we do not model: members are skipped
    let mut foreign: Vec<String> = Vec::new();
    for (no, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let mut it = line.splitn(3, ' ');
        let cmd = it.next().unwrap_or_default();
        let name = it
            .next()
            .ok_or_else(|| Error::Parse(format!("ipset save line {}: {line:?}", no + 1)))?;
        let rest = it.next().unwrap_or_default();
        if !keep(name) {
            continue;
        }
        match cmd {
            "create" => {
                let mut words = rest.split_whitespace();
                let ty = words.next().unwrap_or_default();
                let mut family = Family::V4;
                let mut hash_size = 1024;
                let mut max_elem = 65536;
                while let Some(w) = words.next() {
                    match w {
                        "family" => {
                            family = match words.next() {
                                Some("inet6") => Family::V6,
                                _ => Family::V4,
                            }
                        }
                        "hashsize" => {
                            hash_size = words.next().and_then(|v| v.parse().ok()).unwrap_or(0)
                        }
                        "maxelem" => {
                            max_elem = words.next().and_then(|v| v.parse().ok()).unwrap_or(0)
                        }
                        _ => {}
                    }
                }
                let set_type = match SetType::parse(ty) {
                    Some(t) => t,
                    None => {
                        foreign.push(name.to_string());
                        st.ensure_set(SetSpec::new(name, SetType::HashIp, family));
                        if let Some(s) = st.sets.get_mut(name) {
                            s.foreign_type = Some(ty.to_string());
                        }
                        continue;
                    }
                };
                st.ensure_set(SetSpec {
                    name: name.to_string(),
                    set_type,
                    family,
                    hash_size,
                    max_elem,
                });
            }
            "add" => {
                if foreign.iter().any(|f| f == name) {
                    continue;
                }
                let set = st.sets.get_mut(name).ok_or_else(|| {
                    Error::Parse(format!("ipset save line {}: add before create", no + 1))
                })?;
                // `rest` is the member, optionally followed by options (comment "...", timeout …)
                let member = rest.split_whitespace().next().unwrap_or_default();
                let e = Entry::parse(set.spec.set_type, member)?;
                set.entries.insert(e, String::new());
            }
            _ => {
                return Err(Error::Parse(format!(
                    "ipset save line {}: unexpected {line:?}",
                    no + 1
                )))
            }
        }
    }
    Ok(st)
}
