//! Running `iptables-save` / `iptables-restore` for the proxier: the real applier, or a
//! recorder in tests.

use super::*;

/// Runs `iptables-save` / `iptables-restore` for the proxier (the real [`Iptables`] applier, or
/// a recorder in tests).
pub trait RestoreRunner {
    /// `iptables-save -t TABLE`.
    fn save(&mut self, table: Table) -> Result<String, KernelError>;
    /// One `iptables-restore --noflush` with a payload that may hold several tables.
    fn restore(&mut self, payload: &str) -> Result<(), KernelError>;
    /// Processes spawned so far.
    fn processes(&self) -> u64;
}

impl RestoreRunner for Iptables {
    fn save(&mut self, table: Table) -> Result<String, KernelError> {
        Ok(Iptables::save(self, table)?)
    }
    fn restore(&mut self, payload: &str) -> Result<(), KernelError> {
        Ok(self.apply_restore(Table::Nat, payload)?)
    }
    fn processes(&self) -> u64 {
        self.processes_spawned()
    }
}

/// A [`RestoreRunner`] that records payloads and answers saves with fixed text (for tests and
/// `plan`-style rendering).
#[derive(Debug, Default, Clone)]
pub struct RecordingRunner {
    /// Every restore payload, in order.
    pub restores: Vec<String>,
    /// What `save` returns, per table (empty when unset).
    pub saved: BTreeMap<Table, String>,
    /// Saves run.
    pub saves: u64,
    /// Fail the next restore with this message.
    pub fail_next: Option<String>,
}

impl RestoreRunner for RecordingRunner {
    fn save(&mut self, table: Table) -> Result<String, KernelError> {
        self.saves += 1;
        Ok(self.saved.get(&table).cloned().unwrap_or_default())
    }
    fn restore(&mut self, payload: &str) -> Result<(), KernelError> {
        self.restores.push(payload.to_string());
        match self.fail_next.take() {
            Some(m) => Err(KernelError::Injected(m)),
            None => Ok(()),
        }
    }
    fn processes(&self) -> u64 {
        self.saves + self.restores.len() as u64
    }
}
