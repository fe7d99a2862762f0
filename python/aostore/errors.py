"""aostore's errors, and the one place that tells a miss by its message text.

``ObjectMissingError`` subclasses ``BlockObjectStoreError``, so every ``except
BlockObjectStoreError`` (vLLM's included) still catches a miss. aostore's own stores raise it;
a foreign store (vLLM's own, which the wrappers accept) raises its plain
``BlockObjectStoreError`` saying "does not exist": ``is_missing`` is the only code that reads
that text.
"""

from __future__ import annotations

from aostore._native import BlockObjectStoreError, ObjectMissingError

__all__ = ["BlockObjectStoreError", "ObjectMissingError", "is_missing", "is_store_error"]

# The words every aostore and vLLM miss message carries.
_MISSING_TEXT = "does not exist"


def is_store_error(error: BaseException) -> bool:
    """Whether ``error`` is a ``BlockObjectStoreError``: aostore's, a subclass of it, or a
    foreign store's class of that name (told by name, as vLLM's cannot be imported here)."""
    return any(cls.__name__ == "BlockObjectStoreError" for cls in type(error).__mro__)


def is_missing(error: BaseException) -> bool:
    """Whether ``error`` reports a missing object: an ``ObjectMissingError``, or a foreign
    store's ``BlockObjectStoreError`` whose message says the object does not exist."""
    if isinstance(error, ObjectMissingError):
        return True
    return is_store_error(error) and _MISSING_TEXT in str(error)
