"""The edge pipeline in process: real segments, real frames, the real cloud in process."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from graphs import chain
from incloud import CloudFactory
from ortutil import assert_close, run

from splitinfer.edge.config import AdaptConfig, PrivacyConfig, UplinkConfig
from splitinfer.edge.failover import CloudRefused, CloudUnavailable, Uplink
from splitinfer.edge.model import load_model
from splitinfer.edge.payload import BadInput
from splitinfer.edge.pipeline import Pipeline, server_seconds
from splitinfer.edge.transport import FunctionTransport, Reply, TransportError
from splitinfer.partitioner.pipeline import PackageExtras, artifacts_for, prepare, write_package
from splitinfer.shared.auth import CredentialStore, generate_credential, sign
from splitinfer.shared.codecs import dequantize, quantize
from splitinfer.shared.errors import ConfigError, OverloadError
from splitinfer.shared.frame import Limits, decode_request
from splitinfer.shared.manifest import CodecSpec, PrivacySpec
from splitinfer.shared.package import open_package, quant_params
from splitinfer.shared.privacy import Accountant, PrivacyBudgetExhausted

pytestmark = pytest.mark.integration


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


async def no_sleep(_: float) -> None:
    return None


def build(
    tmp: Path,
    name: str,
    *,
    codec: str = "raw",
    fallback: bool = True,
    privacy: PrivacySpec | None = None,
    cuts: tuple[int, ...] = (2, 0, -1),
) -> tuple[Path, Path]:
    """A package of chain(6): by default cuts c2 (default, split), c0 (none), c3 (all)."""
    src = tmp / f"{name}.onnx"
    onnx.save(chain(6, width=16), str(src))
    prepared = prepare(src)
    plans = prepared.space.plans()
    arts = [artifacts_for(prepared, plans[i]) for i in cuts]
    for art in arts:
        art.codec = CodecSpec(codec)
    extras = PackageExtras(fallback=prepared.optimized if fallback else None, privacy=privacy)
    out = tmp / f"{name}-pkg"
    write_package(prepared, arts, out, extras=extras)
    return src, out


@pytest.fixture(scope="module")
def raw_pkg(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build(tmp_path_factory.mktemp("raw"), "m")


@pytest.fixture(scope="module")
def int8_pkg(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    # no fallback and no "all" cut: nothing answers without the cloud
    return build(
        tmp_path_factory.mktemp("int8"), "q", codec="int8+zstd", fallback=False, cuts=(2, 0)
    )


def make(
    pkg: Path,
    transports: list[Any] | None,
    clock: FakeClock | None = None,
    **kwargs: object,
) -> Pipeline:
    clock = clock or FakeClock()
    model = load_model(pkg)
    uplink = None
    if transports is not None:
        uplink = Uplink(transports, UplinkConfig(max_attempts=3), clock=clock, sleep=no_sleep)
    return Pipeline(model, uplink, clock=clock, **kwargs)  # type: ignore[arg-type]


def feeds(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((batch, 16)).astype(np.float32)}


@pytest.mark.parametrize("cut", ["c2", "c0", "c3"])
@pytest.mark.parametrize("batch", [1, 3])
async def test_every_cut_equals_the_unsplit_model(
    raw_pkg: tuple[Path, Path], cut: str, batch: int, cloud_factory: CloudFactory
) -> None:
    src, pkg = raw_pkg
    cloud = (await cloud_factory(pkg, load=0.25)).transport("a")
    pipe = make(pkg, [cloud])
    x = feeds(batch, seed=batch)
    result = await pipe.infer(x, cut=cut)
    assert_close(result.outputs, run(src, x))
    # the application owns its outputs, whichever side computed them (raw payloads
    # decode to read-only views of the answer's bytes)
    assert all(a.flags.writeable for a in result.outputs.values())
    assert result.cut_id == cut
    if cut == "c3":  # all on the device: nothing is sent
        assert result.local
        assert result.reason == "cut"
        assert cloud.calls == 0
        assert set(result.timings) == {"local", "total"}
    else:
        assert not result.local
        assert cloud.calls == 1
        assert result.load == 0.25
        assert result.model_version == "1"
        assert result.endpoint == "a"
        assert {"edge", "encode", "uplink", "decode", "total"} <= set(result.timings)
        assert result.up_bytes > 16 * 4 * batch


async def test_the_default_cut_is_used_and_int8_matches_the_codec_round_trip(
    int8_pkg: tuple[Path, Path], cloud_factory: CloudFactory
) -> None:
    src, pkg = int8_pkg
    pipe = make(pkg, [(await cloud_factory(pkg)).transport("a")])
    x = feeds(4)
    result = await pipe.infer(x)
    assert result.cut_id == pipe.model.manifest.default_cut == "c2"
    # reference: edge segment, the same int8 quantization (per batch here), cloud segment
    package = open_package(pkg)
    cut = package.manifest.cut
    assert cut.edge is not None
    assert cut.cloud is not None
    mid = run(package.file(cut.edge), x)
    name = cut.tensors[0].name
    from splitinfer.shared.codecs import calibrate_params

    params = quant_params(cut, name) or calibrate_params(mid[name], axis=1)
    mid[name] = dequantize(quantize(mid[name], params), params)
    want = run(package.file(cut.cloud), mid)
    assert_close(result.outputs, want)
    # and it differs from the unsplit model by at most what int8 costs
    ref = run(src, x)["y"]
    assert np.abs(result.outputs["y"] - ref).max() < 0.1 * max(1.0, float(np.abs(ref).max()))


async def test_cloud_down_answers_locally_or_fails_fast(
    raw_pkg: tuple[Path, Path], int8_pkg: tuple[Path, Path]
) -> None:
    def dead(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        raise TransportError("connection refused")

    src, pkg = raw_pkg
    a, b = FunctionTransport(dead, "a"), FunctionTransport(dead, "b")
    pipe = make(pkg, [a, b])
    x = feeds(2)
    result = await pipe.infer(x)
    assert result.local
    assert result.reason.startswith("cloud unavailable")
    assert "connection refused" in result.reason
    assert_close(result.outputs, run(src, x))
    assert a.calls + b.calls == 3  # max_attempts, over both endpoints
    # once every breaker is open the cloud is not even tried
    for _ in range(3):
        await pipe.infer(x)
    calls = a.calls + b.calls
    result = await pipe.infer(x)
    assert result.local
    assert result.reason == "cloud unavailable"
    assert a.calls + b.calls == calls
    # without a local model: a clear error, at once
    _, pkg8 = int8_pkg
    pipe8 = make(pkg8, [FunctionTransport(dead, "a")])
    with pytest.raises(CloudUnavailable, match="no local model"):
        await pipe8.infer(x)


async def test_failover_to_the_second_endpoint(
    raw_pkg: tuple[Path, Path], cloud_factory: CloudFactory
) -> None:
    src, pkg = raw_pkg

    def dead(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        raise TransportError("reset by peer")

    good = (await cloud_factory(pkg)).transport("b")
    pipe = make(pkg, [FunctionTransport(dead, "a"), good])
    x = feeds(1)
    result = await pipe.infer(x)
    assert not result.local
    assert result.endpoint == "b"
    assert result.attempts == 2
    assert_close(result.outputs, run(src, x))


async def test_requests_are_signed_and_a_bad_key_is_refused(
    raw_pkg: tuple[Path, Path], cloud_factory: CloudFactory
) -> None:
    _, pkg = raw_pkg
    cred = generate_credential("cam-01", "k1")
    clock = FakeClock()
    real = await cloud_factory(pkg, credentials=CredentialStore([cred]), wall=lambda: 1.7e9)
    cloud = real.transport("a")
    model = load_model(pkg)

    def signer(key: object) -> Pipeline:
        uplink = Uplink(
            [cloud],
            UplinkConfig(),
            clock=clock,
            sleep=no_sleep,
            signer=lambda m, p, b: sign(m, p, b, key, 1.7e9),  # type: ignore[arg-type]
        )
        return Pipeline(model, uplink, clock=clock)

    result = await signer(cred).infer(feeds(1), cut="c2")
    assert not result.local
    stranger = generate_credential("cam-01", "k1")  # same ids, another secret
    with pytest.raises(CloudRefused, match="401 signature does not match") as info:
        await signer(stranger).infer(feeds(1), cut="c2")
    assert info.value.http_status == 502
    assert info.value.status == 401


async def test_bad_input_is_refused_before_anything_runs(
    raw_pkg: tuple[Path, Path], cloud_factory: CloudFactory
) -> None:
    _, pkg = raw_pkg
    cloud = (await cloud_factory(pkg)).transport("a")
    pipe = make(pkg, [cloud])
    with pytest.raises(BadInput, match="'x' is missing"):
        await pipe.infer({})
    with pytest.raises(BadInput, match=r"dimension 1 is 5, the model takes \[N, 16\]"):
        await pipe.infer({"x": np.ones((1, 5), np.float32)})
    with pytest.raises(ConfigError, match="cut 'c9' is not usable"):
        await pipe.infer(feeds(1), cut="c9")
    assert cloud.calls == 0


async def test_a_malformed_answer_is_an_error(raw_pkg: tuple[Path, Path]) -> None:
    _, pkg = raw_pkg

    def junk(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        return Reply(200, {}, b"SPLT garbage")

    with pytest.raises(CloudRefused, match="malformed frame"):
        await make(pkg, [FunctionTransport(junk)]).infer(feeds(1), cut="c2")


@pytest.mark.slow  # opacus imports torch
async def test_privacy_noises_the_cut_and_the_budget_sends_work_local(
    tmp_path: Path, cloud_factory: CloudFactory
) -> None:
    spec = PrivacySpec(epsilon=2.0, delta=1e-5, clip=1.0, noise_multiplier=2.0)
    src, pkg = build(tmp_path, "p", privacy=spec)
    seen: list[np.ndarray] = []
    manifest = open_package(pkg).manifest
    cloud = await cloud_factory(pkg)

    async def spy(method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        request = decode_request(body, manifest, Limits())
        assert request.privacy.noise_multiplier == 2.0
        assert request.privacy.clip == 1.0
        seen.append(request.tensors[0].array)
        return await cloud(method, path, body, headers)

    # a budget that allows exactly two releases at z=2
    acc = Accountant("rdp")
    acc.record(2.0)
    acc.record(2.0)
    two = acc.epsilon(1e-5)
    assert acc.epsilon_after(2.0, 1e-5) > two * 1.01
    config = PrivacyConfig(budget_epsilon=two * 1.001, budget_window_s=60.0, accountant="rdp")
    clock = FakeClock()
    pipe = make(pkg, [FunctionTransport(spy, "a")], clock, privacy=config)
    x = {"x": 10 * feeds(1)["x"]}
    first = await pipe.infer(x, cut="c2")
    assert not first.local
    assert first.epsilon_spent is not None
    assert first.epsilon_spent < two
    assert "privacy" in first.timings
    mid = run(open_package(pkg).file(manifest.cut.edge), x)  # type: ignore[arg-type]
    clean = mid[manifest.cut.tensors[0].name]
    assert np.linalg.norm(clean) > 1.0  # clipping had work to do
    assert not np.allclose(seen[0], clean, atol=0.1)  # noised: std 4 per element
    await pipe.infer(x, cut="c2")
    third = await pipe.infer(x, cut="c2")
    assert third.local
    assert third.reason == "privacy budget"
    assert len(seen) == 2
    assert_close(third.outputs, run(src, x))
    clock.t += 61.0  # a new window
    assert not (await pipe.infer(x, cut="c2")).local
    # "refuse" raises 429 instead
    strict = make(
        pkg,
        [FunctionTransport(cloud, "a")],
        privacy=replace(config, on_exhausted="refuse", budget_epsilon=first.epsilon_spent * 1.001),
    )
    await strict.infer(x, cut="c2")
    with pytest.raises(PrivacyBudgetExhausted) as info:
        await strict.infer(x, cut="c2")
    assert info.value.http_status == 429


async def test_warm_up_measures_every_edge_segment(raw_pkg: tuple[Path, Path]) -> None:
    _, pkg = raw_pkg
    ticks = iter(range(10_000))
    pipe = make(pkg, None, clock=lambda: float(next(ticks)))  # type: ignore[arg-type]
    seconds = await pipe.warm_up()
    assert set(seconds) == {"cut:c2", "cut:c3", "local"}
    assert all(v > 0 for v in seconds.values())
    assert set(pipe.edge_s) == {"c2", "c3"}


def test_pinning_a_cut_and_unknown_cuts(raw_pkg: tuple[Path, Path]) -> None:
    _, pkg = raw_pkg
    pipe = make(pkg, None, adapt=AdaptConfig(cut="c0"))
    assert pipe.current_cut == "c0"
    with pytest.raises(ConfigError, match=r"adapt\.cut='c7' is not a usable cut"):
        make(pkg, None, adapt=AdaptConfig(cut="c7"))


def test_server_timing_header() -> None:
    assert server_seconds("queue;dur=1.5, compute;dur=10") == pytest.approx(0.0115)
    assert server_seconds("") is None


async def test_a_request_whose_deadline_passed_in_the_queue_is_refused(
    raw_pkg: tuple[Path, Path], cloud_factory: CloudFactory
) -> None:
    _, pkg = raw_pkg
    cloud = await cloud_factory(pkg)
    clock = FakeClock()
    pipe = make(pkg, [cloud.transport()], clock)
    with pytest.raises(OverloadError, match="deadline passed") as info:
        await pipe.infer(feeds(1), deadline=clock.t - 0.5)
    assert info.value.http_status == 503
    assert cloud.requests == 0


async def test_cheap_work_skips_the_pool_only_while_nothing_else_computes(
    raw_pkg: tuple[Path, Path], cloud_factory: CloudFactory
) -> None:
    src, pkg = raw_pkg
    pooled: list[str] = []
    gate = asyncio.Event()
    gate.set()

    async def pool(fn: Any) -> Any:  # a worker pool whose worker can be held
        pooled.append("x")
        await gate.wait()
        return fn()

    cloud = (await cloud_factory(pkg)).transport("a")
    # the fake clock makes every measured front 0 s: under any threshold
    pipe = make(pkg, [cloud], compute=pool, inline_below_s=0.001)
    x = feeds(2)
    first = await pipe.infer(x, cut="c2")  # nothing measured yet: the pool
    second = await pipe.infer(x, cut="c2")  # known to be cheap, nothing computing: inline
    assert (len(pooled), pipe.inlined) == (1, 1)
    for result in (first, second):
        assert_close(result.outputs, run(src, x))
    gate.clear()
    held = asyncio.ensure_future(pipe.infer(x, cut="c0"))  # unmeasured: waits in the pool
    await asyncio.sleep(0)
    assert len(pooled) == 2
    other = asyncio.ensure_future(pipe.infer(x, cut="c2"))  # cheap, but the pool is busy
    await asyncio.sleep(0)
    assert (len(pooled), pipe.inlined) == (3, 1)
    gate.set()
    for result in await asyncio.gather(held, other):
        assert_close(result.outputs, run(src, x))
    never = make(pkg, [cloud], compute=pool, inline_below_s=0.0)
    for _ in range(3):
        await never.infer(x, cut="c2")
    assert never.inlined == 0


async def test_token_ids_cross_zstd_compressed_and_come_back_exact(
    tmp_path: Path, cloud_factory: CloudFactory
) -> None:
    """Cloud-only under int8+zstd: the int64 ids travel with the lossless zstd codec
    (id 8) through the edge's own codec registry and the strict cloud, bit for bit."""
    from graphs import f32
    from graphs import make as make_graph
    from onnx import TensorProto, helper

    table = np.random.default_rng(3).standard_normal((50, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["emb"]),
        helper.make_node("ReduceSum", ["emb", "ax"], ["y"], keepdims=0),
    ]
    ids_vi = helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 6])
    model = make_graph(
        nodes, [ids_vi], [f32("y", ["N", 4])], {"table": table, "ax": np.array([1], np.int64)}
    )
    src = tmp_path / "ids.onnx"
    onnx.save(model, str(src))
    prepared = prepare(src)
    art = artifacts_for(prepared, prepared.space.find("none"))
    art.codec = CodecSpec("int8+zstd")
    write_package(prepared, [art], tmp_path / "pkg")
    pkg = tmp_path / "pkg"
    sent: list[bytes] = []
    cloud = (await cloud_factory(pkg)).transport("a")
    forward = cloud.request

    async def spy(
        method: str, path: str, body: bytes, headers: Mapping[str, str], timeout_s: float
    ) -> Reply:
        sent.append(body)
        return await forward(method, path, body, headers, timeout_s)

    cloud.request = spy  # type: ignore[method-assign]
    pipe = make(pkg, [cloud])
    ids = np.random.default_rng(4).integers(0, 50, size=(3, 6), dtype=np.int64)
    result = await pipe.infer({"ids": ids})
    assert result.cut_id == "c0"
    assert_close(result.outputs, run(src, {"ids": ids}))
    frame = decode_request(sent[0], open_package(pkg).manifest, Limits())
    from splitinfer.shared.codecs import ZSTD

    assert frame.tensors[0].codec == ZSTD
    np.testing.assert_array_equal(frame.tensors[0].array, ids)
