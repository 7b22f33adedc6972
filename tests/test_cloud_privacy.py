"""The cloud's own privacy budget per device: noised frames are charged, a device past
its budget gets 429 with Retry-After until its window ends, a frame noised less than
its package asks is refused (400); the accountant is the real opacus one."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient
from cloudkit import chain_repo, config

from splitinfer.cloud.cli import build_parser, config_from_args
from splitinfer.cloud.config import PrivacyConfig
from splitinfer.cloud.engine import Engine
from splitinfer.cloud.server import build_app
from splitinfer.shared.auth import HEADER_DEVICE
from splitinfer.shared.codecs import RAW
from splitinfer.shared.errors import ConfigError, ProtocolError
from splitinfer.shared.frame import FRAME_TYPE, Privacy, Request, WireTensor, encode_request
from splitinfer.shared.manifest import Manifest
from splitinfer.shared.privacy import Accountant, PrivacyBudgetExhausted

pytestmark = pytest.mark.integration

Client = Callable[..., Awaitable[TestClient[Any, Any]]]
SIGMA, DELTA = 2.0, 1e-5


def epsilon_after(releases: int) -> float:
    acc = Accountant("rdp")
    for _ in range(releases):
        acc.record(SIGMA)
    return acc.epsilon(DELTA)


#: room for exactly two releases at SIGMA
BUDGET = (epsilon_after(2) + epsilon_after(3)) / 2


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    repo = tmp_path_factory.mktemp("privacy") / "repo"
    return repo, chain_repo(repo)


@pytest.fixture
def repo(built: tuple[Path, Manifest], tmp_path: Path) -> Path:
    shutil.copytree(built[0], tmp_path / "repo")
    return tmp_path / "repo"


def noised(manifest: Manifest, sigma: float = SIGMA) -> bytes:
    cut = manifest.find_cut("c0")  # the whole model in the cloud
    assert cut is not None
    x = np.ones((1, 4), np.float32)
    return encode_request(
        Request(
            uuid.uuid4().hex,
            "chain",
            "",
            cut.id,
            (WireTensor(cut.tensors[0].name, x, RAW),),
            privacy=Privacy(sigma, 1.0, 1.0) if sigma else Privacy(),
        )
    )


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def test_a_device_past_its_budget_is_refused_until_its_window_ends(
    built: tuple[Path, Manifest], repo: Path
) -> None:
    m = built[1]
    clock = Clock()
    cfg = config(
        repo, privacy=PrivacyConfig(budget_epsilon=BUDGET, budget_window_s=60.0, budget_delta=DELTA)
    )
    async with Engine(cfg, clock=clock) as engine:
        for _ in range(2):
            await engine.infer("chain", noised(m), device="cam-1")
        for _ in range(3):  # frames without noise are not releases: never charged
            await engine.infer("chain", noised(m, sigma=0.0), device="cam-1")
        clock.t += 10.0
        with pytest.raises(PrivacyBudgetExhausted, match="cam-1") as refused:
            await engine.infer("chain", noised(m), device="cam-1")
        assert refused.value.retry_after == pytest.approx(50.0)  # type: ignore[attr-defined]
        await engine.infer("chain", noised(m), device="cam-2")  # its own budget
        clock.t += 50.0  # cam-1's window is over
        await engine.infer("chain", noised(m), device="cam-1")
        spent = engine.metrics.value("splitinfer_privacy_epsilon_spent_sum", {"model": "chain"})
    # charged: 2 + 1 (cam-2) + 1 (new window); each observation is the window's spend
    assert spent == pytest.approx(
        epsilon_after(1) + epsilon_after(2) + epsilon_after(1) + epsilon_after(1)
    )


async def test_a_frame_noised_less_than_the_package_asks_is_refused(
    built: tuple[Path, Manifest], repo: Path
) -> None:
    path = repo / "chain" / "1" / "manifest.json"
    data = json.loads(path.read_text())
    data["privacy"] = {
        "epsilon": 8.0,
        "delta": DELTA,
        "clip": 1.0,
        "noise_multiplier": SIGMA,
        "accountant": "prv",
    }
    path.write_text(json.dumps(data))
    m = built[1]
    async with Engine(config(repo)) as engine:
        await engine.infer("chain", noised(m))  # as noised as asked: served
        with pytest.raises(ProtocolError, match=r"noise_multiplier: 1 is below the package's 2"):
            await engine.infer("chain", noised(m, sigma=1.0))
        with pytest.raises(ProtocolError, match="noise_multiplier: 0 is below"):
            await engine.infer("chain", noised(m, sigma=0.0))


async def test_over_http_the_refusal_is_429_with_retry_after(
    aiohttp_client: Client, built: tuple[Path, Manifest], repo: Path
) -> None:
    cfg = config(
        repo,
        privacy=PrivacyConfig(budget_epsilon=BUDGET, budget_window_s=600.0, budget_delta=DELTA),
    )
    client = await aiohttp_client(build_app(cfg))
    headers = {"Content-Type": FRAME_TYPE, HEADER_DEVICE: "cam-9"}
    statuses = []
    for _ in range(3):
        resp = await client.post("/v1/models/chain/infer", data=noised(built[1]), headers=headers)
        statuses.append(resp.status)
    assert statuses == [200, 200, 429]
    body = await resp.json()
    assert "privacy budget exhausted for device 'cam-9'" in body["error"]
    assert 590 <= int(resp.headers["Retry-After"]) <= 600
    metrics = await (await client.get("/metrics")).text()
    assert 'splitinfer_rejections_total{model="chain",reason="PrivacyBudgetExhausted"} 1.0' in (
        metrics
    )


def test_the_budget_is_configured_from_flags_and_validated(
    capsys: pytest.CaptureFixture[str],
) -> None:
    new = ["--privacy-budget-epsilon", "8", "--privacy-budget-window", "60s"]
    args = build_parser().parse_args(["--repository", "r", *new])
    p = config_from_args(args).privacy
    want = (8.0, 60.0, 1e-5, "rdp", True)
    assert (p.budget_epsilon, p.budget_window_s, p.budget_delta, p.accountant, p.enforced) == want
    assert not PrivacyConfig().enforced
    assert not PrivacyConfig(budget_epsilon=0.0).enforced  # 0: no budget, as unset
    with pytest.raises(ConfigError, match=r"privacy\.accountant='gdp'"):
        PrivacyConfig(accountant="gdp")
    with pytest.raises(ConfigError, match=r"privacy\.budget_delta=1\.0"):
        PrivacyConfig(budget_delta=1.0)
    # the former flags (the budget's name before the edge agent and the service shared it)
    old = ["--privacy-max-epsilon", "8", "--privacy-window-s", "60", "--privacy-delta", "1e-6"]
    p = config_from_args(build_parser().parse_args(["--repository", "r", *old])).privacy
    assert (p.budget_epsilon, p.budget_window_s, p.budget_delta) == (8.0, 60.0, 1e-6)
    assert capsys.readouterr().err.count("is deprecated; use --privacy-budget-") == 3
