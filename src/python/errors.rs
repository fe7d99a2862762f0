//! The one mapping from `StoreError` to Python exceptions, and the module's exception classes.

use pyo3::exceptions::{PyKeyError, PyMemoryError, PyOverflowError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::error::StoreError;

pyo3::create_exception!(
    aostore,
    BlockObjectStoreError,
    PyRuntimeError,
    "Auxiliary-output storage or retrieval failed."
);

pyo3::create_exception!(
    aostore,
    ObjectMissingError,
    BlockObjectStoreError,
    "A requested auxiliary-output object is not stored (never put, or evicted)."
);

pub(crate) fn to_py_err(error: StoreError) -> PyErr {
    let message = error.to_string();
    match error {
        StoreError::Closed => PyRuntimeError::new_err(message),
        StoreError::ObjectSizeNotPositive
        | StoreError::CapacityBelowOneObject
        | StoreError::PayloadSize { .. }
        | StoreError::InvalidArgument(_) => PyValueError::new_err(message),
        StoreError::CapacityTooLarge { .. } | StoreError::ReferenceOverflow { .. } => {
            PyOverflowError::new_err(message)
        }
        StoreError::ArenaUnavailable { .. } | StoreError::OutOfMemory { .. } => {
            PyMemoryError::new_err(message)
        }
        StoreError::NotReferenced { key } => PyKeyError::new_err(key),
        StoreError::Missing { .. } | StoreError::MissingObject { .. } => {
            ObjectMissingError::new_err(message)
        }
        StoreError::CannotRetain { .. }
        | StoreError::Policy(_)
        | StoreError::CannotRetainBytes { .. } => BlockObjectStoreError::new_err(message),
    }
}
