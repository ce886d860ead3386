//! ipset capacity: whether a Service's new state fits in kube-proxy's sets, whose `maxelem`
//! ([`ipset::MAX_ELEM`], upstream's 65536) the kernel enforces per set, for every Service at
//! once.
//!
//! A set at `maxelem` refuses every further member ("Hash is full"), whoever adds it: left to
//! the kernel, the Service that overfills a set fails the ipset step of every sync on this node
//! (it is retried forever) and the node is never healthy. So the set sizes are checked before a
//! Service's state is taken in ([`Desired::ipset_room`]): a Service whose members would push a
//! set beyond `maxelem` is rejected like an invalid one and keeps its last good state; the
//! Services already holding members keep them (within one sync, Services are taken in name
//! order). Upstream has no such check (its `ipset restore` of the whole set fails).
//!
//! The one exception is the hairpin set, `KUBE-LOOP-BACK` (one member per local endpoint and
//! port: masquerade for a pod that reaches itself through its Service): a Service that
//! overfills only that set is taken in without its hairpin members
//! ([`Desired::ipset_room_or_without_hairpin`]), so a node whose pods fill the set (one
//! tenant's Services with many ports can) loses hairpin for the Services that come after, not
//! their ClusterIPs and NodePorts. Every other set decides reachability (the masquerade and
//! filter rules match them), so overfilling one still rejects the Service.

use ipset::SetKind;
use model::{Invalid, ServiceName};

use super::Desired;
use crate::types::ServiceDesired;

/// Members promised to the Services taken in during one derivation (not yet installed), per
/// set.
#[derive(Debug, Clone, Default)]
pub struct SetGrowth([usize; SetKind::ALL.len()]);

impl Desired {
    /// Members of `set` now.
    pub fn set_size(&self, set: SetKind) -> usize {
        self.entries.size(set)
    }

    /// Checks that `new`, replacing `name`'s current state, leaves every set within `max_elem`
    /// members, counting what `pending` already promised to other Services of this
    /// derivation; when it fits, its growth is added to `pending`. A Service that does not grow
    /// a set is never refused for it.
    pub fn ipset_room(
        &self,
        name: &ServiceName,
        new: &ServiceDesired,
        max_elem: usize,
        pending: &mut SetGrowth,
    ) -> Result<(), Invalid> {
        let mut grow = [0usize; SetKind::ALL.len()];
        let mut free = [0usize; SetKind::ALL.len()];
        for e in new.ipset_entries.iter() {
            if !self.entries.contains(e) {
                grow[e.set as usize] += 1;
            }
        }
        if let Some(old) = self.services.get(name) {
            for e in old.ipset_entries.iter() {
                if self.entries.holders(e) == 1 && !new.ipset_entries.contains(e) {
                    free[e.set as usize] += 1;
                }
            }
        }
        for k in SetKind::ALL {
            let i = k as usize;
            if grow[i] <= free[i] {
                continue;
            }
            let after = self.entries.size(k) + pending.0[i] + grow[i] - free[i];
            if after > max_elem {
                return Err(Invalid::new(format!(
                    "would overfill an ipset ({} would hold {after} members, maxelem {max_elem})",
                    k.name(self.family)
                )));
            }
        }
        for k in SetKind::ALL {
            let i = k as usize;
            pending.0[i] += grow[i].saturating_sub(free[i]);
        }
        Ok(())
    }

    /// [`Desired::ipset_room`], except for a Service that overfills only `KUBE-LOOP-BACK`: it
    /// fits once its hairpin members are taken out of `new`, which then holds none, and the
    /// reason (for a partial rejection) is returned. `Ok(None)`: `new` fits as it is.
    pub fn ipset_room_or_without_hairpin(
        &self,
        name: &ServiceName,
        new: &mut ServiceDesired,
        max_elem: usize,
        pending: &mut SetGrowth,
    ) -> Result<Option<Invalid>, Invalid> {
        let why = match self.ipset_room(name, new, max_elem, pending) {
            Ok(()) => return Ok(None),
            Err(why) => why,
        };
        let hairpin = |e: &crate::types::IpsetEntry| e.set == SetKind::LoopBack;
        let left_out = new.ipset_entries.iter().filter(|e| hairpin(e)).count();
        if left_out == 0 {
            return Err(why);
        }
        let mut without = new.clone();
        without.ipset_entries.retain(|e| !hairpin(e));
        // Another set overfills too: rejected with that set named.
        self.ipset_room(name, &without, max_elem, pending)?;
        *new = without;
        Ok(Some(Invalid::new(format!(
            "hairpin members left out ({left_out} members would overfill {}, maxelem \
             {max_elem}): a pod reaching this Service through its ClusterIP may not reach itself",
            SetKind::LoopBack.name(self.family)
        ))))
    }
}
