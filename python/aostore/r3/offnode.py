"""R3 rows across nodes through Mooncake (docs/r3-reference.md, "Across nodes").

A reference stays format version 1: the Mooncake key is derived from its arena, slot and
generation (:func:`key`), never reused. The object is a 64-byte :data:`HEADER` followed by the
rows; a reader checks the size Mooncake returns and every header field against the reference,
so another output's bytes, a truncated object or a key the master no longer has read as
``ReferenceGone``, never as rows.

- :class:`Publisher`, the frontend's: the arena tells it of every reference made and every slot
  given up; its thread puts the slot's bytes (header and page runs, no copy in Python) into the
  frontend's own segment (``preferred_segment``) and removes the object when the slot goes.
  Failures are counted and retried, never raised into the engine.
- :class:`OffNodeReader`, the trainer's: one ``batch_get_into_multi_buffers`` a batch, the rows
  straight into ``out=`` (else into a buffer of the batch's), the headers apart.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import errors, leases
from . import format as fmt

if TYPE_CHECKING:
    from aostore.mooncake.config import MooncakeConfig

    from .arena import Arena

__all__ = [
    "HEADER",
    "SETTING",
    "OffNodeReader",
    "Publisher",
    "PublisherStats",
    "key",
    "reader_config",
]

logger = logging.getLogger("aostore")

SETTING = "AOSTORE_R3_MOONCAKE"
"""The reader's Mooncake client: a JSON file's path, or the JSON object itself
(``aostore.mooncake.MooncakeConfig``'s keys; ``local_hostname`` required)."""

MAGIC = b"aostore r3 rows:"  # 16 bytes, no NUL (numpy strips trailing NULs of S16)
OBJECT_VERSION = 1
HEADER = np.dtype(
    [
        ("magic", "S16"),
        ("version", "<u4"),
        ("reserved", "<u4"),
        ("arena", "u1", 16),
        ("slot", "<u8"),
        ("generation", "<u8"),
        ("nbytes", "<u8"),
    ]
)
"""What precedes the rows in a Mooncake object: 64 bytes."""
assert HEADER.itemsize == 64

REPLICA_IS_NOT_READY = -703
"""A read of an object whose put has begun and not ended: a publication in flight."""
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
INVALID_PARAMS = -600
TRANSFER_FAIL = -800
_NOT_YET = (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY)

MAX_WAITING = 1 << 17
"""The most puts and removals a publisher keeps for a retry (the oldest go first)."""

READER_CALLS = ("batch_get_into_multi_buffers", "get_size", "register_buffer", "unregister_buffer")
PUBLISHER_CALLS = (
    "batch_put_from_multi_buffers",
    "batch_remove",
    "batch_is_exist",
    "put",
    "get",
    "get_hostname",
)
MARK_CALLS = ("batch_upsert_from",)


def key(prefix: str, arena: bytes, slot: int, generation: int) -> str:
    """The Mooncake key of a reference's rows (unique: an arena's id is random, and every write
    of a slot has a new generation)."""
    return f"{prefix}aostore-r3/{arena.hex()}/{slot}/{generation}"


def marker_key(prefix: str, arena: bytes) -> str:
    """The arena's marker: which node and segment publish its references (hard-pinned; its
    absence tells the publisher that the master restarted empty)."""
    return f"{prefix}aostore-r3/{arena.hex()}/marker"


def settled_key(prefix: str, arena: bytes) -> str:
    """The arena's settled generation (8 bytes, little-endian): every reference of this arena
    whose generation is at most it has been put, or will never be (its slot went first). A
    reader waits for a missing object only above it: below, the object is gone."""
    return f"{prefix}aostore-r3/{arena.hex()}/settled"


def read_key(prefix: str, arena: bytes, slot: int, generation: int) -> str:
    """The key an off-node reader puts once it has read a reference's rows: the read channel
    (Mooncake tells no one of reads), which the frontend's publisher polls."""
    return f"{prefix}aostore-r3/{arena.hex()}/read/{slot}/{generation}"


def renew_key(prefix: str, arena: bytes, slot: int, generation: int) -> str:
    """The key an off-node reader puts to renew an unread reference: 8 bytes, the seconds
    (a float64: clocks are not shared across nodes), which the publisher polls."""
    return f"{prefix}aostore-r3/{arena.hex()}/renew/{slot}/{generation}"


def header(arena: bytes, slot: int, generation: int, nbytes: int) -> np.ndarray:
    made = np.zeros((), HEADER)
    made["magic"] = MAGIC
    made["version"] = OBJECT_VERSION
    made["arena"] = np.frombuffer(arena, np.uint8)
    made["slot"] = slot
    made["generation"] = generation
    made["nbytes"] = nbytes
    return made


def _describe(code: int) -> str:
    from aostore.mooncake.client import describe_code

    return describe_code(code)


def _missing_calls(client: Any, names: tuple[str, ...]) -> list[str]:
    return [name for name in names if not callable(getattr(client, name, None))]


def reader_config(value: Any = None) -> MooncakeConfig | None:
    """The reader's Mooncake config from ``value`` (a ``MooncakeConfig``, a mapping, a JSON
    file's path) or, with None, from :data:`SETTING` (None when that is unset). A mapping or
    file must name ``local_hostname``: a trainer's node is not the frontend's, and 127.0.0.1
    is no default there."""
    from aostore.mooncake.config import MooncakeConfig

    if isinstance(value, MooncakeConfig):
        return value
    where = "Reader(mooncake=...)"
    if value is None:
        text = os.environ.get(SETTING, "").strip()
        if not text:
            return None
        where = SETTING
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{SETTING}: not valid JSON: {error}") from None
        else:
            value = text
    if not isinstance(value, Mapping):
        try:
            with open(value, encoding="utf-8") as file:
                value = json.load(file)
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"{where}: {value!r} is not a readable JSON file: {error}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: a Mooncake config is a JSON object")
    if "local_hostname" not in value:
        raise ValueError(
            f"{where}: the reader's Mooncake config needs local_hostname (this node's address "
            "as the cluster reaches it; no default)"
        )
    try:
        return MooncakeConfig.from_dict(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None


PUBLISH_WAIT = 2.0
"""Seconds an off-node read waits for a reference's object that is not in Mooncake yet while
its arena's marker is (the frontend publishes; the answer may reach the trainer first)."""


class OffNodeReader:
    """Reads references of other nodes through a Mooncake client of the reader's own
    (connected at the first read)."""

    def __init__(self, config: MooncakeConfig, *, wait: float = PUBLISH_WAIT) -> None:
        if not (wait >= 0 and wait < float("inf")):
            raise ValueError(f"wait is a finite number of seconds, at least 0, not {wait}")
        self.config = config
        self.prefix = config.key_prefix
        self.wait = wait
        """Seconds a read waits for an object its arena's marker vouches for (a publication
        in flight) before ``ReferenceGone``."""
        self._client: Any = None
        self._mark = np.ones(8, np.uint8)  # the read channel's object

    def _connected(self) -> Any:
        if self._client is None:
            from aostore.mooncake.client import connect

            try:
                client = connect(self.config)
            except Exception as error:  # MooncakeError, ImportError
                raise errors.OffNodeError(
                    f"no Mooncake client for another node's references ({SETTING}: master "
                    f"{self.config.master_server_address}): {error}"
                ) from None
            missing = _missing_calls(client, READER_CALLS)
            if missing:
                with contextlib.suppress(Exception):
                    client.close()
                raise errors.OffNodeError(
                    f"this Mooncake's client has no {', '.join(missing)}: aostore reads other "
                    "nodes' references with them (tested with 0.3.13.post1)"
                )
            self._client = client
        return self._client

    def read(
        self,
        wanted: Mapping[tuple[bytes, int, int, int], int],
        places: Mapping[tuple[bytes, int, int, int], np.ndarray] | None = None,
    ) -> dict[Any, np.ndarray]:
        """The rows of each ``(arena, slot, generation, nbytes)`` (an index in its batch with
        each, for errors), as ``uint8`` arrays; ``ReferenceGone`` naming the first whose object
        is gone or not its own. A key with a place (a C-contiguous ``uint8`` array of its
        ``nbytes``: the caller's ``out=``) is read straight into it, its header apart; the
        others into one buffer of the batch's."""
        if not wanted:
            return {}
        places = places or {}
        items = list(wanted.items())
        client = self._connected()
        names = [key(self.prefix, arena, slot, gen) for (arena, slot, gen, _), _ in items]
        headers = np.empty((len(items), HEADER.itemsize), np.uint8)
        staged = [k for k, _ in items if k not in places]
        offsets = np.cumsum([0, *(-(-k[3] // 64) * 64 for k in staged)])
        staging = np.empty(int(offsets[-1]), np.uint8)
        rows: dict[Any, np.ndarray] = {
            k: staging[o : o + k[3]] for k, o in zip(staged, offsets[:-1], strict=True)
        }
        rows.update(places)
        # One call reads each object's header into `headers` and its rows where they go (an
        # object of no rows is its header).
        buffers = [
            [headers[i].ctypes.data, rows[k].ctypes.data][: 2 if k[3] else 1]
            for i, (k, _) in enumerate(items)
        ]
        sizes = [[HEADER.itemsize, k[3]][: 2 if k[3] else 1] for k, _ in items]
        registered = self._register(client, [headers, staging, *places.values()])
        waited = False
        try:
            codes = list(client.batch_get_into_multi_buffers(names, buffers, sizes))
            missing = [i for i, code in enumerate(codes) if code in _NOT_YET]
            if missing and self.wait > 0:
                # Objects whose arena's marker is there may be in flight: read them again
                # until they come or the wait is over. One whose put has begun (not ready)
                # is in flight whatever the marker says.
                arenas = sorted({items[i][0][0] for i in missing})
                markers = client.batch_is_exist([marker_key(self.prefix, a) for a in arenas])
                known = {a for a, code in zip(arenas, markers, strict=True) if code == 1}
                settled = self._settled(client, sorted(known))
                missing = [
                    i
                    for i in missing
                    if codes[i] == REPLICA_IS_NOT_READY
                    or (items[i][0][0] in known and items[i][0][2] > settled.get(items[i][0][0], 0))
                ]
                deadline = time.monotonic() + self.wait
                while missing and time.monotonic() < deadline:
                    waited = True
                    time.sleep(0.01)
                    again = client.batch_get_into_multi_buffers(
                        [names[i] for i in missing],
                        [buffers[i] for i in missing],
                        [sizes[i] for i in missing],
                    )
                    for i, code in zip(missing, again, strict=True):
                        codes[i] = code
                    missing = [i for i in missing if codes[i] in _NOT_YET]
        finally:
            for base in registered:
                client.unregister_buffer(base)
        got: dict[Any, np.ndarray] = {}
        for i, (((arena, slot, generation, nbytes), index), code, name) in enumerate(
            zip(items, codes, names, strict=True)
        ):
            self._check(client, arena, name, index, code, HEADER.itemsize + nbytes, waited)
            found = headers[i].view(HEADER)[0]
            if (
                bytes(found["magic"]) != MAGIC
                or int(found["version"]) != OBJECT_VERSION
                or fmt.ident(found["arena"]) != arena
                or int(found["slot"]) != slot
                or int(found["generation"]) != generation
                or int(found["nbytes"]) != nbytes
            ):
                raise errors.ReferenceGone(
                    f"{name} in Mooncake is not its rows: another output's object", index
                )
            got[(arena, slot, generation, nbytes)] = rows[items[i][0]]
        return got

    def _settled(self, client: Any, arenas: list[bytes]) -> dict[bytes, int]:
        """Each arena's settled generation where its publisher announced one: a missing object
        at or below it is gone, not in flight (an arena without one: any may be in flight)."""
        get = getattr(client, "get", None)
        found: dict[bytes, int] = {}
        if get is None:
            return found
        for arena in arenas:
            with contextlib.suppress(Exception):
                raw = get(settled_key(self.prefix, arena))
                if len(raw) == 8:
                    found[arena] = int(np.frombuffer(raw, "<u8")[0])
        return found

    def _register(self, client: Any, buffers: list[np.ndarray]) -> list[int]:
        """Registers the read's destinations where the transport needs it (RDMA; TCP reads
        into any memory, and registering costs about as much as a 6 MB copy): the bases
        registered, to unregister."""
        if self.config.protocol == "tcp":
            return []
        done = []
        for buffer in buffers:
            if buffer.nbytes and client.register_buffer(buffer.ctypes.data, buffer.nbytes) == 0:
                done.append(buffer.ctypes.data)
        return done

    def _check(
        self, client: Any, arena: bytes, name: str, index: int, code: int, size: int, waited: bool
    ) -> None:
        """``ReferenceGone`` (or ``OffNodeError`` for a failed read) unless ``code`` says the
        whole object of ``size`` bytes was read."""
        if code == size:
            return
        if code == OBJECT_NOT_FOUND:
            marker = marker_key(self.prefix, arena)
            if client.batch_is_exist([marker])[0] == 0:
                raise errors.ReferenceGone(
                    f"its rows are not in this Mooncake: it has no {marker} (the frontend "
                    f"is gone or does not publish, or {SETTING} names another cluster "
                    "than the frontend's, or another key_prefix)",
                    index,
                )
            late = f", nor within {self.wait:g} s" if waited else ""
            raise errors.ReferenceGone(
                f"its rows are gone: Mooncake has no {name}{late} (the frontend gave them "
                "up, the master evicted them, or they are not published yet)",
                index,
            )
        if code == REPLICA_IS_NOT_READY:
            late = f" after {self.wait:g} s" if waited else ""
            raise errors.ReferenceGone(
                f"its rows are not readable yet: Mooncake's put of {name} is still in "
                f"flight{late} (read again later, or give the reader a longer wait)",
                index,
            )
        # A buffer of another size than the object: shorter is INVALID_PARAMS, longer a
        # failed transfer; ask the object's size before calling it an outage.
        if code >= 0 or (code in (INVALID_PARAMS, TRANSFER_FAIL) and client.get_size(name) != size):
            raise errors.ReferenceGone(
                f"{name} in Mooncake is not its rows: an object of another size", index
            )
        from aostore.mooncake.client import describe_code

        raise errors.OffNodeError(
            f"reference {index} of the batch: Mooncake's read of {name} failed with "
            f"{describe_code(code)}"
        )

    def renew(self, wanted: Mapping[tuple[bytes, int, int], int], seconds: float) -> None:
        """Ask the frontends to keep these unread references ``seconds`` more: ``ReferenceGone``
        naming the first whose object Mooncake no longer has; the renewal object of each
        (``batch_upsert_from``), which the frontend's publisher applies at its next poll."""
        if not wanted:
            return
        client = self._connected()
        if _missing_calls(client, (*MARK_CALLS, "batch_is_exist")):
            raise errors.OffNodeError("this Mooncake's client cannot renew (batch_upsert_from)")
        items = list(wanted.items())
        names = [key(self.prefix, arena, slot, gen) for (arena, slot, gen), _ in items]
        for (_, index), name, code in zip(items, names, client.batch_is_exist(names), strict=True):
            if code != 1:
                raise errors.ReferenceGone(f"its rows are gone: Mooncake has no {name}", index)
        value = np.array([seconds], "<f8")
        renewals = [renew_key(self.prefix, a, slot, gen) for (a, slot, gen), _ in items]
        codes = client.batch_upsert_from(
            renewals, [value.ctypes.data] * len(items), [value.nbytes] * len(items)
        )
        failed = [index for (_, index), code in zip(items, codes, strict=True) if code != 0]
        if failed:
            raise errors.OffNodeError(
                f"reference {failed[0]} of the batch: Mooncake refused its renewal"
            )

    def mark_read(self, keys: list[tuple[bytes, int, int, int]]) -> bool:
        """Tell the frontends that these references were read (one small object each, put
        with ``batch_upsert_from``); False when Mooncake refused any (their rows then stay
        until their deadline, as unread ones do)."""
        if not keys:
            return True
        client = self._connected()
        if _missing_calls(client, MARK_CALLS):
            return False
        names = [read_key(self.prefix, arena, slot, gen) for arena, slot, gen, _ in keys]
        mark = self._mark
        try:
            codes = client.batch_upsert_from(
                names, [mark.ctypes.data] * len(names), [mark.nbytes] * len(names)
            )
        except Exception:
            return False
        return all(code == 0 for code in codes)

    def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            with contextlib.suppress(Exception):
                client.close()


@dataclass
class PublisherStats:
    """What a publisher did (counters since start)."""

    published: int = 0
    """Objects put."""
    put_failures: int = 0
    """Puts Mooncake refused or failed (each retried until the slot goes)."""
    gone_before_put: int = 0
    """References whose slot went before their put."""
    removed: int = 0
    """Objects removed (or found gone) after their slot went."""
    read_offnode: int = 0
    """References read off-node (the read channel), whose rows may now make way."""
    renewed_offnode: int = 0
    """Renewals of unread references asked off-node and applied."""
    restarts: int = 0
    """Times the arena's marker was gone from Mooncake: the master restarted empty."""
    misplaced: int = 0
    """Markers the master placed outside this frontend's segment (``preferred_segment`` is a
    preference: a segment the master does not know, or none, sends objects elsewhere)."""
    republished: int = 0
    """References put again after a restart."""
    segment_committed: int = 0
    """Bytes of the publisher's Mooncake segment committed at start (0: left to fault in)."""
    remove_retries: int = 0
    """Removals put off: the object was under a reader's Mooncake lease, or the call failed."""
    pending: int = 0
    """Puts and removals not done yet."""
    dropped: int = 0
    """Retries given up because more than :data:`MAX_WAITING` waited (a put's reference is
    then readable on its node only; a removal's object stays until the master evicts it or the
    frontend's client closes)."""
    outages: int = 0
    """Times Mooncake started failing (one WARNING each)."""


MIN_SEGMENT = 16 << 20
"""Mooncake 0.3.13.post1's ``setup`` refuses a segment under 16 MiB (-600, INVALID_PARAMS)."""
SEGMENT_MARGIN = 1.1
"""The frontend's segment is the arena's budget times this (each object is its rows and a
64-byte header, in the master's allocation granularity). A full arena fills it to the
master's eviction watermark (0.9): the rows' objects are hard-pinned, so that none is evicted."""


def connect_publisher(arena: Arena, config: MooncakeConfig, *, setting: str) -> Publisher:
    """A publisher for ``arena`` on a Mooncake client of its own that mounts a segment sized
    from the budget (at least ``config.global_segment_size``); ``OffNodeError`` naming
    ``setting`` when no client can be made."""
    import dataclasses
    import math

    from aostore.mooncake.client import connect

    budget = int(arena._data.nbytes)
    segment = -(-math.ceil(budget * SEGMENT_MARGIN) // fmt.PAGE) * fmt.PAGE
    segment = max(config.global_segment_size, segment, MIN_SEGMENT)
    try:
        client = connect(dataclasses.replace(config, global_segment_size=segment))
    except Exception as error:
        raise errors.OffNodeError(
            f"{setting}: no Mooncake client for publishing R3 rows (master "
            f"{config.master_server_address}): {error}"
        ) from None
    try:
        publisher = Publisher(arena, client, prefix=config.key_prefix, close_client=True)
    except BaseException:
        with contextlib.suppress(Exception):
            client.close()
        raise
    publisher.stats.segment_committed = commit_segment(
        client, publisher._config, key(config.key_prefix, arena.id, 0, 0) + "/probe", segment
    )
    # At exit, bounded: the thread stopped, the client closed (its segment and the objects in
    # it go with it, as the arena's rows do).
    atexit.register(_close_at_exit, weakref.ref(publisher))
    return publisher


MADV_POPULATE_WRITE = 23
"""Linux 5.14: fault pages in writable without changing what they hold (``layouts`` has its
own: it imports the reader, which imports this module)."""


def commit_segment(client: Any, replicate: Any, probe: str, nbytes: int) -> int:
    """Commits the pages of ``client``'s segment at start, as the arena's are, so that no put
    faults them in one at a time (a put of a 6 MB sample into fresh segment pages cost 5 ms of
    CPU, one into committed pages a memcpy: docs/performance.md). Mooncake does not say where
    the segment lies: a probe object put in it (a fresh segment places it at its start) names
    the address, and the pages from there to the segment's end, within that mapping, are
    committed. Best effort: the bytes committed, 0 where any step is refused."""
    import ctypes

    mark = np.zeros(fmt.PAGE, np.uint8)
    try:
        if client.put_from(probe, mark.ctypes.data, mark.nbytes, replicate) != 0:
            return 0
        try:
            replicas = client.get_replica_desc(probe)
            start = int(replicas[0].get_memory_descriptor().buffer_descriptor.buffer_address)
        finally:
            client.remove(probe)
        start -= start % fmt.PAGE
        with open("/proc/self/maps") as maps:
            for line in maps:
                low, high = (int(bound, 16) for bound in line.split()[0].split("-"))
                if low <= start < high and line.split()[1].startswith("rw"):
                    break
            else:
                return 0
        length = min(high, start + nbytes) - start
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(start, length, MADV_POPULATE_WRITE) != 0:
            return 0
        return length
    except Exception:  # a client without these calls, an older kernel: pages fault as before
        return 0


def _close_at_exit(ref: weakref.ref[Publisher]) -> None:
    publisher = ref()
    if publisher is not None and os.getpid() == publisher._pid:
        with contextlib.suppress(Exception):
            publisher.close(timeout=2.0)


class Publisher:
    """Publishes an arena's references to Mooncake from a thread of its own.

    ``client`` is the frontend's connected ``MooncakeDistributedStore`` with a segment mounted
    (``global_segment_size``): objects are put there (``preferred_segment``), so they stay on
    this node until read and go with the client. Failures never reach the arena's caller: they
    are counted (:attr:`stats`) and retried every ``retry`` seconds, a put until it succeeds or its
    slot goes, a removal until the object is gone (never forced)."""

    def __init__(
        self,
        arena: Arena,
        client: Any,
        *,
        prefix: str = "",
        retry: float = 1.0,
        poll: float = 1.0,
        close_client: bool = False,
    ) -> None:
        missing = _missing_calls(client, PUBLISHER_CALLS)
        if missing:
            raise errors.OffNodeError(
                f"this Mooncake's client has no {', '.join(missing)}: aostore publishes R3 "
                "rows with them (tested with 0.3.13.post1)"
            )
        replicate_config = importlib.import_module("mooncake.store").ReplicateConfig

        self._arena = arena
        self._client = client
        self.prefix = prefix
        self.segment = str(client.get_hostname())
        self._config = replicate_config()
        self._config.replica_num = 1
        self._config.preferred_segment = self.segment
        # Hard-pinned: the master never evicts them (at its high watermark, 0.9 of the
        # segment in 0.3.13.post1, it would drop the oldest unread rows of a full arena);
        # the publisher removes each once the arena gives its slot up.
        self._config.with_hard_pin = True
        self._retry = retry
        self._close_client = close_client
        self._pid = os.getpid()
        self._poll = poll  # seconds between looks at the read channel
        self._polled = time.monotonic()
        self._unread: dict[tuple[int, int], None] = {}  # published, not read off-node yet
        self._held: dict[tuple[int, int], int] = {}  # published, slot not given up: nbytes
        self._again_put: set[tuple[int, int]] = set()  # republications under way
        self._dropping: set[tuple[str, tuple[int, int]]] = set()  # read/renewal objects
        self._marked = False  # the marker is in Mooncake (as far as this publisher knows)
        # The generations handed over and not settled (put, or never to be: the slot went
        # first), and the highest handed over: what the settled object announces.
        self._open: set[int] = set()
        self._handed = 0
        self._announced: int | None = None  # the settled value Mooncake has, as far as known
        self._marker_config = replicate_config()
        self._marker_config.with_hard_pin = True
        self._marker_config.replica_num = 1
        self._marker_config.preferred_segment = self.segment
        self._fd = leases.reopen(arena._fd)  # leases of its own, while it reads a slot
        self._cond = threading.Condition()
        self._puts: deque[tuple[int, int, int]] = deque()  # (slot, generation, nbytes)
        self._removes: deque[tuple[int, int]] = deque()  # (slot, generation)
        # Retries, due in the order they were put off (one interval for all).
        self._later: deque[tuple[float, str, tuple[int, ...]]] = deque()
        self._failing = False
        self._busy = False
        self._stop = False
        self.stats = PublisherStats()
        self._thread = threading.Thread(target=self._run, name="aostore-r3-publish", daemon=True)
        self._thread.start()
        arena.offnode = self

    # Called by the arena (under its lock): cheap, never raises ---------------------------

    def published(self, slot: int, generation: int, nbytes: int) -> None:
        with self._cond:
            self._puts.append((slot, generation, nbytes))
            self._open.add(generation)
            self._handed = max(self._handed, generation)
            self._cond.notify()

    def given_up(self, slot: int, generation: int) -> None:
        with self._cond:
            self._removes.append((slot, generation))
            self._cond.notify()

    # --------------------------------------------------------------------------------------

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every put and removal due has been tried (retries not waited for)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._puts or self._removes or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (bounded); the arena is no longer told."""
        if self._arena.offnode is self:
            self._arena.offnode = None
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if not self._thread.is_alive() and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            if self._close_client:  # its segment, and the objects in it, go with it
                with contextlib.suppress(Exception):
                    self._client.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                while not (self._puts or self._removes or self._stop or self._due()):
                    waits = []
                    if self._later:
                        waits.append(self._later[0][0] - time.monotonic())
                    if self._held:
                        waits.append(self._polled + self._poll - time.monotonic())
                    self._cond.wait(max(0.0, min(waits)) if waits else None)
                if self._stop:
                    return
                puts, removes = list(self._puts), list(self._removes)
                unmarks: list[tuple[int, int]] = []
                unrenews: list[tuple[int, int]] = []
                self._puts.clear()
                self._removes.clear()
                now = time.monotonic()
                while self._later and self._later[0][0] <= now:
                    _, what, args = self._later.popleft()
                    if what == "put":
                        puts.append((args[0], args[1], args[2]))
                    elif what == "unmark":
                        unmarks.append((args[0], args[1]))
                    elif what == "unrenew":
                        unrenews.append((args[0], args[1]))
                    else:
                        removes.append((args[0], args[1]))
                self._busy = True
                self.stats.pending = len(self._later) + len(puts) + len(removes)
            try:
                self._put(puts)
            except Exception as error:  # never raised into the engine; counted, retried
                self.stats.put_failures += len(puts)
                self._failed("puts", repr(error))
                for slot, generation, nbytes in puts:
                    self._again("put", (slot, generation, nbytes))
            try:
                if self._held and time.monotonic() >= self._polled + self._poll:
                    self._polled = time.monotonic()
                    self._look()
            except Exception as error:
                self._failed("read channel polls", repr(error))
            try:
                if unmarks:
                    self._unmark(unmarks)
                if unrenews:
                    self._unmark(unrenews, kind="unrenew")
            except Exception:
                for entry in unmarks:
                    self._again("unmark", entry)
                for entry in unrenews:
                    self._again("unrenew", entry)
            try:
                self._remove(removes)
            except Exception as error:
                self.stats.remove_retries += len(removes)
                self._failed("removals", repr(error))
                for slot, generation in removes:
                    self._again("remove", (slot, generation))
            with self._cond:
                self.stats.pending = len(self._later)

    def _due(self) -> bool:
        now = time.monotonic()
        if self._held and now >= self._polled + self._poll:
            return True
        return bool(self._later) and self._later[0][0] <= now

    def _again(self, what: str, args: tuple[int, ...]) -> None:
        with self._cond:
            self._later.append((time.monotonic() + self._retry, what, args))
            while len(self._later) > MAX_WAITING:
                _, dropped, entry = self._later.popleft()
                self.stats.dropped += 1
                if dropped == "put":
                    self._open.discard(entry[1])  # never to be put: settled

    def _failed(self, what: str, detail: str) -> None:
        """One WARNING per outage: from the first failure to the next success."""
        if not self._failing:
            self._failing = True
            self.stats.outages += 1
            logger.warning(
                "aostore: Mooncake refused R3 rows' %s (%s): other nodes cannot read the "
                "references made meanwhile until a retry succeeds (every %.3g s; the engine "
                "goes on)",
                what,
                detail,
                self._retry,
            )

    def _succeeded(self) -> None:
        if self._failing:
            self._failing = False
            logger.warning("aostore: Mooncake takes R3 rows again")

    def _put(self, puts: list[tuple[int, int, int]]) -> None:
        arena = self._arena
        held: list[int] = []
        names: list[str] = []
        pointers: list[list[int]] = []
        sizes: list[list[int]] = []
        headers: list[np.ndarray] = []
        entries: list[tuple[int, int, int]] = []
        try:
            for slot, generation, nbytes in puts:
                if slot in held:
                    continue  # the same write twice in one batch: put once
                if not leases.lock(self._fd, slot, leases.READ):
                    # The frontend holds the slot's lock for a moment: giving it up, or only
                    # looking (a renewed slot is kept). Still this write's: try again later.
                    if int(arena._slots[slot]["generation"]) == generation:
                        self._again("put", (slot, generation, nbytes))
                    else:
                        self.stats.gone_before_put += 1
                        self._settle(generation)
                    continue
                held.append(slot)
                record = arena._slots[slot]
                if int(record["generation"]) != generation:
                    self.stats.gone_before_put += 1
                    self._settle(generation)
                    continue
                made = header(arena.id, slot, generation, nbytes)
                headers.append(made)
                parts, part_sizes = [made.ctypes.data], [HEADER.itemsize]
                data = arena._data.ctypes.data
                page, left = int(record["page"]), nbytes
                for _ in range(int(record["runs"])):
                    if left <= 0:
                        break
                    pages = int(arena._runs[page]["pages"])
                    size = min(left, pages * fmt.PAGE)
                    parts.append(data + page * fmt.PAGE)
                    part_sizes.append(size)
                    left -= size
                    page = int(arena._runs[page]["next"])
                names.append(key(self.prefix, arena.id, slot, generation))
                pointers.append(parts)
                sizes.append(part_sizes)
                entries.append((slot, generation, nbytes))
            if not names:
                return
            codes = self._client.batch_put_from_multi_buffers(names, pointers, sizes, self._config)
        finally:
            for slot in held:
                leases.lock(self._fd, slot, leases.UNLOCK)
        for entry, code in zip(entries, codes, strict=True):
            if code in (0, OBJECT_ALREADY_EXISTS):
                self.stats.published += 1
                self._settle(entry[1])
                if entry[:2] in self._again_put:
                    self._again_put.discard(entry[:2])
                    self.stats.republished += 1
                self._unread[entry[:2]] = None
                self._held[entry[:2]] = entry[2]
                self._succeeded()
            else:
                self.stats.put_failures += 1
                self._failed("puts", _describe(code))
                self._again("put", entry)
        if self._held and not self._marked:
            self._mark()

    def _check_placement(self, name: str) -> None:
        """Whether the master put ``name`` in this frontend's segment (one look a batch)."""
        describe = getattr(self._client, "get_replica_desc", None)
        if describe is None:
            return
        try:
            where = [
                replica.get_memory_descriptor().buffer_descriptor.transport_endpoint
                for replica in describe(name)
                if replica.is_memory_replica()
            ]
        except Exception:
            return
        if where and self.segment not in where:
            self.stats.misplaced += 1
            if self.stats.misplaced == 1:
                logger.warning(
                    "aostore: Mooncake put R3 rows in segment %s, not this frontend's (%s): "
                    "its segment is full or unknown to the master; they cross the network "
                    "twice and live elsewhere (counted in offnode_misplaced)",
                    where[0],
                    self.segment,
                )

    def _look(self) -> None:
        """One poll: the marker (gone: the master restarted empty; every reference held is put
        again) and the read channel for every reference published and not read off-node yet:
        the ones read are marked read in the arena as a reader here would (the read flag, then
        the read log), so their rows may make way, and their read objects removed."""
        arena = self._arena
        unread = list(self._unread)
        names = [marker_key(self.prefix, arena.id)]
        names += [read_key(self.prefix, arena.id, slot, gen) for slot, gen in unread]
        names += [renew_key(self.prefix, arena.id, slot, gen) for slot, gen in unread]
        found = self._client.batch_is_exist(names)
        renewed = [e for e, code in zip(unread, found[1 + len(unread) :], strict=True) if code == 1]
        if found[0] == 0 and self._marked:
            self.stats.restarts += 1
            logger.warning(
                "aostore: the Mooncake master lost this frontend's R3 objects (restarted "
                "empty): publishing the %d references held again",
                len(self._held),
            )
            with self._cond:
                for (slot, generation), nbytes in self._held.items():
                    self._puts.append((slot, generation, nbytes))
                    self._again_put.add((slot, generation))
                    self._open.add(generation)  # not settled until put again
            self._held.clear()
            self._unread.clear()
            self._marked = False
            self._announced = None  # the restarted master has no settled object either
            return
        if found[0] == 1:
            self._announce()
        if found[0] == 0 and not self._marked:
            self._mark()
        if renewed:
            self._renew(renewed)
        read = [e for e, code in zip(unread, found[1 : 1 + len(unread)], strict=True) if code == 1]
        if not read:
            return
        first: list[tuple[int, int]] = []
        for slot, generation in read:
            del self._unread[(slot, generation)]
            if not leases.lock(self._fd, slot, leases.READ):
                continue  # being given up: nothing to mark
            try:
                record = arena._slots[slot]
                if int(record["generation"]) == generation and not record["read"]:
                    record["read"] = 1
                    first.append((slot, generation))
            finally:
                leases.lock(self._fd, slot, leases.UNLOCK)
        if first:
            _log_reads(arena, self._fd, first)
        # Counted once the reads are in the log, so a caller that sees the count may rely on
        # the rows making way (counting first let a deliver race the log).
        self.stats.read_offnode += len(read)
        self._unmark(read)

    def _settle(self, generation: int) -> None:
        with self._cond:
            self._open.discard(generation)

    def _announce(self) -> None:
        """Upsert the settled generation where it moved (once a poll, with the marker seen in
        the same poll: a value put on a master that restarted since would vouch for
        republications not yet made). The value only grows between restarts, so one Mooncake
        refused (an object under a reader's lease) is a value behind: readers wait longer,
        never shorter."""
        upsert = getattr(self._client, "upsert", None)
        if upsert is None:
            return  # readers wait by the marker alone
        with self._cond:
            settled = min(self._open) - 1 if self._open else self._handed
        if settled == self._announced:
            return
        value = np.array([settled], "<u8").tobytes()
        name = settled_key(self.prefix, self._arena.id)
        if upsert(name, value, self._marker_config) == 0:
            self._announced = settled

    def _mark(self) -> None:
        """Put the arena's marker (hard-pinned: the master never evicts it)."""
        arena = self._arena
        payload = json.dumps(
            {
                "arena": arena.id.hex(),
                "boot": leases.boot_id().hex(),
                "segment": self.segment,
                "budget": int(arena._data.nbytes),
            }
        ).encode()
        name = marker_key(self.prefix, arena.id)
        code = self._client.put(name, payload, self._marker_config)
        self._marked = code in (0, OBJECT_ALREADY_EXISTS)
        if code == 0:
            # Where the marker went, the rows go (the same preference). Looked at on the marker
            # alone: a look leases the object for Mooncake's lease time, which would put a
            # row object's removal off as a read does.
            self._check_placement(name)

    def _renew(self, renewed: list[tuple[int, int]]) -> None:
        """Apply off-node renewals: each slot's deadline moved to at least now + the seconds
        asked (as a reader here does), then the renewal objects removed."""
        arena = self._arena
        renewed = [e for e in renewed if ("unrenew", e) not in self._dropping]  # applied
        for slot, generation in renewed:
            raw = self._client.get(renew_key(self.prefix, arena.id, slot, generation))
            if len(raw) != 8:
                continue  # not a renewal aostore wrote: ignored (and removed)
            seconds = float(np.frombuffer(raw, "<f8")[0])
            if not (seconds > 0 and seconds < float("inf")):
                continue
            if not leases.lock(self._fd, slot, leases.READ):
                continue
            try:
                record = arena._slots[slot]
                if int(record["generation"]) == generation:
                    record["deadline"] = max(float(record["deadline"]), fmt.now() + seconds)
                    self.stats.renewed_offnode += 1
            finally:
                leases.lock(self._fd, slot, leases.UNLOCK)
        self._unmark(renewed, kind="unrenew")

    def _unmark(self, read: list[tuple[int, int]], kind: str = "unmark") -> None:
        """Remove read (or renewal) objects (retried like the rows' objects: a fresh one is
        under a lease; one retry waits for each at a time)."""
        made = read_key if kind == "unmark" else renew_key
        names = [made(self.prefix, self._arena.id, slot, gen) for slot, gen in read]
        codes = self._client.batch_remove(names, False)
        for entry, code in zip(read, codes, strict=True):
            if code in (0, OBJECT_NOT_FOUND):
                self._dropping.discard((kind, entry))
            elif (kind, entry) not in self._dropping:
                self._dropping.add((kind, entry))
                self._again(kind, entry)
            else:
                self._again(kind, entry)  # this was its retry: the next one

    def _remove(self, removes: list[tuple[int, int]]) -> None:
        for entry in removes:
            self._unread.pop(entry, None)
            self._held.pop(entry, None)
            self._again_put.discard(entry)
            self._settle(entry[1])
        if not removes:
            return
        names = [key(self.prefix, self._arena.id, slot, gen) for slot, gen in removes]
        codes = self._client.batch_remove(names, False)  # never forced: a read may be in flight
        for entry, code in zip(removes, codes, strict=True):
            if code in (0, OBJECT_NOT_FOUND):
                self.stats.removed += 1
            else:
                self.stats.remove_retries += 1
                if code != OBJECT_HAS_LEASE:  # a lease is a reader's, not an outage
                    self._failed("removals", _describe(code))
                self._again("remove", entry)


def _log_reads(arena: Arena, fd: int, first: list[tuple[int, int]]) -> None:
    """Append first reads to the arena's read log, as a reader does (under the log's lock,
    only tried: an entry left out only delays when those rows may go, to their deadline)."""
    for _ in range(100):
        if leases.lock_byte(fd, leases.LOG, leases.WRITE):
            break
        time.sleep(0.0001)
    else:
        return
    try:
        tail = int(arena._log_tail[0])
        capacity = len(arena._log)
        for slot, generation in first:
            entry = arena._log[tail % capacity]
            entry["slot"] = slot
            entry["generation"] = generation
            tail += 1
        arena._log_tail[0] = tail
    finally:
        leases.lock_byte(fd, leases.LOG, leases.UNLOCK)
