//! `check()`'s ledger: a stored key lost other than by eviction or replacement (a rollback that
//! forgets it) breaks `stored == written - evicted - replaced`, which no structural count sees.

/// Stored objects removed by eviction, and objects whose bytes a re-put replaced.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Ledger {
    pub evicted_stored: u64,
    pub replaced: u64,
}

impl Ledger {
    /// The ledger's equation, or the invariant's name.
    pub(crate) fn check(&self, written: u64, stored: usize) -> Result<(), String> {
        let ledger = written - self.evicted_stored - self.replaced;
        if ledger == stored as u64 {
            return Ok(());
        }
        Err(format!(
            "every object written and not evicted or replaced is stored: {stored} stored, \
             {ledger} by the ledger ({written} written, {} evicted, {} replaced)",
            self.evicted_stored, self.replaced
        ))
    }
}
