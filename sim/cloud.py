"""The cloud service of a scenario: ``cloud-service`` as a subprocess on a free loopback
port (``--no-auth``), serving every strategy's package as a version of the model, and
its batch counters."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from splitinfer.sim.daemon import Daemon, command
from splitinfer.sim.scenario import CloudSpec

#: Seconds the cloud service may take to print its address and become ready.
CLOUD_START_S = 60.0


# -- the cloud service ------------------------------------------------------------------


class CloudService:
    """``cloud-service`` as a subprocess (:class:`~splitinfer.sim.daemon.Daemon`);
    ``url`` once started and ready. What it writes goes to ``log_path``. Every version
    of ``models`` is served (``versions = "all"``)."""

    def __init__(
        self, repository: Path, models: Sequence[str], spec: CloudSpec, log_path: Path
    ) -> None:
        self.repository = repository
        self.models = list(models)
        self.spec = spec
        self.log_path = log_path
        self.url = ""
        self._daemon: Daemon | None = None

    def argv(self) -> list[str]:
        argv = [
            *command("cloud-service"),
            "--repository",
            str(self.repository),
            "--listen",
            "127.0.0.1:0",
            "--no-auth",
            "--log-level",
            "warning",
            "--max-batch-size",
            str(self.spec.max_batch_size),
            "--max-queue-delay",
            f"{self.spec.max_queue_delay_ms:g}ms",
            "--batching" if self.spec.batching else "--no-batching",
        ]
        for model in self.models:
            argv += ["--set", f'models.{model}.versions="all"']
        return argv

    async def start(self) -> str:
        self._daemon = Daemon(
            self.argv(), log=self.log_path, ready="/readyz", timeout_s=CLOUD_START_S
        )
        self.url = await self._daemon.wait_async()
        return self.url

    async def get(self, path: str) -> str:
        import aiohttp

        async with aiohttp.ClientSession() as session, session.get(self.url + path) as resp:
            return await resp.text()

    async def stop(self) -> None:
        if self._daemon is not None:
            await self._daemon.stop_async(10.0)
            self._daemon = None

    async def __aenter__(self) -> CloudService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def batch_sizes(metrics_text: str) -> dict[str, float]:
    """``{"count": batches, "sum": samples}`` of ``splitinfer_batch_size`` (all labels)."""
    out = {"count": 0.0, "sum": 0.0}
    for line in metrics_text.splitlines():
        for key in out:
            prefix = f"splitinfer_batch_size_{key}"
            if line.startswith(prefix + "{") or line.startswith(prefix + " "):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out
