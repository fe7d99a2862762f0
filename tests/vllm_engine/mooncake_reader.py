"""A trainer's reader, in a process of its own: objects read back by key from Mooncake.

    python mooncake_reader.py CONFIG_JSON_FILE KEYS_JSON_FILE OBJECT_NBYTES OUT_FILE

Connects its own client with the config (the engine's ``AOSTORE_VLLM_MOONCAKE`` file) and
reads every key with Mooncake's own calls, not aostore's stores: ``batch_get_buffer`` in
batches of at most half the client's local buffer, each key once, the key prefix of the
config prepended. Writes a pickle ``{key: bytes}`` (``None`` for a key Mooncake did not return)
and prints one JSON line with the counts.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    config_path, keys_path, nbytes_text, out_path = argv
    from aostore.mooncake import MooncakeConfig, connect

    config = MooncakeConfig.from_file(config_path)
    keys: list[str] = list(dict.fromkeys(json.loads(Path(keys_path).read_text())))
    step = max(1, config.local_buffer_size // 2 // int(nbytes_text))
    client = connect(config)
    found: dict[str, bytes | None] = {}
    try:
        for start in range(0, len(keys), step):
            batch = keys[start : start + step]
            handles = client.batch_get_buffer([config.key_prefix + key for key in batch])
            for key, handle in zip(batch, handles, strict=True):
                found[key] = None if handle is None else bytes(memoryview(handle))
            del handles
    finally:
        client.close()
    Path(out_path).write_bytes(pickle.dumps(found))
    missing = sum(value is None for value in found.values())
    print(json.dumps({"keys": len(keys), "read": len(found) - missing, "missing": missing}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
