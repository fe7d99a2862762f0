"""The tier's one question to its local store: what did a put write?"""

from __future__ import annotations

from typing import Any

__all__ = ["put_and_report"]


def put_and_report(
    local: Any, method: str, *args: Any, keys: list[str], **options: Any
) -> list[str]:
    """Runs ``local.<method>(*args, **options)`` (``put`` or ``put_blocks``) and returns which
    of the put's distinct ``keys`` (in first-occurrence order) it stored: new, or replaced
    (``grow``: a stored key nothing references; the variable store: every re-put). Those are
    published.

    aostore's stores say so themselves (``put_reporting``); a local store without that is
    asked before the put (check-then-act, sound only under the tier's write lock).
    """
    reporting = getattr(local, method + "_reporting", None)
    if reporting is not None:
        written: list[str] = reporting(*args, **options)
        return written
    written = keys
    if keys:
        stored = local.contains(keys)
        if getattr(local, "profile", "fail-closed") == "grow":
            counts = local.reference_counts(keys)
            written = [k for k, s, c in zip(keys, stored, counts, strict=True) if not s or c == 0]
        else:
            written = [key for key, s in zip(keys, stored, strict=True) if not s]
    getattr(local, method)(*args, **options)
    return written
