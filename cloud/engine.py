"""The in-process engine: request frame in, response frame out, no sockets.

``infer`` routes the request to a version, validates the frame against that
version's cut (``shared.frame.decode_request``), queues it in the model's
:class:`Batcher` and awaits its share of a batch. Batches run in a thread pool
off the event loop (stacking, the runtime and splitting all happen there); the
loop only moves requests and sets results. The batcher is driven by events (a
submit, a finished batch, a timer at ``wake_at``), so nothing polls.

Hand-offs cost the model time, so the loop keeps them short: a finished batch's
successor is launched before its callers are answered, and the loop lets go of
the GIL when it launches a batch of more than 5 ms of compute until the
worker is inside the runtime (at most ``HANDOFF_S``; the worker would otherwise
wait for the busy loop's next pause). A batch expected to compute for less than
``INLINE_MAX_S`` runs on the loop itself: the hop to a worker and back costs
more than it. Submits ask for one decision per loop iteration, so the requests
read in one iteration form one batch.

The same engine runs under the HTTP server, in ``sim/`` and in tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitinfer.cloud.batcher import Batch, Batcher, Item, QueueKey
from splitinfer.cloud.config import ServiceConfig
from splitinfer.cloud.metrics import Metrics, VersionSeries
from splitinfer.cloud.overload import DeadlineUnmeetable, ShuttingDown
from splitinfer.cloud.registry import CutRunner, LoadedVersion, Registry, RuntimeFactory
from splitinfer.cloud.segments import segment_factory
from splitinfer.cloud.tensors import Array, Arrays, bucket, sample_shape, split, stack
from splitinfer.shared.codecs import RAW
from splitinfer.shared.errors import ProtocolError
from splitinfer.shared.frame import (
    Request,
    Response,
    WireTensor,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
    read_request_head,
)
from splitinfer.shared.manifest import PrivacySpec
from splitinfer.shared.privacy import Budget, BudgetPolicy, PrivacyBudgetExhausted

log = logging.getLogger("splitinfer.cloud")

DEFAULT_PRIORITY = 5
#: The most the loop waits for a free worker to enter the runtime with a new batch.
HANDOFF_S = 0.002
#: ... and does so only for batches expected to compute at least this long (CPython's
#: default switch interval, the longest a worker waits for the GIL otherwise). A short
#: batch does not repay it: the loop stalls for the worker's wake-up, and the worker,
#: done quickly, then waits for the busy loop's GIL again to hand its result back (on
#: a tiny segment under load the hand-off cost throughput here instead of adding it).
HANDOFF_MIN_COMPUTE_S = 0.005
#: A batch expected (from what this version's batches took) to compute for less than this
#: runs on the event loop, not in a worker: the round trip to a worker (a thread wake-up,
#: the GIL changing hands twice, the loop woken through its self-pipe) costs the loop about
#: as much CPU as this and the batch's callers more latency (docs/benchmarks.md, "Front end
#: cost per request"). Longer batches, and any batch before a time is known, go to a worker.
INLINE_MAX_S = 0.0002


#: What a batch gave: each caller's share of its outputs and the run's seconds, or what
#: it raised.
Outcome = tuple[list[Arrays], float] | Exception


class BatchFailed(RuntimeError):
    """The runtime failed on a validated batch: a bug or a broken model (HTTP 500)."""


@dataclass(eq=False)
class _Pending:
    version: LoadedVersion
    runner: CutRunner
    arrays: Arrays
    length: int | None  # the sequence length before padding, if padded
    future: asyncio.Future[Arrays]


@dataclass(frozen=True)
class Served:
    """One answered request: the response frame and the version that computed it."""

    body: bytes
    version: str
    request_id: str
    load: float
    #: seconds the request spent in the service (queue, compute, decode, encode)
    service_s: float = 0.0


class Engine:
    """The cloud service without its HTTP layer.

    ``async with Engine(config) as engine:`` loads the repository (every
    wanted version loaded and warmed) and, on exit, drains the queues.
    """

    def __init__(
        self,
        config: ServiceConfig,
        *,
        metrics: Metrics | None = None,
        runtime_factory: RuntimeFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        inline_max_s: float = INLINE_MAX_S,
    ) -> None:
        self.config = config
        #: batches expected to compute for less than this run on the loop (0: none do;
        #: tests that hold a batch inside the runtime need it in a worker)
        self.inline_max_s = inline_max_s
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.wall = wall
        self.limits = config.limits()
        if runtime_factory is None:
            runtime_factory = segment_factory(self.metrics.registry)
        self.registry = Registry(config, self.metrics, runtime_factory=runtime_factory, clock=clock)
        self.registry.on_retire = self._retired
        self._batchers: dict[str, Batcher[_Pending]] = {}
        self._timers: dict[str, tuple[float, asyncio.TimerHandle]] = {}  # model -> (wake_at, timer)
        self._pumping: set[str] = set()  # models whose decision is due this loop iteration
        self._in_flight: dict[str, int] = {}  # the in_flight gauge reads it when scraped
        self._breakers: dict[int, bool] = {}  # version uid -> breaker open, as last published
        self._executing = 0  # batches handed to the pool and not finished
        self._watcher: asyncio.Task[None] | None = None
        self._workers = config.workers or max(2, 2 * config.batching.max_concurrent_batches)
        self._pool = ThreadPoolExecutor(
            max_workers=self._workers, thread_name_prefix="splitinfer-batch"
        )
        self.closing = False
        p = config.privacy
        self.privacy = (
            Budget(
                BudgetPolicy(
                    p.budget_window_s,
                    p.budget_epsilon or 0.0,
                    p.budget_delta if p.budget_delta is not None else 1e-5,
                    "refuse",
                    "rdp" if p.accountant == "rdp" else "prv",
                )
            )
            if p.enforced
            else None
        )

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Load the repository; start watching it if ``watch_interval_s`` is set."""
        report = await self.registry.reload(force=True)
        for failure in report["failed"]:
            log.error("not serving %(model)s version %(version)s: %(error)s", failure)
        if self.config.watch_interval_s > 0:
            self._watcher = asyncio.create_task(self._watch(self.config.watch_interval_s))

    async def stop(self, drain_timeout: float | None = None) -> None:
        """Refuse new requests, let queued ones finish (up to the timeout), then stop."""
        self.closing = True
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        timeout = self.config.drain_timeout_s if drain_timeout is None else drain_timeout
        deadline = self.clock() + timeout
        while self.clock() < deadline and (
            self._executing or any(b.queued for b in self._batchers.values())
        ):
            await asyncio.sleep(0.005)
        for batcher in self._batchers.values():
            for item in batcher.drain():
                _fail(item, ShuttingDown("the service stopped before this request ran", 5.0))
        for _, handle in self._timers.values():
            handle.cancel()
        end = self.clock() + max(1.0, timeout)
        while self._executing and self.clock() < end:
            await asyncio.sleep(0.005)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.registry.close()

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def reload(self, force: bool = True) -> dict[str, Any]:
        return await self.registry.reload(force=force)

    @property
    def ready(self) -> bool:
        return self.registry.ready and not self.closing

    def batchers(self) -> list[Batcher[Any]]:
        return list(self._batchers.values())

    def load(self, model: str) -> float:
        batcher = self._batchers.get(model)
        return 0.0 if batcher is None else batcher.load

    # -- inference ----------------------------------------------------------------

    async def infer(
        self,
        model: str,
        body: bytes,
        *,
        device: str = "",
        priority: int = DEFAULT_PRIORITY,
        raw_ok: bool = False,
    ) -> Served:
        """Answer one request frame for ``model`` with a response frame.

        Its tensors must travel in the cut's codec unless ``config.accept_raw``
        or ``raw_ok`` (the JSON path, whose values arrive exact, as raw).
        """
        if self.closing:
            raise ShuttingDown("the service is shutting down", 5.0)
        admitted = self.clock()
        state = self.registry.model(model)
        head = read_request_head(body, self.limits)  # parsed once, for routing and decoding
        if head.model != model:
            raise ProtocolError(
                f"frame.model: {head.model!r} does not match the URL's model {model!r}"
            )
        lv = state.route(head.model_version, device, admitted, self.registry.draw())
        runner = lv.runner(head.cut_id)
        request = decode_request(
            head,
            lv.manifest,
            self.limits,
            runner.codecs,
            strict_codec=not (self.config.accept_raw or raw_ok),
            finite=True,
        )
        self._check_privacy(lv.manifest.privacy, request.privacy.noise_multiplier, device, model)
        arrays = {t.name: t.array for t in request.tensors}
        outputs, load = await self._submit(model, lv, runner, arrays, request, priority, admitted)
        response = Response(
            request_id=request.request_id,
            tensors=tuple(WireTensor(n, outputs[n], RAW) for n in runner.outputs),
            model_version=lv.version,
            load=load,
        )
        encoded = encode_response(response)
        spent = self.clock() - admitted
        self.metrics.version(model, lv.version).request_seconds.observe(spent)
        return Served(encoded, lv.version, request.request_id, load, spent)

    def _check_privacy(
        self, spec: PrivacySpec | None, noise_multiplier: float, device: str, model: str
    ) -> None:
        """Refuse a frame noised less than its package asks; charge the device's budget.

        The release has happened once the frame is here, so a charged request that
        fails later (overload, a failed batch) stays charged.
        """
        if spec is not None and noise_multiplier < spec.noise_multiplier * (1 - 1e-9):
            raise ProtocolError(
                f"frame.privacy.noise_multiplier: {noise_multiplier:g} is below the package's "
                f"{spec.noise_multiplier:g} (epsilon {spec.epsilon:g}): the device did not "
                "apply the package's privacy mechanism"
            )
        if self.privacy is None or noise_multiplier <= 0:
            return
        try:
            decision = self.privacy.charge(device or "unsigned", noise_multiplier, self.clock())
        except PrivacyBudgetExhausted as exc:
            window = self.privacy.window_end(device or "unsigned")
            exc.retry_after = max(1.0, window - self.clock())  # type: ignore[attr-defined]
            raise
        self.metrics.privacy_epsilon.labels(model).observe(decision.spent)

    async def infer_arrays(
        self,
        model: str,
        cut_id: str,
        inputs: Mapping[str, Any],
        *,
        version: str = "",
        device: str = "",
        priority: int = DEFAULT_PRIORITY,
    ) -> tuple[dict[str, Array], str]:
        """Nested lists (or arrays) in, output arrays out: the JSON debugging path.

        The values go through a real request frame, so they are validated
        exactly like a device's.
        """
        lv = self.registry.route(model, version, device)
        runner = lv.runner(cut_id)
        tensors = []
        for spec in runner.cut.tensors:
            if spec.name not in inputs:
                raise ProtocolError(
                    f"inputs.{spec.name}: missing (cut {cut_id} needs {list(runner.inputs)})"
                )
            try:
                array = np.asarray(inputs[spec.name], dtype=spec.dtype)
            except (ValueError, TypeError, OverflowError) as exc:
                raise ProtocolError(
                    f"inputs.{spec.name}: not a {spec.dtype} array ({exc})"
                ) from exc
            tensors.append(WireTensor(spec.name, array, RAW))
        extra = sorted(set(inputs) - set(runner.inputs))
        if extra:
            raise ProtocolError(f"inputs.{extra[0]}: not a tensor of cut {cut_id}")
        frame = encode_request(Request(uuid.uuid4().hex, model, lv.version, cut_id, tuple(tensors)))
        served = await self.infer(model, frame, device=device, priority=priority, raw_ok=True)
        response = decode_response(served.body, lv.manifest, self.limits)
        return {t.name: t.array for t in response.tensors}, served.version

    async def _submit(
        self,
        model: str,
        lv: LoadedVersion,
        runner: CutRunner,
        arrays: Arrays,
        request: Request,
        priority: int,
        admitted: float,
    ) -> tuple[Arrays, float]:
        length = None
        if runner.pad is not None:
            length = runner.pad.length(arrays)
            arrays = runner.pad.pad(arrays, bucket(length))
        if runner.batchable:
            rows = int(arrays[runner.inputs[0]].shape[0])
            key = QueueKey(lv.uid, runner.cut.id, sample_shape(arrays, runner.inputs))
        else:
            rows, key = 1, QueueKey(lv.uid, runner.cut.id, solo=True)
        deadline = math.inf
        if request.deadline_ms:
            deadline = admitted + (request.deadline_ms / 1000.0 - self.wall())
        batcher = self._batcher(model)
        batcher.adopt(lv.uid, runner.cut.id, runner.latency)
        future: asyncio.Future[Arrays] = asyncio.get_running_loop().create_future()
        item = Item(key, rows, _Pending(lv, runner, arrays, length, future), priority, deadline)
        batcher.submit(item, admitted)
        self._in_flight[model] += 1
        try:
            self._pump_soon(model, batcher)
            outputs = await future
        except asyncio.CancelledError:
            batcher.cancel(item)
            raise
        finally:
            self._in_flight[model] -= 1
        return outputs, batcher.load

    # -- the batch loop -----------------------------------------------------------

    def _batcher(self, model: str) -> Batcher[_Pending]:
        batcher = self._batchers.get(model)
        if batcher is None:
            batcher = self._batchers[model] = Batcher(self.config.batching_for(model))
            # counted here, per request and per batch; the gauges read them when scraped
            self._in_flight[model] = 0
            series = self.metrics.model(model)
            series.in_flight.set_function(lambda: self._in_flight[model])
            series.queued.set_function(lambda: batcher.queued_rows)
        return batcher

    def _pump_soon(self, model: str, batcher: Batcher[_Pending]) -> None:
        """After a submit: decide now if the model is idle (a request that finds it idle
        starts at once), else once the loop has run what is ready now, so that the
        requests read in one iteration while a batch runs are decided on together (one
        decision, not one per request)."""
        if model in self._pumping:
            return
        if not batcher.running:
            self._pump(model)
            return
        self._pumping.add(model)
        asyncio.get_running_loop().call_soon(self._pump, model)

    def _pump(self, model: str) -> None:
        """Ask the batcher what to do now; start batches, refuse expired, set the timer."""
        self._pumping.discard(model)
        batcher = self._batchers[model]
        if not batcher.queued_rows:  # nothing to start or refuse, no reason to wake
            held = self._timers.pop(model, None)
            if held is not None:
                held[1].cancel()
            return
        now = self.clock()
        decision = batcher.schedule(now)
        series = self.metrics.model(model)
        for item in decision.expired:
            series.expired.inc()
            _fail(item, DeadlineUnmeetable("deadline can no longer be met while queued", 1.0))
        for batch in decision.batches:
            for it in batch.items:
                series.queue_seconds.observe(now - it.arrival)
            self._launch(model, batcher, batch)
        wake = decision.wake_at
        held = self._timers.get(model)
        if held is not None and held[0] != wake:  # a timer for the same moment stays
            held[1].cancel()
            del self._timers[model]
            held = None
        if wake is not None and held is None:
            loop = asyncio.get_running_loop()
            self._timers[model] = (wake, loop.call_later(max(0.0, wake - now), self._woken, model))

    def _woken(self, model: str) -> None:
        self._timers.pop(model, None)  # fired: the next decision sets a new one
        self._pump(model)

    def _launch(self, model: str, batcher: Batcher[_Pending], batch: Batch[_Pending]) -> None:
        """Hand a batch to the thread pool, or run a tiny one here (:meth:`_inline`);
        :meth:`_finish` runs on the loop when it is done.

        Plain callbacks rather than a task: one loop iteration less on each side.
        """
        pending = [it.payload for it in batch.items]
        runner = pending[0].runner
        parts = [p.arrays for p in pending]
        rows = [it.rows for it in batch.items]
        lengths = [p.length for p in pending]
        loop = asyncio.get_running_loop()
        self._executing += 1
        if self._inline(runner, batch.rows):  # cheaper here than the hop to a worker
            outcome: Outcome
            try:
                outcome = _compute(runner, parts, rows, lengths, None)
            except Exception as exc:
                outcome = exc
            loop.call_soon(self._finish, model, batcher, batch, outcome)
            return
        entered = threading.Event()
        work = self._pool.submit(_compute, runner, parts, rows, lengths, entered)
        if self._hands_off(runner, batch.rows):
            entered.wait(HANDOFF_S)

        def done(f: Future[tuple[list[Arrays], float]]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(self._finished, model, batcher, batch, f)

        work.add_done_callback(done)

    def _finished(
        self,
        model: str,
        batcher: Batcher[_Pending],
        batch: Batch[_Pending],
        work: Future[tuple[list[Arrays], float]],
    ) -> None:
        """A worker's batch is done: on to :meth:`_finish` with what it gave."""
        outcome: Outcome
        try:
            outcome = work.result()
        except Exception as exc:
            outcome = exc
        self._finish(model, batcher, batch, outcome)

    def _inline(self, runner: CutRunner, rows: int) -> bool:
        """Whether a batch is short enough to run on the loop (see ``INLINE_MAX_S``)."""
        return runner.latency.known and runner.latency.estimate(rows) < self.inline_max_s

    def _hands_off(self, runner: CutRunner, rows: int) -> bool:
        """Whether the loop waits for a just-launched batch's worker to enter the runtime.

        Only with a worker free (it would otherwise wait for a batch to end) and a batch
        expected to compute long enough to repay the wait. Left to the busy loop, the
        GIL reaches the worker only at the loop's next pause or after the interpreter's
        switch interval (5 ms), the model idle meanwhile.
        """
        if self._executing > self._workers:
            return False
        return runner.latency.estimate(rows) >= HANDOFF_MIN_COMPUTE_S

    def _finish(
        self,
        model: str,
        batcher: Batcher[_Pending],
        batch: Batch[_Pending],
        outcome: Outcome,
    ) -> None:
        """A batch is done: ``outcome`` is its shares and run seconds, or what it raised."""
        self._executing -= 1
        pending = [it.payload for it in batch.items]
        lv = pending[0].version
        vm = self.metrics.version(model, lv.version)
        now = self.clock()
        failure: Exception | None = None
        shares: list[Arrays] = []
        seconds = 0.0
        if isinstance(outcome, Exception):
            failure = outcome
        else:
            shares, seconds = outcome
        batcher.complete(batch, now, seconds, ok=failure is None)
        lv.breaker.record(failure is None, now)
        self._pump(model)  # the next batch starts before this one's callers are answered
        if failure is not None:
            log.error(
                "%s version %s: batch of %d failed", model, lv.version, batch.rows, exc_info=failure
            )
            self._show_breaker(vm, lv, not lv.breaker.closed)
            error = BatchFailed(
                f"the model failed on this batch: {' '.join(str(failure).split())[:200]}"
            )
            for p in pending:
                if not p.future.done():
                    p.future.set_exception(error)
            return
        self._show_breaker(vm, lv, False)
        vm.compute_seconds.observe(seconds)
        vm.batch_size.observe(batch.rows)
        vm.inferences.inc(batch.rows)
        vm.executions.inc()
        for p, share in zip(pending, shares, strict=True):
            if not p.future.done():
                p.future.set_result(share)

    def _show_breaker(self, vm: VersionSeries, lv: LoadedVersion, is_open: bool) -> None:
        """Set a version's breaker gauge when its state changed (a set takes a lock)."""
        if self._breakers.get(lv.uid) != is_open:
            self._breakers[lv.uid] = is_open
            vm.breaker_open.set(is_open)

    async def _watch(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.registry.reload(force=False)
            except Exception:  # a bad scan must not stop the watcher
                log.exception("repository rescan failed")

    def _retired(self, lv: LoadedVersion) -> None:
        self._breakers.pop(lv.uid, None)
        batcher = self._batchers.get(lv.model)
        if batcher is not None and not batcher.queued:
            batcher.forget(lv.uid)


def _compute(
    runner: CutRunner,
    parts: Sequence[Arrays],
    rows: Sequence[int],
    lengths: Sequence[int | None],
    entered: threading.Event | None,
) -> tuple[list[Arrays], float]:
    """Stack, run and split one batch, in a worker thread (``entered`` is set when it is
    about to run) or, for a tiny batch, on the loop. Returns (shares, run seconds)."""
    try:
        feeds = stack(parts, runner.inputs)
    finally:
        if entered is not None:
            entered.set()  # the loop may go on: the runtime lets go of the GIL while it runs
    started = time.perf_counter()
    produced = runner.runtime.run(feeds)
    seconds = time.perf_counter() - started
    outputs = {n: produced[n] if n in produced else feeds[n] for n in runner.outputs}
    shares = split(outputs, rows, runner.output_axes)
    if runner.pad is not None:
        shares = [
            runner.pad.unpad(s, n) if n is not None else s
            for s, n in zip(shares, lengths, strict=True)
        ]
    return shares, seconds


def _fail(item: Item[_Pending], error: BaseException) -> None:
    if not item.payload.future.done():
        item.payload.future.set_exception(error)
