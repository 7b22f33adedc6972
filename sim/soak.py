"""The soak run's logic (issue 29), pure: the fault schedule, the ledger, the answer
rules and the verdicts. ``bench/bench_soak.py`` drives real processes with it.

- :func:`schedule` turns a run's length into its faults: a hot swap every minute, a
  cloud kill every 3 minutes, a 10-30 s link outage every 2 minutes (each on the
  next device's link), and once each a 15 s SIGSTOP of the cloud, a restart of the
  nonce store and a full disk under the repository. Shorter runs are compressed
  (periods scale with the run, down to floors) so that every kind happens at least
  once; the one-off faults are placed apart from each other and from the kills.
- :class:`Ledger` holds every request each device sent, the errors its attempts
  met and its answer: from the cloud, from the device (with the agent's reason), or
  none. :meth:`Ledger.window` counts what happened in a window of run time.
- :func:`rule_of` reads a package's manifest for how its answers are judged:
  :class:`Exact` (fp32 segments over a lossless wire: ``allclose`` 1e-5) or
  :class:`Agreement` (an int8 edge, a lossy wire, privacy noise: the top-1
  agreement the package states, on how many samples).
- :func:`rss_findings`, :func:`fd_findings` and :func:`nonce_findings` judge the
  processes' samples.

No sockets, no processes, no clocks: times are passed in (seconds of run time).
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from splitinfer.shared.errors import ConfigError

FAULT_KINDS = ("hot-swap", "cloud-kill", "link-outage", "cloud-stop", "nonce-restart", "disk-full")
#: Kinds that disturb the cloud side as a whole; at most one of them at a time.
EXCLUSIVE = ("cloud-kill", "cloud-stop", "nonce-restart", "disk-full")


# -- the fault schedule -------------------------------------------------------------------


@dataclass(frozen=True)
class Cadence:
    """The faults of an hour-long run; :func:`schedule` compresses them for shorter ones."""

    swap_every_s: float = 60.0
    kill_every_s: float = 180.0
    outage_every_s: float = 120.0
    outage_min_s: float = 10.0
    outage_max_s: float = 30.0
    stop_s: float = 15.0
    #: how long the nonce store stays down before it is started again
    nonce_down_s: float = 5.0
    #: how long the repository's disk stays full
    disk_full_s: float = 20.0
    #: what a killed cloud is given to come back before the next exclusive fault
    restart_s: float = 20.0
    #: runs at least this long keep the periods above; shorter ones scale them down
    full_scale_s: float = 1200.0
    #: floors of the compressed periods
    min_swap_every_s: float = 15.0
    min_kill_every_s: float = 45.0
    min_outage_every_s: float = 30.0
    #: no fault starts in the first this-many seconds, or ends in the last
    settle_s: float = 10.0
    #: where the one-off faults aim, as fractions of the run
    stop_at: float = 0.35
    nonce_at: float = 0.55
    disk_at: float = 0.75


@dataclass(frozen=True)
class Fault:
    """One fault at ``at_s`` seconds of run time; ``device``: the link of a
    ``link-outage``."""

    at_s: float
    kind: str
    duration_s: float = 0.0
    device: int | None = None

    @property
    def end_s(self) -> float:
        return self.at_s + self.duration_s

    def describe(self) -> str:
        what = {
            "hot-swap": "hot swap: the next version written into the repository",
            "cloud-kill": "cloud killed (SIGKILL) and restarted",
            "link-outage": f"link outage on device {self.device} for {self.duration_s:.0f} s",
            "cloud-stop": f"cloud hung (SIGSTOP) for {self.duration_s:.0f} s",
            "nonce-restart": f"nonce store stopped for {self.duration_s:.0f} s and restarted",
            "disk-full": f"repository disk full for {self.duration_s:.0f} s",
        }
        return what.get(self.kind, self.kind)


def _periodic(start: float, every: float, until: float) -> list[float]:
    times, t = [], start
    while t <= until + 1e-9:
        times.append(round(t, 3))
        t += every
    return times


def _place(
    target: float, length: float, busy: Sequence[tuple[float, float]], low: float, high: float
) -> float | None:
    """The start nearest ``target`` (whole seconds) of ``[t, t + length)`` inside
    ``[low, high]`` overlapping no ``busy`` interval; None if there is none."""
    best: float | None = None
    t = math.ceil(low)
    while t + length <= high + 1e-9:
        free = all(t + length <= a or t >= b for a, b in busy)
        if free and (best is None or abs(t - target) < abs(best - target)):
            best = float(t)
        t += 1
    return best


def schedule(
    duration_s: float, devices: int, seed: int = 0, cadence: Cadence = Cadence()
) -> tuple[Fault, ...]:
    """Every fault of a run of ``duration_s`` seconds over ``devices`` links, in time
    order. A :class:`ConfigError` when the run is too short for every kind."""
    c = cadence
    if devices < 1:
        raise ConfigError(f"devices={devices!r}: a soak run needs at least one device")
    scale = min(1.0, duration_s / c.full_scale_s)
    swap = max(c.min_swap_every_s, c.swap_every_s * scale)
    kill = max(c.min_kill_every_s, c.kill_every_s * scale)
    outage = max(c.min_outage_every_s, c.outage_every_s * scale)
    last = duration_s - c.settle_s  # every fault ends by then
    rng = random.Random(f"soak:{seed}")
    faults: list[Fault] = []
    faults += [Fault(t, "hot-swap") for t in _periodic(swap, swap, last)]
    busy: list[tuple[float, float]] = []
    for t in _periodic(kill, kill, last - c.restart_s):
        faults.append(Fault(t, "cloud-kill", c.restart_s))
        busy.append((t, t + c.restart_s))
    longest = min(c.outage_max_s, outage / 2)
    shortest = min(c.outage_min_s, longest)
    for k, t in enumerate(_periodic(outage / 2, outage, last - shortest)):
        length = round(rng.uniform(shortest, longest), 1)
        length = min(length, last - t)
        faults.append(Fault(t, "link-outage", length, device=k % devices))
    guard = 5.0  # seconds of calm after each exclusive fault
    for kind, at, length in (
        ("cloud-stop", c.stop_at, c.stop_s),
        ("nonce-restart", c.nonce_at, c.nonce_down_s),
        ("disk-full", c.disk_at, c.disk_full_s),
    ):
        start = _place(at * duration_s, length + guard, busy, c.settle_s, last + guard)
        if start is None:
            raise ConfigError(
                f"a {duration_s / 60:g}-minute run has no room for the {kind} fault "
                f"({length:g} s) apart from the others: run at least 3 minutes"
            )
        faults.append(Fault(start, kind, length))
        busy.append((start, start + length + guard))
    missing = set(FAULT_KINDS) - {f.kind for f in faults}
    if missing:
        raise ConfigError(
            f"a {duration_s / 60:g}-minute run is too short for {', '.join(sorted(missing))}: "
            "run at least 3 minutes"
        )
    return tuple(sorted(faults, key=lambda f: (f.at_s, FAULT_KINDS.index(f.kind))))


def outages_of(faults: Iterable[Fault], device: int) -> tuple[tuple[float, float], ...]:
    """``(start_s, duration_s)`` of every link outage of ``device`` (a ``LinkConfig``'s
    ``outages``, when the link starts at run time 0)."""
    return tuple(
        (f.at_s, f.duration_s) for f in faults if f.kind == "link-outage" and f.device == device
    )


# -- how answers are judged -------------------------------------------------------------------

#: Wire codecs that carry a float tensor bit for bit.
LOSSLESS = ("raw",)


@dataclass(frozen=True)
class Exact:
    """Every output within ``allclose(rtol, atol)`` of the reference."""

    rtol: float = 1e-5
    atol: float = 1e-5

    def describe(self) -> str:
        return f"exact (allclose rtol {self.rtol:g}, atol {self.atol:g})"


@dataclass(frozen=True)
class Agreement:
    """The package states that ``stated`` of its ``samples`` held-out answers agree with
    the fp32 model by ``metric`` (top-1). Each answer either agrees or not. The run
    passes when its agreement is consistent with the statement at three sigma: at
    least the Wilson lower bound (z = 3) of the stated figure on its samples, less
    three standard errors of the run's own ``answers`` at that bound."""

    stated: float
    samples: int
    metric: str = "top1"
    why: str = ""
    #: answers carry fresh noise (privacy): each one is an independent draw
    noised: bool = False

    def floor(self, answers: int) -> float:
        z, n, p = 3.0, max(self.samples, 1), min(max(self.stated, 0.0), 1.0)
        centre = p + z * z / (2 * n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        lower = (centre - half) / (1 + z * z / n)
        return max(0.0, lower - z * math.sqrt(lower * (1 - lower) / max(answers, 1)))

    def holds(self, agreed: int, answers: int, independent: int | None = None) -> bool:
        """Whether ``agreed`` of ``answers`` keep the statement; ``independent``: how
        many of them are independent draws (default all; without noise an input's
        answers are all alike, so count its distinct inputs)."""
        n = answers if independent is None else independent
        return answers == 0 or agreed / answers >= self.floor(n)

    def describe(self) -> str:
        return f"top-1 agreement >= {self.stated:.3g} stated on {self.samples} ({self.why})"


Rule = Exact | Agreement


def rule_of(manifest: Mapping[str, Any], cut_id: str) -> Rule:
    """How answers through ``cut_id`` of this package are judged (see the module doc)."""
    cut = next((c for c in manifest.get("cuts", ()) if c.get("id") == cut_id), None)
    if cut is None:
        raise ConfigError(f"{manifest.get('model_name')}: no cut {cut_id!r} in the manifest")
    quality = cut.get("quality") or {}
    codec = (cut.get("codec") or {}).get("name", "raw")
    precision = (cut.get("edge") or {}).get("precision", "fp32")
    if manifest.get("privacy"):
        stated = quality.get("private") or {}
        why = f"privacy, epsilon {manifest['privacy'].get('epsilon')}"
    elif precision != "fp32" or codec not in LOSSLESS:
        stated = quality
        why = f"{precision} edge, {codec} wire"
    else:
        return Exact()
    if stated.get("metric", "top1") != "top1" or "value" not in stated:
        raise ConfigError(
            f"{manifest.get('model_name')} cut {cut_id}: the package states no top-1 agreement "
            f"for its {why}; partition it with --split auto (which measures one)"
        )
    samples = int(stated.get("samples") or quality.get("samples") or 1)
    return Agreement(float(stated["value"]), samples, "top1", why, bool(manifest.get("privacy")))


def judge(rule: Rule, got: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray]) -> str:
    """``ok``, ``wrong`` (an exact rule broken, or an output missing or misshapen) or
    ``disagree`` (another top-1 under an agreement rule)."""
    for name, want in ref.items():
        have = got.get(name)
        if have is None or np.shape(have) != np.shape(want):
            return "wrong"
        if isinstance(rule, Exact):
            if not np.allclose(have, want, rtol=rule.rtol, atol=rule.atol):
                return "wrong"
        elif not np.array_equal(np.argmax(have, axis=-1), np.argmax(want, axis=-1)):
            return "disagree"
    return "ok"


# -- the ledger --------------------------------------------------------------------------------

OUTCOMES = ("pending", "cloud", "local", "failed")
_NUMBERS = re.compile(r"\d+(\.\d+)?")
_URL = re.compile(r"https?://\S+")


def error_kind(text: str) -> str:
    """An error line reduced to its kind: the HTTP status kept, URLs, numbers and
    everything from the first parenthesis on dropped, at most 60 characters
    (``503: no cloud endpoint answered``)."""
    m = re.match(r"^(\d{3}): (.*)$", text.strip(), re.S)
    status, rest = (m.group(1) + ": ", m.group(2)) if m else ("", text)
    rest = _NUMBERS.sub("N", _URL.sub("URL", rest).split("(")[0])
    rest = " ".join(rest.split()).strip(" ;:,")
    return (status + rest)[:60].strip() or "empty error"


@dataclass
class Entry:
    """One request of one device, from its first send to its answer."""

    device: int
    model: str
    seq: int
    sample: int
    sent_s: float
    attempts: int = 0
    errors: list[tuple[float, str]] = field(default_factory=list)
    outcome: str = "pending"
    done_s: float | None = None
    version: str = ""
    cut: str = ""
    reason: str = ""
    verdict: str = ""

    @property
    def latency_s(self) -> float | None:
        return None if self.done_s is None else self.done_s - self.sent_s

    def record(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "model": self.model,
            "seq": self.seq,
            "sample": self.sample,
            "sent_s": round(self.sent_s, 4),
            "attempts": self.attempts,
            "errors": [[round(t, 3), e] for t, e in self.errors],
            "outcome": self.outcome,
            "done_s": None if self.done_s is None else round(self.done_s, 4),
            "version": self.version,
            "cut": self.cut,
            "reason": self.reason,
            "verdict": self.verdict,
        }


@dataclass(frozen=True)
class Window:
    """What happened in ``[start_s, end_s)`` of run time."""

    index: int
    start_s: float
    end_s: float
    sent: int
    cloud: int
    local: int
    failed: int
    errors: Mapping[str, int]
    local_reasons: Mapping[str, int]
    wrong: int
    disagree: int
    p50_ms: float
    p99_ms: float


class Ledger:
    """Every device's requests, in order; each device's list is its ledger."""

    def __init__(self) -> None:
        self.devices: dict[int, list[Entry]] = {}

    def sent(self, device: int, model: str, sample: int, now_s: float) -> Entry:
        book = self.devices.setdefault(device, [])
        entry = Entry(device, model, len(book), sample, now_s)
        book.append(entry)
        return entry

    @staticmethod
    def attempt_failed(entry: Entry, error: str, now_s: float, final: bool) -> None:
        entry.attempts += 1
        entry.errors.append((now_s, error))
        if final:
            entry.outcome = "failed"
            entry.done_s = now_s

    @staticmethod
    def answered(
        entry: Entry,
        now_s: float,
        *,
        local: bool,
        verdict: str,
        version: str = "",
        cut: str = "",
        reason: str = "",
    ) -> None:
        if local and not reason:
            raise ValueError("a device's own answer needs its reason")
        entry.attempts += 1
        entry.outcome = "local" if local else "cloud"
        entry.done_s = now_s
        entry.version, entry.cut, entry.reason, entry.verdict = version, cut, reason, verdict

    def entries(self) -> list[Entry]:
        return [e for book in self.devices.values() for e in book]

    def lost(self) -> list[Entry]:
        """Requests with no answer: failed, or still pending."""
        return [e for e in self.entries() if e.outcome not in ("cloud", "local")]

    def counts(self) -> Counter[str]:
        return Counter(e.outcome for e in self.entries())

    def window(self, index: int, start_s: float, end_s: float) -> Window:
        def inside(t: float | None) -> bool:
            return t is not None and start_s <= t < end_s

        entries = self.entries()
        done = [e for e in entries if inside(e.done_s)]
        latencies = [e.latency_s for e in done if e.outcome in ("cloud", "local")]
        ms = np.asarray([x for x in latencies if x is not None], dtype=np.float64) * 1e3
        errors = Counter(error_kind(text) for e in entries for t, text in e.errors if inside(t))
        return Window(
            index=index,
            start_s=start_s,
            end_s=end_s,
            sent=sum(inside(e.sent_s) for e in entries),
            cloud=sum(e.outcome == "cloud" for e in done),
            local=sum(e.outcome == "local" for e in done),
            failed=sum(e.outcome == "failed" for e in done),
            errors=dict(errors.most_common()),
            local_reasons=dict(Counter(e.reason for e in done if e.outcome == "local")),
            wrong=sum(e.verdict == "wrong" for e in done),
            disagree=sum(e.verdict == "disagree" for e in done),
            p50_ms=float(np.percentile(ms, 50)) if ms.size else math.nan,
            p99_ms=float(np.percentile(ms, 99)) if ms.size else math.nan,
        )


def format_window(w: Window, pending: int) -> str:
    """The window's report: its counts and latency, why the device answered, the
    errors requests met."""
    errors = sum(w.errors.values())
    kinds = "; ".join(f"{k} x{n}" for k, n in list(w.errors.items())[:3])
    line = (
        f"window {w.index} [{_clock(w.start_s)}-{_clock(w.end_s)}]  sent {w.sent}  "
        f"answered {w.cloud + w.local} (cloud {w.cloud}, device {w.local})  "
        f"failed {w.failed}  pending {pending}  wrong {w.wrong}  "
        f"p50 {_ms(w.p50_ms)}  p99 {_ms(w.p99_ms)}"
    )
    if w.local_reasons:
        line += "\n  on the device: " + ", ".join(f"{r} x{n}" for r, n in w.local_reasons.items())
    if errors:
        line += f"\n  errors the applications met (then retried): {errors} ({kinds})"
    return line


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0f} ms"


def _clock(seconds: float) -> str:
    s = max(0, round(seconds))
    return f"{s // 60}:{s % 60:02d}"


# -- the processes -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One process at one time: its role (``cloud``, ``agent sim-3``, ``redis``, ...)."""

    t_s: float
    role: str
    pid: int
    rss_bytes: int
    fds: int


def series(samples: Iterable[Sample]) -> dict[tuple[str, int], list[Sample]]:
    """Samples by process (role and pid: a restarted process is a new series), in time
    order."""
    out: dict[tuple[str, int], list[Sample]] = {}
    for s in sorted(samples, key=lambda s: s.t_s):
        out.setdefault((s.role, s.pid), []).append(s)
    return out


def rss_findings(
    samples: Iterable[Sample],
    run_s: float,
    *,
    at_s: float = 600.0,
    tolerance: float = 0.10,
    min_run_s: float = 1200.0,
    exclude: Sequence[str] = (),
) -> list[str]:
    """One line per long-lived process whose last RSS is more than ``tolerance`` away
    from its RSS at ``at_s`` (the sample nearest it at or before). Only runs of at
    least ``min_run_s``; a process is long-lived when it was sampled at or before
    ``at_s`` and in the last sample round."""
    if run_s < min_run_s:
        return []
    every = series(samples)
    end = max((s.t_s for ss in every.values() for s in ss), default=0.0)
    bad = []
    for (role, pid), ss in every.items():
        if role in exclude:
            continue
        early = [s for s in ss if s.t_s <= at_s]
        if not early or ss[-1].t_s < end:
            continue
        ref, last = early[-1].rss_bytes, ss[-1].rss_bytes
        if ref > 0 and abs(last - ref) > tolerance * ref:
            bad.append(
                f"{role} (pid {pid}): RSS {last / 2**20:.1f} MB at the end vs "
                f"{ref / 2**20:.1f} MB at {_clock(early[-1].t_s)} "
                f"({(last - ref) / ref:+.0%}, bound {tolerance:.0%})"
            )
    return bad


def grows(values: Sequence[float], slack: float) -> bool:
    """A growth trend: every value of the last third above every value of the first
    third by more than ``slack``, and the least-squares slope positive. Needs three
    values."""
    if len(values) < 3:
        return False
    k = max(1, len(values) // 3)
    first, last = values[:k], values[-k:]
    slope = float(np.polyfit(np.arange(len(values)), np.asarray(values, np.float64), 1)[0])
    return min(last) > max(first) + slack and slope > 0


def fd_findings(
    samples: Iterable[Sample], slack: int = 8, exclude: Sequence[str] = (), warmup_s: float = 0.0
) -> list[str]:
    """One line per process whose open file descriptors grow across the windows
    (:func:`grows`, by more than ``slack`` or a quarter of the early maximum, whichever
    is more). Samples at or before ``warmup_s`` are left out while three remain."""
    bad = []
    for (role, pid), ss in series(samples).items():
        late = [s for s in ss if s.t_s > warmup_s]
        fds = [s.fds for s in (late if len(late) >= 3 else ss)]
        if role in exclude or not fds:
            continue
        margin = max(slack, int(0.25 * max(fds[: max(1, len(fds) // 3)])))
        if grows(fds, margin):
            bad.append(f"{role} (pid {pid}): open fds {' -> '.join(map(str, fds))}")
    return bad


def nonce_bound(peak_requests_per_s: float, attempts: int, window_s: float) -> int:
    """Most nonces the store may hold: every attempt of the busiest rate, remembered
    for the replay window (plus a second), twice over, plus a margin."""
    return math.ceil(2 * attempts * peak_requests_per_s * (window_s + 1)) + 100


def nonce_findings(sizes: Sequence[tuple[float, int | None]], bound: int) -> list[str]:
    """Lines for samples of the store's size (DBSIZE) above ``bound``, or a growth trend."""
    seen = [(t, n) for t, n in sizes if n is not None]
    bad = [f"{n} keys at {_clock(t)} (bound {bound})" for t, n in seen if n > bound]
    if grows([float(n) for _, n in seen], slack=max(10.0, 0.1 * bound)):
        bad.append("the nonce store grows: " + " -> ".join(str(n) for _, n in seen))
    return bad
