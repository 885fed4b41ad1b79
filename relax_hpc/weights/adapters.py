"""Adapter sync (trainer.lora.sync adapter): each version reaches the engines as a PEFT folder.

After each optimizer step rank 0 writes the version's adapter folder to RUN_DIR/weights/lora/vN
(a filesystem every engine's node sees: no collective group, so an engine on any node, SGLang
included, takes it) and asks every engine that answers to /load_lora_adapter it under the name
vN, then to report version N (/update_weight_version, without aborting anything). The driver names
an engine's adapter in each /generate request (lora_path, from the version the engine reports),
so an answer comes from exactly that version, whatever the engine loaded since. Version 0 has no
folder: its B is zero, so the base model is version 0 bit for bit (a fresh or restarted engine
serves it before any load).

Each push also asks the engines to unload vN-2, without waiting: the engine answers once no request
in flight uses it (SGLang's rule; the next load waits behind it). vN-1 stays loaded, for requests
built from a version the driver read before this push; a request naming an unloaded adapter makes
the engine load it again from its folder, and the folders of the last KEEP_FOLDERS versions stay.
A vLLM engine speaks through relax_hpc.protocol.vllm.VllmClient (vLLM's /v1 adapter routes; its
unload forgets the name at once, and its filesystem resolver reloads a named adapter from here).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from relax_hpc import fence
from relax_hpc.protocol import requests as P
from relax_hpc.protocol import routes as R
from relax_hpc.protocol.client import EngineClient, EngineRequestError, EngineUnavailable
from relax_hpc.protocol.registry import EngineRecord, read_records
from relax_hpc.protocol.requests import adapter_name
from relax_hpc.weights.channel import FullParameters, QuietHooks
from relax_hpc.weights.sender import answering, same_engines

log = logging.getLogger("relax_hpc.weights")

KEEP_FOLDERS = 4
Adapter = dict[str, torch.Tensor]  # sync names (relax_hpc.weights.lora), SCALING included


def push_adapter(
    publisher: AdapterPublisher | None, params: Iterable[tuple[str, torch.Tensor | None]], version: int
) -> int:
    """A version's push; collective over trainer ranks (all gather the adapters, rank 0, whose
    `publisher` is not None, publishes them). Returns the number of engines updated (rank 0)."""
    if publisher is None:
        for _ in params:  # the other ranks take part in the gathers
            pass
        return 0
    adapter = {}
    for name, tensor in params:
        assert tensor is not None, f"rank 0 holds every full tensor; {name} is None"
        adapter[name] = tensor.cpu().clone()  # the gather's buffer may be reused
    return publisher.publish(version, adapter)


def write_version(folders: Path, version: int, write: Callable[[Path], None]) -> Path:
    """Write version's folder through `write` (into a temporary folder first: an engine never
    reads a half-written one), replacing an older one of that version (a resumed run rewrites its
    current version from the checkpoint); keep the newest KEEP_FOLDERS."""
    name = adapter_name(version)
    assert name is not None, "version 0 is the base model"
    folder, partial = folders / name, folders / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    write(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    versions = sorted(int(p.name[1:]) for p in folders.glob("v*") if p.name[1:].isdigit())
    for old in versions[:-KEEP_FOLDERS]:
        shutil.rmtree(folders / f"v{old}", ignore_errors=True)
    return folder


class AdapterPublisher:
    """Rank 0's side: makes every live engine serve a version's adapter folder."""

    def __init__(
        self,
        registry: Path,
        folders: Path,
        write: Callable[[Path, Adapter], None],
        api_key: str,
        timeout_s: float,
        client_class: type[EngineClient] = EngineClient,
    ) -> None:
        """`write(folder, adapter)` writes a PEFT adapter folder (relax_hpc.models.lora), in
        `folders` (RUN_DIR/weights/lora); `client_class` speaks the engines' API (VllmClient for
        rollout.engine vllm, whose adapter routes are vLLM's)."""
        self.registry, self.folders, self.write = registry, folders, write
        self.api_key, self.timeout_s, self.client_class = api_key, timeout_s, client_class
        self.members: list[EngineRecord] = []  # the engines the last push served
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="adapters")

    def _client(self, record: EngineRecord) -> EngineClient:
        return self.client_class(record.url, self.api_key, self.timeout_s)

    def _live(self) -> list[EngineRecord]:
        return answering(read_records(self.registry), self._pool, self._client)

    def engine_set_changed(self) -> bool:
        """True when the engines that answer differ from those the last push served (a new or
        restarted engine serves the base model until it gets the current adapter)."""
        return not same_engines(self._live(), self.members)

    def publish(self, version: int, adapter: Adapter) -> int:
        """Write version's folder (none for version 0: the base) and have every live engine load
        it and report the version; returns how many did."""
        fence.check("weight push (adapter)")
        folder = None
        if version > 0:
            folder = write_version(self.folders, version, lambda out: self.write(out, adapter))
        engines = self._live()
        served = list(self._pool.map(lambda r: self._serve(r, version, folder), engines))
        self.members = [r for r, ok in zip(engines, served, strict=True) if ok]
        return len(self.members)

    def _serve(self, record: EngineRecord, version: int, folder: Path | None) -> bool:
        client, name = self._client(record), adapter_name(version)
        try:
            if name is not None and folder is not None:
                client.load_adapter(name, str(folder))
            client.post(R.UPDATE_WEIGHT_VERSION.path, P.UpdateWeightVersionReqInput(str(version), False))
        except (EngineUnavailable, EngineRequestError) as e:
            log.warning("engine %s did not take adapter %s: %s", record.engine_id, name, e)
            return False
        old = adapter_name(version - 2)
        if old is not None:  # answered once no request uses it: not waited for
            self._pool.submit(self._unload, client, old)
        return True

    @staticmethod
    def _unload(client: EngineClient, name: str) -> None:
        # An engine that never loaded it (started since) says so; one that died is the next push's.
        with contextlib.suppress(EngineUnavailable, EngineRequestError):
            client.unload_adapter(name)


class AdapterChannel(QuietHooks):
    """Only the LoRA adapters travel, as PEFT folders (relax_hpc.weights.adapters); every rank
    takes part in the gathers, rank 0 (whose `publisher` is not None) publishes."""

    def __init__(self, publisher: AdapterPublisher | None) -> None:
        self.publisher = publisher

    def push(self, full_parameters: FullParameters, version: int) -> int:
        return push_adapter(self.publisher, full_parameters(), version)

    def engines_changed(self, delivered: int) -> bool:
        assert self.publisher is not None, "rank 0 decides"
        return self.publisher.engine_set_changed()
