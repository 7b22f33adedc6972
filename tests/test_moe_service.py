"""An MoE model served end to end: ``edge-agent`` → HTTP → ``cloud-service`` with an
expert cache smaller than the experts (``--expert-cache``), against the dense
torch reference; the cache's metrics on the service's ``/metrics``.
"""

from __future__ import annotations

import asyncio
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from daemons import daemon

from splitinfer.cloud.config import RuntimeConfig
from splitinfer.cloud.moe.runtime import UNBOUNDED, cache_config
from splitinfer.models.moe import INPUT_SHAPES, moe_transformer, reference
from splitinfer.partitioner.moe_export import export_moe_package
from splitinfer.shared.errors import ConfigError
from splitinfer.sim.daemon import Daemon

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class World:
    def __init__(self, tmp: Path) -> None:
        self.model = moe_transformer()
        self.pkg = tmp / "repo" / "moe_transformer" / "1"
        shape = INPUT_SHAPES["transformer"]
        export_moe_package(self.model, tmp / "pkg", name="moe_transformer", sample_shape=shape)
        shutil.copytree(tmp / "pkg", self.pkg)
        moe = json.loads((self.pkg / "manifest.json").read_text())["planning"]["moe"]
        self.one_expert = max(moe["expert_bytes"])
        self.all_experts = moe["experts_total_bytes"]
        self.repo = tmp / "repo"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("moe-service"))


@pytest.fixture(scope="module")
def cloud(world: World) -> Iterator[Daemon]:
    proc = daemon(
        "cloud-service",
        "--repository", world.repo,
        "--listen", "127.0.0.1:0",
        "--no-auth",
        "--expert-cache", str(2 * world.one_expert),
    )  # fmt: skip
    yield proc
    proc.stop()


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def test_an_edge_agent_gets_the_reference_through_a_small_expert_cache(
    world: World, cloud: Daemon
) -> None:
    assert 2 * world.one_expert < world.all_experts / 4  # the cache really is small
    agent = daemon(
        "edge-agent", "--package", world.pkg, "--cloud", cloud.url, "--listen", "127.0.0.1:0"
    )
    rng = np.random.default_rng(5)
    xs = [
        rng.standard_normal((batch, *INPUT_SHAPES["transformer"])).astype(np.float32)
        for batch in (1, 4, 9, 2)
    ]

    async def ask() -> tuple[list[tuple[int, dict[str, str], bytes]], str, str]:
        async with aiohttp.ClientSession() as session:

            async def one(x: np.ndarray) -> tuple[int, dict[str, str], bytes]:
                async with session.post(f"{agent.url}/v1/infer", data=npy(x)) as resp:
                    return resp.status, dict(resp.headers), await resp.read()

            answers = await asyncio.gather(*(one(x) for x in xs))  # several in flight
            async with session.get(f"{cloud.url}/metrics") as resp:
                before = await resp.text()
            # the same request again: an unbounded cache would hold its experts by now
            answers.append(await one(xs[2]))
            async with session.get(f"{cloud.url}/metrics") as resp:
                return list(answers), before, await resp.text()

    try:
        answers, before, metrics = asyncio.run(ask())
    finally:
        code = agent.stop()
    assert code == 0, "".join(agent.lines)
    for x, (status, headers, body) in zip([*xs, xs[2]], answers, strict=True):
        assert status == 200, body
        assert headers["X-Splitinfer-Local"] == "0"
        with np.load(io.BytesIO(body)) as got:
            np.testing.assert_allclose(got["logits"], reference(world.model, x), atol=1e-5)
    # the experts were paged through the bounded cache, and the service says so
    assert total(before, "splitinfer_moe_expert_requests_total", 'result="miss"') > 0
    paged = "splitinfer_moe_paged_bytes_total"
    assert total(metrics, paged) > total(before, paged) > 0


def total(metrics: str, name: str, label: str = "") -> float:
    """The sum of a Prometheus series over its labels (those holding ``label``)."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(name + "{") and label in line
    ]
    assert values, f"no {name} in /metrics"
    return sum(values)


def test_the_cache_budget_comes_from_the_runtime_section() -> None:
    assert cache_config(RuntimeConfig()).budget_bytes == UNBOUNDED
    small = cache_config(RuntimeConfig(expert_cache_bytes=1 << 20, expert_cache_policy="lru"))
    assert (small.budget_bytes, small.policy) == (1 << 20, "lru")
    with pytest.raises(ConfigError, match="expert_cache_policy='fifo'"):
        RuntimeConfig(expert_cache_policy="fifo")
    with pytest.raises(ConfigError, match="expert_cache=-1: must be at least 0"):
        RuntimeConfig(expert_cache_bytes=-1)
