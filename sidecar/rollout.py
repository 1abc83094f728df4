"""Rolling a new version of a served model out, with its index, without one mixed reply.

A team retrains weekly: `embedcar model prepare --from NEW --model NAME` replaces the model's
directory (the old one kept as NAME.previous) and `embedcar catalog build` adds an index version
built with the new model. Each sidecar notices the new manifest (sidecar.poll_s) and builds
the new version beside the one in service, off the request path:

    new manifest seen -> candidate ServedModel: backend loaded and warm, admission calibrated,
    its own index holder looking for an index of the new version's id
      -> while the model in service has an index and the candidate has none yet: keep waiting
      -> switch: one assignment in the ModelSet; the old version closes after sidecar.grace_s

Every request resolves its model once (sidecar.service), so until the switch it searches the old
index with the old model and after it the new index with the new model: never one with the other.
Rolling back is one command, `embedcar model rollback --model NAME` (the previous directory comes
back; its index versions are still in the index root), and goes through the same steps. So does a
new default variant (`embedcar model report NAME --set-default`) where the sidecar serves the default.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from inference.errors import EmbedcarError
from inference.manifest import Manifest, load_manifest, verify_files
from sidecar.metrics import Metrics
from sidecar.models import ModelSet, ServedModel, build_model, model_settings
from sidecar.settings import Settings

log = logging.getLogger(__name__)


class Rollout:
    def __init__(self, settings: Settings, models: ModelSet, metrics: Metrics, *,
                 on_switch: Callable[[ServedModel], None] | None = None,
                 on_index_load: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self.models = models
        self.metrics = metrics
        self._on_switch = on_switch
        self._on_index_load = on_index_load
        self._candidates: dict[str, ServedModel] = {}
        self._waiting: set[str] = set()  # versions already reported as waiting for their index
        self._reported: set[tuple[str, str]] = set()  # start failures already logged
        self._retiring: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        poll = self.settings.sidecar.poll_s
        while True:
            await asyncio.sleep(poll)
            for current in self.models:
                try:
                    await self.check(current.name)
                except EmbedcarError as exc:  # e.g. a Triton that does not serve the new version yet
                    if (current.name, exc.message) not in self._reported:  # once, not every poll
                        self._reported.add((current.name, exc.message))
                        log.warning("model %s: the new version cannot start yet (%s); still serving %s",
                                    current.name, exc.message, current.version_id)
                except Exception:  # keep serving what is in service; the next poll tries again
                    log.exception("rollout of model %s failed", current.name)

    async def close(self) -> None:
        for cand in self._candidates.values():
            await cand.close()
        self._candidates.clear()
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    def _on_disk(self, name: str) -> str | None:
        """The id of what model `name`'s directory would serve now (its version and the configured variant,
        or the manifest's default: a new default rolls out like a new version); None while it is replaced."""
        try:
            return self._serves(load_manifest(model_settings(self.settings, name).model.model_dir))
        except EmbedcarError:
            return None

    def _serves(self, manifest: Manifest) -> str:
        return manifest.variant_id(self.settings.model.variant)

    async def check(self, name: str) -> None:
        """One step of `name`'s rollout: start a candidate for a new version, switch once it is ready."""
        current = self.models.get(name)
        version = await asyncio.to_thread(self._on_disk, name)
        cand = self._candidates.get(name)
        if cand is not None and self._serves(cand.manifest) != version:  # superseded, or rolled back meanwhile
            del self._candidates[name]
            await cand.close()
            cand = None
        if version is None or version == self._serves(current.manifest):
            return
        if cand is None:
            cand = await self._start_candidate(name, version)
            if cand is None:
                return
        if current.index.current() is not None and cand.index.current() is None:
            if version not in self._waiting:
                self._waiting.add(version)
                log.info("model %s %s is warm; waiting for an index built with it (%s)", name, cand.version_id,
                         cand.index.reason())
            return
        del self._candidates[name]
        old = self.models.replace(cand)
        self.metrics.model_switches.inc()
        log.info("model %s: now serving %s%s (was %s)", name, cand.version_id,
                 f" with index {idx.version}" if (idx := cand.index.current()) is not None else "", old.version_id)
        if self._on_switch is not None:
            self._on_switch(cand)
        task = asyncio.get_running_loop().create_task(self._retire(old), name=f"retire-{name}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _start_candidate(self, name: str, version: str) -> ServedModel | None:
        settings = model_settings(self.settings, name)
        model_dir = settings.model.model_dir
        manifest = await asyncio.to_thread(load_manifest, model_dir)
        problems = await asyncio.to_thread(verify_files, model_dir, manifest)
        if self._serves(manifest) != version or problems:
            return None  # still being written: the next poll sees it whole
        cand = build_model(self.settings, name, self.metrics, on_index_load=self._on_index_load)
        try:
            await cand.start()
        except BaseException:
            await cand.close()
            raise
        self._candidates[name] = cand
        log.info("model %s: new version %s loaded and warm", name, cand.version_id)
        return cand

    async def _retire(self, old: ServedModel) -> None:
        # Requests that resolved the old version before the switch finish on it.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(self.settings.sidecar.grace_s)
        await old.close()
