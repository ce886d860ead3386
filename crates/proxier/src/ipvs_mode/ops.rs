//! Pure helpers over diffs and operations: drift not explained by the pending changes, set
//! counts, the split of an ipset diff around address changes, which real servers drain.

use std::sync::Arc;

use super::*;

/// The differences a full sync found that the pending changes do not explain (drift), per
/// subsystem: IPVS operations on virtual servers the changes did not touch, ipset members and
/// set (re)creations or destructions the changes did not ask for, addresses the changes did not
/// bind or unbind.
///
/// What the kernel refuses for isolated Services (`isolated`: their virtual servers and set
/// members) differs at every full sync and is not drift either.
pub(super) fn unexplained(
    expected: &Delta,
    fam: ipset::Family,
    ipvs: Option<&IpvsOps>,
    sets: Option<&IpsetDiff>,
    (addr_add, addr_del): (&[IpAddr], &[IpAddr]),
    isolated: &(BTreeSet<ServiceKey>, BTreeSet<(String, ipset::Entry)>),
) -> (usize, usize, usize) {
    let mut keys: BTreeSet<ServiceKey> = expected
        .ipvs
        .apply
        .iter()
        .chain(&expected.ipvs.remove)
        .filter_map(op_key)
        .collect();
    keys.extend(isolated.0.iter().copied());
    let n_ipvs = ipvs.map_or(0, |ops| {
        ops.apply
            .iter()
            .chain(&ops.remove)
            .filter(|op| op_key(op).is_none_or(|k| !keys.contains(&k)))
            .count()
    });
    let mut members: BTreeSet<(String, ipset::Entry)> = expected
        .ipset_add
        .iter()
        .chain(&expected.ipset_del)
        .map(|e| (e.set.name(fam), e.entry.clone()))
        .collect();
    members.extend(isolated.1.iter().cloned());
    let n_sets = sets.map_or(0, |d| {
        let changed = d
            .adds
            .iter()
            .chain(&d.dels)
            .filter(|c| !members.contains(&(c.set.to_string(), c.entry.clone())))
            .count();
        d.len() - d.adds.len() - d.dels.len() + changed
    });
    let addrs: BTreeSet<IpAddr> = expected
        .addresses_add
        .iter()
        .chain(&expected.addresses_del)
        .copied()
        .collect();
    let n_addr = addr_add
        .iter()
        .chain(addr_del)
        .filter(|a| !addrs.contains(a))
        .count();
    (n_ipvs, n_sets, n_addr)
}

pub(super) fn count_sets(desired: &Desired) -> BTreeMap<SetKind, usize> {
    let mut counts = BTreeMap::new();
    for e in desired.ipset_members() {
        *counts.entry(e.set).or_default() += 1;
    }
    counts
}

/// The set kinds non-empty before or after a change.
pub(super) fn union_of(before: &BTreeSet<SetKind>, after: &BTreeSet<SetKind>) -> BTreeSet<SetKind> {
    before.union(after).copied().collect()
}

pub(super) fn non_empty(counts: &BTreeMap<SetKind, usize>) -> BTreeSet<SetKind> {
    counts
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, _)| *k)
        .collect()
}

pub(super) fn entry_changes(entries: &[IpsetEntry], fam: ipset::Family) -> Vec<EntryChange> {
    let unknown: Arc<str> = Arc::from("");
    entries
        .iter()
        .map(|e| EntryChange {
            set: Arc::from(e.set.name(fam)),
            entry: e.entry.clone(),
            owner: unknown.clone(),
        })
        .collect()
}

/// Splits a full ipset diff into what must happen before a VIP is bound (creates, adds) and
/// after it is unbound (deletes, destroys).
pub(super) fn split_set_diff(d: IpsetDiff) -> (IpsetDiff, IpsetDiff) {
    let grow = IpsetDiff {
        creates: d.creates,
        recreates: d.recreates,
        adds: d.adds,
        ..IpsetDiff::default()
    };
    let shrink = IpsetDiff {
        dels: d.dels,
        destroys: d.destroys,
        ..IpsetDiff::default()
    };
    (grow, shrink)
}

/// Real servers of TCP and SCTP virtual servers drain; UDP ones are deleted at once.
pub(super) fn drains(k: &ServiceKey) -> bool {
    !matches!(
        k,
        ServiceKey::Inet {
            protocol: ipvs_netlink::Protocol::Udp,
            ..
        }
    )
}

pub(super) fn op_key(op: &Op) -> Option<ServiceKey> {
    match op {
        Op::NewService(s) | Op::SetService(s) => Some(s.key),
        Op::DelService(k) | Op::NewDest(k, _) | Op::SetDest(k, _) | Op::DelDest(k, ..) => Some(*k),
        Op::Flush | Op::SetTimeouts(_) => None,
    }
}
