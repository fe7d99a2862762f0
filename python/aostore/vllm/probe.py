"""Running vLLM's own store once, on a one-slot arena, to learn whether it grows; the profile."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from .compat.names import ERROR, FIXED_STORE, OBJECT, STORE_MODULE
from .settings import ENV_PROFILE, Settings


def drop(record: logging.LogRecord) -> bool:
    """A logging filter that drops every record."""
    return False


def quiet(*names: str) -> list[logging.Logger]:
    """Silences the loggers ``names`` (with :func:`drop`) and returns them, to undo it."""
    loggers = [logging.getLogger(name) for name in names]
    for one in loggers:
        one.addFilter(drop)
    return loggers


def original_grows(originals: Mapping[str, Any], name: str = FIXED_STORE) -> bool | None:
    """Whether vLLM's store ``name`` grows when every object is referenced; ``None``: cannot
    tell."""
    store_cls, object_cls = originals.get(name), originals.get(OBJECT)
    error_cls = originals.get(ERROR)
    if store_cls is None or object_cls is None or error_cls is None:
        return None
    keys = ["aostore-probe-0", "aostore-probe-1"]
    # vLLM's store warns when it grows: keep the probe out of the user's log.
    silenced = logging.getLogger(STORE_MODULE)
    silenced.addFilter(drop)
    try:
        store = store_cls(max_bytes=1, object_nbytes=1)
        try:
            store.put([object_cls(key, b"\0") for key in keys], retain_keys=keys)
            return int(store.num_slots) >= len(keys)
        except error_cls:
            return False
        finally:
            store.close()
    except Exception:
        return None
    finally:
        silenced.removeFilter(drop)


def choose_profile(originals: Mapping[str, Any], settings: Settings) -> tuple[str, str, bool]:
    """The profile to install, why, and whether that deserves a warning."""
    forced, said = settings.profile, settings.profile_said
    if forced is not None:
        return forced, said, False
    prefix = f"{said}: " if said else ""
    grows = original_grows(originals)
    if grows is None:
        why = f"could not probe vLLM's {FIXED_STORE}; set {ENV_PROFILE} to choose"
        return "fail-closed", prefix + why, True
    why = "vLLM's store grows" if grows else "vLLM's store fails closed"
    return ("grow" if grows else "fail-closed"), prefix + why, bool(said)
