"""The model repository on disk: ``<repo>/<model>/<version>/`` folders of split packages.

Scanning is read-only and keeps no state but a cache of file hashes. A version
folder counts only when it is complete: ``manifest.json`` parses, names this
model, and every file the cloud needs (each cut's cloud segment and codec
dictionary) is present with the sha256 the manifest records. Edge segments and
anything else in the folder are ignored, so a whole split package can be
copied in. Folders whose name starts with ``.`` are skipped: write a version
as ``.3.tmp`` and rename it to ``3`` once complete.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cachetools import LRUCache

from splitinfer.cloud.config import ModelPolicy
from splitinfer.shared.errors import PackageError
from splitinfer.shared.manifest import MANIFEST_NAME, Manifest, load_manifest, resolve_file

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class Candidate:
    """One version folder as found on disk."""

    model: str
    version: str
    path: Path
    fingerprint: str  # sha256 of manifest.json: a changed package is a new load
    manifest: Manifest | None
    problem: str = ""  # why it is incomplete; "" when complete

    @property
    def complete(self) -> bool:
        return not self.problem and self.manifest is not None


def version_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Natural order: ``2 < 10``, ``1.9 < 1.10``; digits sort before letters."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.findall(r"\d+|\D+", name)
    )


def select_versions(policy: ModelPolicy, complete: Sequence[str]) -> list[str]:
    """The versions the policy wants served, oldest first, among complete ones."""
    ordered = sorted(complete, key=version_key)
    if policy.versions == "all":
        return ordered
    if policy.versions == "list":
        wanted = set(policy.version_list)
        return [v for v in ordered if v in wanted]
    return ordered[-policy.latest :]


class HashCache:
    """sha256 of files, remembered by (path, size, mtime) so rescans are cheap."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._cache: LRUCache[tuple[str, int, int], str] = LRUCache(maxsize=max_entries)

    def sha256(self, path: Path) -> str:
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        found = self._cache.get(key)  # a hit makes it the most recent
        if found is not None:
            return found
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        digest = h.hexdigest()
        self._cache[key] = digest  # the least recent entry goes when it is full
        return digest


def scan(root: Path, hashes: HashCache) -> dict[str, list[Candidate]]:
    """Every model folder and its version folders, complete or not."""
    if not root.is_dir():
        raise PackageError(f"repository {root}: no such folder")
    found: dict[str, list[Candidate]] = {}
    for model_dir in sorted(root.iterdir()):
        if not model_dir.is_dir() or not NAME.fullmatch(model_dir.name):
            continue
        found[model_dir.name] = [
            check_version(model_dir.name, d, hashes)
            for d in sorted(model_dir.iterdir(), key=lambda p: version_key(p.name))
            if d.is_dir() and NAME.fullmatch(d.name)
        ]
    return found


def check_version(model: str, path: Path, hashes: HashCache) -> Candidate:
    """A version folder, with the reason it cannot serve if it is incomplete."""
    version = path.name
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        return Candidate(model, version, path, "", None, f"no {MANIFEST_NAME}")
    try:
        fingerprint = hashes.sha256(manifest_path)
        manifest = load_manifest(path)
    except (OSError, PackageError) as exc:
        return Candidate(model, version, path, "", None, _line(exc))
    problem = _check_files(model, path, manifest, hashes)
    return Candidate(model, version, path, fingerprint, manifest, problem)


def _check_files(model: str, path: Path, manifest: Manifest, hashes: HashCache) -> str:
    if manifest.model_name != model:
        return (
            f"manifest model_name {manifest.model_name!r} is not the folder's {model!r}; "
            f"put the package under {manifest.model_name}/<version>/"
        )
    cloud_cuts = [c for c in manifest.cuts if c.cloud is not None]
    if not cloud_cuts:
        return "no cut has a cloud segment (an all-edge package)"
    for cut in cloud_cuts:
        assert cut.cloud is not None
        try:
            file = resolve_file(path, cut.cloud.file)
            if not file.is_file():
                return f"cut {cut.id}: {cut.cloud.file} is missing"
            if hashes.sha256(file) != cut.cloud.sha256:
                return f"cut {cut.id}: {cut.cloud.file} does not match its sha256"
            if cut.codec.dictionary and not resolve_file(path, cut.codec.dictionary).is_file():
                return f"cut {cut.id}: codec dictionary {cut.codec.dictionary} is missing"
        except (OSError, PackageError) as exc:
            return f"cut {cut.id}: {_line(exc)}"
    return ""


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
