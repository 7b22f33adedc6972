"""The cloud service's two HTTP front ends, started alike for the hostile-client tests.

:class:`Daemon` runs ``cloud-service``'s aiohttp server (``cloud/server.py``) in the
test's loop, one per ``running()``. :class:`RayIngress` is the Ray Serve ingress
(``cloud/scale/``) with one engine replica, on a local Ray started once per module
(:func:`ray_ingress`); its ``running()`` redeploys only when the service config
changes (about 3 s), so tests that share a config share a deployment. Both put the
same handler (``cloud/handler.py``) behind a real socket on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Protocol

from cloudkit import config
from hostile import served

from splitinfer.cloud.server import serve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Ingress(Protocol):
    name: str
    #: how long a request sent on a raw socket may take to reach the handler
    settle: float
    #: the counter of answered inference requests, by model, version and status
    requests_metric: str

    def address(self) -> str:
        """The URL the next ``running(listen=...)`` can be given and answers at."""
        ...

    def running(self, **kw: Any) -> contextlib.AbstractAsyncContextManager[str]:
        """The service with ``cloudkit.config(repo, credentials=..., **kw)``; its URL."""
        ...

    def replicas(self, n: int, **kw: Any) -> contextlib.AbstractAsyncContextManager[list[str]]:
        """``n`` replicas of it sharing ``kw``; a URL for each (Ray: one, ``n`` times)."""
        ...


class Daemon:
    """``cloud-service`` (aiohttp), started anew for each ``running()``."""

    name = "aiohttp"
    settle = 0.05
    requests_metric = "splitinfer_requests_total"

    def __init__(self, repo: Path, creds: Path) -> None:
        self.repo = repo
        self.creds = creds

    def address(self) -> str:
        return f"http://127.0.0.1:{free_port()}"

    @contextlib.asynccontextmanager
    async def running(self, **kw: Any) -> AsyncIterator[str]:
        cfg = config(self.repo, credentials=str(self.creds), warmup=False, **kw)
        async with served(lambda stop, started: serve(cfg, stop, started=started)) as url:
            yield url

    @contextlib.asynccontextmanager
    async def replicas(self, n: int, **kw: Any) -> AsyncIterator[list[str]]:
        async with contextlib.AsyncExitStack() as stack:
            yield [await stack.enter_async_context(self.running(**kw)) for _ in range(n)]


class RayIngress:
    """The Ray Serve application on the Ray this process started; one engine replica."""

    name = "ray"
    settle = 0.5  # the proxy, Serve's router and the ingress replica are three hops
    requests_metric = "splitinfer_ingress_requests_total"

    def __init__(self, repo: Path, creds: Path, port: int) -> None:
        self.repo = repo
        self.creds = creds
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._deployed: Any = None

    def address(self) -> str:
        return self.url

    def _deploy(self, ingress_replicas: int, kw: dict[str, Any]) -> str:
        from splitinfer.cloud.scale.config import ScaleConfig
        from splitinfer.cloud.scale.ray_serve import deploy

        listen = kw.pop("listen", None)
        assert listen is None or f"http://{listen}" == self.url, "Serve's proxy has one port"
        scale = ScaleConfig(
            service=config(self.repo, credentials=str(self.creds), warmup=False, **kw),
            min_replicas=1,
            max_replicas=1,
            num_cpus=0.5,
            ingress_replicas=ingress_replicas,
            ingress_num_cpus=0.25,
        )
        if scale != self._deployed:
            self._deployed = None
            deploy(scale, port=self.port, timeout_s=90)
            self._deployed = scale
        return self.url

    @contextlib.asynccontextmanager
    async def running(self, **kw: Any) -> AsyncIterator[str]:
        yield self._deploy(1, kw)

    @contextlib.asynccontextmanager
    async def replicas(self, n: int, **kw: Any) -> AsyncIterator[list[str]]:
        yield [self._deploy(n, kw)] * n


@contextlib.contextmanager
def ray_ingress(repo: Path, creds: Path) -> Iterator[RayIngress]:
    """A local Ray (2 CPUs) for the ingress; Serve and Ray shut down on the way out."""
    import ray

    from splitinfer.cloud.scale.ray_serve import shutdown

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield RayIngress(repo, creds, free_port())
    finally:
        shutdown()
        ray.shutdown()
