"""A real Mooncake cluster on loopback for tests and benchmarks, and a worker for two processes.

``cluster()`` starts ``mooncake_master`` (RPC, HTTP metadata server and metrics on free
ports, each given 127.0.0.1; Mooncake 0.3.13.post1 binds its built-in metadata server to 0.0.0.0
all the same: docs/mooncake.md) and, unless told not to, one segment holder
(``mooncake_client`` with a ``--global_segment_size`` pool), so engine clients can use
``global_segment_size=0`` and what they publish outlives them. ``Cluster.stop()`` stops every
process it started by PID (SIGTERM, then SIGKILL after a bound). For fault tests,
``kill_master``, ``pause_master`` / ``resume_master`` (SIGSTOP/SIGCONT) and ``restart_master``
(same ports, empty) act on the master by PID. Where ``setpriv`` exists the servers also get
``--pdeathsig``, so a test run that is killed does not leave them behind.

As a script, the worker for the two-process tests:

    python mooncake_util.py publish CONFIG_JSON PREFIX COUNT NBYTES
    python mooncake_util.py read CONFIG_JSON PREFIX COUNT NBYTES
    python mooncake_util.py digest CONFIG_JSON PREFIX COUNT NBYTES

``publish`` writes COUNT objects through its own tiered store, flushes and closes it;
``read`` reads them through a fresh tiered store (an empty local tier) and checks every byte;
``digest`` reads them the same way and reports each object's SHA-256 (what another engine
sees). Each prints one JSON line with what it did.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

PIP_PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
INSTALL_HINT = f"pip install '{PIP_PACKAGE}' and apt-get install libibverbs1"
LOOPBACK = "127.0.0.1"
START_TIMEOUT = 20.0  # seconds for a server to answer; only reached when something is broken
STOP_TIMEOUT = 10.0  # seconds between SIGTERM and SIGKILL


def package_dir() -> Path | None:
    """Where the ``mooncake`` package lies, found without importing it."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def missing_reason() -> str | None:
    """Why Mooncake tests cannot run here, or None when they can."""
    where = package_dir()
    if where is None:
        return f"Mooncake is not installed ({INSTALL_HINT})"
    for name in ("mooncake_master", "mooncake_client"):
        if not (where / name).is_file():
            return f"{where / name} is missing ({INSTALL_HINT})"
    try:
        importlib.import_module("mooncake.store")
    except ImportError as error:
        return f"mooncake.store does not import: {error} ({INSTALL_HINT})"
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def port_open(port: int) -> bool:
    try:
        socket.create_connection((LOOPBACK, port), timeout=0.2).close()
        return True
    except OSError:
        return False


class Server:
    """One process started by argv, logging to a file; stopped by PID."""

    def __init__(self, name: str, argv: list[str], log_path: Path, ready_port: int) -> None:
        self.name = name
        self.log_path = log_path
        self.ready_port = ready_port
        env = dict(os.environ, MC_TCP_BIND_ADDRESS=LOOPBACK)
        setpriv = shutil.which("setpriv")
        if setpriv is not None:  # the kernel stops it if this process dies first
            argv = [setpriv, "--pdeathsig", "TERM", "--", *argv]
        self._log: IO[bytes] = log_path.open("wb")
        self.process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        self.pid = self.process.pid  # setpriv execs the server: the same PID

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not port_open(self.ready_port):
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"{self.name} did not listen on {self.ready_port} in {timeout} s:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.05)

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM by PID, SIGKILL if it is still there after ``STOP_TIMEOUT``; idempotent."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)  # a paused server (a fault test) cannot exit
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self.process.wait(STOP_TIMEOUT)
        if not self._log.closed:
            self._log.close()

    def log_tail(self, lines: int = 20) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


class Cluster:
    """A master and optionally a segment holder, on loopback."""

    def __init__(
        self,
        log_dir: Path,
        *,
        holder_segment: str | None = "64MB",
        master_flags: tuple[str, ...] = (),
    ) -> None:
        where = package_dir()
        assert where is not None, INSTALL_HINT
        self.rpc_port = free_port()
        self.http_port = free_port()
        self.metrics_port = free_port()
        self.servers: list[Server] = []
        self.master = Server(
            "mooncake_master",
            [
                str(where / "mooncake_master"),
                f"--rpc_address={LOOPBACK}",
                f"--rpc_port={self.rpc_port}",
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_host={LOOPBACK}",
                f"--http_metadata_server_port={self.http_port}",
                f"--metrics_host={LOOPBACK}",
                f"--metrics_port={self.metrics_port}",
                "--rpc_thread_num=2",
                *master_flags,
            ],
            log_dir / f"master-{self.rpc_port}.log",
            self.rpc_port,
        )
        self.servers.append(self.master)
        try:
            self.master.wait_ready()
            self.holder: Server | None = None
            if holder_segment is not None:
                port = free_port()
                self.holder = Server(
                    "mooncake_client",
                    [
                        str(where / "mooncake_client"),
                        f"--host={LOOPBACK}",
                        f"--port={port}",
                        f"--global_segment_size={holder_segment}",
                        f"--master_server_address={self.master_address}",
                        f"--metadata_server={self.metadata_server}",
                        "--protocol=tcp",
                    ],
                    log_dir / f"holder-{port}.log",
                    port,
                )
                self.servers.append(self.holder)
                self.holder.wait_ready()
        except BaseException:
            self.stop()
            raise

    @property
    def master_address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}/metadata"

    def config(self, **overrides: Any) -> dict[str, Any]:
        """A client config (aostore.mooncake.MooncakeConfig keys) for this cluster."""
        values: dict[str, Any] = {
            "master_server_address": self.master_address,
            "metadata_server": self.metadata_server,
            "local_hostname": LOOPBACK,
            "global_segment_size": 0,
            "local_buffer_size": "8MB",
            "protocol": "tcp",
            "connect_timeout_s": 10.0,
        }
        values.update(overrides)
        return values

    def stop_master(self) -> None:
        self.master.stop()

    def kill_master(self) -> None:
        """SIGKILL to the master by PID (a crash: nothing is flushed or unregistered)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.master.pid, signal.SIGKILL)
        self.master.process.wait(STOP_TIMEOUT)
        self.master.stop()

    def pause_master(self) -> None:
        """SIGSTOP to the master by PID: its port still accepts connections, nothing answers."""
        os.kill(self.master.pid, signal.SIGSTOP)

    def resume_master(self) -> None:
        os.kill(self.master.pid, signal.SIGCONT)

    def restart_master(self) -> None:
        """A new master on the same ports, after the old one is gone (it starts empty: a
        Mooncake master keeps its data in memory). The segment holder mounts its segment on
        it again by itself (about a second)."""
        assert not self.master.running(), "stop or kill the master first"
        old = self.master
        argv = list(old.process.args)  # type: ignore[arg-type]
        if "--" in argv:  # setpriv --pdeathsig TERM -- mooncake_master ...
            argv = argv[argv.index("--") + 1 :]
        self.restarts = getattr(self, "restarts", 0) + 1
        log = old.log_path.with_name(f"{old.log_path.stem}-restart{self.restarts}.log")
        self.master = Server("mooncake_master", argv, log, self.rpc_port)
        self.servers[self.servers.index(old)] = self.master
        self.master.wait_ready()

    def stop(self) -> None:
        """Stops every server this cluster started, by PID, newest first."""
        for server in reversed(self.servers):
            server.stop()


@contextlib.contextmanager
def cluster(log_dir: Path, **kwargs: Any) -> Iterator[Cluster]:
    started = Cluster(log_dir, **kwargs)
    try:
        yield started
    finally:
        started.stop()


def payload(prefix: str, index: int, nbytes: int) -> bytes:
    """The bytes of object ``index``: recognisable, different for every index and prefix."""
    seed = (sum(prefix.encode()) + 31 * index) % 251
    return bytes((seed + i) % 256 for i in range(16)) * (nbytes // 16) + bytes(nbytes % 16)


def _worker(argv: list[str]) -> int:
    mode, config_json, prefix, count_text, nbytes_text = argv
    count, nbytes = int(count_text), int(nbytes_text)
    from aostore import BlockObject
    from aostore.mooncake import TieredBlockObjectStore

    config = json.loads(config_json)
    keys = [f"{prefix}:{i}" for i in range(count)]
    store = TieredBlockObjectStore.from_config(
        config, max_bytes=max(1, count) * nbytes, object_nbytes=nbytes
    )
    try:
        if mode == "publish":
            store.put([BlockObject(key, payload(prefix, i, nbytes)) for i, key in enumerate(keys)])
            store.flush()
            result: dict[str, Any] = {"published": count}
        elif mode == "read":
            data = store.get_concatenated(keys)
            expected = b"".join(payload(prefix, i, nbytes) for i in range(count))
            result = {"read": count, "equal": data == expected}
        elif mode == "digest":
            data = store.get_concatenated(keys)
            result = {
                "sha256": [
                    hashlib.sha256(data[i * nbytes : (i + 1) * nbytes]).hexdigest()
                    for i in range(count)
                ]
            }
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        stats = store.stats()
        result.update({k: stats[k] for k in ("remote_hit_objects", "published_objects")})
    finally:
        store.close()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
