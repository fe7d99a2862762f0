"""Queueing an update that the writer thread will fail on, without depending on timing."""

from __future__ import annotations

from typing import Any


def put_refused(writer: Any, objects: list[Any], **keys: Any) -> BaseException | None:
    """Queues an update the writer thread fails on and returns what ``put`` raised, if anything.

    As in vLLM, ``put`` checks for a latched failure after queueing too, so a writer fast enough
    to fail before ``put`` returns makes this very call raise "publication failed". Both outcomes
    are right; the error stays latched for the next call either way, which the tests check."""
    try:
        writer.put(objects, **keys)
    except Exception as error:
        assert "publication failed" in str(error), repr(error)
        return error
    return None
