"""Export a split package's dense cloud segment as a Triton Inference Server model.

For operators who already run Triton: one cut's cloud segment becomes

    <repo>/<model>/config.pbtxt
    <repo>/<model>/<version>/model.onnx

with platform ``onnxruntime_onnx``, inputs and outputs named, typed and shaped
from the segment itself (without the batch dimension when ``max_batch_size >
0``, as Triton wants), dynamic batching (preferred sizes and queue delay,
defaulting to the cloud service's ``[batching]``), a version policy and an
instance group. The config is built as Triton's own ``ModelConfig`` protobuf
message (``tritonclient.grpc.model_config_pb2``) and printed with
``google.protobuf.text_format``, so it is valid by construction;
:func:`validate` parses a ``config.pbtxt`` back with the same schema.

Triton replaces the cloud service, not the edge: it speaks KServe v2, not the
splitinfer wire frame, so devices need a gateway that decodes frames (or the
cloud service itself) in front of it. MoE packages are refused: their MoE
layers are not ONNX.

    splitinfer-triton PACKAGE -o REPO [--cut ID] [--max-batch-size N]
                      [--max-queue-delay DURATION] [--model-version N] ...
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from splitinfer import __version__
from splitinfer.cloud.config import BatchingConfig, load_toml
from splitinfer.cloud.config import build_config as build_service_config
from splitinfer.shared.cli import (
    ArgumentParser,
    add_debug_flag,
    add_version_flag,
    examples,
    run_cli,
)
from splitinfer.shared.errors import ConfigError, PackageError
from splitinfer.shared.links import parse_duration
from splitinfer.shared.manifest import Cut, Manifest
from splitinfer.shared.options import Deprecated
from splitinfer.shared.package import Package, open_package

PROG = "splitinfer-triton"
PLATFORM = "onnxruntime_onnx"
CONFIG_NAME = "config.pbtxt"
MODEL_FILE = "model.onnx"
KINDS = {"gpu": "KIND_GPU", "cpu": "KIND_CPU", "auto": "KIND_AUTO"}
_MAX_INLINE = 1_800_000_000  # protobuf's 2 GiB limit, with room: bigger weights go external

#: ONNX tensor element type -> Triton DataType name.
TRITON_TYPES: dict[int, str] = {
    onnx.TensorProto.FLOAT: "TYPE_FP32",
    onnx.TensorProto.FLOAT16: "TYPE_FP16",
    onnx.TensorProto.BFLOAT16: "TYPE_BF16",
    onnx.TensorProto.DOUBLE: "TYPE_FP64",
    onnx.TensorProto.INT8: "TYPE_INT8",
    onnx.TensorProto.INT16: "TYPE_INT16",
    onnx.TensorProto.INT32: "TYPE_INT32",
    onnx.TensorProto.INT64: "TYPE_INT64",
    onnx.TensorProto.UINT8: "TYPE_UINT8",
    onnx.TensorProto.UINT16: "TYPE_UINT16",
    onnx.TensorProto.UINT32: "TYPE_UINT32",
    onnx.TensorProto.UINT64: "TYPE_UINT64",
    onnx.TensorProto.BOOL: "TYPE_BOOL",
    onnx.TensorProto.STRING: "TYPE_STRING",
}


def _pb() -> Any:
    """Triton's ModelConfig protobuf module (the ``triton`` extra)."""
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError as exc:
        raise ConfigError(
            "the Triton export needs tritonclient: pip install 'splitinfer[triton]' "
            f"(or tritonclient[grpc]); import failed: {exc}"
        ) from exc
    return model_config_pb2


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions Triton serves: ``latest:N``, ``all`` or ``specific:1,3``."""

    kind: str = "latest"
    latest: int = 1
    versions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("latest", "all", "specific"):
            raise ConfigError(
                f"version policy {self.kind!r}: give latest:N, all or specific:V[,V...]"
            )
        if self.kind == "latest" and self.latest < 1:
            raise ConfigError(f"version policy latest:{self.latest}: N must be >= 1")
        if self.kind == "specific" and (not self.versions or min(self.versions) < 1):
            raise ConfigError(
                "version policy specific: name one or more versions >= 1, e.g. specific:1,2"
            )

    @classmethod
    def parse(cls, text: str) -> VersionPolicy:
        kind, _, rest = text.strip().partition(":")
        try:
            if kind == "latest":
                return cls("latest", latest=int(rest or "1"))
            if kind == "specific":
                return cls("specific", versions=tuple(int(v) for v in rest.split(",") if v))
        except ValueError:
            raise ConfigError(
                f"version policy {text!r}: numbers expected, e.g. latest:2 or specific:1,3"
            ) from None
        if kind == "all" and not rest:
            return cls("all")
        return cls(kind)  # __post_init__ names the accepted forms


@dataclass(frozen=True)
class TritonOptions:
    """What goes into ``config.pbtxt`` beyond what the segment itself says.

    ``max_batch_size`` None: the cloud service's default when the segment
    batches, else 0. ``preferred_batch_sizes`` empty: ``(max_batch_size,)``.
    """

    max_batch_size: int | None = None
    max_queue_delay_us: int = int(BatchingConfig().max_queue_delay_ms * 1000)
    preferred_batch_sizes: tuple[int, ...] = ()
    version: int = 1
    policy: VersionPolicy = field(default_factory=VersionPolicy)
    instance_kind: str = "gpu"
    instance_count: int = 1
    name: str = ""  # the Triton model name; "" = the package's model name

    def __post_init__(self) -> None:
        if self.max_batch_size is not None and self.max_batch_size < 0:
            raise ConfigError(f"--max-batch-size {self.max_batch_size}: must be >= 0")
        if self.max_queue_delay_us < 0:
            raise ConfigError(f"--max-queue-delay {self.max_queue_delay_us}us: must be >= 0")
        if any(b < 1 for b in self.preferred_batch_sizes):
            raise ConfigError(
                f"--preferred-batch-size {list(self.preferred_batch_sizes)}: sizes must be >= 1"
            )
        if self.version < 1:
            raise ConfigError(f"--model-version {self.version}: Triton versions are integers >= 1")
        if self.instance_kind not in KINDS:
            raise ConfigError(f"--instance-kind {self.instance_kind!r}: one of {', '.join(KINDS)}")
        if self.instance_count < 1:
            raise ConfigError(f"--instances {self.instance_count}: must be >= 1")
        if self.name and (self.name.startswith(".") or "/" in self.name or "\\" in self.name):
            raise ConfigError(f"--name {self.name!r}: a plain folder name, no '/' or leading '.'")


@dataclass(frozen=True)
class Exported:
    """What :func:`export` wrote."""

    config_path: Path
    model_path: Path
    config: Any  # model_config_pb2.ModelConfig
    cut_id: str
    #: manifest outputs the segment does not compute (cut tensors passed through: the
    #: device already holds them, Triton does not return them)
    passthrough: tuple[str, ...] = ()


def _cut(manifest: Manifest, cut_id: str | None) -> Cut:
    cut = manifest.find_cut(cut_id or manifest.default_cut)
    if cut is None:
        raise PackageError(
            f"--cut {cut_id}: no such cut (the package has {list(manifest.cut_ids)})"
        )
    if cut.cloud is None:
        raise PackageError(
            f"cut {cut.id}: no cloud segment (an all-edge cut); "
            f"pick one of {[c.id for c in manifest.cuts if c.cloud is not None]}"
        )
    if cut.cloud.file.endswith(".json"):
        raise PackageError(
            f"cut {cut.id}: the cloud segment {cut.cloud.file} is an MoE program, not ONNX: "
            "Triton cannot run its MoE layers; serve it with cloud-service"
        )
    return cut


def _dims(value: onnx.ValueInfoProto) -> list[int | str]:
    shape = value.type.tensor_type.shape
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in shape.dim]


def _batches(graph: onnx.GraphProto, batch_dim: str | None) -> bool:
    """Every input and output leads with the batch dimension (so Triton may batch)."""
    if batch_dim is None:
        return False
    return all(_dims(v)[:1] == [batch_dim] for v in (*graph.input, *graph.output))


def _io(pb: Any, message: Any, value: onnx.ValueInfoProto, batched: bool) -> None:
    tensor = value.type.tensor_type
    if not value.type.HasField("tensor_type") or tensor.elem_type not in TRITON_TYPES:
        raise PackageError(f"{value.name}: element type {tensor.elem_type} has no Triton data type")
    message.name = value.name
    message.data_type = pb.DataType.Value(TRITON_TYPES[tensor.elem_type])
    dims = _dims(value)
    if batched:
        dims = dims[1:]
    message.dims.extend(d if isinstance(d, int) else -1 for d in dims)
    if not message.dims:
        # a scalar per sample: Triton wants dims [1] and a reshape to []
        message.dims.append(1)
        message.reshape.SetInParent()


def build_config(
    package: Package, cut_id: str | None = None, options: TritonOptions | None = None
) -> tuple[Any, onnx.ModelProto, Cut]:
    """The ``ModelConfig`` message for one cut's cloud segment, the segment and the cut."""
    options = options or TritonOptions()
    pb = _pb()
    manifest = package.manifest
    cut = _cut(manifest, cut_id)
    assert cut.cloud is not None
    path = package.file(cut.cloud)
    try:
        segment = onnx.load(str(path))
    except Exception as exc:  # onnx raises untyped errors (protobuf, OS, external data)
        raise PackageError(f"{path}: cannot read the cloud segment: {exc}") from exc
    batched = _batches(segment.graph, manifest.batch_dim)
    max_batch = options.max_batch_size
    if max_batch is None:
        max_batch = BatchingConfig().max_batch_size if batched else 0
    if max_batch > 0 and not batched:
        raise ConfigError(
            f"--max-batch-size {max_batch}: cut {cut.id}'s cloud segment does not lead every "
            f"input and output with the batch dimension {manifest.batch_dim!r}; give "
            "--max-batch-size 0"
        )

    config = pb.ModelConfig(name=options.name or manifest.model_name, platform=PLATFORM)
    config.max_batch_size = max_batch
    for value in segment.graph.input:
        _io(pb, config.input.add(), value, batched and max_batch > 0)
    for value in segment.graph.output:
        _io(pb, config.output.add(), value, batched and max_batch > 0)
    if max_batch > 0:
        sizes = options.preferred_batch_sizes or (max_batch,)
        too_big = [s for s in sizes if s > max_batch]
        if too_big:
            raise ConfigError(
                f"--preferred-batch-size {too_big}: above --max-batch-size {max_batch}"
            )
        config.dynamic_batching.preferred_batch_size.extend(sorted(set(sizes)))
        config.dynamic_batching.max_queue_delay_microseconds = options.max_queue_delay_us
    policy = options.policy
    if policy.kind == "latest":
        config.version_policy.latest.num_versions = policy.latest
    elif policy.kind == "all":
        config.version_policy.all.SetInParent()
    else:
        config.version_policy.specific.versions.extend(policy.versions)
    group = config.instance_group.add()
    group.kind = pb.ModelInstanceGroup.Kind.Value(KINDS[options.instance_kind])
    group.count = options.instance_count
    return config, segment, cut


def render(config: Any) -> str:
    """The text form Triton reads (``config.pbtxt``)."""
    from google.protobuf import text_format

    return str(text_format.MessageToString(config))


def export(
    package: Path | str,
    repository: Path | str,
    cut_id: str | None = None,
    options: TritonOptions | None = None,
    *,
    force: bool = False,
) -> Exported:
    """Write ``<repository>/<model>/config.pbtxt`` and ``<version>/model.onnx``.

    The version folder is written under a dot-name and renamed into place, so
    a Triton polling the repository never sees half a model. An existing
    version is refused unless ``force``.
    """
    options = options or TritonOptions()
    pkg = open_package(package)
    config, segment, cut = build_config(pkg, cut_id, options)
    model_dir = Path(repository) / config.name
    final = model_dir / str(options.version)
    if final.exists() and not force:
        raise ConfigError(f"{final} already exists: give another --model-version, or --force")
    tmp = model_dir / f".{options.version}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir(parents=True)
    try:
        if segment.ByteSize() > _MAX_INLINE:
            onnx.save(
                segment, str(tmp / MODEL_FILE), save_as_external_data=True, location="model.data"
            )
        else:
            onnx.save(segment, str(tmp / MODEL_FILE))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    config_path = model_dir / CONFIG_NAME
    staged = model_dir / f".{CONFIG_NAME}.{uuid.uuid4().hex[:8]}"
    staged.write_text(render(config), encoding="utf-8")
    os.replace(staged, config_path)
    produced = {v.name for v in segment.graph.output}
    passthrough = tuple(o.name for o in pkg.manifest.outputs if o.name not in produced)
    return Exported(config_path, final / MODEL_FILE, config, cut.id, passthrough)


def validate(path: Path | str) -> Any:
    """Parse a ``config.pbtxt`` with Triton's schema and check what Triton would refuse.

    Returns the ``ModelConfig``; any problem is one :class:`ConfigError` line.
    """
    from google.protobuf import text_format

    pb = _pb()
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    config = pb.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ConfigError(f"{path}: not a Triton ModelConfig: {exc}") from exc
    where = f"{path}"
    if not config.name:
        raise ConfigError(f"{where}: name is empty")
    if path.parent.name and config.name != path.parent.name:
        raise ConfigError(f"{where}: name {config.name!r} is not its folder's {path.parent.name!r}")
    if not config.platform and not config.backend:
        raise ConfigError(f"{where}: neither platform nor backend is set")
    if config.max_batch_size < 0:
        raise ConfigError(f"{where}: max_batch_size {config.max_batch_size} is negative")
    if config.HasField("dynamic_batching") and config.max_batch_size == 0:
        raise ConfigError(f"{where}: dynamic_batching needs max_batch_size > 0")
    for kind, tensors in (("input", config.input), ("output", config.output)):
        if not tensors:
            raise ConfigError(f"{where}: no {kind}")
        for t in tensors:
            if t.data_type == pb.DataType.Value("TYPE_INVALID"):
                raise ConfigError(f"{where}: {kind} {t.name!r} has no data_type")
            if not t.dims or any(d < -1 or d == 0 for d in t.dims):
                raise ConfigError(f"{where}: {kind} {t.name!r} dims {list(t.dims)} are invalid")
    sizes = config.dynamic_batching.preferred_batch_size
    if any(s < 1 or s > config.max_batch_size for s in sizes):
        raise ConfigError(
            f"{where}: preferred_batch_size {list(sizes)} must lie within "
            f"1..max_batch_size={config.max_batch_size}"
        )
    return config


# -- the command line ------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Export a split package's cloud segment as a Triton Inference Server model.",
        epilog=examples(
            "splitinfer-triton pkg -o triton-repo --max-batch-size 32",
            "splitinfer-triton pkg -o triton-repo --config cloud.toml --model-version 2 "
            "--instance-kind cpu",
            "splitinfer-triton pkg -o triton-repo --max-queue-delay 500us --force",
        ),
    )
    p.add_argument("package", type=Path, metavar="PACKAGE", help="a split package folder")
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        metavar="REPO",
        help="the Triton model repository to write into",
    )
    p.add_argument(
        "--cut", default=None, metavar="ID", help="the cut (default: the package's default cut)"
    )
    p.add_argument("--name", default="", help="Triton model name (default: the package's model)")
    p.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="a cloud-service TOML whose [batching] gives the defaults",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        metavar="N",
        help="0: no batching (default: the cloud config's, 0 if unbatchable)",
    )
    p.add_argument(
        "--max-queue-delay",
        type=_delay,
        default=None,
        metavar="DURATION",
        help="dynamic batching queue delay, e.g. 500us (default: the cloud config's, 2ms)",
    )
    p.add_argument(
        "--max-queue-delay-us",
        action=Deprecated,
        dest="max_queue_delay",
        new="--max-queue-delay",
        type=_delay_us,
    )
    p.add_argument(
        "--preferred-batch-size",
        default="",
        metavar="N[,N...]",
        help="preferred batch sizes (default: the max batch size)",
    )
    p.add_argument(
        "--model-version",
        type=int,
        default=1,
        metavar="N",
        help="the model's version folder to write (default: 1)",
    )
    p.add_argument(
        "--version-policy",
        default="latest:1",
        metavar="POLICY",
        help="latest:N, all or specific:V[,V...] (default: latest:1)",
    )
    p.add_argument(
        "--instance-kind",
        default="gpu",
        choices=sorted(KINDS),
        help="where Triton runs the model's instances: gpu, cpu or auto, Triton's "
        "KIND_GPU/KIND_CPU/KIND_AUTO (default: gpu)",
    )
    p.add_argument(
        "--instances",
        type=int,
        default=1,
        metavar="N",
        help="model instances per device (default: 1)",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing version folder")
    add_debug_flag(p)
    add_version_flag(p, __version__)
    return p


def _delay(text: str) -> int:
    """``--max-queue-delay``: microseconds, Triton's unit, of a duration (``500us``)."""
    try:
        seconds = 0.0 if text.strip() == "0" else parse_duration(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return round(seconds * 1e6)


def _delay_us(text: str) -> int:
    """The former ``--max-queue-delay-us N``."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of microseconds") from None


def former_version(argv: Sequence[str]) -> list[str]:
    """``argv`` with the former ``--version N`` (the model's version folder) as
    ``--model-version N``, told once on stderr; ``--version`` alone prints the version."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--":
            break
        value = arg.partition("=")[2] if arg.startswith("--version=") else None
        if arg == "--version" and i + 1 < len(out) and out[i + 1].isdigit():
            value = out.pop(i + 1)
        if value is not None:
            print(
                f"{PROG}: warning: --version N is deprecated; use --model-version N",
                file=sys.stderr,
            )
            out[i] = f"--model-version={value}"
            return out
    return out


def _batching_defaults(path: Path | None, model: str) -> BatchingConfig:
    if path is None:
        return BatchingConfig()
    data = load_toml(path)
    data.setdefault("repository", ".")  # only [batching] and [models.*] matter here
    return build_service_config(data, where=str(path)).batching_for(model)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: comma-separated integers expected") from None


def _body(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(former_version(sys.argv[1:] if argv is None else argv))
    manifest = open_package(args.package, verify=False).manifest
    batching = _batching_defaults(args.config, manifest.model_name)
    max_batch = args.max_batch_size
    if max_batch is None and args.config is not None:
        max_batch = batching.max_batch_size
    delay = args.max_queue_delay
    if delay is None:
        delay = round(batching.max_queue_delay_ms * 1000)
    options = TritonOptions(
        max_batch_size=max_batch,
        max_queue_delay_us=delay,
        preferred_batch_sizes=_ints(args.preferred_batch_size, "--preferred-batch-size"),
        version=args.model_version,
        policy=VersionPolicy.parse(args.version_policy),
        instance_kind=args.instance_kind,
        instance_count=args.instances,
        name=args.name,
    )
    done = export(args.package, args.output, args.cut, options, force=args.force)
    validate(done.config_path)
    c = done.config
    dyn = c.dynamic_batching
    batching_note = (
        f"max_batch_size {c.max_batch_size}, preferred {list(dyn.preferred_batch_size)}"
        f", queue delay {dyn.max_queue_delay_microseconds} us"
        if c.max_batch_size
        else "no batching (max_batch_size 0)"
    )
    print(
        f"cut {done.cut_id} -> {done.model_path} and {done.config_path} "
        f"({len(c.input)} input(s), {len(c.output)} output(s), {batching_note})"
    )
    if done.passthrough:
        print(
            f"note: outputs {list(done.passthrough)} are cut tensors the segment passes through; "
            "Triton does not return them (the device already holds them)"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, _body, argv)


if __name__ == "__main__":
    sys.exit(main())
