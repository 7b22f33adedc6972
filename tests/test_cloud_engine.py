"""The in-process engine over real ONNX Runtime sessions of real packages (no sockets)."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cloudkit import chain_repo, config, frame, neck, policy, variable_length, write
from ortutil import run

from splitinfer.cloud.config import BatchingConfig, OverloadConfig, RuntimeConfig
from splitinfer.cloud.engine import BatchFailed, Engine
from splitinfer.cloud.overload import CircuitOpen, DeadlineUnmeetable, QueueFull, ShuttingDown
from splitinfer.cloud.runtime import Runtime
from splitinfer.shared.errors import ModelNotFoundError, ProtocolError
from splitinfer.shared.frame import decode_response
from splitinfer.shared.manifest import Manifest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """chain versions 1 and 2, and a variable-length model, built once."""
    repo = tmp_path_factory.mktemp("built") / "repo"
    chain_repo(repo, versions=("1", "2"))
    write(variable_length(), repo, "seq", "1", cuts=("none", "c1"), shapes={"x": [2, 5, 4],
          "mask": [2, 5]})  # fmt: skip
    return repo


@pytest.fixture
def repo(built: Path, tmp_path: Path) -> Path:
    out = tmp_path / "repo"
    shutil.copytree(built, out)
    return out


class Gate:
    """A runtime factory whose sessions block in ``run`` until the gate opens."""

    def __init__(self, fail: Callable[[], bool] = lambda: False) -> None:
        self.open = threading.Event()
        self.open.set()
        self.fail = fail
        self.batches: list[int] = []

    def __call__(self, path: Path, cfg: RuntimeConfig) -> Runtime:
        gate = self

        class Gated(Runtime):
            def run(self, feeds: Any) -> dict[str, np.ndarray]:
                gate.open.wait(timeout=30)
                if gate.fail():
                    raise RuntimeError("simulated device failure")
                gate.batches.append(len(next(iter(feeds.values()))))
                return super().run(feeds)

        return Gated(path, cfg)


def x(seed: int, rows: int = 1, width: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)


def answer(manifest: Manifest, body: bytes) -> np.ndarray:
    from splitinfer.shared.frame import Limits

    return decode_response(body, manifest, Limits()).tensors[0].array


def manifest_of(repo: Path, model: str = "chain", version: str = "2") -> Manifest:
    from splitinfer.shared.manifest import load_manifest

    return load_manifest(repo / model / version)


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Yield to the loop until ``cond`` holds (the model threads do the work)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.001)


def queued(engine: Engine) -> int:
    return sum(b.queued for b in engine.batchers())


def running(engine: Engine) -> int:
    return sum(b.running for b in engine.batchers())


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.open.set()


async def test_concurrent_requests_form_batches_and_each_gets_its_own_answer(
    repo: Path, gate: Gate
) -> None:
    m = manifest_of(repo)
    cfg = config(repo, batching=BatchingConfig(max_batch_size=64))
    # inline_max_s=0: the gate holds a batch in a worker (this quick model would run inline)
    async with Engine(cfg, runtime_factory=gate, inline_max_s=0) as engine:
        gate.open.clear()  # hold the first batch so the rest queue up behind it
        inputs = [x(i, rows=1 + i % 3) for i in range(24)]
        tasks = [asyncio.create_task(engine.infer("chain", frame(m, {"x": a}))) for a in inputs]
        await until(lambda: queued(engine) == 23)
        gate.open.set()
        served = await asyncio.gather(*tasks)
        for a, s in zip(inputs, served, strict=True):
            want = run(repo / "chain" / "2" / "cloud.onnx", {"x": a})["y"]
            np.testing.assert_allclose(answer(m, s.body), want, rtol=1e-6, atol=1e-6)
            assert s.version == "2"
        rows = sum(a.shape[0] for a in inputs)
        assert gate.batches[-2:] == [1, rows - 1]  # one alone (idle), the rest together
        labels = {"model": "chain", "version": "2"}
        assert engine.metrics.value("splitinfer_inferences_total", labels) == rows
        assert engine.metrics.value("splitinfer_executions_total", labels) == 2


async def test_a_split_cut_runs_its_own_cloud_segment(repo: Path) -> None:
    m = manifest_of(repo)
    cut = m.find_cut("c2")
    assert cut is not None
    assert cut.cloud is not None
    (spec,) = cut.tensors
    a = x(7, rows=2)
    async with Engine(config(repo)) as engine:
        served = await engine.infer("chain", frame(m, {spec.name: a}, cut="c2"))
        outputs, version = await engine.infer_arrays("chain", "c2", {spec.name: a.tolist()})
    want = run(repo / "chain" / "2" / cut.cloud.file, {spec.name: a})["y"]
    np.testing.assert_allclose(answer(m, served.body), want, rtol=1e-6)
    np.testing.assert_allclose(outputs["y"], want, rtol=1e-6)
    assert version == "2"


async def test_bad_requests_are_refused_with_the_right_error(repo: Path) -> None:
    m = manifest_of(repo)
    good = frame(m, {"x": x(0)})
    async with Engine(config(repo)) as engine:
        with pytest.raises(ModelNotFoundError, match="'nope' is not served"):
            await engine.infer("nope", good)
        with pytest.raises(ModelNotFoundError, match="no version '9'"):
            await engine.infer("chain", frame(m, {"x": x(0)}, version="9"))
        with pytest.raises(ModelNotFoundError, match="cut 'c5' is not served"):
            await engine.infer("chain", good.replace(b'"cut_id":"c0"', b'"cut_id":"c5"'))
        with pytest.raises(ProtocolError, match="does not match the URL's model"):
            await engine.infer("chain", frame(m, {"x": x(0)}, model="other"))
        with pytest.raises(ProtocolError, match=r"dim 1 is 5, the manifest says 4"):
            await engine.infer("chain", frame(m, {"x": x(0, width=5)}))
        with pytest.raises(ProtocolError, match="dtype"):
            await engine.infer("chain", frame(m, {"x": x(0).astype(np.float64)}))
        with pytest.raises(ProtocolError, match="magic"):
            await engine.infer("chain", b"JUNK" + good[4:])
        with pytest.raises(ProtocolError, match=r"inputs\.x: missing"):
            await engine.infer_arrays("chain", "c0", {})
        # and it keeps serving everyone else
        served = await engine.infer("chain", good)
        assert served.version == "2"


async def test_a_request_names_its_version(repo: Path) -> None:
    m = manifest_of(repo)
    cfg = config(repo, models={"chain": policy(versions="all")})
    a = x(3)
    async with Engine(cfg) as engine:
        one = await engine.infer("chain", frame(m, {"x": a}, version="1"))
        two = await engine.infer("chain", frame(m, {"x": a}, version="2"))
        default = await engine.infer("chain", frame(m, {"x": a}))
    assert (one.version, two.version, default.version) == ("1", "2", "2")
    for s, v in ((one, "1"), (two, "2")):
        want = run(repo / "chain" / v / "cloud.onnx", {"x": a})["y"]
        np.testing.assert_allclose(answer(m, s.body), want, rtol=1e-6)


async def test_deadlines_and_the_queue_bound_refuse_early(repo: Path, gate: Gate) -> None:
    m = manifest_of(repo)
    batching = BatchingConfig(max_batch_size=2, max_queue_size=4)
    cfg = config(repo, batching=batching)
    async with Engine(cfg, runtime_factory=gate, inline_max_s=0) as engine:
        now_ms = int(time.time() * 1000)
        with pytest.raises(DeadlineUnmeetable, match="already passed"):
            await engine.infer("chain", frame(m, {"x": x(0)}, deadline_ms=now_ms - 10))
        gate.open.clear()
        first = asyncio.create_task(engine.infer("chain", frame(m, {"x": x(0)})))
        await until(lambda: running(engine) == 1)
        waiting = [
            asyncio.create_task(engine.infer("chain", frame(m, {"x": x(i)}))) for i in range(4)
        ]
        await until(lambda: queued(engine) == 4)
        with pytest.raises(QueueFull, match="max_queue_size=4") as err:
            await engine.infer("chain", frame(m, {"x": x(9)}))
        assert err.value.http_status == 503
        # teach it that a batch takes 10 s: a 1 s deadline behind two batches cannot be met
        runner = next(iter(engine.registry.model("chain").serving["2"].cuts.values()))
        for rows in (1, 2):
            runner.latency.observe(rows, 10.0)
        waiting[0].cancel()  # its caller went away: it leaves the queue
        await until(lambda: queued(engine) == 3)
        with pytest.raises(DeadlineUnmeetable, match="cannot be met"):
            await engine.infer(
                "chain", frame(m, {"x": x(1)}, deadline_ms=int(time.time() * 1000) + 1000)
            )
        assert engine.load("chain") == pytest.approx(0.75)
        gate.open.set()
        await first
        results = await asyncio.gather(*waiting[1:])
        assert all(r.version == "2" for r in results)
        assert engine.metrics.value("splitinfer_queued_samples", {"model": "chain"}) == 0


async def test_variable_lengths_are_padded_to_buckets_under_the_mask(repo: Path) -> None:
    m = manifest_of(repo, "seq", "1")
    cut = m.find_cut("c1")
    assert cut is not None
    assert cut.cloud is not None
    assert {t.name for t in cut.tensors} == {"mask", "r"}
    rng = np.random.default_rng(0)

    def sample(length: int) -> dict[str, np.ndarray]:
        mask = np.ones((1, length), np.float32)
        mask[0, length // 2 + 1 :] = 0
        r = np.abs(rng.standard_normal((1, length, 4))).astype(np.float32)
        return {"mask": mask, "r": r}

    samples = [sample(n) for n in (2, 3, 4, 3, 5, 7)]
    gate = Gate()
    async with Engine(config(repo), runtime_factory=gate, inline_max_s=0) as engine:
        runner = engine.registry.model("seq").serving["1"].runner("c1")
        assert runner.pad is not None
        assert runner.pad.symbol == "S"
        gate.open.clear()
        tasks = [asyncio.create_task(engine.infer("seq", frame(m, s, cut="c1"))) for s in samples]
        await until(lambda: queued(engine) == 5)
        # lengths 3, 4, 3 share the bucket of 4; 5 and 7 share 8
        shapes = sorted(k.shape for k in engine.batchers()[0].queue_keys())
        assert shapes == [((4,), (4, 4)), ((8,), (8, 4))]
        gate.open.set()
        served = await asyncio.gather(*tasks)
    assert sorted(gate.batches[-3:]) == [1, 2, 3]  # 2 alone, then one batch per bucket
    for s, got in zip(samples, served, strict=True):
        want = run(repo / "seq" / "1" / cut.cloud.file, s)["y"]
        np.testing.assert_allclose(answer(m, got.body), want, rtol=1e-5, atol=1e-6)


async def test_a_version_swap_under_load_fails_no_request(repo: Path, gate: Gate) -> None:
    m = manifest_of(repo)
    (repo / "chain" / "2").rename(repo / "chain" / ".2.staged")
    async with Engine(config(repo), runtime_factory=gate, inline_max_s=0) as engine:
        assert list(engine.registry.model("chain").serving) == ["1"]
        # a batch of version 1 is held in the runtime while version 2 arrives
        gate.open.clear()
        held = asyncio.create_task(engine.infer("chain", frame(m, {"x": x(0)})))
        await until(lambda: running(engine) == 1)
        gate.open.set()
        stop = asyncio.Event()
        versions: list[str] = []

        async def client(seed: int) -> None:
            while not stop.is_set():
                versions.append((await engine.infer("chain", frame(m, {"x": x(seed)}))).version)

        clients = [asyncio.create_task(client(i)) for i in range(8)]
        await until(lambda: len(versions) > 50)
        (repo / "chain" / ".2.staged").rename(repo / "chain" / "2")
        report = await engine.reload(force=False)
        assert report["loaded"] == [{"model": "chain", "version": "2"}]
        assert report["retired"] == [{"model": "chain", "version": "1"}]
        count = len(versions)
        await until(lambda: len(versions) > count + 50)
        stop.set()
        await asyncio.gather(*clients)  # any failure would raise here
        assert (await held).version == "1"  # it finished on the version it started on
        first_two = versions.index("2")
        assert set(versions[:first_two]) == {"1"}
        assert set(versions[first_two + 16 :]) == {"2"}  # 8 clients, at most one batch late


async def test_a_version_that_fails_to_load_leaves_the_old_one_serving(repo: Path) -> None:
    m = manifest_of(repo)
    async with Engine(config(repo)) as engine:
        broken = repo / "chain" / "3"
        shutil.copytree(repo / "chain" / "2", broken)
        (broken / "cloud.onnx").write_bytes(b"not onnx")
        _rehash(broken)
        report = await engine.reload(force=False)
        assert report["failed"][0]["version"] == "3"
        assert "cannot load" in report["failed"][0]["error"]
        state = engine.registry.model("chain")
        assert list(state.serving) == ["2"]
        assert (await engine.infer("chain", frame(m, {"x": x(0)}))).version == "2"
        again = await engine.reload(force=False)  # same package: not retried
        assert again == {"loaded": [], "failed": [], "retired": []}
        labels = {"model": "chain", "version": "3", "result": "failure"}
        assert engine.metrics.value("splitinfer_model_loads_total", labels) == 1
        status = engine.registry.status()["models"][0]["versions"]
        assert {"version": "3", "state": "failed", "error": report["failed"][0]["error"]} in status


def _rehash(package: Path) -> None:
    """Make the manifest agree with the files again (a broken model, not a torn copy)."""
    import hashlib
    import json

    path = package / "manifest.json"
    data = json.loads(path.read_text())
    for cut in data["cuts"]:
        seg = cut.get("cloud")
        if seg:
            seg["sha256"] = hashlib.sha256((package / seg["file"]).read_bytes()).hexdigest()
    path.write_text(json.dumps(data))


async def test_a_failing_version_trips_its_breaker_and_traffic_moves_off_it(repo: Path) -> None:
    m = manifest_of(repo)
    failing = {"on": False}
    gate = Gate(fail=lambda: failing["on"])
    cfg = config(
        repo,
        models={"chain": policy(versions="all", weights={"1": 50, "2": 50})},
        overload=OverloadConfig(breaker_failures=2, breaker_cooldown_s=60),
    )
    draws = iter([0.9, 0.9, 0.9] + [0.1, 0.9] * 10)  # 2 then 2 then 2, then alternating
    async with Engine(cfg, runtime_factory=gate) as engine:
        engine.registry.draw = lambda: next(draws)
        failing["on"] = True
        for _ in range(2):
            with pytest.raises(BatchFailed, match="simulated device failure"):
                await engine.infer("chain", frame(m, {"x": x(0)}))
        failing["on"] = False
        assert not engine.registry.model("chain").serving["2"].breaker.closed
        served = [(await engine.infer("chain", frame(m, {"x": x(0)}))).version for _ in range(6)]
        assert served == ["1"] * 6  # even the draws that pick 2 go to 1
        with pytest.raises(CircuitOpen, match="keeps failing"):
            await engine.infer("chain", frame(m, {"x": x(0)}, version="2"))
        labels = {"model": "chain", "version": "2"}
        assert engine.metrics.value("splitinfer_breaker_open", labels) == 1


async def test_stopping_drains_the_queue_then_refuses(repo: Path, gate: Gate) -> None:
    m = manifest_of(repo)
    engine = Engine(config(repo), runtime_factory=gate, inline_max_s=0)
    await engine.start()
    gate.open.clear()
    tasks = [asyncio.create_task(engine.infer("chain", frame(m, {"x": x(i)}))) for i in range(5)]
    await until(lambda: queued(engine) == 4)
    stopping = asyncio.create_task(engine.stop(drain_timeout=30))
    await until(lambda: engine.closing)
    with pytest.raises(ShuttingDown):
        await engine.infer("chain", frame(m, {"x": x(0)}))
    gate.open.set()
    await stopping
    assert [t.result().version for t in tasks] == ["2"] * 5


async def test_a_launched_batch_is_inside_the_runtime_before_the_loop_goes_on(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop hands the GIL to the worker at launch instead of making it wait for a pause."""
    from splitinfer.cloud import engine as engine_module

    monkeypatch.setattr(engine_module, "HANDOFF_S", 30.0)  # no timing in the assertion
    monkeypatch.setattr(engine_module, "HANDOFF_MIN_COMPUTE_S", 0.0)  # the chain is quick
    armed, inside, release = threading.Event(), threading.Event(), threading.Event()

    class Entered(Runtime):
        def run(self, feeds: Any) -> dict[str, np.ndarray]:
            if armed.is_set():  # not during the warm-up
                inside.set()
                release.wait(timeout=30)
            return super().run(feeds)

    seen: list[bool] = []
    launch = Engine._launch

    def launch_and_look(self: Engine, *args: Any) -> None:
        launch(self, *args)
        seen.append(inside.is_set())  # no await in between: the loop has kept the GIL

    monkeypatch.setattr(Engine, "_launch", launch_and_look)
    m = manifest_of(repo)
    async with Engine(config(repo), runtime_factory=Entered, inline_max_s=0) as engine:
        await engine.infer("chain", frame(m, {"x": x(1)}))  # the pool's thread is started
        armed.set()
        task = asyncio.create_task(engine.infer("chain", frame(m, {"x": x(0)})))
        try:
            await until(lambda: running(engine) == 1)
            assert seen[1:] == [True]  # _launch returned only once the worker was in run()
        finally:
            release.set()
        want = run(repo / "chain" / "2" / "cloud.onnx", {"x": x(0)})["y"]
        np.testing.assert_allclose(answer(m, (await task).body), want, rtol=1e-6, atol=1e-6)


async def test_the_loop_hands_off_only_batches_long_enough_to_repay_it(repo: Path) -> None:
    async with Engine(config(repo)) as engine:
        runner = engine.registry.model("chain").serving["2"].runner("c0")
        assert runner.latency.known  # the warm-up timed it: well under 5 ms
        assert not engine._hands_off(runner, 1)
        for rows in (1, 8):
            runner.latency.observe(rows, 0.020 * rows)  # now a batch takes 20 ms a sample
        assert engine._hands_off(runner, 1)
        engine._executing = engine._workers + 1  # every worker busy: nobody to hand to
        assert not engine._hands_off(runner, 1)
        engine._executing = 0


async def test_a_tiny_batch_runs_on_the_loop_and_a_longer_one_in_a_worker(repo: Path) -> None:
    """The hop to a worker costs more than a batch of a few microseconds: such a batch runs
    on the loop; one expected to take longer (or before any time is known) in a worker."""
    threads: list[str] = []

    class Seen(Runtime):
        def run(self, feeds: Any) -> dict[str, np.ndarray]:
            threads.append(threading.current_thread().name)
            return super().run(feeds)

    m = manifest_of(repo)
    async with Engine(config(repo), runtime_factory=Seen) as engine:
        runner = engine.registry.model("chain").serving["2"].runner("c0")
        assert engine._inline(runner, 1)  # the warm-up timed it: microseconds
        threads.clear()
        first = await engine.infer("chain", frame(m, {"x": x(0)}))
        assert threads == [threading.current_thread().name]
        for rows in (1, 8):
            runner.latency.observe(rows, 0.001 * rows)  # now a batch takes a millisecond
        second = await engine.infer("chain", frame(m, {"x": x(0)}))
        assert threads[1].startswith("splitinfer-batch")
        np.testing.assert_array_equal(answer(m, first.body), answer(m, second.body))
    async with Engine(config(repo), runtime_factory=Seen, inline_max_s=0) as engine:
        runner = engine.registry.model("chain").serving["2"].runner("c0")
        assert not engine._inline(runner, 1)


async def test_requests_that_arrive_while_a_batch_runs_are_decided_on_once(
    repo: Path, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that finds the model idle starts at once; those read in one loop
    iteration while a batch runs cost one decision between them, not one each."""
    decisions: list[int] = []
    pump = Engine._pump

    def counted(self: Engine, model: str) -> None:
        decisions.append(1)
        pump(self, model)

    monkeypatch.setattr(Engine, "_pump", counted)
    m = manifest_of(repo)
    async with Engine(config(repo), runtime_factory=gate, inline_max_s=0) as engine:
        gate.open.clear()
        first = asyncio.create_task(engine.infer("chain", frame(m, {"x": x(0)})))
        await until(lambda: running(engine) == 1)
        decisions.clear()
        rest = [
            asyncio.create_task(engine.infer("chain", frame(m, {"x": x(i)}))) for i in range(10)
        ]
        await until(lambda: queued(engine) == 10)
        assert len(decisions) == 1
        gate.open.set()
        await asyncio.gather(first, *rest)
    assert gate.batches[-2:] == [1, 10]


async def test_the_warm_up_feeds_a_cut_tensor_at_its_analysed_size(tmp_path: Path) -> None:
    """A cut tensor of a free-H/W net has dimensions of its own (H/2 here, ``r_dim2``); fed
    at 1 x 1 the cloud's pooled branch no longer fits the Concat and the version would be
    refused at load. The manifest carries the analysed 8 x 8, and the warm-up uses it."""
    repo = tmp_path / "repo"
    m = write(neck(), repo, "neck", "1", cuts=("none", "c1"), shapes={"x": [1, 2, 16, 16]})
    cut = next(c for c in m.cuts if c.id == "c1")
    assert [t.name for t in cut.tensors] == ["r"]
    assert all(isinstance(d, str) for d in cut.tensors[0].shape[2:])  # no input's H or W
    assert cut.sample_shapes == {"r": (4, 8, 8)}
    async with Engine(config(repo)) as engine:  # warm-up on: a failure refuses the version
        runner = engine.registry.model("neck").serving["1"].runner("c1")
        assert runner.latency.known
