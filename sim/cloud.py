"""The cloud service of a scenario: ``cloud-service`` as a subprocess on a free loopback
port (``--no-auth``), serving every strategy's package as a version of the model, and
its batch counters."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from splitinfer.shared.errors import ConfigError
from splitinfer.sim.scenario import CloudSpec

#: Seconds the cloud service may take to print its address and become ready.
CLOUD_START_S = 60.0


# -- the cloud service ------------------------------------------------------------------


class CloudService:
    """``cloud-service`` as a subprocess; ``url`` once started. Its stderr goes to
    ``log_path``. Every version of ``models`` is served (``versions = "all"``)."""

    def __init__(
        self, repository: Path, models: Sequence[str], spec: CloudSpec, log_path: Path
    ) -> None:
        self.repository = repository
        self.models = list(models)
        self.spec = spec
        self.log_path = log_path
        self.url = ""
        self._proc: asyncio.subprocess.Process | None = None
        self._drain: asyncio.Task[None] | None = None

    def argv(self) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "splitinfer.cloud.cli",
            "--repository",
            str(self.repository),
            "--listen",
            "127.0.0.1:0",
            "--no-auth",
            "--log-level",
            "warning",
            "--max-batch-size",
            str(self.spec.max_batch_size),
            "--max-queue-delay-ms",
            f"{self.spec.max_queue_delay_ms:g}",
            "--batching" if self.spec.batching else "--no-batching",
        ]
        for model in self.models:
            argv += ["--set", f'models.{model}.versions="all"']
        return argv

    async def start(self) -> str:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as err:
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv(), stdout=asyncio.subprocess.PIPE, stderr=err
            )
        assert self._proc.stdout is not None
        try:
            line = await asyncio.wait_for(self._proc.stdout.readline(), CLOUD_START_S)
        except TimeoutError:
            line = b""
        text = line.decode(errors="replace").strip()
        marker = "listening on "
        if marker not in text:
            await self.stop()
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:]
            raise ConfigError(f"cloud-service did not start: {tail[0] if tail else text!r}")
        self.url = text.split(marker, 1)[1].split()[0].rstrip("/")
        self._drain = asyncio.create_task(self._drain_stdout())
        await self._wait_ready()
        return self.url

    async def _drain_stdout(self) -> None:
        assert self._proc is not None
        assert self._proc.stdout is not None
        while await self._proc.stdout.readline():
            pass

    async def _wait_ready(self) -> None:
        import aiohttp

        deadline = time.monotonic() + CLOUD_START_S
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with session.get(self.url + "/readyz") as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.1)
        raise ConfigError(f"cloud-service at {self.url} was not ready in {CLOUD_START_S:g} s")

    async def get(self, path: str) -> str:
        import aiohttp

        async with aiohttp.ClientSession() as session, session.get(self.url + path) as resp:
            return await resp.text()

    async def stop(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10.0)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._drain is not None:
            self._drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain
        self._proc = None

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
