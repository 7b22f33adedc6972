"""A cloud-only package whose input travels as PNG, end to end: ``partition --split none
--input-codec png`` → ``edge-agent`` → HTTP → ``cloud-service``, on the digits images
(on the k/16 grid, so PNG is lossless and the answers equal the model's)."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import aiohttp
import numpy as np
import onnx
import pytest
from daemons import daemon
from graphs import f32, make
from onnx import helper
from ortutil import run

from splitinfer.partitioner.cli import main as partition
from splitinfer.shared.manifest import load_manifest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def digits(n: int, offset: int = 0) -> np.ndarray:
    from sklearn.datasets import load_digits

    images = load_digits().images[offset : offset + n]
    return (images / 16.0).astype(np.float32)[:, None]


def test_png_inputs_from_an_edge_agent_give_the_models_answers(tmp_path: Path) -> None:
    w = np.random.default_rng(0).standard_normal((64, 10)).astype(np.float32)
    model = make(
        [
            helper.make_node("Flatten", ["x"], ["f"], axis=1),
            helper.make_node("MatMul", ["f", "w"], ["y"]),
        ],
        [f32("x", ["N", 1, 8, 8])],
        [f32("y", ["N", 10])],
        {"w": w},
    )
    src = tmp_path / "digits.onnx"
    onnx.save(model, str(src))
    calib = tmp_path / "calib"
    calib.mkdir()
    np.save(calib / "digits.npy", digits(64))
    pkg = tmp_path / "repo" / "digits" / "1"
    argv = [str(src), "--split", "none", "--input-codec", "png", "--calibration", str(calib)]
    assert partition([*argv, "-o", str(pkg), "-q"]) == 0
    assert load_manifest(pkg).cut.codec.name == "png"

    cloud = daemon(
        "cloud-service", "--repository", tmp_path / "repo", "--listen", "127.0.0.1:0", "--no-auth"
    )
    try:
        agent = daemon(
            "edge-agent", "--package", pkg, "--cloud", cloud.url, "--listen", "127.0.0.1:0"
        )
        x = digits(24, offset=100)  # not the calibration images
        try:

            async def ask() -> tuple[int, dict[str, str], bytes]:
                buf = io.BytesIO()
                np.save(buf, x)
                async with (
                    aiohttp.ClientSession() as session,
                    session.post(
                        f"{agent.url}/v1/infer",
                        data=buf.getvalue(),
                        headers={"X-Splitinfer-Timings": "1"},
                    ) as resp,
                ):
                    return resp.status, dict(resp.headers), await resp.read()

            status, headers, body = asyncio.run(ask())
        finally:
            assert agent.stop() == 0, "".join(agent.lines)
    finally:
        cloud.stop()
    assert status == 200, body
    assert headers["X-Splitinfer-Local"] == "0"
    with np.load(io.BytesIO(body)) as got:
        np.testing.assert_allclose(got["y"], run(src, {"x": x})["y"], rtol=1e-5, atol=1e-5)
