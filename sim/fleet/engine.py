"""The fleet on simulated time, one decision period (``decide_every``) at a time.

Each period ``[T, T + E)``:

1. **Feedback.** Answers that reached their devices before ``T`` update each device's
   uplink estimate and, with the latest answer's cloud load, its chooser
   (``CutChooser.observe_load``).
2. **Decisions.** Devices with requests in the period ask their chooser
   (:meth:`~splitinfer.sim.fleet.devices.Choosers.decide`).
3. **Devices and uplinks, in numpy.** Each request runs its cut's edge segment and
   encoding on its device (a FIFO per device; lognormal jitter), then its upload crosses
   the device's uplink (:func:`~splitinfer.sim.fleet.links.transfer`), the one-way delay
   and the cloud's decoding. All-edge requests end on the device.
4. **The cloud, in Python.** Arrivals go to replicas (round-robin in arrival order,
   random, or sticky per device); each replica takes its arrivals before ``T + E`` in
   time order with its real batcher (:class:`~splitinfer.sim.fleet.replica.Replica`).
   Arrivals after ``T + E`` wait for the next period: none can come from a later one.
5. **Answers, in numpy.** Finished batches' answers cross each device's downlink; a
   refused request (queue full, deadline, rate limit) or one answered after the
   device's ``request_timeout`` is answered by the device's local model (``fallback``)
   or counted as an error.

Retries of a refused request and TCP dynamics are not modelled (the agent's failover
would retry before falling back; docs/netsim.md says what else differs).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from splitinfer.edge.link import prior_link
from splitinfer.shared.links import MahimahiTrace
from splitinfer.sim.fleet.devices import Arrivals, Choosers, LinkEstimates, read_times
from splitinfer.sim.fleet.links import RATE, TRACE, UNLIMITED, Capacities, fifo, transfer
from splitinfer.sim.fleet.replica import Finished, Replica
from splitinfer.sim.fleet.results import (
    CLOUD,
    FALLBACK_LATE,
    FALLBACK_REFUSED,
    LATE,
    LOCAL,
    REFUSED,
    FleetRun,
    Requests,
)
from splitinfer.sim.fleet.scenario import FleetScenario, LinkSpec

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


def _capacities(specs: list[LinkSpec], counts: list[int], rng: np.random.Generator) -> Capacities:
    n = sum(counts)
    kind = np.zeros(n, np.int8)
    rate = np.ones(n)
    trace_of = np.zeros(n, np.int64)
    offset = np.zeros(n)
    loaded: dict[str, int] = {}
    traces: list[MahimahiTrace] = []
    at = 0
    for spec, count in zip(specs, counts, strict=True):
        sl = slice(at, at + count)
        at += count
        if spec.kind == "unlimited":
            kind[sl] = UNLIMITED
        elif spec.kind == "rate":
            kind[sl], rate[sl] = RATE, spec.rate_bps
        else:
            ids = []
            for path in spec.traces:
                if str(path) not in loaded:
                    loaded[str(path)] = len(traces)
                    traces.append(MahimahiTrace.load(path))
                ids.append(loaded[str(path)])
            pick = np.asarray(ids)[rng.integers(0, len(ids), count)]
            kind[sl], trace_of[sl] = TRACE, pick
            periods = np.array([traces[i].duration_ms / 1000.0 for i in pick])
            offset[sl] = rng.uniform(0, periods) if spec.offset_s is None else spec.offset_s
    return Capacities(kind, rate, trace_of, offset, traces)


class FleetSim:
    """One run of a :class:`FleetScenario`; :meth:`run` returns a :class:`FleetRun`."""

    def __init__(
        self,
        sc: FleetScenario,
        *,
        exact: bool = False,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.sc = sc
        self.progress = progress or (lambda _m: None)
        seeds = np.random.SeedSequence(sc.seed).spawn(7)
        r_link, r_arr, r_dev, r_route, r_deg, r_cloud, r_jit = (
            np.random.default_rng(s) for s in seeds
        )
        groups = sc.groups
        counts = [g.count for g in groups]
        n = sum(counts)
        self.n = n
        self.group_of = np.repeat(np.arange(len(groups)), counts)
        self.cut_ids = list(sc.costs)
        costs = [sc.costs[c] for c in self.cut_ids]
        self.kind_all = np.array([c.kind == "all" for c in costs])
        self.edge = np.array([c.edge_s + c.encode_s for c in costs])
        self.up = np.array([c.up_bytes for c in costs], np.float64)
        self.down = np.array([c.down_bytes for c in costs], np.float64)
        self.decode = np.array([c.decode_s for c in costs])
        self.scale = np.array([g.edge_scale for g in groups])[self.group_of]
        self.sigma = np.array([g.jitter for g in groups])[self.group_of]
        self.delay = np.array([g.delay_s for g in groups])[self.group_of]
        self.timeout = np.array([g.request_timeout_s for g in groups])[self.group_of]
        self.fallback = np.array([g.fallback for g in groups])[self.group_of]
        self.local = (sc.local_s or 0.0) * self.scale
        self.upcap = _capacities([g.uplink for g in groups], counts, r_link)
        self.downcap = _capacities([g.downlink for g in groups], counts, r_link)
        self.degraded: list[tuple[float, float, float, int]] = []
        starts = np.cumsum([0, *counts])
        for d in sc.degradations:
            mask = np.zeros(n, dtype=bool)
            for g in range(len(groups)):
                pick = r_deg.permutation(counts[g])[: round(d.share * counts[g])]
                mask[starts[g] + pick] = True
            cap = self.upcap if d.direction == "uplink" else self.downcap
            cap.degrade(mask, d.start_s, d.end_s, d.factor)
            self.degraded.append((d.start_s, d.end_s, d.factor, int(mask.sum())))
        self.arrivals = []
        for g, group in enumerate(groups):
            devs = np.arange(starts[g], starts[g + 1])
            if group.arrivals.kind == "poisson":
                self.arrivals.append(Arrivals(devs, r_arr, rate=group.arrivals.rate))
            else:
                assert group.arrivals.file is not None
                times, owners = read_times(group.arrivals.file)
                self.arrivals.append(Arrivals(devs, r_arr, times=times, owners=owners))
        prior = prior_link(sc.planning, sc.adapt)
        self.prior_down = prior.downlink_bps
        self.rtt = 2.0 * self.delay
        self.estimates = LinkEstimates(
            n, prior.uplink_bps, self.rtt, sc.adapt.link_half_life_s, sc.adapt.min_rate_bytes
        )
        edge_by_group = [
            {
                c: (sc.costs[c].edge_s * g.edge_scale)
                for c in self.cut_ids
                if sc.costs[c].kind != "none"
            }
            for g in groups
        ]
        self.choosers = Choosers(
            sc.costs,
            sc.start_cut,
            sc.adapt,
            edge_by_group,
            self.group_of,
            self.prior_down,
            exact=exact,
        )
        cloud = sc.cloud
        rows = cloud.batching.max_batch_size
        tables = {c: lat.table(rows) for c, lat in cloud.latency.items()}
        names = [f"device-{i}" for i in range(n)] if cloud.overload.device_rate > 0 else []
        cloud_seeds = r_cloud.integers(0, 2**31, cloud.replicas)
        self.replicas = [
            Replica(
                cloud.batching,
                cloud.overload,
                self.cut_ids,
                tables,
                jitter=cloud.jitter,
                seed=int(s),
                exact=exact,
                devices=names,
            )
            for s in cloud_seeds
        ]
        self.r_dev, self.r_route, self.r_jit = r_dev, r_route, r_jit
        self.sticky = r_route.integers(0, cloud.replicas, n)
        self.rr = 0
        # per device: the end of its last compute, upload and download (time, bytes, bytes)
        self.dev_free = np.full(n, -math.inf)
        self.up_pos = np.zeros(n)
        self.down_pos = np.zeros(n)
        rate = sum(g.count * g.arrivals.rate for g in groups if g.arrivals.kind == "poisson")
        self.req = Requests.empty(int(rate * sc.duration_s * 1.02) + 1024)
        # per replica, arrivals not yet taken: rows time, request, cut, deadline, device
        self.pending = [np.zeros((5, 0)) for _ in self.replicas]
        self.feedback: list[np.ndarray] = []  # rows: device, reply, bits, y, load, at
        self.switch_times: list[float] = []
        self.switches = 0

    # -- one period ---------------------------------------------------------------------
    def _new_requests(self, a: float, b: float) -> tuple[I64, F64]:
        devs, times = [], []
        for arrivals in self.arrivals:
            d, t = arrivals.between(a, b)
            devs.append(d)
            times.append(t)
        dev = np.concatenate(devs).astype(np.int64)
        t = np.concatenate(times)
        order = np.argsort(t, kind="stable")
        return dev[order], t[order]

    def _apply_feedback(self, now: float) -> None:
        if not self.feedback:
            self.estimates.update(np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0), now)
            return
        fb = np.concatenate(self.feedback, axis=1)
        due = fb[1] < now
        self.feedback = [fb[:, ~due]] if (~due).any() else []
        fb = fb[:, due]
        dev = fb[0].astype(np.int64)
        self.estimates.update(dev, fb[1], fb[2], fb[3], now)
        if dev.size:  # the latest answer per device carries the load it sees
            order = np.lexsort((fb[1], dev))
            last = order[np.r_[dev[order][1:] != dev[order][:-1], True]]
            self.choosers.observe_load(dev[last], fb[4, last], fb[1, last])

    def _admit(self, a: float, b: float) -> None:
        dev, t = self._new_requests(a, b)
        n = dev.size
        if n == 0:
            return
        uniq, counts = np.unique(dev, return_counts=True)
        est = self.estimates.uplink_bps[uniq]
        switched = self.choosers.decide(uniq, counts, est, self.rtt[uniq], a)
        if switched:
            self.switches += switched
            self.switch_times.extend([a] * switched)
        cut = self.choosers.current[dev]
        service = self.edge[cut] * self.scale[dev]
        jitter = self.sigma[dev] > 0
        if jitter.any():
            service[jitter] *= self.r_jit.lognormal(0.0, self.sigma[dev][jitter])
        _, done = fifo(dev, t, service, self.dev_free)
        req = self.req
        req.reserve(n)
        ids = np.arange(req.n, req.n + n)
        req.n += n
        req.arrival[ids] = t
        req.device[ids] = dev
        req.cut[ids] = cut
        req.parts[0, ids] = done - t
        local = self.kind_all[cut]
        if local.any():
            req.outcome[ids[local]] = LOCAL
            req.e2e[ids[local]] = (done - t)[local]
        go = ~local
        if not go.any():
            return
        ids, dev, cut, done, t = ids[go], dev[go], cut[go], done[go], t[go]
        sent = transfer(self.upcap, dev, done, self.up[cut], self.up_pos)
        arrive = sent + self.delay[dev] + self.decode[cut]
        req.parts[1, ids] = arrive - done
        req.submit[ids] = arrive
        self._route(ids, dev, cut, arrive, t)

    def _route(self, ids: I64, dev: I64, cut: I64, arrive: F64, t: F64) -> None:
        r = len(self.replicas)
        routing = self.sc.cloud.routing
        if routing == "device":
            which = self.sticky[dev]
        elif routing == "random":
            which = self.r_route.integers(0, r, ids.size)
        else:
            order = np.argsort(arrive, kind="stable")
            which = np.empty(ids.size, np.int64)
            which[order] = (self.rr + np.arange(ids.size)) % r
            self.rr = (self.rr + ids.size) % r
        deadline = t + self.timeout[dev]
        rows = np.stack([arrive, ids, cut, deadline, dev])  # float64 holds the integers exactly
        for k in range(r):
            m = which == k
            if m.any():
                self.pending[k] = np.concatenate([self.pending[k], rows[:, m]], axis=1)

    def _cloud(self, horizon: float) -> None:
        deadlines = self.sc.cloud.deadlines
        outs = []
        for k, replica in enumerate(self.replicas):
            rows = self.pending[k]
            rows = rows[:, np.argsort(rows[0], kind="stable")]
            take = int(np.searchsorted(rows[0], horizon, side="left"))
            now = rows[:, :take]
            out = replica.advance(
                now[0].tolist(),
                now[1].astype(np.int64).tolist(),
                now[2].astype(np.int64).tolist(),
                now[3].tolist() if deadlines else None,
                now[4].astype(np.int64).tolist(),
                horizon,
            )
            self.pending[k] = rows[:, take:]
            outs.append(out)
        self._answers(outs)  # together: each device's downlink serves its answers in order

    def _answers(self, outs: list[Finished]) -> None:
        req = self.req
        if any(out.rows for out in outs):
            batches = np.concatenate(
                [
                    np.array([np.full(len(o.rows), k), o.started, o.ended, o.rows, o.cut, o.load])
                    for k, o in enumerate(outs)
                    if o.rows
                ],
                axis=1,
            )
            self._batches.append(batches[:5])
            rows = batches[3].astype(np.int64)
            ids = np.concatenate([np.asarray(o.ids, np.int64) for o in outs])
            start = np.repeat(batches[1], rows)
            end = np.repeat(batches[2], rows)
            load = np.repeat(batches[5], rows)
            dev = req.device[ids].astype(np.int64)
            cut = req.cut[ids].astype(np.int64)
            t = req.arrival[ids]
            submit = req.submit[ids]
            sent = transfer(self.downcap, dev, end, self.down[cut], self.down_pos)
            reply = sent + self.delay[dev]
            req.parts[2, ids] = start - submit
            req.parts[3, ids] = end - start
            req.parts[4, ids] = reply - end
            e2e = reply - t
            late = e2e > self.timeout[dev]
            ok = ~late
            req.outcome[ids[ok]] = CLOUD
            req.e2e[ids[ok]] = e2e[ok]
            self._fallback(ids[late], dev[late], t[late] + self.timeout[dev[late]], late=True)
            # the agent's network time: elapsed - Server-Timing - download at the prior
            y = (reply - end) + req.parts[1, ids] - self.decode[cut]
            y -= self.down[cut] * 8 / self.prior_down
            self.feedback.append(
                np.array([dev[ok], reply[ok], self.up[cut[ok]] * 8, y[ok], load[ok]])
            )
        refused = [i for o in outs for i in o.refused]
        if refused:
            ids = np.asarray(refused, np.int64)
            dev = req.device[ids].astype(np.int64)
            back = np.asarray([t for o in outs for t in o.refused_at]) + self.delay[dev]
            self._fallback(ids, dev, back, late=False)

    def _fallback(self, ids: I64, dev: I64, at: F64, late: bool) -> None:
        if ids.size == 0:
            return
        req = self.req
        fb = self.fallback[dev]
        req.outcome[ids] = np.where(
            fb, FALLBACK_LATE if late else FALLBACK_REFUSED, LATE if late else REFUSED
        )
        e2e = at + self.local[dev] - req.arrival[ids]
        req.e2e[ids] = np.where(fb, e2e, np.nan)

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> FleetRun:
        import time

        wall = time.perf_counter()
        sc = self.sc
        every = sc.decide_every_s
        self._batches: list[np.ndarray] = []
        periods = math.ceil(sc.duration_s / every)
        k = 0
        while True:
            a = k * every
            b = a + every
            self._apply_feedback(a)
            if k < periods:
                self._admit(a, min(b, sc.duration_s))
            self._cloud(b)
            k += 1
            if k % max(1, periods // 20) == 0 and k <= periods:
                self.progress(
                    f"{a + every:.0f} of {sc.duration_s:.0f} simulated s, {self.req.n:,} requests"
                )
            if (
                k >= periods
                and all(p.shape[1] == 0 for p in self.pending)
                and all(r.idle for r in self.replicas)
            ):
                break
        self.choosers.flush()
        self.req.trim()
        cols = np.concatenate(self._batches, axis=1) if self._batches else np.zeros((5, 0))
        batches = {
            "replica": cols[0].astype(np.int64),
            "start": cols[1],
            "end": cols[2],
            "rows": cols[3].astype(np.int64),
            "cut": cols[4].astype(np.int64),
        }
        return FleetRun(
            scenario=sc,
            requests=self.req,
            batches=batches,
            switches=self.switches,
            switch_times=np.asarray(self.switch_times),
            busy_s=[r.busy_s for r in self.replicas],
            chooser_calls=self.choosers.calls,
            degraded=self.degraded,
            wall_s=time.perf_counter() - wall,
        )


def run_fleet(
    sc: FleetScenario, *, exact: bool = False, progress: Callable[[str], None] | None = None
) -> FleetRun:
    """Simulate ``sc``; deterministic for its seed."""
    return FleetSim(sc, exact=exact, progress=progress).run()
