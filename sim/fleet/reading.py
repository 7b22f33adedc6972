"""Reading a fleet scenario's TOML (the format: :mod:`splitinfer.sim.fleet.scenario`)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from splitinfer.cloud.config import BatchingConfig, OverloadConfig
from splitinfer.edge.config import AdaptConfig
from splitinfer.shared.costs import CutCost
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.links import parse_rate
from splitinfer.shared.options import build, load_toml
from splitinfer.shared.profiles import BUILTIN
from splitinfer.sim import traces
from splitinfer.sim.fleet.scenario import (
    ARRIVAL_KINDS,
    ROUTINGS,
    Arrivals,
    BatchLatency,
    CloudSpec,
    Degradation,
    DeviceGroup,
    FleetScenario,
    LinkSpec,
    parse_span,
)

_TOP = {
    "name",
    "seed",
    "duration",
    "decide_every",
    "package",
    "devices",
    "degrade",
    "adapt",
    "cloud",
}
_GROUP = {
    "count",
    "profile",
    "edge_scale",
    "jitter",
    "fallback",
    "request_timeout",
    "arrivals",
    "uplink",
    "downlink",
    "delay",
}
_CLOUD = {
    "profile",
    "replicas",
    "routing",
    "deadlines",
    "jitter",
    "batch_latency",
    "batching",
    "overload",
}
_CUT_TIMES = ("edge", "encode", "cloud", "decode")


def load_fleet(path: Path | str, warn: Callable[[str], None] | None = None) -> FleetScenario:
    """Read a fleet scenario TOML file; paths in it are relative to its folder."""
    path = Path(path)
    return fleet_from_dict(load_toml(path, "fleet scenario"), path.parent, str(path), warn)


def fleet_from_dict(
    doc: Mapping[str, Any],
    base: Path,
    where: str = "fleet scenario",
    warn: Callable[[str], None] | None = None,
) -> FleetScenario:
    _known(doc, _TOP, where)
    say = warn or (lambda _m: None)
    pkg = _table(doc, "package", where)
    costs, start, local, planning, source = _package(pkg, base, f"{where}: [package]")
    groups_raw = doc.get("devices")
    if not isinstance(groups_raw, list) or not groups_raw:
        raise ConfigError(f"{where}: give at least one [[devices]] table")
    groups = tuple(
        _group(g, base, f"{where}: [[devices]] #{i + 1}") for i, g in enumerate(groups_raw)
    )
    planned_edge = str(planning.get("edge_profile", ""))
    for g in groups:
        if g.profile and planned_edge and g.profile != planned_edge and g.edge_scale == 1.0:
            say(
                f"{where}: devices of profile {g.profile!r} run the package's times, planned for "
                f"{planned_edge!r}; set edge_scale to rescale them"
            )
        if g.fallback and local is None:
            raise ConfigError(
                f"{where}: [[devices]] fallback = true, but the package has no local model "
                "(partition --edge-fallback) or no all-edge time; set fallback = false or "
                '[package] local = "40ms"'
            )
    degradations = tuple(
        _degradation(d, f"{where}: [[degrade]] #{i + 1}")
        for i, d in enumerate(doc.get("degrade", []))
    )
    spans = sorted((d.start_s, d.end_s) for d in degradations)
    for (_, a_end), (b_start, _) in itertools.pairwise(spans):
        if b_start < a_end:
            raise ConfigError(f"{where}: [[degrade]] windows overlap; give them apart in time")
    cloud = _cloud(_table(doc, "cloud", where), costs, planning, where, say)
    adapt = build(AdaptConfig, _table(doc, "adapt", where), f"{where}: [adapt]")
    seed = doc.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"{where}: seed={seed!r} must be an integer")
    duration = parse_span(doc.get("duration", "60s"), f"{where}: duration")
    every = parse_span(doc.get("decide_every", "2s"), f"{where}: decide_every")
    if duration <= 0 or every <= 0:
        raise ConfigError(f"{where}: duration and decide_every must be > 0")
    return FleetScenario(
        name=str(doc.get("name", "fleet")),
        seed=seed,
        duration_s=duration,
        decide_every_s=every,
        costs=costs,
        start_cut=start,
        local_s=local,
        groups=groups,
        degradations=degradations,
        cloud=cloud,
        adapt=adapt,
        planning=planning,
        source=source,
    )


def _known(table: Mapping[str, Any], keys: set[str], where: str) -> None:
    unknown = sorted(set(table) - keys)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(keys))})")


def _table(doc: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = doc.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: [{key}] must be a table")
    return value


def _number(value: Any, name: str, low: float = 0.0) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value >= low:
        raise ConfigError(f"{name}={value!r} must be a number >= {low:g}")
    return float(value)


def _package(
    pkg: Mapping[str, Any], base: Path, where: str
) -> tuple[dict[str, CutCost], str, float | None, dict[str, Any], str]:
    """(costs by cut in package order, start cut, local seconds, planning, source)."""
    _known(pkg, {"manifest", "cuts", "start", "local", "fallback"}, where)
    local = parse_span(pkg["local"], f"{where} local") if "local" in pkg else None
    if "manifest" in pkg:
        from splitinfer.edge.model import cut_cost
        from splitinfer.shared.manifest import Manifest

        path = base / str(pkg["manifest"])
        file = path / "manifest.json" if path.is_dir() else path
        try:
            manifest = Manifest.from_dict(json.loads(file.read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{where}: cannot read {file}: {exc}") from None
        costs = {}
        for cut in manifest.cuts:
            cost = cut_cost(cut)
            if cost is None:
                raise ConfigError(f"{where}: cut {cut.id} of {file} has no predicted cost")
            costs[cut.id] = cost
        start = str(pkg.get("start", manifest.default_cut))
        planning = dict(manifest.planning)
        if local is None and manifest.fallback is not None:
            local = _all_edge_seconds(costs, planning)
        source = str(file)
    else:
        cuts = pkg.get("cuts")
        if not isinstance(cuts, list) or not cuts:
            raise ConfigError(f"{where}: give manifest = PATH or [[package.cuts]] tables")
        costs = {}
        for i, raw in enumerate(cuts):
            cost = _cut(raw, f"{where} cuts[{i}]")
            costs[cost.cut_id] = cost
        start = str(pkg.get("start", next(iter(costs))))
        planning = {}
        if local is None and pkg.get("fallback", False):
            local = _all_edge_seconds(costs, planning)
        source = "cost model in the scenario"
    if start not in costs:
        raise ConfigError(f"{where}: start cut {start!r} is not among {', '.join(costs)}")
    return costs, start, local, planning, source


def _all_edge_seconds(costs: Mapping[str, CutCost], planning: Mapping[str, Any]) -> float | None:
    """The whole model's seconds on the device: the all-edge cut's, from the candidates or
    the planning table."""
    for cost in costs.values():
        if cost.kind == "all":
            return cost.edge_s + cost.encode_s
    for row in planning.get("table", []):
        if isinstance(row, Mapping) and row.get("kind") == "all":
            return float(row.get("edge_ms", 0.0)) / 1000.0
    return None


def _cut(raw: Any, where: str) -> CutCost:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: must be a table")
    _known(raw, {"id", "kind", "up_bytes", "down_bytes", "batch", *_CUT_TIMES}, where)
    times = {k: parse_span(raw[k], f"{where} {k}") if k in raw else 0.0 for k in _CUT_TIMES}
    batch = raw.get("batch", {})
    if not isinstance(batch, Mapping):
        raise ConfigError(f'{where}: batch must be a table {{ 8 = "3ms" }}')
    pairs = tuple((int(b), parse_span(s, f"{where} batch.{b}")) for b, s in batch.items())
    return CutCost(
        cut_id=str(raw.get("id", "")),
        kind=str(raw.get("kind", "split")),
        up_bytes=int(raw.get("up_bytes", 0)),
        down_bytes=int(raw.get("down_bytes", 0)),
        cloud_batch_s=pairs,
        edge_s=times["edge"],
        encode_s=times["encode"],
        cloud_s=times["cloud"],
        decode_s=times["decode"],
    )


def _direction(value: Any, base: Path, where: str) -> LinkSpec:
    if isinstance(value, str):
        if value.strip().lower() in {"unlimited", "none", "inf"}:
            return LinkSpec("unlimited")
        if any(value.endswith(s) for s in (".up", ".down")) or "/" in value:
            return LinkSpec("traces", (_trace(value, base, where),))
        return LinkSpec("rate", rate_bps=parse_rate(value, where))
    if isinstance(value, Mapping):
        _known(value, {"traces", "offset"}, where)
        names = value.get("traces")
        if isinstance(names, str):
            names = [names]
        if not isinstance(names, list) or not names:
            raise ConfigError(f"{where}: traces must list trace files")
        offset = value.get("offset", "random")
        off = None if offset == "random" else parse_span(offset, f"{where} offset")
        return LinkSpec("traces", tuple(_trace(str(n), base, where) for n in names), offset_s=off)
    raise ConfigError(f'{where}: give a rate ("20mbit"), "unlimited", or {{ traces = [...] }}')


def _trace(name: str, base: Path, where: str) -> Path:
    local = base / name
    if local.is_file():
        return local
    try:
        return traces.path(name)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _group(raw: Any, base: Path, where: str) -> DeviceGroup:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: must be a table")
    _known(raw, _GROUP, where)
    count = raw.get("count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ConfigError(f"{where}: count={count!r} must be an integer >= 1")
    arrivals = raw.get("arrivals", {})
    if not isinstance(arrivals, Mapping):
        raise ConfigError(f"{where}: arrivals must be a table")
    _known(arrivals, {"kind", "rate", "file"}, f"{where} arrivals")
    kind = arrivals.get("kind", "poisson")
    if kind not in ARRIVAL_KINDS:
        raise ConfigError(f"{where}: arrivals kind {kind!r}, use one of {', '.join(ARRIVAL_KINDS)}")
    file = None
    if kind == "trace":
        if "file" not in arrivals:
            raise ConfigError(f'{where}: arrivals kind = "trace" needs file = PATH')
        file = base / str(arrivals["file"])
    profile = str(raw.get("profile", ""))
    if profile and (profile not in BUILTIN or BUILTIN[profile].kind != "edge"):
        edges = ", ".join(n for n, p in BUILTIN.items() if p.kind == "edge")
        raise ConfigError(f"{where}: profile {profile!r} is not a built-in edge profile ({edges})")
    return DeviceGroup(
        count=count,
        uplink=_direction(raw.get("uplink", "unlimited"), base, f"{where} uplink"),
        downlink=_direction(raw.get("downlink", "unlimited"), base, f"{where} downlink"),
        delay_s=parse_span(raw.get("delay", "0s"), f"{where} delay"),
        arrivals=Arrivals(kind, _number(arrivals.get("rate", 0.5), f"{where} rate"), file),
        profile=profile,
        edge_scale=_number(raw.get("edge_scale", 1.0), f"{where} edge_scale"),
        jitter=_number(raw.get("jitter", 0.0), f"{where} jitter"),
        fallback=bool(raw.get("fallback", False)),
        request_timeout_s=parse_span(raw.get("request_timeout", "10s"), f"{where} request_timeout"),
    )


def _degradation(raw: Any, where: str) -> Degradation:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: must be a table")
    _known(raw, {"share", "start", "end", "factor", "direction"}, where)
    out = Degradation(
        share=_number(raw.get("share", 1.0), f"{where} share"),
        start_s=parse_span(raw.get("start", "0s"), f"{where} start"),
        end_s=parse_span(raw.get("end", "0s"), f"{where} end"),
        factor=_number(raw.get("factor", 0.0), f"{where} factor"),
        direction=str(raw.get("direction", "uplink")),
    )
    if not (0 < out.share <= 1 and out.end_s > out.start_s and out.factor <= 1):
        raise ConfigError(f"{where}: need 0 < share <= 1, end > start and 0 <= factor <= 1")
    if out.direction not in {"uplink", "downlink"}:
        raise ConfigError(f"{where}: direction {out.direction!r}: uplink or downlink")
    return out


def _cloud(
    raw: Mapping[str, Any],
    costs: Mapping[str, CutCost],
    planning: Mapping[str, Any],
    where: str,
    say: Callable[[str], None],
) -> CloudSpec:
    _known(raw, _CLOUD, f"{where}: [cloud]")
    name = str(raw.get("profile", planning.get("cloud_profile", "l4")))
    profile = BUILTIN.get(name)
    if profile is None or profile.kind != "cloud" or profile.cost_per_hour is None:
        clouds = ", ".join(n for n, p in BUILTIN.items() if p.kind == "cloud")
        raise ConfigError(f"{where}: [cloud] profile {name!r} is not a built-in cloud ({clouds})")
    table = raw.get("batch_latency", {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: [cloud] batch_latency must be a table per cut")
    planned = planning.get("cloud_profile")
    if not table and planned and planned != name:
        raise ConfigError(
            f"{where}: the package's cloud times were planned for {planned!r}, not {name!r}; "
            "give [cloud] batch_latency (a measured table) or re-partition for that profile"
        )
    latency: dict[str, BatchLatency] = {}
    for cut_id, cost in costs.items():
        if cost.kind == "all":
            continue
        if cut_id in table:
            points = tuple(
                (int(b), parse_span(s, f"{where}: batch_latency.{cut_id}.{b}"))
                for b, s in table[cut_id].items()
            )
        else:
            points = ((1, cost.cloud_s), *cost.cloud_batch_s)
        latency[cut_id] = BatchLatency(points)
    for cut_id in table:
        if cut_id not in latency:
            raise ConfigError(f"{where}: batch_latency names {cut_id!r}, not a cloud cut")
    replicas = raw.get("replicas", 1)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ConfigError(f"{where}: [cloud] replicas={replicas!r} must be an integer >= 1")
    routing = str(raw.get("routing", "round-robin"))
    if routing not in ROUTINGS:
        raise ConfigError(f"{where}: [cloud] routing {routing!r}: one of {', '.join(ROUTINGS)}")
    return CloudSpec(
        profile=name,
        price_per_hour=float(profile.cost_per_hour),
        replicas=replicas,
        batching=build(
            BatchingConfig, _table(raw, "batching", where), f"{where}: [cloud.batching]"
        ),
        overload=build(
            OverloadConfig, _table(raw, "overload", where), f"{where}: [cloud.overload]"
        ),
        latency=latency,
        routing=routing,
        deadlines=bool(raw.get("deadlines", False)),
        jitter=_number(raw.get("jitter", 0.0), f"{where}: [cloud] jitter"),
    )
