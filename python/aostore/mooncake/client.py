"""Connecting to Mooncake, and the connected client: its lock, health latch and error codes.

docs/mooncake.md ("The Mooncake API aostore relies on") has what each Mooncake call does.
"""

from __future__ import annotations

import contextlib
import importlib
import ipaddress
import logging
import os
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from aostore._worker import fork_generation
from aostore.errors import BlockObjectStoreError
from aostore.mooncake.config import MooncakeConfig, split_address

__all__ = [
    "MOONCAKE_PIP_PACKAGE",
    "RPC_FAIL",
    "CallThread",
    "Client",
    "MooncakeError",
    "connect",
    "describe_code",
]

logger = logging.getLogger("aostore")

#: The pinned PyPI package that provides ``mooncake.store`` (CPU and TCP only; it needs
#: Debian's ``libibverbs1`` at run time).
MOONCAKE_PIP_PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"

# Error codes that Mooncake returns, as seen from its Python client.
_ERROR_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -200: "NO_AVAILABLE_HANDLE",
    -600: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
}
RPC_FAIL = -900
_PROBE_TIMEOUT_S = 1.0


class MooncakeError(BlockObjectStoreError):
    """Mooncake could not be reached, or refused a put or a read (not a plain miss)."""


def describe_code(code: int) -> str:
    return f"{code} ({_ERROR_NAMES.get(code, 'unknown error')})"


def _import_store_class() -> Any:
    try:
        module = importlib.import_module("mooncake.store")
    except ImportError as error:
        raise ImportError(
            f"aostore.mooncake needs Mooncake: pip install '{MOONCAKE_PIP_PACKAGE}' "
            f"(on Debian/Ubuntu it also needs: apt-get install libibverbs1). "
            f"Importing mooncake.store failed: {error}"
        ) from error
    return module.MooncakeDistributedStore


def _wait_for_port(what: str, host: str, port: int, deadline: float) -> None:
    """Connects to ``host:port`` until it answers or ``deadline`` (monotonic) passes."""
    last: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise MooncakeError(
                f"the Mooncake {what} at {host}:{port} is unreachable ({last}); is "
                f"mooncake_master running there? (gave up after the connect timeout)"
            )
        try:
            socket.create_connection((host, port), timeout=min(1.0, remaining)).close()
            return
        except OSError as error:
            last = error
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def bind_tcp_address(config: MooncakeConfig) -> None:
    """Sets ``MC_TCP_BIND_ADDRESS`` (read by Mooncake's ``setup``) to ``local_hostname`` for the
    TCP transport when it is unset and an IP: otherwise Mooncake advertises the LAN address."""
    if config.protocol != "tcp" or "MC_TCP_BIND_ADDRESS" in os.environ:
        return
    try:
        ipaddress.ip_address(config.local_hostname)
    except ValueError:
        return
    os.environ["MC_TCP_BIND_ADDRESS"] = config.local_hostname
    logger.info("set MC_TCP_BIND_ADDRESS=%s for Mooncake's TCP transport", config.local_hostname)


def connect(config: MooncakeConfig | Mapping[str, Any] | str | os.PathLike[str]) -> Any:
    """A ``mooncake.store.MooncakeDistributedStore`` set up from ``config``.

    ``config`` is a ``MooncakeConfig``, a mapping or a JSON file's path. Raises ``ImportError``
    naming the pip package when Mooncake is not installed, and ``MooncakeError`` when the
    master (or the HTTP metadata server) does not answer within ``connect_timeout_s`` or
    ``setup`` fails. With ``protocol="tcp"`` it sets ``MC_TCP_BIND_ADDRESS`` (see
    ``MooncakeConfig``).
    """
    config = MooncakeConfig.coerce(config)
    store_class = _import_store_class()
    bind_tcp_address(config)
    deadline = time.monotonic() + config.connect_timeout_s
    host, port = split_address(config.master_server_address)
    _wait_for_port("master", host, port, deadline)
    metadata = re.match(r"^https?://([^/:]+|\[[^\]]+\]):(\d+)", config.metadata_server)
    if metadata:
        _wait_for_port(
            "HTTP metadata server", metadata.group(1).strip("[]"), int(metadata.group(2)), deadline
        )
    client = store_class()
    code = client.setup(
        config.local_hostname,
        config.metadata_server,
        config.global_segment_size,
        config.local_buffer_size,
        config.protocol,
        config.device_name,
        config.master_server_address,
    )
    if code != 0:
        raise MooncakeError(
            f"Mooncake setup failed with {describe_code(code)} (master "
            f"{config.master_server_address}, metadata {config.metadata_server}, protocol "
            f"{config.protocol})"
        )
    logger.info(
        "connected to Mooncake master %s (metadata %s, segment %d B, buffer %d B)",
        config.master_server_address,
        config.metadata_server,
        config.global_segment_size,
        config.local_buffer_size,
    )
    return client


class Client:
    """A connected ``MooncakeDistributedStore`` and what every call into it needs.

    One lock serializes the calls (they share the client's local buffer; Mooncake releases the
    GIL while it works). Before a call: the process check (the client's threads exist only in
    the process that connected), the closed check, and the health latch: Mooncake's own
    ``health_check`` flag, and this client's latch, set when a call failed and the master's
    port did not answer; while it is set each call probes the port first (so a master that
    comes back is used again) instead of waiting on Mooncake's retries.
    """

    def __init__(self, raw: Any, *, master_address: str = "", close_client: bool = True) -> None:
        self.raw = raw
        self.master_address = master_address
        self._close_client = close_client
        self._lock = threading.Lock()
        self._closed = False
        self._master_down = False
        self._generation = fork_generation()

    @property
    def closed(self) -> bool:
        return self._closed

    @contextlib.contextmanager
    def locked(self, *, reachable: bool = True) -> Iterator[Any]:
        """The raw client under the lock, checked open (and reachable, unless told not to)."""
        with self._lock:
            self.check_open()
            if reachable:
                self._check_reachable()
            yield self.raw

    def check_process(self) -> None:
        if self._generation != fork_generation():
            raise RuntimeError(
                "this aostore Mooncake store was created in the parent process before fork(); "
                "its Mooncake client's threads do not exist here: connect a new store in the child"
            )

    def check_open(self) -> None:
        self.check_process()
        if self._closed:
            raise RuntimeError("auxiliary output store is closed")

    def unreachable(self, detail: str) -> MooncakeError:
        """The error for a master that is gone; latches it, so the next calls probe first."""
        self._master_down = True
        where = f" at {self.master_address}" if self.master_address else ""
        return MooncakeError(
            f"the Mooncake master{where} is unreachable ({detail}); auxiliary outputs cannot be "
            f"read from or published to Mooncake"
        )

    def _master_answers(self) -> bool:
        """Whether the master's RPC port accepts a connection (refused at once when the master
        process is gone; at most ``_PROBE_TIMEOUT_S``). True when the address is unknown."""
        if not self.master_address:
            return True
        host, port = split_address(self.master_address)
        try:
            socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S).close()
        except OSError:
            return False
        return True

    def _check_reachable(self) -> None:
        health = getattr(self.raw, "health_check", None)
        code = health() if health is not None else 0
        if code == 1:
            raise MooncakeError("the Mooncake client is closed or was never set up")
        if code == 2 or self._master_down:
            if not self._master_answers():
                raise self.unreachable("its port refuses connections")
            self._master_down = False

    def check_after_failure(self, detail: str) -> None:
        """After a failed call: raises the unreachable error when the master does not answer."""
        if not self._master_answers():
            raise self.unreachable(detail)

    def raise_for_code(self, what: str, code: int) -> None:
        """Raises ``MooncakeError`` for a call that returned the error ``code``."""
        self.check_after_failure(f"{what} failed with {describe_code(code)}")
        if code == RPC_FAIL:
            raise self.unreachable(f"{what} failed with {describe_code(code)}")
        hint = ""
        if code == -200:
            hint = (
                "; no mounted segment has room: Mooncake evicts at its high watermark, "
                "otherwise mount more memory (global_segment_size > 0 or a mooncake_client "
                "segment holder)"
            )
        elif code == -600:
            hint = "; the batch may not fit in the client's local_buffer_size"
        raise MooncakeError(f"Mooncake {what} failed with {describe_code(code)}{hint}")

    def remove_quietly(self, name: str) -> None:
        """``remove(name, force=True)``, best effort (never raises)."""
        remove = getattr(self.raw, "remove", None)
        if remove is None:
            return
        try:
            with self._lock:
                if self._closed or self._master_down:
                    return
                remove(name, True)
        except Exception as error:  # what is left behind costs a few bytes in Mooncake
            logger.debug("removing %r from Mooncake failed: %s", name, error)

    def close(self) -> None:
        """Closes the raw client (when this one owns it); idempotent."""
        self.check_process()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._close_client:
                code = self.raw.close()
                if code not in (0, None):
                    logger.warning("Mooncake client close returned %s", describe_code(code))


class _Job:
    """One call for a :class:`CallThread`; the caller waits for ``done``."""

    __slots__ = ("abandoned", "done", "error", "fn", "result")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn: Callable[[], Any] | None = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.abandoned = False


class CallThread:
    """Runs calls into Mooncake one at a time on a daemon thread, so that a caller can give up
    after a deadline while the call goes on (Mooncake's own timeouts are 30 s per RPC). A call
    given up on leaves the thread ``stuck`` until it returns: later callers then give up at
    once instead of queueing behind it. Started on first use; a daemon, so a call that never
    returns does not keep the interpreter from exiting."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._abandoned: _Job | None = None

    @property
    def stuck(self) -> bool:
        job = self._abandoned
        return job is not None and not job.done.is_set()

    def call(self, fn: Callable[[], Any], timeout: float) -> tuple[bool, Any]:
        """``(True, fn())`` when ``fn`` returned within ``timeout`` seconds (its exception is
        raised here), ``(False, None)`` when it did not or the thread is stuck."""
        with self._lock:
            if self.stuck:
                return False, None
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=self._name)
                self._thread.start()
            job = _Job(fn)
            self._jobs.put(job)
        if not job.done.wait(max(0.0, timeout)):
            with self._lock:
                job.abandoned = True
                if not job.done.is_set():
                    self._abandoned = job
                    return False, None
        if job.error is not None:
            raise job.error
        return True, job.result

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if not job.abandoned and job.fn is not None:
                    job.result = job.fn()
            except BaseException as error:  # handed to the caller, if it still waits
                job.error = error
            finally:
                job.fn = None
                job.done.set()

    def stop(self) -> None:
        """Lets the thread end once its current call returns; does not wait for it."""
        with self._lock:
            if self._thread is not None:
                self._jobs.put(None)
