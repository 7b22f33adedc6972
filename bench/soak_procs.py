"""The soak run's processes and the faults done to them (``bench/bench_soak.py``).

- :class:`Repository`: the cloud's model repository, on a size-limited tmpfs the
  run mounts when it runs as root (so that a full disk is a real ``ENOSPC``); hot
  swaps write a new version folder under a dot-name and rename it into place.
- :class:`Redis`: ``redis-server`` on a loopback port, no persistence: the nonce
  store; stopped and started again on the same port.
- :class:`Cloud`: ``cloud-service`` on a fixed loopback port (its links point at
  it), killed with SIGKILL and started again, or stopped with SIGSTOP.
- :class:`RayCloud`: the same service as a two-replica Ray Serve application,
  run by a driver process (``bench_soak.py --ray-driver``); a fault kills or stops
  one replica's worker process, which Serve replaces.

Every daemon starts through the one launcher (``sim/daemon.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from splitinfer.sim.daemon import Daemon, command

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
#: tmpfs size of the repository: the packages take about 2 MB
REPOSITORY_BYTES = 16 * 2**20
#: versions of the hot-swapped model kept on disk (older ones are retired and removed)
KEEP_VERSIONS = 3


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def write_toml(path: Path, data: Mapping[str, Any]) -> Path:
    """A TOML file of ``data`` (values, then tables; nested tables by dotted names)."""
    lines: list[str] = []

    def table(prefix: str, d: Mapping[str, Any]) -> None:
        flat = [(k, v) for k, v in d.items() if not isinstance(v, Mapping)]
        if prefix and flat:
            lines.append(f"[{prefix}]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in flat)
        for k, v in d.items():
            if isinstance(v, Mapping):
                table(f"{prefix}.{k}" if prefix else k, v)

    table("", data)
    path.write_text("\n".join(lines) + "\n")
    return path


# -- the repository -----------------------------------------------------------------------


class Repository:
    """The model repository; ``mounted`` when it sits on its own small tmpfs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mounted = False
        self.why_not = ""
        self.ballast = path / ".ballast"

    def mount(self) -> None:
        """A fresh, empty repository: on its own tmpfs when this process may mount one."""
        if self.path.is_mount():  # left by a run that was killed
            subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            self.why_not = "not root: no size-limited tmpfs can be mounted"
            return
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={REPOSITORY_BYTES},mode=0755", "tmpfs",
             str(self.path)],
            check=False, capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            self.why_not = f"mount -t tmpfs failed: {done.stderr.strip() or done.returncode}"
            return
        self.mounted = True

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)
            self.mounted = False

    def install(self, name: str, version: str, package: Path) -> None:
        """Copy ``package`` in as ``name/version``: written under a dot-name, renamed."""
        tmp = self.path / name / f".{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            shutil.copytree(package, tmp)
            tmp.rename(self.path / name / version)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def prune(self, name: str, newest: int) -> None:
        """Remove the versions of ``name`` older than the ``KEEP_VERSIONS`` newest."""
        for d in (self.path / name).iterdir():
            if d.name.isdigit() and int(d.name) <= newest - KEEP_VERSIONS:
                shutil.rmtree(d, ignore_errors=True)

    def fill(self) -> int:
        """Fill the file system until ENOSPC; the bytes written."""
        written = 0
        chunk = bytes(2**20)
        with self.ballast.open("wb") as f:
            while True:
                try:
                    f.write(chunk)
                    f.flush()
                    written += len(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
            with contextlib.suppress(OSError):  # the last partial chunk
                os.fsync(f.fileno())
        return written

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.ballast.unlink()

    def usage(self) -> str:
        total, used, _ = shutil.disk_usage(self.path)
        return f"{used / 2**20:.1f} of {total / 2**20:.1f} MiB used"


# -- the nonce store ------------------------------------------------------------------------


class Redis:
    """``redis-server`` on ``port``, no persistence (a restart forgets every nonce)."""

    def __init__(self, port: int, log: Path) -> None:
        self.port = port
        self.log = log
        self.daemon: Daemon | None = None
        self.url = f"redis://127.0.0.1:{port}/0"

    def argv(self) -> list[str]:
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("bench_soak: redis-server is not on PATH (apt install redis-server)")
        return [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--protected-mode", "yes"]  # fmt: skip

    def start(self) -> None:
        self.daemon = Daemon(self.argv(), name="redis-server", log=self.log, url=self.url)
        deadline = time.monotonic() + 30
        while self.dbsize() is None:
            if self.daemon.proc is None or self.daemon.proc.poll() is not None:
                raise SystemExit(f"bench_soak: redis-server did not start: {self.daemon.tail()}")
            if time.monotonic() > deadline:
                raise SystemExit("bench_soak: redis-server did not answer PING in 30 s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop(10)
            self.daemon = None

    @property
    def pid(self) -> int | None:
        return self.daemon.pid if self.daemon is not None else None

    def dbsize(self) -> int | None:
        import redis

        try:
            client = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)
            try:
                return int(client.dbsize())
            finally:
                client.close()
        except redis.RedisError:
            return None


# -- the cloud ------------------------------------------------------------------------------


class Cloud:
    """``cloud-service`` with ``config`` (a TOML file) on a fixed port."""

    mode = "cloud-service"

    def __init__(self, config: Path, port: int, log: Path) -> None:
        self.config = config
        self.port = port
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        self.daemon: Daemon | None = None
        self.starts = 0

    def _start(self) -> Daemon:
        argv = [*command("cloud-service"), "--config", str(self.config)]
        return Daemon(argv, log=self.log, env=ONE_THREAD, ready="/readyz", timeout_s=180)

    async def start(self) -> float:
        """Start it; the seconds until it was ready."""
        t = time.monotonic()
        self.daemon = self._start()
        await self.daemon.wait_async()
        self.starts += 1
        return time.monotonic() - t

    async def kill_and_restart(self) -> str:
        assert self.daemon is not None
        old = self.daemon.pid
        await asyncio.to_thread(self.daemon.kill)
        took = await self.start()
        return f"pid {old} killed; pid {self.pid} ready {took:.1f} s later"

    @contextlib.asynccontextmanager
    async def stopped(self) -> Any:
        """SIGSTOP inside the block, SIGCONT on the way out (also on an error)."""
        pid = self.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            yield f"pid {pid}"
        finally:
            os.kill(pid, signal.SIGCONT)

    async def stop(self) -> None:
        if self.daemon is not None:
            await self.daemon.stop_async(15)
            self.daemon = None

    @property
    def pid(self) -> int | None:
        return self.daemon.pid if self.daemon is not None else None

    def processes(self) -> dict[str, int]:
        pid = self.pid
        return {"cloud": pid} if pid is not None else {}


class RayCloud(Cloud):
    """The service as a two-replica Ray Serve application, run by a driver process
    (``bench_soak.py --ray-driver CONFIG``). Faults go to one replica's worker."""

    mode = "ray"

    def _start(self) -> Daemon:
        argv = [sys.executable, str(Path(__file__).with_name("bench_soak.py")),
                "--ray-driver", str(self.config), "--ray-port", str(self.port)]  # fmt: skip
        return Daemon(argv, name="ray-driver", log=self.log, env=ONE_THREAD, timeout_s=300)

    def _family(self) -> list[tuple[int, str]]:
        """(pid, command line) of every process of this run's Ray: the driver's
        descendants only, never another session's Ray."""
        import psutil

        if self.pid is None:
            return []
        out = []
        try:
            for p in psutil.Process(self.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    out.append((p.pid, " ".join(p.cmdline())))
        except psutil.Error:
            return []
        return out

    def _replicas(self) -> list[int]:
        return sorted(
            pid for pid, line in self._family() if "ServeReplica" in line and "CloudReplica" in line
        )

    async def kill_and_restart(self) -> str:
        replicas = self._replicas()
        if not replicas:
            return "no CloudReplica worker found: nothing killed"
        victim = replicas[(self.starts + len(replicas)) % len(replicas)]
        os.kill(victim, signal.SIGKILL)
        self.starts += 1
        t = time.monotonic()
        while time.monotonic() - t < 120:
            await asyncio.sleep(1)
            now = [p for p in self._replicas() if p != victim]
            if len(now) >= len(replicas):
                took = time.monotonic() - t
                return f"replica pid {victim} killed; Serve replaced it in {took:.0f} s"
        return f"replica pid {victim} killed; not replaced within 120 s"

    @contextlib.asynccontextmanager
    async def stopped(self) -> Any:
        replicas = self._replicas()
        if not replicas:
            yield "no CloudReplica worker found: nothing stopped"
            return
        pid = replicas[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            yield f"replica pid {pid}"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    async def stop(self) -> None:
        """Stop the driver (it shuts Serve and Ray down), then end whatever of its Ray
        outlived it (Ray's agents can be left behind, orphaned)."""
        import psutil

        family = []
        if self.pid is not None:
            with contextlib.suppress(psutil.Error):
                family = psutil.Process(self.pid).children(recursive=True)
        if self.daemon is not None:
            await self.daemon.stop_async(60)
            self.daemon = None
        for p in family:
            with contextlib.suppress(psutil.Error):
                if p.is_running():  # the same process: psutil compares its start time
                    p.kill()

    def processes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if self.pid is not None:
            out["ray driver"] = self.pid
        names = {"CloudReplica": "ray replica", "Ingress": "ray ingress",
                 "ServeController": "ray controller", "ProxyActor": "ray proxy",
                 "raylet/raylet": "raylet", "gcs_server": "ray gcs"}  # fmt: skip
        for pid, line in self._family():
            for key, role in names.items():
                if key in line:
                    n = sum(r.startswith(role) for r in out)
                    out[f"{role} {n}" if n or role == "ray replica" else role] = pid
                    break
        return out


def ray_driver(config: Path, port: int) -> int:
    """The ``--ray-driver`` process: a local Ray, the application with two replicas
    on ``port``, until SIGTERM."""
    import ray

    from splitinfer.cloud.config import build_config
    from splitinfer.cloud.scale.config import ScaleConfig
    from splitinfer.cloud.scale.ray_serve import deploy, shutdown
    from splitinfer.shared.options import load_toml

    data = load_toml(config)
    data.pop("listen", None)
    service = build_config(data, where=str(config))
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        scale = ScaleConfig(
            service=service, min_replicas=2, max_replicas=2, num_cpus=0.5, ingress_num_cpus=0.25
        )
        url = deploy(scale, port=port, timeout_s=240)
        print(f"ray-driver: listening on {url}", flush=True)
        while not stop:
            time.sleep(0.5)
    finally:
        shutdown()
        ray.shutdown()
    return 0
