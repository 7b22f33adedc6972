"""``runtime.emulate_device``: edge segments stretched to a slower device's profile."""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from graphs import chain

from splitinfer.edge.cli import resolve
from splitinfer.edge.config import RuntimeConfig
from splitinfer.edge.emulate import EmulatedRunner, emulate, load_device
from splitinfer.edge.model import load_model
from splitinfer.edge.runtime import SegmentRunner
from splitinfer.partitioner.pipeline import PackageExtras, artifacts_for, prepare, write_package
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.nodeprofile import NodeProfile

pytestmark = pytest.mark.unit


class _Session:
    """The least an ONNX Runtime session does for SegmentRunner."""

    def get_inputs(self) -> list[object]:
        return []

    def get_outputs(self) -> list[object]:
        return []

    def get_providers(self) -> list[str]:
        return ["CPUExecutionProvider"]

    def run(self, names: list[str], feeds: dict[str, object]) -> list[object]:
        return []


def test_a_run_is_stretched_to_the_target_for_its_batch() -> None:
    slept: list[float] = []
    ticks = iter([0.0, 0.001, 1.0, 1.05])
    asked: list[int] = []

    def seconds(batch: int) -> float:
        asked.append(batch)
        return 0.01 * batch

    slow = EmulatedRunner(
        SegmentRunner(_Session(), "edge"), seconds, sleep=slept.append, clock=lambda: next(ticks)
    )
    slow.run({"x": np.zeros((3, 2), np.float32)})
    assert asked == [3]
    assert slept == [pytest.approx(0.029)]
    # a run already slower than the device sleeps nothing
    slow.run({"x": np.zeros((1, 2), np.float32)})
    assert slept == [pytest.approx(0.029)]


def test_runners_of_one_device_run_one_at_a_time() -> None:
    lock = threading.Lock()
    seen: list[bool] = []

    def sleep(_: float) -> None:
        seen.append(lock.locked())

    runner = EmulatedRunner(
        SegmentRunner(_Session(), "edge"), lambda b: 1.0, lock=lock, sleep=sleep
    )
    runner.run({"x": np.zeros((1, 2), np.float32)})
    assert seen == [True]
    assert not lock.locked()


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A split package of a 6-node chain and a profile with 1 ms per node, batch 1 and 4."""
    tmp = tmp_path_factory.mktemp("emulate")
    onnx.save(chain(6, width=16), str(tmp / "m.onnx"))
    prepared = prepare(tmp / "m.onnx")
    plans = prepared.space.plans()
    write_package(
        prepared,
        [artifacts_for(prepared, plans[i]) for i in (2, 0)],
        tmp / "pkg",
        extras=PackageExtras(fallback=prepared.optimized),
    )
    names = [n.name for n in prepared.optimized.graph.node]
    profile = NodeProfile(
        device="slow board",
        batch_sizes=(1, 4),
        times={1: dict.fromkeys(names, 1e-3), 4: dict.fromkeys(names, 3e-3)},
        wall={1: 6e-3, 4: 18e-3},
        unattributed_s={1: 0.0, 4: 0.0},
    )
    profile.save(tmp / "slow.json")
    return tmp / "pkg", tmp / "slow.json"


def test_segments_take_the_profile_time_of_their_nodes(package: tuple[Path, Path]) -> None:
    pkg, profile = package
    model = load_model(pkg)
    slept: list[float] = []
    slow = emulate(model, str(profile), sleep=slept.append, clock=lambda: 0.0)
    assert slow.emulated is not None
    assert "slow board" in slow.emulated
    for cut_id, rt in slow.cuts.items():
        segment = rt.cut.edge
        if segment is None:
            assert rt.edge is None  # nothing runs on the device for a "none" cut
            continue
        assert isinstance(rt.edge, EmulatedRunner), cut_id
        nodes = len(onnx.load(str(model.package.file(segment))).graph.node)
        assert rt.edge.seconds(1) == pytest.approx(nodes * 1e-3)
        assert rt.edge.seconds(4) == pytest.approx(nodes * 3e-3)
        feeds = model.sample_inputs(4)
        out = rt.edge.run(feeds)
        assert slept[-1] == pytest.approx(nodes * 3e-3)
        # the answer is the segment's own
        want = model.cuts[cut_id].edge.run(feeds)  # type: ignore[union-attr]
        for k, v in want.items():
            np.testing.assert_array_equal(out[k], v)
    assert isinstance(slow.fallback, EmulatedRunner)
    whole = len(onnx.load(str(model.package.file(model.manifest.fallback))).graph.node)  # type: ignore[arg-type]
    assert slow.fallback.seconds(1) == pytest.approx(whole * 1e-3)
    assert model.emulated is None  # the original is untouched


def test_a_builtin_profile_gives_its_roofline(package: tuple[Path, Path]) -> None:
    pkg, _ = package
    slow = emulate(load_model(pkg), "jetson-orin-nano", sleep=lambda s: None)
    assert slow.emulated == "jetson-orin-nano (roofline estimate)"
    fallback = slow.fallback
    assert isinstance(fallback, EmulatedRunner)
    one, four = fallback.seconds(1), fallback.seconds(4)
    # launch overheads of a few nodes: microseconds, and more samples cost more
    assert 0 < one < 1e-3
    assert four >= one


def test_the_agent_option_loads_an_emulated_model(
    package: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    pkg, profile = package
    config, _ = resolve(
        [
            "--package",
            str(pkg),
            "--cloud",
            "http://127.0.0.1:9",
            "--emulate-device",
            str(profile),
        ]
    )
    assert config.runtime.emulate_device == str(profile)
    with caplog.at_level(logging.INFO, logger="splitinfer.edge.model"):
        model = load_model(pkg, config.runtime)
    assert model.emulated is not None
    assert any("emulating device slow board" in r.getMessage() for r in caplog.records)
    assert all(
        isinstance(rt.edge, EmulatedRunner) for rt in model.cuts.values() if rt.edge is not None
    )
    assert load_model(pkg).emulated is None  # off by default


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("pi-zero", "unknown edge profile 'pi-zero'"),
        ("a100", "is a cloud profile"),
        ("/nonexistent/p.json", "/nonexistent/p.json"),
    ],
)
def test_a_bad_profile_is_one_line_naming_it(spec: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_device(spec)
    assert message in str(info.value)
    assert "runtime.emulate_device" in str(info.value)
    assert "\n" not in str(info.value)


def test_an_empty_option_is_refused() -> None:
    with pytest.raises(ConfigError, match="emulate_device"):
        RuntimeConfig(emulate_device=" ")
    assert dataclasses.replace(RuntimeConfig(), emulate_device="x").emulate_device == "x"
