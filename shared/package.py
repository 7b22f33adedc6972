"""Reading a split package as a daemon does: verified files and the codecs of a cut.

Both daemons call :func:`open_package` before they serve anything: it reads the
manifest (format version first), then checks that every file the manifest
names exists inside the package and has the recorded sha256. A package copied
half-way, or edited after partitioning, is refused with the file named.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from splitinfer.shared.codecs import (
    FP16,
    INT4_ZSTD,
    INT8,
    INT8_ZSTD,
    JPEG,
    JPEG_QUALITY,
    PNG,
    RAW,
    Codec,
    Fp16Codec,
    Int4ZstdCodec,
    Int8Codec,
    Int8ZstdCodec,
    JpegCodec,
    PngCodec,
    QuantParams,
    RawCodec,
    ZstdCodec,
)
from splitinfer.shared.errors import CodecError, PackageError
from splitinfer.shared.manifest import (
    Cut,
    Manifest,
    QuantSpec,
    Segment,
    load_manifest,
    resolve_file,
)

#: Wire id of each codec name the manifest may give.
CODEC_IDS = {
    "raw": RAW,
    "fp16": FP16,
    "int8": INT8,
    "int8+zstd": INT8_ZSTD,
    "png": PNG,
    "jpeg": JPEG,
    "int4+zstd": INT4_ZSTD,
}


@dataclass(frozen=True)
class Package:
    """A verified split package on disk."""

    path: Path
    manifest: Manifest

    def file(self, segment: Segment) -> Path:
        return resolve_file(self.path, segment.file)

    def codec(self, cut: Cut) -> tuple[int, dict[int, Codec]]:
        """The wire id the cut's tensors travel with and a registry that decodes them.

        The registry holds every codec (a peer may fall back to raw), with the
        zstd ones set to the cut's level and dictionary.
        """
        spec = cut.codec
        dictionary = None
        if spec.dictionary is not None:
            dictionary = resolve_file(self.path, spec.dictionary).read_bytes()
        try:
            zstd = Int8ZstdCodec(level=spec.level, dictionary=dictionary)
            int4 = Int4ZstdCodec(level=spec.level, dictionary=dictionary)
        except CodecError as exc:
            raise PackageError(f"cut {cut.id}: codec: {exc}") from exc
        jpeg = JpegCodec(spec.quality if spec.quality is not None else JPEG_QUALITY)
        codecs: list[Codec] = [
            RawCodec(),
            Fp16Codec(),
            Int8Codec(),
            zstd,
            PngCodec(),
            jpeg,
            int4,
            ZstdCodec(),
        ]
        return CODEC_IDS[spec.name], {c.id: c for c in codecs}


def quant_params(cut: Cut, tensor: str) -> QuantParams | None:
    """The calibrated int8 parameters of a cut tensor, or None (compute per batch)."""
    q = cut.quant.get(tensor)
    if q is None:
        return None
    return QuantParams(scale=q.scale, zero_point=q.zero_point, axis=q.axis or 0)


def quant_spec(params: QuantParams) -> QuantSpec:
    """The manifest form of calibrated parameters (axis None when per tensor)."""
    axis = None if params.per_tensor else params.axis
    return QuantSpec(tuple(params.scale), tuple(params.zero_point), axis)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def open_package(path: Path | str, *, verify: bool = True) -> Package:
    """Load the manifest and check every file it names (existence and sha256)."""
    root = Path(path)
    manifest = load_manifest(root)
    if verify:
        segments = [s for c in manifest.cuts for s in c.segments()]
        if manifest.fallback is not None:
            segments.append(manifest.fallback)
        for seg in segments:
            file = resolve_file(root, seg.file)
            if not file.is_file():
                raise PackageError(f"{root}: {seg.file} named by the manifest is missing")
            if sha256_of(file) != seg.sha256:
                raise PackageError(
                    f"{root}: {seg.file} does not match its sha256 in the manifest "
                    "(a partial copy, or edited after partitioning)"
                )
        for cut in manifest.cuts:
            name = cut.codec.dictionary
            if name is not None and not resolve_file(root, name).is_file():
                raise PackageError(f"{root}: zstd dictionary {name} of cut {cut.id} is missing")
    return Package(root, manifest)
