"""How to reach a Mooncake Store cluster: ``MooncakeConfig`` and its sizes and addresses."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["MIB", "MooncakeConfig", "parse_size", "split_address"]

MIB = 1 << 20

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(name: str, value: object) -> int:
    """An ``int`` number of bytes, or a string such as ``"64MB"``/``"1 GiB"`` (powers of 1024,
    as Mooncake reads them)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number of bytes, not {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        size = int(match.group(1)) << (10 * _UNITS[match.group(2)[:1].lower()])
    else:
        raise ValueError(f"{name} must be a number of bytes or a size like '64MB', not {value!r}")
    if size < 0:
        raise ValueError(f"{name} must not be negative, got {size}")
    return size


@dataclasses.dataclass(frozen=True)
class MooncakeConfig:
    """How to reach a Mooncake Store cluster.

    The keys are those of the ``mooncake.json`` files that vLLM's Mooncake connectors read,
    plus aostore's own:

    - ``master_server_address``: ``"host:port"`` of ``mooncake_master`` (required).
    - ``metadata_server``: ``"http://host:port/metadata"`` (the master's HTTP metadata
      server), ``"P2PHANDSHAKE"`` (the default: no metadata server) or an etcd address.
    - ``local_hostname``: the address this client advertises (default ``"127.0.0.1"``: one
      machine; set this host's address for several). With ``protocol="tcp"``, ``connect``
      also sets ``MC_TCP_BIND_ADDRESS`` to it when that variable is unset and it is an IP.
    - ``global_segment_size``: bytes this client adds to the pool (default 0: the pool comes
      from segment holders; objects in a client's segment go when the client closes).
    - ``local_buffer_size``: the client's staging buffer for transfers (default 16 MiB).
    - ``protocol`` (``"tcp"``) and ``device_name`` (RDMA devices, ``""``).
    - ``connect_timeout_s``: how long ``connect`` waits for the master (default 10 s).
    - ``max_batch_bytes``: the most payload bytes per ``put_batch``/``batch_get_buffer``
      (default 4 MiB; capped at half of ``local_buffer_size``).
    - ``key_prefix``: prepended to every key in Mooncake (a namespace per model; default "").

    Sizes take an ``int`` or a string such as ``"64MB"``.
    """

    master_server_address: str
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 0
    local_buffer_size: int = 16 * MIB
    protocol: str = "tcp"
    device_name: str = ""
    connect_timeout_s: float = 10.0
    max_batch_bytes: int = 4 * MIB
    key_prefix: str = ""

    def __post_init__(self) -> None:
        for name in ("master_server_address", "metadata_server", "local_hostname", "protocol"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        for name in ("device_name", "key_prefix"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        split_address(self.master_server_address)
        for name in ("global_segment_size", "local_buffer_size", "max_batch_bytes"):
            object.__setattr__(self, name, parse_size(name, getattr(self, name)))
        if self.local_buffer_size <= 0:
            raise ValueError("local_buffer_size must be positive")
        if self.max_batch_bytes <= 0:
            raise ValueError("max_batch_bytes must be positive")
        timeout = self.connect_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"connect_timeout_s must be a positive number, got {timeout!r}")

    @property
    def batch_bytes(self) -> int:
        """The batch bound in effect: ``max_batch_bytes``, at most half the local buffer."""
        return max(1, min(self.max_batch_bytes, self.local_buffer_size // 2))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> MooncakeConfig:
        """A config from a mapping; unknown keys raise ``ValueError`` (a typo never passes)."""
        if not isinstance(values, Mapping):
            raise TypeError(f"a Mooncake config must be a mapping, not {type(values).__name__}")
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(
                f"unknown Mooncake config keys {unknown}; known keys are {sorted(names)}"
            )
        if "master_server_address" not in values:
            raise ValueError("a Mooncake config needs master_server_address ('host:port')")
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> MooncakeConfig:
        """A config from a JSON file holding one object."""
        text = Path(path).read_text(encoding="utf-8")
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON: {error}") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path}: a Mooncake config must be a JSON object")
        return cls.from_dict(values)

    @classmethod
    def coerce(
        cls, config: MooncakeConfig | Mapping[str, Any] | str | os.PathLike[str]
    ) -> MooncakeConfig:
        """``config`` itself, or a config from a mapping or a JSON file's path."""
        if isinstance(config, MooncakeConfig):
            return config
        if isinstance(config, Mapping):
            return cls.from_dict(config)
        return cls.from_file(config)


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"master_server_address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)
