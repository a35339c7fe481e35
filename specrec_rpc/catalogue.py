"""Local snapshots of the catalogue, kept in step with the item-set service.

Drafter, verifier and gateway each hold a :class:`CatalogueWatcher`: it
downloads the current version (``ItemSet.Snapshot``), builds a
:class:`~specrec.itemset.LocalItemSet` (trie, prefix ranges) and polls
``GetVersion`` every ``poll_s`` seconds; a new version is fetched, built off
the event loop, and swapped in atomically, then listeners are told. The last
``keep`` versions stay available so a request pinned to a version is served
from exactly that version.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc
import numpy as np
import structlog

from specrec.itemset import LocalItemSet

from .errors import FailedPrecondition, Unavailable
from .v1 import itemset_pb2, itemset_pb2_grpc


@dataclass
class Snapshot:
    version: str
    itemset: LocalItemSet
    ids: list[str]  # by row ("" for rows not in this version)
    titles: list[str]
    texts: list[str]
    index: dict[str, int] = field(default_factory=dict)  # item id -> row

    @property
    def level_sizes(self) -> list[int]:
        return self.itemset.level_sizes


def build_snapshot(version: str, level_sizes: list[int], items: list) -> Snapshot:
    n = max((it.row for it in items), default=-1) + 1
    L = len(level_sizes)
    sids = np.zeros((n, L), dtype=np.int64)
    seen = np.zeros(n, dtype=bool)
    active = np.zeros(n, dtype=bool)
    ids, titles, texts = [""] * n, [""] * n, [""] * n
    for it in items:
        r = it.row
        sids[r] = list(it.sid.codes)
        seen[r] = not it.unseen
        active[r] = True
        ids[r], titles[r], texts[r] = it.item_id, it.title, it.text
    itemset = LocalItemSet(sids, seen, list(level_sizes), version=version, active=active)
    _ = itemset.trie, itemset.order  # build now, not on the first request
    return Snapshot(version, itemset, ids, titles, texts, {i: r for r, i in enumerate(ids) if i})


Listener = Callable[[Snapshot, Snapshot | None], Awaitable[None] | None]


class CatalogueWatcher:
    def __init__(self, channel: grpc.aio.Channel, poll_s: float = 0.5, keep: int = 3, timeout_s: float = 30.0):
        self.stub = itemset_pb2_grpc.ItemSetStub(channel)
        self.poll_s, self.keep, self.timeout_s = poll_s, keep, timeout_s
        self.snapshots: dict[str, Snapshot] = {}
        self.current: Snapshot | None = None
        self.listeners: list[Listener] = []
        self._task: asyncio.Task | None = None
        self.log = structlog.get_logger("catalogue")
        self.last_ok = 0.0

    async def fetch(self, version: str = "") -> Snapshot:
        items, level_sizes, got = [], [], version
        try:
            async for chunk in self.stub.Snapshot(itemset_pb2.SnapshotRequest(version=version), timeout=self.timeout_s):
                got = chunk.version
                if chunk.level_sizes:
                    level_sizes = list(chunk.level_sizes)
                items.extend(chunk.items)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                raise FailedPrecondition(f"catalogue version {version!r} is not available: {e.details()}") from None
            raise Unavailable(f"item set unavailable: {e.code().name}: {e.details()}") from None
        return await asyncio.to_thread(build_snapshot, got, level_sizes, items)

    async def _install(self, snap: Snapshot) -> None:
        old = self.current
        self.snapshots[snap.version] = snap
        for v in sorted(self.snapshots, key=lambda x: int(x) if x.isdigit() else 0)[: -self.keep]:
            if v != snap.version:
                self.snapshots.pop(v, None)
        self.current = snap
        self.log.info("catalogue version", version=snap.version, items=len(snap.itemset))
        for fn in self.listeners:
            r = fn(snap, old)
            if asyncio.iscoroutine(r):
                await r

    async def start(self, wait_s: float = 120.0) -> Snapshot:
        """Fetch the current version (retrying until the item set answers), then poll."""
        t0 = time.monotonic()
        while True:
            try:
                await self._install(await self.fetch(""))
                break
            except (Unavailable, FailedPrecondition) as e:
                if time.monotonic() - t0 > wait_s:
                    raise
                self.log.warning("waiting for the item set", error=str(e))
                await asyncio.sleep(1.0)
        self.last_ok = time.monotonic()
        self._task = asyncio.create_task(self._poll())
        return self.current

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                info = await self.stub.GetVersion(itemset_pb2.GetVersionRequest(), timeout=max(1.0, self.poll_s * 4))
                self.last_ok = time.monotonic()
                if self.current is None or info.version != self.current.version:
                    await self._install(await self.fetch(info.version))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep serving the versions we have
                self.log.warning("catalogue poll failed", error=str(e))

    async def get(self, version: str = "") -> Snapshot:
        if not version or (self.current is not None and version == self.current.version):
            return self.current
        snap = self.snapshots.get(version)
        if snap is None:
            snap = await self.fetch(version)
            self.snapshots[version] = snap
        return snap

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
