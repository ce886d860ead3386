//! Running `iptables-save` / `iptables-restore` for the proxier: the real applier, or a
//! recorder in tests.

use super::*;

/// Runs `iptables-save` / `iptables-restore` for the proxier (the real [`Iptables`] applier, or
/// a recorder in tests).
pub trait RestoreRunner {
    /// `iptables-save -t TABLE`.
    fn save(&mut self, table: Table) -> Result<String, KernelError>;
    /// `iptables -t TABLE -S CHAIN`: one chain's rules (the periodic check's read).
    fn list_chain(&mut self, table: Table, chain: &str) -> Result<String, KernelError>;
    /// One `iptables-restore --noflush` with a payload that may hold several tables.
    fn restore(&mut self, payload: &str) -> Result<(), KernelError>;
    /// Processes spawned so far.
    fn processes(&self) -> u64;
}

impl RestoreRunner for Iptables {
    fn save(&mut self, table: Table) -> Result<String, KernelError> {
        Ok(Iptables::save(self, table)?)
    }
    fn list_chain(&mut self, table: Table, chain: &str) -> Result<String, KernelError> {
        Ok(Iptables::list_chain(self, table, chain)?)
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
    /// Chains listed (`list_chain`), in order: answered from `saved` (that chain's `-A`
    /// lines), or an error for a chain listed in `missing`.
    pub listed: Vec<(Table, String)>,
    /// Chains `list_chain` answers with an error (as `iptables -S` does for a chain that does
    /// not exist).
    pub missing: BTreeSet<String>,
    /// Fail the next restore with this message.
    pub fail_next: Option<String>,
}

impl RestoreRunner for RecordingRunner {
    fn save(&mut self, table: Table) -> Result<String, KernelError> {
        self.saves += 1;
        Ok(self.saved.get(&table).cloned().unwrap_or_default())
    }
    fn list_chain(&mut self, table: Table, chain: &str) -> Result<String, KernelError> {
        self.listed.push((table, chain.to_string()));
        if self.missing.contains(chain) {
            return Err(KernelError::Injected(format!(
                "iptables -t {table} -S {chain}: No chain/target/match by that name."
            )));
        }
        let prefix = format!("-A {chain} ");
        let saved = self.saved.get(&table).map(String::as_str).unwrap_or("");
        Ok(saved
            .lines()
            .filter(|l| l.starts_with(&prefix))
            .map(|l| format!("{l}\n"))
            .collect())
    }
    fn restore(&mut self, payload: &str) -> Result<(), KernelError> {
        self.restores.push(payload.to_string());
        match self.fail_next.take() {
            Some(m) => Err(KernelError::Injected(m)),
            None => Ok(()),
        }
    }
    fn processes(&self) -> u64 {
        self.saves + self.listed.len() as u64 + self.restores.len() as u64
    }
}

/// A [`RecordingRunner`] the caller keeps reading while the proxier owns a clone (tests).
#[derive(Debug, Default, Clone)]
pub struct SharedRecording(pub std::sync::Arc<std::sync::Mutex<RecordingRunner>>);

impl SharedRecording {
    /// A copy of the records so far.
    pub fn get(&self) -> RecordingRunner {
        self.with(|r| r.clone())
    }

    /// Runs `f` on the recorder (a poisoned lock is taken over: the records stay readable).
    pub fn with<T>(&self, f: impl FnOnce(&mut RecordingRunner) -> T) -> T {
        match self.0.lock() {
            Ok(mut r) => f(&mut r),
            Err(p) => f(&mut p.into_inner()),
        }
    }
}

impl RestoreRunner for SharedRecording {
    fn save(&mut self, table: Table) -> Result<String, KernelError> {
        self.with(|r| r.save(table))
    }
    fn list_chain(&mut self, table: Table, chain: &str) -> Result<String, KernelError> {
        self.with(|r| r.list_chain(table, chain))
    }
    fn restore(&mut self, payload: &str) -> Result<(), KernelError> {
        self.with(|r| r.restore(payload))
    }
    fn processes(&self) -> u64 {
        self.with(|r| r.processes())
    }
}
