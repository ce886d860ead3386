//! Desired/current ipset state, the pure diff between two states, and the `ipset restore` /
//! `ipset save` text formats.

use std::collections::BTreeMap;
use std::fmt;
use std::fmt::Write as _;
use std::sync::Arc;

use crate::entry::Entry;
use crate::set::{Family, SetKind, SetSpec, SetType};
use crate::Error;

/// One set: how it is created and its members, each with an opaque owner label (e.g.
/// `"default/web:http"`) used to report which object a kernel-rejected entry came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetState {
    /// Creation parameters.
    pub spec: SetSpec,
    /// Members → owner label (empty when unknown, e.g. read from the kernel). Shared: a
    /// service's members, and the changes made from them, hold one copy of its label.
    pub entries: BTreeMap<Entry, Arc<str>>,
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
        self.insert_shared(set, entry, &Arc::from(owner))
    }

    /// [`IpsetState::insert`] with an owner label shared with other members.
    pub fn insert_shared(
        &mut self,
        set: &str,
        entry: Entry,
        owner: &Arc<str>,
    ) -> Result<bool, Error> {
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
        Ok(s.entries.insert(entry, owner.clone()).is_none())
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

    /// Put a whole set (as read from the kernel), replacing one of the same name.
    pub(crate) fn put_set(&mut self, set: SetState) {
        self.sets.insert(set.spec.name.clone(), set);
    }

    /// Remove a set entirely (used to model "not present").
    pub fn remove_set(&mut self, name: &str) -> Option<SetState> {
        self.sets.remove(name)
    }
}

/// An entry to add, with its owner label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryChange {
    /// Set name (shared by the changes of one set).
    pub set: Arc<str>,
    /// The member.
    pub entry: Entry,
    /// Owner label ("" when unknown; shared with the member's state).
    pub owner: Arc<str>,
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
    let change = |set: &Arc<str>, e: &Entry, owner: &Arc<str>| EntryChange {
        set: set.clone(),
        entry: e.clone(),
        owner: owner.clone(),
    };
    for (set_name, want) in &desired.sets {
        let name = &Arc::<str>::from(set_name.as_str());
        match current.sets.get(set_name) {
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

/// One line of a restore script, borrowed from its diff: what it does and to what (so ipset's
/// "Error in line N" maps back to an entry and its owner). Its text is its `Display`; a line
/// costs no allocation until it is written out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineOrigin<'a> {
    /// `destroy` of a wrong-type set before recreating it.
    DestroyForRecreate(&'a SetSpec),
    /// `create` of a set.
    Create(&'a SetSpec),
    /// `del` of a member.
    Del(&'a EntryChange),
    /// `add` of a member.
    Add(&'a EntryChange),
    /// `destroy` of a set no longer desired.
    Destroy(&'a str),
}

impl<'a> LineOrigin<'a> {
    /// The set the line touches.
    pub fn set(&self) -> &'a str {
        match *self {
            LineOrigin::DestroyForRecreate(s) | LineOrigin::Create(s) => &s.name,
            LineOrigin::Destroy(s) => s,
            LineOrigin::Del(c) | LineOrigin::Add(c) => &c.set,
        }
    }

    /// The member added or deleted (`None` for set lines).
    pub fn member(&self) -> Option<&'a EntryChange> {
        match *self {
            LineOrigin::Del(c) | LineOrigin::Add(c) => Some(c),
            _ => None,
        }
    }
}

impl fmt::Display for LineOrigin<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LineOrigin::DestroyForRecreate(s) => write!(f, "destroy {}", s.name),
            LineOrigin::Create(s) => write!(f, "create {} {}", s.name, s.create_args()),
            LineOrigin::Del(c) => write!(f, "del {} {}", c.set, c.entry),
            LineOrigin::Add(c) => write!(f, "add {} {}", c.set, c.entry),
            LineOrigin::Destroy(s) => write!(f, "destroy {s}"),
        }
    }
}

/// The restore script lines of a diff in a safe order: wrong-type sets destroyed, sets
/// created, members deleted, members added, unwanted sets destroyed.
pub fn restore_lines(diff: &IpsetDiff) -> Vec<LineOrigin<'_>> {
    let mut out = Vec::with_capacity(diff.len());
    out.extend(diff.recreates.iter().map(LineOrigin::DestroyForRecreate));
    out.extend(
        diff.recreates
            .iter()
            .chain(&diff.creates)
            .map(LineOrigin::Create),
    );
    out.extend(diff.dels.iter().map(LineOrigin::Del));
    out.extend(diff.adds.iter().map(LineOrigin::Add));
    out.extend(
        diff.destroys
            .iter()
            .map(|s| LineOrigin::Destroy(s.as_str())),
    );
    out
}

/// The diff as one `ipset restore -exist` script.
pub fn render_restore(diff: &IpsetDiff) -> String {
    let mut s = String::new();
    for line in restore_lines(diff) {
        let _ = writeln!(s, "{line}");
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
    // Members read from the kernel have no owner: one shared empty label.
    let unknown: Arc<str> = Arc::from("");
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
                let mut family = Family::Inet;
                let mut hash_size = 1024;
                let mut max_elem = 65536;
                while let Some(w) = words.next() {
                    match w {
                        "family" => {
                            family = match words.next() {
                                Some("inet6") => Family::Inet6,
                                _ => Family::Inet,
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
                set.entries.insert(e, unknown.clone());
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::Protocol;
    use std::net::IpAddr;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn kube_state_has_17_sets_with_upstream_names_and_types() {
        let st = IpsetState::kube(Family::Inet);
        let names: Vec<_> = st
            .sets()
            .map(|(n, s)| (n.clone(), s.spec.set_type))
            .collect();
        assert_eq!(names.len(), 17);
        assert!(names.contains(&("KUBE-LOOP-BACK".into(), SetType::HashIpPortIp)));
        assert!(names.contains(&("KUBE-NODE-PORT-SCTP-HASH".into(), SetType::HashIpPort)));
        assert!(names.contains(&("KUBE-HEALTH-CHECK-NODE-PORT".into(), SetType::BitmapPort)));
        assert!(names.contains(&("KUBE-IPVS-IPS".into(), SetType::HashIp)));
        let v6 = IpsetState::kube(Family::Inet6);
        let v6names: Vec<_> = v6.sets().map(|(n, _)| n.clone()).collect();
        assert!(v6names
            .iter()
            .all(|n| n.starts_with("KUBE-6-") && n.len() <= 31));
        // upstream truncates to 31 characters
        assert!(v6names.contains(&"KUBE-6-LOAD-BALANCER-SOURCE-CID".to_string()));
        assert!(v6names.contains(&"KUBE-6-NODE-PORT-LOCAL-SCTP-HAS".to_string()));
        assert_eq!(
            SetKind::from_name("KUBE-6-LOAD-BALANCER-SOURCE-CID"),
            Some((SetKind::LoadBalancerSourceCidr, Family::Inet6))
        );
        let s = v6.get("KUBE-6-CLUSTER-IP").unwrap();
        assert_eq!(
            s.spec.create_args(),
            "hash:ip,port family inet6 hashsize 1024 maxelem 65536 comment"
        );
    }

    #[test]
    fn insert_checks_type_and_family() {
        let mut st = IpsetState::kube(Family::Inet);
        let e = Entry::ip_port(ip("10.96.0.1"), Protocol::Tcp, 80);
        assert!(st.insert("KUBE-CLUSTER-IP", e.clone(), "a/b:c").unwrap());
        assert!(!st.insert("KUBE-CLUSTER-IP", e.clone(), "a/b:c").unwrap());
        assert!(st.insert("KUBE-LOOP-BACK", e, "x").is_err());
        let v6 = Entry::ip_port(ip("fd00::1"), Protocol::Tcp, 80);
        assert!(st.insert("KUBE-CLUSTER-IP", v6, "x").is_err());
        assert!(st.insert("KUBE-NOPE", Entry::Port(1), "x").is_err());
        // bitmap:port has no family
        assert!(st
            .insert("KUBE-NODE-PORT-TCP", Entry::Port(30080), "x")
            .unwrap());
    }

    fn sample() -> IpsetState {
        let mut st = IpsetState::new();
        st.ensure_set(SetKind::ClusterIp.spec(Family::Inet));
        st.ensure_set(SetKind::NodePortTcp.spec(Family::Inet));
        st
    }

    #[test]
    fn diff_creates_missing_sets_with_their_members() {
        let mut want = sample();
        want.add(
            SetKind::ClusterIp,
            Family::Inet,
            Entry::ip_port(ip("10.96.0.1"), Protocol::Tcp, 443),
            "default/kubernetes:https",
        )
        .unwrap();
        let d = diff(&want, &IpsetState::new());
        assert_eq!(d.creates.len(), 2);
        assert_eq!(d.adds.len(), 1);
        assert_eq!(&*d.adds[0].owner, "default/kubernetes:https");
        let script = render_restore(&d);
        let lines: Vec<_> = script.lines().collect();
        assert_eq!(
            lines,
            vec![
                "create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536 comment",
                "create KUBE-NODE-PORT-TCP bitmap:port range 0-65535 comment",
                "add KUBE-CLUSTER-IP 10.96.0.1,tcp:443",
            ]
        );
    }

    #[test]
    fn diff_adds_and_deletes_only_changes() {
        let mut want = sample();
        let mut have = sample();
        want.insert("KUBE-NODE-PORT-TCP", Entry::Port(30001), "a")
            .unwrap();
        want.insert("KUBE-NODE-PORT-TCP", Entry::Port(30002), "b")
            .unwrap();
        have.insert("KUBE-NODE-PORT-TCP", Entry::Port(30002), "")
            .unwrap();
        have.insert("KUBE-NODE-PORT-TCP", Entry::Port(30003), "")
            .unwrap();
        let d = diff(&want, &have);
        assert!(d.creates.is_empty() && d.recreates.is_empty() && d.destroys.is_empty());
        assert_eq!(d.adds.len(), 1);
        assert_eq!(d.adds[0].entry, Entry::Port(30001));
        assert_eq!(d.dels.len(), 1);
        assert_eq!(d.dels[0].entry, Entry::Port(30003));
        assert_eq!(
            render_restore(&d),
            "del KUBE-NODE-PORT-TCP 30003\nadd KUBE-NODE-PORT-TCP 30001\n"
        );
        assert!(diff(&want, &want).is_empty());
    }

    #[test]
    fn diff_recreates_wrong_type_and_destroys_unwanted() {
        let mut want = sample();
        want.insert(
            "KUBE-CLUSTER-IP",
            Entry::ip_port(ip("10.96.0.10"), Protocol::Udp, 53),
            "kube-system/kube-dns:dns",
        )
        .unwrap();
        let mut have = IpsetState::new();
        have.ensure_set(SetSpec::new(
            "KUBE-CLUSTER-IP",
            SetType::HashIp,
            Family::Inet,
        ));
        have.insert("KUBE-CLUSTER-IP", Entry::Ip(ip("10.96.0.10")), "")
            .unwrap();
        have.ensure_set(SetKind::NodePortTcp.spec(Family::Inet));
        have.ensure_set(SetKind::LoopBack.spec(Family::Inet));
        let d = diff(&want, &have);
        assert_eq!(d.recreates.len(), 1);
        assert_eq!(d.destroys, vec!["KUBE-LOOP-BACK".to_string()]);
        let s = render_restore(&d);
        let lines: Vec<_> = s.lines().collect();
        assert_eq!(lines[0], "destroy KUBE-CLUSTER-IP");
        assert!(lines[1].starts_with("create KUBE-CLUSTER-IP hash:ip,port "));
        assert_eq!(lines[2], "add KUBE-CLUSTER-IP 10.96.0.10,udp:53");
        assert_eq!(lines[3], "destroy KUBE-LOOP-BACK");
        // a family change is a type change too
        let mut have6 = IpsetState::new();
        have6.ensure_set(SetSpec::new(
            "KUBE-CLUSTER-IP",
            SetType::HashIpPort,
            Family::Inet6,
        ));
        have6.ensure_set(SetKind::NodePortTcp.spec(Family::Inet6));
        let d = diff(&want, &have6);
        assert_eq!(d.recreates.len(), 1, "{d:?}");
        assert_eq!(d.recreates[0].name, "KUBE-CLUSTER-IP");
    }

    const SAVE: &str = "\
create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536 comment bucketsize 12 initval 0xe87cc940
add KUBE-CLUSTER-IP 10.96.0.2,udp:53 comment \"hi there\"
add KUBE-CLUSTER-IP 10.96.0.1,tcp:80
create KUBE-NODE-PORT-TCP bitmap:port range 0-65535 comment
add KUBE-NODE-PORT-TCP 80
create KUBE-LOAD-BALANCER-SOURCE-CIDR hash:ip,port,net family inet hashsize 1024 maxelem 65536 comment bucketsize 12 initval 0x5cc1f117
add KUBE-LOAD-BALANCER-SOURCE-CIDR 1.2.3.4,tcp:80,10.0.0.0/8
add KUBE-LOAD-BALANCER-SOURCE-CIDR 1.2.3.4,tcp:80,10.1.2.3
create KUBE-6-LOOP-BACK hash:ip,port,ip family inet6 hashsize 1024 maxelem 65536 comment bucketsize 12 initval 0x06bc58b9
add KUBE-6-LOOP-BACK fd00::1,tcp:80,fd00::1
create OTHER hash:net family inet hashsize 1024 maxelem 65536
add OTHER 192.168.0.0/16
create KUBE-IPVS-IPS hash:net family inet hashsize 1024 maxelem 65536
add KUBE-IPVS-IPS 192.168.0.0/16
";

    #[test]
    fn parse_save_reads_owned_sets_only() {
        let st = parse_save(SAVE, |n| n.starts_with("KUBE-")).unwrap();
        assert!(st.get("OTHER").is_none());
        assert_eq!(st.get("KUBE-CLUSTER-IP").unwrap().entries.len(), 2);
        let cidr = st.get("KUBE-LOAD-BALANCER-SOURCE-CIDR").unwrap();
        assert_eq!(cidr.spec.set_type, SetType::HashIpPortNet);
        let v6 = st.get("KUBE-6-LOOP-BACK").unwrap();
        assert_eq!(v6.spec.family, Family::Inet6);
        assert_eq!(st.entry_count(), 6);
        // an owned set of a foreign type is marked and recreated by the diff
        assert_eq!(
            st.get("KUBE-IPVS-IPS").unwrap().foreign_type.as_deref(),
            Some("hash:net")
        );
        let mut want = IpsetState::new();
        want.ensure_set(SetKind::IpvsIps.spec(Family::Inet));
        let d = diff(&want, &parse_save(SAVE, |n| n == "KUBE-IPVS-IPS").unwrap());
        assert_eq!(d.recreates.len(), 1);
    }

    #[test]
    fn render_save_round_trips() {
        let mut st = IpsetState::kube(Family::Inet);
        st.add(
            SetKind::LoadBalancerSourceCidr,
            Family::Inet,
            Entry::ip_port_net(
                ip("1.2.3.4"),
                Protocol::Tcp,
                80,
                "10.9.9.9/8".parse().unwrap(),
            ),
            "o",
        )
        .unwrap();
        st.add(
            SetKind::LoopBack,
            Family::Inet,
            Entry::ip_port_ip(ip("10.244.0.5"), Protocol::Sctp, 9, ip("10.244.0.5")),
            "o",
        )
        .unwrap();
        let text = render_save(&st);
        assert!(text.contains("add KUBE-LOAD-BALANCER-SOURCE-CIDR 1.2.3.4,tcp:80,10.0.0.0/8\n"));
        let back = parse_save(&text, |_| true).unwrap();
        assert!(diff(&st, &back).is_empty());
        assert_eq!(back.entry_count(), 2);
    }

    #[test]
    fn parse_save_rejects_garbage() {
        assert!(parse_save("add KUBE-X 1.2.3.4\n", |_| true).is_err());
        assert!(parse_save("frobnicate KUBE-X\n", |_| true).is_err());
        assert!(parse_save(
            "create KUBE-X hash:ip family inet\nadd KUBE-X notanip\n",
            |_| true
        )
        .is_err());
        assert!(parse_save("create\n", |_| true).is_err());
    }
}
