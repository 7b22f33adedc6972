"""The status pages in a real browser: headless Chromium screenshots both daemons' ``/``.

A cloud-service app and an edge-agent app (the daemons' own aiohttp apps, the
agent talking HTTP to the cloud with a signed device key) on 127.0.0.1; a few
requests through the agent; then ``/usr/bin/chromium --headless --screenshot``
of each page. Skipped where Chromium is not installed (``make install`` installs
it as root with apt-get). With ``SPLITINFER_STATUS_SCREENSHOTS=DIR`` the two
PNGs are also copied to DIR (how docs/status-*.png were made).
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from statuskit import device_credential, status_package

from splitinfer.cloud.config import ServiceConfig
from splitinfer.cloud.server import build_app
from splitinfer.edge.agent import create_app
from splitinfer.edge.config import EdgeConfig

CHROMIUM = Path("/usr/bin/chromium")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="no /usr/bin/chromium (Debian package chromium; make install adds it as root)",
    ),
]


async def screenshot(url: str, out: Path, profile: Path) -> None:
    """One headless Chromium screenshot of ``url``; the event loop keeps serving meanwhile."""
    proc = await asyncio.create_subprocess_exec(
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--screenshot={out}",
        "--window-size=1200,900",
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, output.decode(errors="replace")[-2000:]


def check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000, f"{path}: {len(data)} bytes, too small for a page"
    with Image.open(io.BytesIO(data)) as image:
        assert image.size == (1200, 900)
        grey = np.asarray(image.convert("L"))
    # text on a white page: many pixels far from white, but mostly white
    dark = float((grey < 128).mean())
    assert 0.005 < dark < 0.5, dark


async def test_both_pages_in_headless_chromium(
    aiohttp_server: Callable[..., Any],
    aiohttp_client: Callable[..., Any],
    tmp_path: Path,
) -> None:
    package = status_package(tmp_path)
    repo = tmp_path / "repo" / "statusdemo"
    repo.mkdir(parents=True)
    (repo / "1").symlink_to(package.resolve(), target_is_directory=True)
    _, credentials = device_credential(tmp_path)
    cloud_config = ServiceConfig(repository=str(tmp_path / "repo"), credentials=str(credentials))
    cloud = await aiohttp_server(build_app(cloud_config), host="127.0.0.1")
    cloud_url = str(cloud.make_url("")).rstrip("/")
    edge_config = EdgeConfig(package=package, cloud=(cloud_url,), credentials=credentials)
    agent = await aiohttp_client(create_app(edge_config), server_kwargs={"host": "127.0.0.1"})
    x = io.BytesIO()
    np.save(x, np.ones((1, 16), np.float32))
    # past adapt.min_dwell (10): the agent moves to the all-edge cut, which this
    # machine runs far faster than the package predicted, and the page says why
    local = []
    for _ in range(12):
        resp = await agent.post("/v1/infer", data=x.getvalue())
        assert resp.status == 200, await resp.text()
        local.append(resp.headers["X-Splitinfer-Local"])
    assert local[0] == "0"
    pages = {
        "cloud": f"{cloud_url}/",
        "edge": str(agent.make_url("/")),
    }
    keep = os.environ.get("SPLITINFER_STATUS_SCREENSHOTS")
    for name, url in pages.items():
        out = tmp_path / f"status-{name}.png"
        await screenshot(url, out, tmp_path / f"chromium-{name}")
        check_png(out)
        if keep:
            shutil.copyfile(out, Path(keep) / out.name)
