"""The edge pipeline, in process: inputs to outputs through the cloud or locally.

One request goes: check the inputs against the manifest → choose the cut →
run the cut's edge segment → clip and noise (when the package has privacy) →
encode the cut tensors with the cut's codec into a request frame → the uplink
(signing, retries, failover; any :class:`~splitinfer.edge.transport.Transport`)
→ decode the response frame. An "all" cut answers on the device and sends
nothing. When no cloud endpoint answers, the full local model (``full.onnx``, or
an "all" cut) answers and the result is marked local; without one the request
fails at once with a clear error. Every stage is timed.

No sockets here: the agent wraps a pipeline in an HTTP API, tests drive it with
a function transport, and ``sim/`` with an emulated link. CPU work (segments,
noise, codecs) runs through ``compute`` (a thread pool in the agent, inline by
default); the clock and the noise generator are injected.
"""

from __future__ import annotations

import logging
import math
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from splitinfer.edge.chooser import Choice, CutChooser
from splitinfer.edge.config import AdaptConfig, PrivacyConfig
from splitinfer.edge.failover import CloudRefused, CloudUnavailable, Uplink, infer_path
from splitinfer.edge.link import Estimate, LinkEstimator, prior_link
from splitinfer.edge.model import CutRuntime, EdgeModel
from splitinfer.edge.noise import PrivacyGate, noise_tensors
from splitinfer.edge.payload import check_inputs
from splitinfer.edge.runtime import SegmentRunner
from splitinfer.edge.wire import wire_tensor
from splitinfer.shared.errors import (
    CodecError,
    ConfigError,
    ModelError,
    OverloadError,
    ProtocolError,
)
from splitinfer.shared.frame import (
    STATUS_OK,
    Limits,
    Privacy,
    Request,
    decode_response,
    encode_request,
)
from splitinfer.shared.links import Link
from splitinfer.shared.privacy import PrivacyBudgetExhausted, secure_rng

log = logging.getLogger(__name__)

Array = np.ndarray[Any, Any]
T = TypeVar("T")
Compute = Callable[[Callable[[], T]], Awaitable[T]]

_SERVER_TIMING = re.compile(r"dur=([0-9.]+)")


async def inline(fn: Callable[[], T]) -> T:
    """Run CPU work on the event loop itself (tests, benchmarks)."""
    return fn()


@dataclass
class Result:
    """One answered request."""

    outputs: dict[str, Array]
    cut_id: str
    #: Answered on the device (an "all" cut, or the fallback model).
    local: bool
    #: Seconds per stage: edge, privacy, encode, uplink, decode, local, total.
    timings: dict[str, float] = field(default_factory=dict)
    #: Why the answer is local: "cut", "cloud unavailable: ...", "privacy budget".
    reason: str = ""
    model_version: str = ""
    #: The cloud's load from this answer (None when local).
    load: float | None = None
    endpoint: str = ""
    attempts: int = 0
    up_bytes: int = 0
    down_bytes: int = 0
    #: The link estimate after this request.
    link: Link | None = None
    #: Epsilon spent in the privacy window after this request (None: no budget).
    epsilon_spent: float | None = None


def eligible_cuts(model: EdgeModel) -> dict[str, CutRuntime]:
    """The cuts this package may use: with privacy, only those whose tensors can be noised."""
    if model.manifest.privacy is None:
        return dict(model.cuts)
    return {k: rt for k, rt in model.cuts.items() if rt.local or rt.float_only}


def server_seconds(header: str) -> float | None:
    """The sum of the ``dur=`` (ms) entries of a Server-Timing header, in seconds."""
    durations = [float(m) for m in _SERVER_TIMING.findall(header)]
    return sum(durations) / 1e3 if durations else None


class Pipeline:
    """Runs requests through a package's cuts; see the module docstring."""

    def __init__(
        self,
        model: EdgeModel,
        uplink: Uplink | None,
        *,
        model_name: str | None = None,
        model_version: str = "",
        adapt: AdaptConfig | None = None,
        privacy: PrivacyConfig | None = None,
        device_id: str = "device",
        request_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        compute: Compute[Any] = inline,
        rng: Callable[[], np.random.Generator] = secure_rng,
        limits: Limits | None = None,
        inline_below_s: float = 0.0,
    ) -> None:
        adapt = adapt or AdaptConfig()
        privacy = privacy or PrivacyConfig()
        self.model = model
        self.uplink = uplink
        manifest = model.manifest
        self.model_name = model_name or manifest.model_name
        self.model_version = model_version
        self.path = infer_path(self.model_name)
        self.request_timeout_s = request_timeout_s
        self._clock = clock
        self._wall = wall
        self._compute = compute
        self._rng = rng
        self._limits = limits or Limits()
        self.adapt = adapt
        self.cuts = eligible_cuts(model)
        if not self.cuts:
            raise ConfigError(
                "no cut of this package can be used with its privacy settings: every cut "
                "ships non-float tensors that noise cannot protect; re-partition"
            )
        self.start_reason = ""
        self.start_cut = self._start(adapt)
        costs = {k: rt.cost for k, rt in self.cuts.items() if rt.cost is not None}
        # a pinned cut, or switching off, keeps the costs: the chooser still predicts
        # every candidate (GET /v1/status) and never moves
        if self.start_cut not in costs:
            if len(costs) > 1 and adapt.enabled and adapt.cut is None:
                log.warning("cut %s has no predicted cost; cut switching is off", self.start_cut)
            costs = {}
        self.chooser = CutChooser(costs, self.start_cut, adapt, self.start_reason)
        self.estimator = LinkEstimator(
            prior_link(model.manifest.planning, adapt),
            half_life_s=adapt.link_half_life_s,
            min_rate_bytes=adapt.min_rate_bytes,
        )
        self.gate: PrivacyGate | None = None
        if manifest.privacy is not None:
            self.gate = PrivacyGate(manifest.privacy, privacy, device_id, clock)
        self.edge_s: dict[str, float] = {}
        #: Per cut: the request's own CPU work (edge segment, noise, encode), smoothed.
        self.front_s: dict[str, float] = {}
        self.inline_below_s = inline_below_s
        self.inlined = 0
        self._computing = 0
        self.in_flight = 0
        self.last_load: float | None = None
        #: The last answer the device gave instead of the cloud: (clock time, reason).
        self.last_fallback: tuple[float, str] | None = None

    def _start(self, adapt: AdaptConfig) -> str:
        manifest = self.model.manifest
        if adapt.cut is not None:
            if adapt.cut not in self.cuts:
                usable = ", ".join(self.cuts)
                raise ConfigError(
                    f"adapt.cut={adapt.cut!r} is not a usable cut; use one of {usable}"
                )
            self.start_reason = f"pinned by adapt.cut={adapt.cut}"
            return adapt.cut
        if manifest.default_cut in self.cuts:
            self.start_reason = "the package's default cut (the partitioner's choice)"
            return manifest.default_cut
        first = next(iter(self.cuts))
        log.warning("default cut %s cannot be used; starting at %s", manifest.default_cut, first)
        self.start_reason = (
            f"the first usable cut: the default cut {manifest.default_cut} cannot be used "
            "with this package's privacy settings"
        )
        return first

    # -- state for the agent -----------------------------------------------------
    @property
    def current_cut(self) -> str:
        return self.chooser.current

    def now(self) -> float:
        """The pipeline's clock (deadlines are on it)."""
        return self._clock()

    def estimate(self) -> Estimate:
        return self.estimator.estimate()

    def local_runner(self) -> SegmentRunner | None:
        return self.model.local_runner()

    def edge_times(self) -> dict[str, float] | None:
        """The measured edge times the chooser predicts with (None: the package's)."""
        return self.edge_s if self.adapt.measured_edge else None

    def explain(self) -> dict[str, Any]:
        """Every candidate's predicted latency now and why the current cut is used
        (:meth:`CutChooser.explain` at the current link estimate), with the last
        local fallback."""
        now = self._clock()
        doc = self.chooser.explain(self.estimator.estimate().link, now, self.edge_times())
        doc["fallback"] = None
        if self.last_fallback is not None:
            at, reason = self.last_fallback
            doc["fallback"] = {"reason": reason, "since_s": max(now - at, 0.0)}
        return doc

    def record_edge_time(self, cut_id: str, seconds: float) -> None:
        """A measured edge-segment time per sample (warm-up or a request)."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        old = self.edge_s.get(cut_id)
        a = self.adapt.alpha
        self.edge_s[cut_id] = seconds if old is None else old + a * (seconds - old)

    async def warm_up(self) -> dict[str, float]:
        """Run every usable edge segment and the local model twice on sample inputs.

        A session that cannot run the analysed shapes fails here, at start, not on
        the first request; the second run's time seeds the measured edge times.
        Returns seconds per part ("cut:<id>", "local").
        """
        feeds = self.model.sample_inputs(1)
        parts: list[tuple[str, SegmentRunner]] = [
            (f"cut:{k}", rt.edge) for k, rt in self.cuts.items() if rt.edge is not None
        ]
        local = self.local_runner()
        if local is not None and all(local is not r for _, r in parts):
            parts.append(("local", local))
        seconds: dict[str, float] = {}
        for name, runner in parts:
            await self._compute(lambda r=runner: r.run(feeds))  # type: ignore[misc]
            t = self._clock()
            await self._compute(lambda r=runner: r.run(feeds))  # type: ignore[misc]
            seconds[name] = self._clock() - t
            if name.startswith("cut:"):
                self.record_edge_time(name[4:], seconds[name])
        return seconds

    async def probe(self) -> None:
        """A round of health checks; their round trips feed the RTT while idle."""
        if self.uplink is None:
            return
        if self.in_flight:  # a busy agent's round trips queue behind its own requests
            await self.uplink.check_health()
            return
        await self.uplink.check_health(lambda s: self.estimator.observe_rtt(s, self._clock()))

    # -- one request -------------------------------------------------------------
    def choose(self, cut: str | None = None) -> Choice:
        """The cut for the next request (``cut`` forces one)."""
        if cut is not None:
            if cut not in self.cuts:
                raise ConfigError(
                    f"cut {cut!r} is not usable here; use one of {', '.join(self.cuts)}"
                )
            return Choice(cut, {}, False, self.chooser.loaded)
        return self.chooser.choose(self.estimator.estimate().link, self._clock(), self.edge_times())

    async def infer(
        self,
        inputs: Mapping[str, Any],
        *,
        deadline: float | None = None,
        cut: str | None = None,
        request_id: str | None = None,
        trace_id: str = "",
        headers: Mapping[str, str] | None = None,
    ) -> Result:
        """Answer one request; a :class:`SplitInferError` says why not.

        ``deadline`` is on the pipeline's clock (default: now + request_timeout_s).
        """
        self.in_flight += 1
        try:
            return await self._infer(inputs, deadline, cut, request_id, trace_id, headers)
        finally:
            self.in_flight -= 1

    async def _infer(
        self,
        inputs: Mapping[str, Any],
        deadline: float | None,
        cut: str | None,
        request_id: str | None,
        trace_id: str,
        headers: Mapping[str, str] | None,
    ) -> Result:
        t0 = self._clock()
        deadline = t0 + self.request_timeout_s if deadline is None else deadline
        feeds = check_inputs(self.model.manifest, inputs)
        if t0 >= deadline:
            raise OverloadError(
                f"the request's deadline passed {t0 - deadline:.3g} s before it could start "
                "(it waited in the queue); retry, or give it more time (X-Splitinfer-Timeout-Ms)"
            )
        choice = self.choose(cut)
        rt = self.cuts[choice.cut_id]
        timings: dict[str, float] = {}
        batch = next(iter(feeds.values())).shape[0] if feeds else 1
        if rt.local:
            assert rt.edge is not None
            result = await self._local(feeds, rt.edge, rt.id, "cut", t0, timings)
            self.record_edge_time(rt.id, timings["local"] / batch)
            return result
        local = self.local_runner()
        if local is not None and (self.uplink is None or not self.uplink.any_available()):
            return await self._local(feeds, local, rt.id, "cloud unavailable", t0, timings)
        spent = None
        if self.gate is not None:
            decision = await self.gate.charge(self._compute)
            if decision is not None:
                spent = decision.spent
                if not decision.allowed:
                    if local is None:
                        raise PrivacyBudgetExhausted(
                            f"privacy budget exhausted (epsilon {decision.spent:.3g} of "
                            f"{decision.limit:g} this window) and the package has no local "
                            "model (partition --edge-fallback)"
                        )
                    return await self._local(feeds, local, rt.id, "privacy budget", t0, timings)
        if self.uplink is None:
            raise CloudUnavailable(
                "no cloud endpoint is configured and the package has no local model"
            )
        rid = request_id or secrets.token_hex(8)
        wall_deadline = self._wall() + max(deadline - self._clock(), 0.0)
        body = await self._cpu(
            rt.id, lambda: self._front(rt, feeds, rid, int(wall_deadline * 1000), trace_id, timings)
        )
        front = sum(timings.get(k, 0.0) for k in ("edge", "privacy", "encode"))
        old = self.front_s.get(rt.id)
        self.front_s[rt.id] = front if old is None else old + self.adapt.alpha * (front - old)
        if rt.edge is not None:
            self.record_edge_time(rt.id, timings["edge"] / batch)
        t_up = self._clock()
        try:
            delivery = await self.uplink.post(self.path, body, deadline, headers)
        except CloudUnavailable as exc:
            timings["uplink"] = self._clock() - t_up
            if local is None:
                raise CloudUnavailable(
                    f"{exc}; the package has no local model to answer instead "
                    "(partition --edge-fallback)"
                ) from None
            log.info("answering locally: %s", exc)
            return await self._local(feeds, local, rt.id, f"cloud unavailable: {exc}", t0, timings)
        timings["uplink"] = self._clock() - t_up
        reply = delivery.reply
        t_dec = self._clock()
        try:
            response = decode_response(reply.body, self.model.manifest, self._limits, rt.codecs)
        except (ProtocolError, CodecError) as exc:
            raise CloudRefused(
                f"cloud {delivery.endpoint} answered a malformed frame: {exc}", 502
            ) from None
        timings["decode"] = self._clock() - t_dec
        if response.status != STATUS_OK:
            raise CloudRefused(
                f"cloud {delivery.endpoint} answered {response.status}: {response.message}",
                response.status,
            )
        if response.request_id != rid:
            raise CloudRefused(
                f"cloud {delivery.endpoint} answered request {response.request_id!r} for {rid!r}",
                502,
            )
        now = self._clock()
        server = server_seconds(reply.header("Server-Timing"))
        if server is None and rt.cost is not None:
            server = rt.cost.cloud_s + rt.cost.decode_s
        self.estimator.observe_transfer(
            len(body), len(reply.body), delivery.elapsed_s, server or 0.0, now
        )
        self.chooser.observe_load(response.load, now)
        self.last_load = response.load
        timings["total"] = now - t0
        return Result(
            # raw payloads decode to read-only views of the answer; the caller owns these
            outputs={
                t.name: t.array if t.array.flags.writeable else t.array.copy()
                for t in response.tensors
            },
            cut_id=rt.id,
            local=False,
            timings=timings,
            model_version=response.model_version,
            load=response.load,
            endpoint=delivery.endpoint,
            attempts=delivery.attempts,
            up_bytes=len(body),
            down_bytes=len(reply.body),
            link=self.estimator.estimate().link,
            epsilon_spent=spent,
        )

    async def _cpu(self, cut_id: str, fn: Callable[[], T]) -> T:
        """Run a request's CPU work: on the event loop when it is known to be cheaper
        than ``inline_below_s`` and nothing else is computing (a hop to a worker thread
        and back costs 0.3-0.5 ms on a small machine, more than such work itself),
        otherwise through ``compute`` (the worker pool), which keeps the loop free
        and lets concurrent requests use every core."""
        predicted = self.front_s.get(cut_id)
        if predicted is not None and predicted < self.inline_below_s and self._computing == 0:
            self.inlined += 1
            return fn()
        self._computing += 1
        try:
            result: T = await self._compute(fn)
        finally:
            self._computing -= 1
        return result

    def _front(
        self,
        rt: CutRuntime,
        feeds: Mapping[str, Array],
        request_id: str,
        deadline_ms: int,
        trace_id: str,
        timings: dict[str, float],
    ) -> bytes:
        """Edge segment, noise, encode: the request frame's bytes (CPU work)."""
        t = self._clock()
        produced: dict[str, Array] = dict(feeds)
        if rt.edge is not None:
            produced.update(rt.edge.run(feeds))
        timings["edge"] = self._clock() - t
        try:
            arrays = [produced[spec.name] for spec in rt.cut.tensors]
        except KeyError as exc:
            raise ModelError(
                f"cut {rt.id}: the edge segment does not produce {exc.args[0]!r}"
            ) from None
        spec = self.model.manifest.privacy
        privacy = Privacy()
        if spec is not None:
            t = self._clock()
            arrays = noise_tensors(arrays, spec, self._rng())
            timings["privacy"] = self._clock() - t
            privacy = Privacy(spec.noise_multiplier, spec.clip, spec.epsilon)
        t = self._clock()
        tensors = tuple(
            wire_tensor(rt, s.name, a) for s, a in zip(rt.cut.tensors, arrays, strict=True)
        )
        request = Request(
            request_id=request_id,
            model_name=self.model_name,
            model_version=self.model_version,
            cut_id=rt.id,
            tensors=tensors,
            privacy=privacy,
            deadline_ms=deadline_ms,
            trace_id=trace_id,
        )
        body = encode_request(request, rt.codecs)
        timings["encode"] = self._clock() - t
        return body

    async def _local(
        self,
        feeds: Mapping[str, Array],
        runner: SegmentRunner,
        cut_id: str,
        reason: str,
        t0: float,
        timings: dict[str, float],
    ) -> Result:
        t = self._clock()
        if reason != "cut":
            self.last_fallback = (t, reason)
        produced = await self._compute(lambda: runner.run(feeds))
        timings["local"] = self._clock() - t
        try:
            outputs = {o.name: produced[o.name] for o in self.model.manifest.outputs}
        except KeyError as exc:
            raise ModelError(f"{runner.name} does not produce output {exc.args[0]!r}") from None
        timings["total"] = self._clock() - t0
        return Result(
            outputs=outputs,
            cut_id=cut_id if reason == "cut" else "local",
            local=True,
            timings=timings,
            reason=reason,
            link=self.estimator.estimate().link,
            epsilon_spent=self.gate.spent if self.gate is not None and self.gate.enforced else None,
        )
