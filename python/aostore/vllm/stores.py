"""The classes the plugin installs in vLLM, with the settings ``register`` binds into them.

Each is aostore's store with the defaults vLLM's use needs (``prefault`` from
``AOSTORE_VLLM_PREFAULT``, the profile the plan chose, the Mooncake tier of
``AOSTORE_VLLM_MOONCAKE``). The settings reach them once, through :func:`bind`, not by reading
the environment at each construction. Their public home is ``aostore.vllm_plugin``: that is the
name vLLM's users, logs and ``aostore vllm-check`` show.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Self, cast

from aostore import BlockObjectStore, ShmBlockObjectStore
from aostore.mooncake import MooncakeBlockObjectStore, MooncakeError, TieredBlockObjectStore

from .settings import ENV_MOONCAKE, MooncakeTier, Prefault

TIER_PENDING_BATCHES = 64
"""``max_pending_batches`` of the tier the plugin builds: puts queued for the publisher before a
put waits (vLLM puts a few blocks at a time; the publisher joins what is queued, up to one
batch of ``max_batch_bytes``, into one Mooncake call)."""

# Where users find these classes (and what the start-up line and vllm-check print).
PUBLIC_MODULE = "aostore.vllm_plugin"


class EngineBlockObjectStore(BlockObjectStore):
    """``aostore.BlockObjectStore`` as the vLLM plugin installs it (profile ``fail-closed``).

    The one default that differs: ``prefault`` is the ``AOSTORE_VLLM_PREFAULT`` that
    ``register`` read (``"background"`` unless set). vLLM sizes the arena to be filled (1.1x
    the KV cache's blocks in an RL run), and a page fault on the writer thread costs more than
    the copy it precedes (docs/vllm-plugin.md has the figures), so a thread commits every page
    from engine start while start-up goes on. The memory effect: the whole arena is resident
    from the start instead of as it fills. Other keyword arguments (``max_bytes`` and
    ``object_nbytes`` in bytes, ``policy``, ``profile``, ``pin_memory``) pass on unchanged.
    """

    __slots__ = ()
    __module__ = PUBLIC_MODULE
    _default_profile: ClassVar[str] = "fail-closed"
    _prefault: ClassVar[Prefault] = "background"

    def __new__(
        cls,
        *,
        max_bytes: int,
        object_nbytes: int,
        policy: Any | None = None,
        profile: str | None = None,
        pin_memory: bool = False,
        prefault: Prefault | None = None,
    ) -> Self:
        store = super().__new__(
            cls,
            max_bytes=max_bytes,
            object_nbytes=object_nbytes,
            policy=policy,
            profile=cls._default_profile if profile is None else profile,
            pin_memory=pin_memory,
            prefault=cls._prefault if prefault is None else prefault,
        )
        return cast(Self, store)


class GrowBlockObjectStore(EngineBlockObjectStore):
    """``EngineBlockObjectStore`` whose ``profile`` defaults to ``"grow"`` (vLLM 0.33)."""

    __slots__ = ()
    __module__ = PUBLIC_MODULE
    _default_profile = "grow"


def _tiered(tier: MooncakeTier, local_class: type[EngineBlockObjectStore], **options: Any) -> Any:
    """``local_class(**options)`` as the local tier of a ``TieredBlockObjectStore`` in front
    of the Mooncake cluster that ``tier`` names."""
    local = local_class(**options)
    try:
        remote = MooncakeBlockObjectStore.from_config(
            tier.config, object_nbytes=local.object_nbytes
        )
    except Exception as error:
        local.close()
        raise MooncakeError(
            f"aostore vLLM plugin: cannot build the Mooncake tier that {ENV_MOONCAKE}="
            f"{tier.path} asks for: {error}"
        ) from error
    except BaseException:
        local.close()
        raise
    try:
        return TieredBlockObjectStore(local, remote, max_pending_batches=TIER_PENDING_BATCHES)
    except BaseException:
        remote.close()
        local.close()
        raise


class TieredEngineBlockObjectStore(EngineBlockObjectStore):
    """What the plugin installs for vLLM's ``BlockObjectStore`` when ``AOSTORE_VLLM_MOONCAKE``
    names a valid config (profile ``fail-closed``).

    Constructing it returns an ``aostore.mooncake.TieredBlockObjectStore`` (not an instance of
    this class): its local tier is exactly the store the plugin builds without the setting
    (:class:`EngineBlockObjectStore` with the same arguments, so the same profile and
    prefault), its remote tier a ``MooncakeBlockObjectStore`` connected with the file's config,
    ``max_pending_batches`` :data:`TIER_PENDING_BATCHES`. Closing it publishes what is queued
    and closes both tiers. When Mooncake cannot be reached (or the objects do not fit its
    batches) the constructor closes the local store and raises
    ``aostore.mooncake.MooncakeError`` naming the setting and the file. Without a tier bound
    (:func:`bind`) it raises ``ValueError``.
    """

    __slots__ = ()
    __module__ = PUBLIC_MODULE
    _local_class: ClassVar[type[EngineBlockObjectStore]] = EngineBlockObjectStore
    _tier: ClassVar[MooncakeTier | None] = None

    def __new__(
        cls,
        *,
        max_bytes: int,
        object_nbytes: int,
        policy: Any | None = None,
        profile: str | None = None,
        pin_memory: bool = False,
        prefault: Prefault | None = None,
    ) -> Self:
        tier = cls._tier
        if tier is None:
            raise ValueError(
                f"no Mooncake tier configured: {ENV_MOONCAKE} named none when the plugin "
                "registered (aostore.vllm.stores.bind sets one)"
            )
        store = _tiered(
            tier,
            cls._local_class,
            max_bytes=max_bytes,
            object_nbytes=object_nbytes,
            policy=policy,
            profile=profile,
            pin_memory=pin_memory,
            prefault=prefault,
        )
        return cast(Self, store)


class TieredGrowBlockObjectStore(TieredEngineBlockObjectStore):
    """:class:`TieredEngineBlockObjectStore` whose local tier is a :class:`GrowBlockObjectStore`
    (vLLM 0.33)."""

    __slots__ = ()
    __module__ = PUBLIC_MODULE
    _default_profile = "grow"
    _local_class = GrowBlockObjectStore


class EngineShmBlockObjectStore(ShmBlockObjectStore):
    """``aostore.ShmBlockObjectStore`` as the plugin installs it on vLLM's Mooncake branch.

    As :class:`EngineBlockObjectStore`, the one default that differs is ``prefault``, the
    ``AOSTORE_VLLM_PREFAULT`` that ``register`` read (``"background"`` unless set).
    """

    __slots__ = ()
    __module__ = PUBLIC_MODULE
    _prefault: ClassVar[Prefault] = "background"

    def __new__(
        cls,
        *,
        max_bytes: int,
        object_nbytes: int,
        pin_memory: bool = False,
        prefault: Prefault | None = None,
    ) -> Self:
        return super().__new__(
            cls,
            max_bytes=max_bytes,
            object_nbytes=object_nbytes,
            pin_memory=pin_memory,
            prefault=cls._prefault if prefault is None else prefault,
        )


def bind(*, prefault: Prefault, tier: MooncakeTier | None) -> Callable[[], None]:
    """Gives the installed classes the prefault and the Mooncake tier ``register`` decided on
    (from :class:`~aostore.vllm.settings.Settings`); returns what puts back the ones they had
    (``register`` undoes a swap that fails half-way)."""
    before = (
        EngineBlockObjectStore._prefault,
        EngineShmBlockObjectStore._prefault,
        TieredEngineBlockObjectStore._tier,
    )
    EngineBlockObjectStore._prefault = prefault
    EngineShmBlockObjectStore._prefault = prefault
    TieredEngineBlockObjectStore._tier = tier

    def undo() -> None:
        (
            EngineBlockObjectStore._prefault,
            EngineShmBlockObjectStore._prefault,
            TieredEngineBlockObjectStore._tier,
        ) = before

    return undo


def bound() -> tuple[Prefault, MooncakeTier | None]:
    """The prefault and the Mooncake tier the installed classes have now (see :func:`bind`)."""
    return EngineBlockObjectStore._prefault, TieredEngineBlockObjectStore._tier
