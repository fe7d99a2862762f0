//! The one error type of the core; the binding maps each variant to one Python exception.

use std::fmt;

/// Why a store operation failed; every failure leaves the store consistent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// The store was closed; nothing changed.
    Closed,
    /// `object_nbytes` is zero (Python: `ValueError`).
    ObjectSizeNotPositive,
    /// `max_bytes` is smaller than one object (Python: `ValueError`).
    CapacityBelowOneObject,
    /// The arena's size does not fit the address space or the slot index type.
    CapacityTooLarge { num_slots: u64, object_nbytes: u64 },
    /// The operating system refused to map the arena.
    ArenaUnavailable { bytes: usize, errno: i32 },
    /// A payload's length is not `object_nbytes`; nothing changed.
    PayloadSize { key: String, expected: usize, actual: usize },
    /// A release of a key whose count would drop below zero; nothing changed.
    NotReferenced { key: String },
    /// A retain of a key whose count would pass `u32::MAX`; nothing changed.
    ReferenceOverflow { key: String },
    /// Too few evictable keys for the batch: nothing evicted or stored, counts and moves kept.
    CannotRetain { limit: usize },
    /// A read named a key that is not stored; nothing changed.
    Missing { key: String, used: usize, limit: usize, hint: bool },
    /// The victim policy failed or broke its contract (message from the policy).
    Policy(String),
    /// Variable-size store: too few evictable bytes for the batch; the call changed nothing.
    CannotRetainBytes { limit: usize },
    /// Variable-size store: a read named a key that is not stored; nothing changed.
    MissingObject { key: String, used: usize, limit: usize },
    /// A constructor argument out of range (Python: `ValueError`).
    InvalidArgument(String),
    /// The allocator refused memory for bookkeeping (Python: `MemoryError`); nothing changed.
    OutOfMemory { what: &'static str, bytes: usize },
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Closed => f.write_str("auxiliary output store is closed"),
            Self::ObjectSizeNotPositive => {
                f.write_str("auxiliary output object size must be positive")
            }
            Self::CapacityBelowOneObject => {
                f.write_str("auxiliary output store must fit at least one object")
            }
            Self::CapacityTooLarge { num_slots, object_nbytes } => write!(
                f,
                "auxiliary output store is too large: {num_slots} slots of {object_nbytes} bytes \
                 do not fit in one arena"
            ),
            Self::ArenaUnavailable { bytes, errno } => write!(
                f,
                "auxiliary output store could not map an arena of {bytes} bytes (errno {errno})"
            ),
            Self::OutOfMemory { what, bytes } => write!(
                f,
                "auxiliary output store could not allocate {bytes} bytes for its {what}"
            ),
            Self::PayloadSize { key, expected, actual } => write!(
                f,
                "auxiliary output object {key:?} has {actual} bytes, expected object_nbytes={expected}"
            ),
            Self::NotReferenced { key } => write!(f, "{key:?}"),
            Self::ReferenceOverflow { key } => write!(
                f,
                "auxiliary output object {key:?} cannot be retained again: its reference count \
                 is at the limit of {}",
                u32::MAX
            ),
            Self::CannotRetain { limit } => write!(
                f,
                "auxiliary output store cannot retain the requested batch: limit={limit} objects"
            ),
            Self::Missing { key, used, limit, hint } => {
                write!(
                    f,
                    "auxiliary output object {key:?} does not exist; the object may have been \
                     evicted (used={used}, limit={limit} objects)"
                )?;
                if *hint {
                    f.write_str(
                        ". Increase aux_output_config.max_bytes when a KV cache hit requires it.",
                    )?;
                }
                Ok(())
            }
            Self::Policy(message) => write!(f, "victim policy failed: {message}"),
            Self::CannotRetainBytes { limit } => write!(
                f,
                "auxiliary output store cannot retain the requested batch: limit={limit} bytes"
            ),
            Self::MissingObject { key, used, limit } => write!(
                f,
                "auxiliary output object {key:?} does not exist; the object may have been \
                 evicted (used={used}, limit={limit} bytes). Increase aux_output_config.max_bytes \
                 when a KV cache hit requires it."
            ),
            Self::InvalidArgument(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for StoreError {}
