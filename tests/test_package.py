"""Opening a split package as a daemon does: verified files, codecs, quantization."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import zstandard
from graphs import residual

from splitinfer.partitioner.pipeline import PackageExtras, artifacts_for, prepare, write_package
from splitinfer.shared.codecs import INT8_ZSTD, RAW, calibrate_params, default_codecs
from splitinfer.shared.errors import PackageError
from splitinfer.shared.manifest import CodecSpec
from splitinfer.shared.package import open_package, quant_params, quant_spec

pytestmark = pytest.mark.unit


@pytest.fixture
def package(tmp_path: Path) -> Path:
    onnx.save(residual(), str(tmp_path / "res.onnx"))
    prepared = prepare(tmp_path / "res.onnx")
    plan = prepared.space.find("c2")
    acts = np.abs(np.random.default_rng(0).standard_normal((64, 4))).astype(np.float32)
    dictionary = zstandard.train_dictionary(1024, [bytes(a) for a in (acts * 50).astype(np.int8)])
    art = replace(
        artifacts_for(prepared, plan),
        codec=CodecSpec("int8+zstd", level=5, dictionary="codec/c2.zdict"),
        quant={plan.crossing[0]: quant_spec(calibrate_params(acts))},
    )
    other = artifacts_for(prepared, prepared.space.find("none"))
    other.codec = CodecSpec("raw")
    extras = PackageExtras(files={"codec/c2.zdict": dictionary.as_bytes()})
    write_package(prepared, [art, other], tmp_path / "pkg", extras=extras)
    return tmp_path / "pkg"


def test_a_written_package_opens_with_its_codecs(package: Path) -> None:
    pkg = open_package(package)
    cut = pkg.manifest.cut
    wire, codecs = pkg.codec(cut)
    assert wire == INT8_ZSTD
    params = quant_params(cut, cut.tensors[0].name)
    assert params is not None
    assert len(params.scale) == 4
    x = np.abs(np.random.default_rng(1).standard_normal((3, 4))).astype(np.float32)
    data = codecs[wire].encode(x, params)
    back = codecs[wire].decode(data, "float32", x.shape, params, 1 << 20)
    np.testing.assert_allclose(back, x, atol=max(params.scale))
    other = pkg.manifest.cuts[1]
    assert pkg.codec(other)[0] == RAW
    assert quant_params(other, other.tensors[0].name) is None
    # the cut's registry holds every codec a peer may send (ids travel zstd, id 8)
    assert set(codecs) == set(default_codecs())


def test_a_tampered_segment_is_refused(package: Path) -> None:
    (package / "cloud.onnx").write_bytes((package / "cloud.onnx").read_bytes() + b"\0")
    with pytest.raises(PackageError, match=r"cloud.onnx does not match its sha256"):
        open_package(package)
    assert open_package(package, verify=False).manifest.default_cut == "c2"


def test_a_missing_file_is_named(package: Path) -> None:
    (package / "edge.onnx").unlink()
    with pytest.raises(PackageError, match=r"edge.onnx named by the manifest is missing"):
        open_package(package)


def test_a_missing_dictionary_is_named(package: Path) -> None:
    (package / "codec" / "c2.zdict").unlink()
    with pytest.raises(PackageError, match=r"zstd dictionary codec/c2.zdict of cut c2"):
        open_package(package)
