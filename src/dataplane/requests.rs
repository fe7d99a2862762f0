//! The requests the worker tracks (vLLM's `requests` dict): a state per request, found by id,
//! in a table whose indices stay put while a request lives (steps in flight name them).

use std::ops::{Index, IndexMut};

use foldhash::HashMap;

use super::staging::Staged;
use super::PlaneError;

#[derive(Debug)]
pub(super) struct RequestState {
    pub(super) id: Box<str>,
    /// Insertion order of the request map (Python dict order).
    pub(super) seq: u64,
    pub(super) keys: Vec<Box<str>>,
    /// Its rows in the staging buffer: unkeyed full blocks and the incomplete one.
    pub(super) staged: Staged,
    pub(super) capture_cursor: Option<i64>,
    pub(super) scheduled_cursor: i64,
    pub(super) emit_cursor: i64,
    /// `emit_cursor` came from a step, not from the metadata (see `Emitted::cursor_from_step`).
    pub(super) cursor_from_step: bool,
    pub(super) pending_outputs: u32,
    pub(super) finished: bool,
}

/// Request states by index, with the free indices for reuse and the ids' index.
#[derive(Debug, Default)]
pub(super) struct Requests {
    states: Vec<Option<RequestState>>,
    free: Vec<u32>,
    by_id: HashMap<Box<str>, u32>,
    next_seq: u64,
}

impl Requests {
    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(super) fn find(&self, id: &str) -> Option<u32> {
        self.by_id.get(id).copied()
    }

    /// The index of a request the worker must know (vLLM's `requests[id]`, a `KeyError`).
    pub(super) fn lookup<E>(&self, id: &str) -> Result<u32, PlaneError<E>> {
        self.find(id).ok_or_else(|| PlaneError::UnknownRequest(id.to_owned()))
    }

    pub(super) fn insert(&mut self, id: &str, emit_cursor: i64) -> u32 {
        let state = RequestState {
            id: id.into(),
            seq: self.next_seq,
            keys: Vec::new(),
            staged: Staged::default(),
            capture_cursor: None,
            scheduled_cursor: 0,
            emit_cursor,
            cursor_from_step: false,
            pending_outputs: 0,
            finished: false,
        };
        self.next_seq += 1;
        let index = match self.free.pop() {
            Some(index) => {
                self.states[index as usize] = Some(state);
                index
            }
            None => {
                self.states.push(Some(state));
                (self.states.len() - 1) as u32
            }
        };
        self.by_id.insert(id.into(), index);
        index
    }

    pub(super) fn remove(&mut self, index: u32) -> RequestState {
        let state = self.states[index as usize].take().expect("live request index");
        self.by_id.remove(&state.id);
        self.free.push(index);
        state
    }

    /// The live requests in insertion order (the dict's iteration order).
    pub(super) fn in_order(&self) -> Vec<&RequestState> {
        let mut live: Vec<&RequestState> = self.states.iter().flatten().collect();
        live.sort_unstable_by_key(|state| state.seq);
        live
    }

    /// Every request dropped; insertion order keeps counting.
    pub(super) fn clear(&mut self) {
        self.states.clear();
        self.free.clear();
        self.by_id.clear();
    }
}

impl Index<u32> for Requests {
    type Output = RequestState;

    fn index(&self, index: u32) -> &RequestState {
        self.states[index as usize].as_ref().expect("live request index")
    }
}

impl IndexMut<u32> for Requests {
    fn index_mut(&mut self, index: u32) -> &mut RequestState {
        self.states[index as usize].as_mut().expect("live request index")
    }
}
