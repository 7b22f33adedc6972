"""The measured per-node profile and its JSON file (``splitinfer.node-profile``).

A profile holds, for each measured batch size, the median seconds each node of
the optimized graph took for the whole batch, the median wall time of a whole
run, and the time that could not be attributed to any node. See
``docs/profiles.md`` for the file format. Shared: the partitioner reads and writes
profiles, the edge agent measures and emulates devices with them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from splitinfer.shared.errors import ConfigError
from splitinfer.shared.manifest import PRECISIONS

FORMAT = "splitinfer.node-profile"
FORMAT_VERSION = 1
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

MetaValue = str | int | float | bool | None


def _is_time(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


@dataclass(frozen=True)
class NodeProfile:
    """Measured seconds per node, per batch size, on one device and runtime."""

    device: str
    batch_sizes: tuple[int, ...]
    #: batch size -> node name -> median seconds for the whole batch
    times: dict[int, dict[str, float]]
    #: batch size -> median wall seconds of one ``session.run`` (profiler off)
    wall: dict[int, float]
    #: batch size -> median seconds of runtime nodes that map to no graph node
    unattributed_s: dict[int, float]
    runtime: str = "onnxruntime-cpu"
    source_sha256: str | None = None
    #: precision of the measured model (int8 for a QDQ model), if known
    precision: str | None = None
    #: how it was measured: runs, threads, onnxruntime version, ...
    meta: dict[str, MetaValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        batches = tuple(self.batch_sizes)
        object.__setattr__(self, "batch_sizes", batches)
        if not batches or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in batches
        ):
            raise ConfigError(f"batch sizes {list(batches)}: need one or more positive integers")
        if list(batches) != sorted(set(batches)):
            raise ConfigError(f"batch sizes {list(batches)}: must be increasing, each once")
        if not isinstance(self.device, str) or not self.device:
            raise ConfigError("device: must be a non-empty string")
        if not isinstance(self.runtime, str) or not self.runtime:
            raise ConfigError("runtime: must be a non-empty string")
        if self.source_sha256 is not None and (
            not isinstance(self.source_sha256, str) or not _SHA256.match(self.source_sha256)
        ):
            raise ConfigError(
                f"source_sha256 {self.source_sha256!r}: must be 64 lowercase hex digits or null"
            )
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        for label, table in (("wall", self.wall), ("unattributed_s", self.unattributed_s)):
            if set(table) != set(batches):
                raise ConfigError(f"{label}: batch sizes {sorted(table)} != {list(batches)}")
            for b, x in table.items():
                if not _is_time(x):
                    raise ConfigError(
                        f"{label} at batch {b} is {x!r}; times must be non-negative seconds"
                    )
        if set(self.times) != set(batches):
            raise ConfigError(f"times: batch sizes {sorted(self.times)} != {list(batches)}")
        names = set(self.times[batches[0]])
        for b in batches:
            if set(self.times[b]) != names:
                raise ConfigError(f"times: batch {b} names other nodes than batch {batches[0]}")
            for name, x in self.times[b].items():
                if not isinstance(name, str) or not name:
                    raise ConfigError(f"times: node name {name!r} must be a non-empty string")
                if not _is_time(x):
                    raise ConfigError(
                        f"node {name!r} time at batch {b} is {x!r}; "
                        "times must be non-negative seconds"
                    )

    @property
    def nodes(self) -> list[str]:
        return list(self.times[self.batch_sizes[0]])

    @property
    def overhead_s(self) -> dict[int, float]:
        """Wall time not spent in any node (framework, copies, Python): wall - sum."""
        return {b: self.wall[b] - sum(self.times[b].values()) for b in self.batch_sizes}

    def times_at(self, batch: int) -> tuple[dict[str, float], str | None]:
        """Node times for ``batch`` samples and a note when it was not measured.

        Between two measured batch sizes each node's time is interpolated
        linearly; outside the measured range it is scaled in proportion to the
        batch from the nearest measured one.
        """
        if batch < 1:
            raise ConfigError(f"batch {batch}: must be a positive integer")
        if batch in self.times:
            return dict(self.times[batch]), None
        below = [b for b in self.batch_sizes if b < batch]
        above = [b for b in self.batch_sizes if b > batch]
        if below and above:
            lo, hi = below[-1], above[0]
            f = (batch - lo) / (hi - lo)
            t_lo, t_hi = self.times[lo], self.times[hi]
            times = {n: t_lo[n] + f * (t_hi[n] - t_lo[n]) for n in t_lo}
            return times, f"batch {batch} interpolated between measured batches {lo} and {hi}"
        ref = below[-1] if below else above[0]
        scale = batch / ref
        times = {n: t * scale for n, t in self.times[ref].items()}
        return times, f"batch {batch} scaled linearly from measured batch {ref}"

    # -- JSON -------------------------------------------------------------

    def to_json(self) -> str:
        """The profile as JSON text: one line per field, one line per node."""
        batches = list(self.batch_sizes)
        head = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "device": self.device,
            "runtime": self.runtime,
            "precision": self.precision,
            "source_sha256": self.source_sha256,
            "batch_sizes": batches,
            "wall_s": [self.wall[b] for b in batches],
            "unattributed_s": [self.unattributed_s[b] for b in batches],
        }
        fields = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in head.items()]
        nodes = ",\n".join(
            f"    {json.dumps(n)}: {json.dumps([self.times[b][n] for b in batches])}"
            for n in self.nodes
        )
        fields.append('  "nodes": {\n' + nodes + "\n  }" if nodes else '  "nodes": {}')
        fields.append(f'  "meta": {json.dumps(dict(self.meta))}')
        return "{\n" + ",\n".join(fields) + "\n}\n"

    @classmethod
    def from_json(cls, text: str, origin: str = "node profile") -> NodeProfile:
        """Parse a profile; any problem is a one-line :class:`ConfigError` naming ``origin``."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{origin}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
            ) from None
        try:
            return cls._from_doc(doc)
        except ConfigError as exc:
            raise ConfigError(f"{origin}: {exc}") from None

    @classmethod
    def _from_doc(cls, doc: object) -> NodeProfile:
        if not isinstance(doc, dict):
            raise ConfigError("not a JSON object")
        fmt = doc.get("format")
        if fmt != FORMAT:
            raise ConfigError(f"format {fmt!r} is not {FORMAT!r}; not a measured node profile")
        version = doc.get("format_version")
        if version != FORMAT_VERSION or isinstance(version, bool):
            raise ConfigError(
                f"format_version {version!r} is not supported (this splitinfer reads "
                f"version {FORMAT_VERSION}); re-measure the profile with this version"
            )
        missing = [
            k
            for k in ("device", "batch_sizes", "wall_s", "unattributed_s", "nodes")
            if k not in doc
        ]
        if missing:
            raise ConfigError(f"missing field {missing[0]!r}")
        batches = doc["batch_sizes"]
        if not isinstance(batches, list):
            raise ConfigError(f"batch_sizes {batches!r}: must be a list of positive integers")
        n = len(batches)
        per_batch: dict[str, list[object]] = {}
        for key in ("wall_s", "unattributed_s"):
            values = doc[key]
            if not isinstance(values, list) or len(values) != n:
                raise ConfigError(f"{key}: must be a list of {n} numbers, one per batch size")
            per_batch[key] = values
        nodes = doc["nodes"]
        if not isinstance(nodes, dict):
            raise ConfigError("nodes: must be an object of node name -> list of seconds")
        for name, values in nodes.items():
            if not isinstance(values, list) or len(values) != n:
                raise ConfigError(
                    f"node {name!r}: must be a list of {n} numbers, one per batch size"
                )
        meta = doc.get("meta", {})
        if not isinstance(meta, dict) or not all(
            isinstance(v, str | int | float | bool) or v is None for v in meta.values()
        ):
            raise ConfigError("meta: must be an object of plain values")
        try:
            times = {
                b: {name: values[j] for name, values in nodes.items()}
                for j, b in enumerate(batches)
            }
            wall = dict(zip(batches, per_batch["wall_s"], strict=True))
            unattributed = dict(zip(batches, per_batch["unattributed_s"], strict=True))
        except TypeError:  # an unhashable batch size
            raise ConfigError(
                f"batch_sizes {batches!r}: must be a list of positive integers"
            ) from None
        return cls(
            device=doc["device"],
            batch_sizes=tuple(batches),
            times=times,  # checked in __post_init__
            wall=wall,
            unattributed_s=unattributed,
            runtime=doc.get("runtime", "onnxruntime-cpu"),
            source_sha256=doc.get("source_sha256"),
            precision=doc.get("precision"),
            meta=meta,
        )

    def save(self, path: Path | str) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load(cls, path: Path | str) -> NodeProfile:
        path = Path(path)
        if not path.exists():
            raise ConfigError(
                f"profile {path}: no such file (measure one with `edge-agent profile`, "
                "or name a built-in device profile)"
            )
        if not path.is_file():
            raise ConfigError(f"profile {path}: not a file")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
            raise ConfigError(f"profile {path}: cannot read it ({reason})") from None
        return cls.from_json(text, origin=f"profile {path}")
