//! The store calls the plane makes (vLLM's `store.put(objects, retain_keys=, release_keys=)`):
//! the keys of a generation, the calls' payloads (pooled), and the `Sink` that takes them.

use std::ops::{Deref, DerefMut, Range};
use std::sync::{Arc, Mutex, PoisonError};

use super::capture::push_hex;

/// One store call (vLLM's `store.put(objects, retain_keys=, release_keys=)`), owned: the
/// payloads are copied out of the staging slots and the step's rows at hand-over, so the slots
/// may be reused at once while a writer applies the call later.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Publication {
    /// Every key of the call, back to back.
    pub text: String,
    /// (key in `text`, payload in `payload`) per object, in vLLM's order.
    pub objects: Vec<(Range<usize>, Range<usize>)>,
    pub payload: Payload,
    pub retains: Vec<Range<usize>>,
    pub releases: Vec<Range<usize>>,
}

impl Publication {
    pub fn key(&self, range: &Range<usize>) -> &str {
        &self.text[range.clone()]
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty() && self.retains.is_empty() && self.releases.is_empty()
    }

    fn push_key(&mut self, key: &str) -> Range<usize> {
        let start = self.text.len();
        self.text.push_str(key);
        start..self.text.len()
    }
}

/// Payload buffers pooled: at most this many, of at most this capacity each.
const POOLED_PAYLOADS: usize = 4;
/// The least a pooled buffer may hold; a plane pools buffers as large as a step's blocks.
pub(super) const POOLED_PAYLOAD_BYTES: usize = 2 << 20;

/// Payload buffers back from applied calls, for the next calls: a call's payloads are then
/// copied into pages already committed, not into a fresh allocation's (which the kernel
/// zeroes page by page as the copy faults them in).
#[derive(Debug, Default)]
struct PayloadPool {
    buffers: Mutex<Vec<Vec<u8>>>,
    /// The largest buffer kept: a prefill step's payload is megabytes, and a buffer that is
    /// not kept is a fresh allocation for the next such step, faulted in page by page while
    /// the engine thread copies into it (the worst steps of a run on vLLM's schedule).
    largest: usize,
}

impl PayloadPool {
    /// An empty buffer with room for `bytes`.
    fn take(&self, bytes: usize) -> Vec<u8> {
        let pooled = self.buffers.lock().unwrap_or_else(PoisonError::into_inner).pop();
        let mut buffer = pooled.unwrap_or_default();
        buffer.clear();
        buffer.reserve(bytes);
        buffer
    }

    fn give(&self, buffer: Vec<u8>) {
        if buffer.capacity() == 0 || buffer.capacity() > self.largest {
            return;
        }
        let mut buffers = self.buffers.lock().unwrap_or_else(PoisonError::into_inner);
        if buffers.len() < POOLED_PAYLOADS {
            buffers.push(buffer);
        }
    }
}

/// A call's payloads, back to back (a `Vec<u8>` to read and write). The plane's calls take
/// their buffer from its pool, and it goes back there when the call is dropped (by the
/// writer's thread, once applied).
#[derive(Default)]
pub struct Payload {
    bytes: Vec<u8>,
    pool: Option<Arc<PayloadPool>>,
}

impl Deref for Payload {
    type Target = Vec<u8>;

    fn deref(&self) -> &Vec<u8> {
        &self.bytes
    }
}

impl DerefMut for Payload {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.bytes
    }
}

impl Drop for Payload {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.give(std::mem::take(&mut self.bytes));
        }
    }
}

impl Clone for Payload {
    fn clone(&self) -> Self {
        Self { bytes: self.bytes.clone(), pool: None }
    }
}

impl PartialEq for Payload {
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}

impl Eq for Payload {}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.bytes.fmt(f)
    }
}

/// The store behind the connector: vLLM's `BackgroundBlockObjectStore`.
pub trait Sink {
    type Error;
    /// Queues one call (never made for an empty one).
    fn put(&mut self, publication: Publication) -> Result<(), Self::Error>;
    /// Waits for queued calls, then the payloads of `keys`, concatenated, into `out`.
    fn get_concatenated(&mut self, keys: &[&str], out: &mut Vec<u8>) -> Result<(), Self::Error>;
}

/// What a plane's calls share: the prefix of the generation's keys, and the payload buffers.
#[derive(Debug)]
pub(super) struct Publisher {
    /// The prefix of every key made in this generation (`Capture::key_prefix`).
    prefix: String,
    payloads: Arc<PayloadPool>,
}

impl Publisher {
    /// `largest`: the bytes of the largest payload buffer to keep for later calls.
    pub(super) fn new(prefix: String, largest: usize) -> Self {
        let largest = largest.max(POOLED_PAYLOAD_BYTES);
        Self { prefix, payloads: Arc::new(PayloadPool { buffers: Mutex::default(), largest }) }
    }

    /// A new generation's keys.
    pub(super) fn set_prefix(&mut self, prefix: String) {
        self.prefix = prefix;
    }

    /// The key of a block hash in this generation.
    pub(super) fn key(&self, hash: &[u8]) -> Box<str> {
        // Sized exactly, so the boxed text keeps the allocation (no shrinking copy).
        let mut key = String::with_capacity(self.prefix.len() + 2 * hash.len());
        key.push_str(&self.prefix);
        push_hex(&mut key, hash);
        key.into_boxed_str()
    }

    /// One call: `objects` (key, payload) in order, `bytes` of payloads in all, then the
    /// retains and releases.
    pub(super) fn call<'a>(
        &self,
        objects: impl Iterator<Item = (&'a str, &'a [u8])>,
        bytes: usize,
        retains: &[Box<str>],
        releases: &[Box<str>],
    ) -> Publication {
        let mut call = Publication {
            payload: Payload {
                bytes: self.payloads.take(bytes),
                pool: Some(Arc::clone(&self.payloads)),
            },
            ..Default::default()
        };
        for (key, payload) in objects {
            let key = call.push_key(key);
            let at = call.payload.len();
            call.payload.extend_from_slice(payload);
            call.objects.push((key, at..at + payload.len()));
        }
        call.retains = retains.iter().map(|key| call.push_key(key)).collect();
        call.releases = releases.iter().map(|key| call.push_key(key)).collect();
        call
    }
}
