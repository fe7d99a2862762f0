"""Where aostore's own log records go, and the rule that logging never loses work.

The native store and the Rust writer report a growth (profile ``grow``) by calling
:func:`store_grew`. A logging handler or filter that raises must not drop a batch, skip a
``close()`` or escape from a ``put``: each record is emitted here and any error from the
logging machinery is reported through ``logging``'s own ``handleError`` path, never raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

__all__ = [
    "GROWTH_MESSAGE",
    "add_growth_target",
    "growth_targets",
    "logger",
    "remove_growth_target",
    "store_grew",
]

logger = logging.getLogger("aostore")
"""The ``aostore`` logger."""

GROWTH_MESSAGE = "auxiliary output store grew to %d slots: every object is referenced"

# Extra loggers that also get the growth warning, looked up at each call (the vLLM plugin adds
# the store module's ``logger`` so a vLLM test that patches it sees the warning).
_growth_targets: list[Callable[[], logging.Logger | None]] = []


def add_growth_target(target: Callable[[], logging.Logger | None]) -> bool:
    """Also send growth warnings to the logger ``target()`` returns (``None``: skip).

    Returns whether it was added (``False``: it already was)."""
    if target in _growth_targets:
        return False
    _growth_targets.append(target)
    return True


def remove_growth_target(target: Callable[[], logging.Logger | None]) -> None:
    """Stops sending growth warnings to ``target`` (nothing when it was not added)."""
    if target in _growth_targets:
        _growth_targets.remove(target)


def growth_targets() -> list[Callable[[], logging.Logger | None]]:
    """The targets added, in order (a copy)."""
    return list(_growth_targets)


def _emit(target: logging.Logger, message: str, *args: object) -> None:
    try:
        target.warning(message, *args)
    except Exception:
        # A filter or handler that raises: logging's usual policy for a failing emit (print a
        # traceback to stderr when logging.raiseExceptions) rather than losing the caller's work.
        if logging.raiseExceptions:
            import traceback

            traceback.print_exc()


def store_grew(num_slots: int) -> None:
    """Warns that a ``grow`` store grew to ``num_slots`` slots. Never raises."""
    _emit(logger, GROWTH_MESSAGE, num_slots)
    for get_target in list(_growth_targets):
        try:
            target = get_target()
        except Exception:
            continue
        if target is not None and target is not logger:
            _emit(target, GROWTH_MESSAGE, num_slots)
