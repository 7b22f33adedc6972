"""The Triton export: config.pbtxt parsed back with Triton's schema; model.onnx = the segment."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from cloudkit import cnn, write
from ortutil import assert_close, run

from splitinfer.cloud.triton import (
    TritonOptions,
    VersionPolicy,
    export,
    main,
    render,
    validate,
)
from splitinfer.shared.errors import ConfigError, PackageError
from splitinfer.shared.package import open_package

pytestmark = pytest.mark.unit
pb = pytest.importorskip(
    "tritonclient.grpc.model_config_pb2", reason="the optional triton extra is not installed"
)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small CNN split at c2 (cloud half on p1 [N, 8, 8, 8]) and at none (id c0)."""
    repo = tmp_path_factory.mktemp("triton") / "repo"
    write(cnn(), repo, "cnn", "1", cuts=("c2", "none"))
    return repo / "cnn" / "1"


def fp32() -> int:
    return int(pb.DataType.Value("TYPE_FP32"))


def test_the_config_parses_back_with_the_schema(package: Path, tmp_path: Path) -> None:
    done = export(package, tmp_path / "triton", "c2", TritonOptions(max_queue_delay_us=500))
    assert done.config_path == tmp_path / "triton" / "cnn" / "config.pbtxt"
    assert done.model_path == tmp_path / "triton" / "cnn" / "1" / "model.onnx"
    config = validate(done.config_path)
    assert config == done.config
    assert config.name == "cnn"
    assert config.platform == "onnxruntime_onnx"
    assert config.max_batch_size == 32  # the cloud service's default
    [inp] = config.input
    assert (inp.name, inp.data_type, list(inp.dims)) == ("p1", fp32(), [8, 8, 8])
    [out] = config.output
    assert (out.name, out.data_type, list(out.dims)) == ("y", fp32(), [10])
    assert list(config.dynamic_batching.preferred_batch_size) == [32]
    assert config.dynamic_batching.max_queue_delay_microseconds == 500
    assert config.version_policy.WhichOneof("policy_choice") == "latest"
    assert config.version_policy.latest.num_versions == 1
    [group] = config.instance_group
    assert (group.kind, group.count) == (pb.ModelInstanceGroup.Kind.Value("KIND_GPU"), 1)
    text = done.config_path.read_text()
    assert 'platform: "onnxruntime_onnx"' in text
    assert "max_queue_delay_microseconds: 500" in text
    # nothing left behind but the model and its version folder
    assert sorted(p.name for p in done.config_path.parent.iterdir()) == ["1", "config.pbtxt"]


def test_the_exported_model_equals_the_cloud_segment(package: Path, tmp_path: Path) -> None:
    done = export(package, tmp_path, "c2")
    pkg = open_package(package)
    cut = pkg.manifest.find_cut("c2")
    assert cut is not None
    assert cut.cloud is not None
    feeds = {"p1": np.random.default_rng(3).standard_normal((5, 8, 8, 8)).astype(np.float32)}
    want = run(pkg.file(cut.cloud), feeds)
    got = run(done.model_path, feeds)
    assert_close(got, want)
    assert got["y"].shape == (5, 10)


def test_version_policies_batching_off_and_instances(package: Path, tmp_path: Path) -> None:
    options = TritonOptions(
        max_batch_size=0,
        version=3,
        policy=VersionPolicy.parse("specific:1,3"),
        instance_kind="cpu",
        instance_count=2,
        name="cnn-whole",
    )
    done = export(package, tmp_path, "c0", options)
    config = validate(done.config_path)
    assert done.model_path == tmp_path / "cnn-whole" / "3" / "model.onnx"
    assert config.max_batch_size == 0
    assert not config.HasField("dynamic_batching")
    [inp] = config.input
    assert (inp.name, list(inp.dims)) == ("x", [-1, 3, 16, 16])  # the batch dim stays
    assert list(config.version_policy.specific.versions) == [1, 3]
    assert config.instance_group[0].kind == pb.ModelInstanceGroup.Kind.Value("KIND_CPU")
    assert config.instance_group[0].count == 2
    assert VersionPolicy.parse("all") == VersionPolicy("all")
    again = export(package, tmp_path, "c0", TritonOptions(policy=VersionPolicy("all")))
    assert validate(again.config_path).version_policy.WhichOneof("policy_choice") == "all"


def test_the_cli_writes_and_reports(
    package: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    conf = tmp_path / "service.toml"
    conf.write_text('[batching]\nmax_batch_size = 8\nmax_queue_delay = "1.5ms"\n')
    out = tmp_path / "repo"
    argv = [str(package), "-o", str(out), "--cut", "c2", "--config", str(conf)]
    argv += ["--preferred-batch-size", "4,8", "--model-version", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "cut c2 ->" in printed
    assert "max_batch_size 8, preferred [4, 8], queue delay 1500 us" in printed
    config = validate(out / "cnn" / "config.pbtxt")
    assert config.max_batch_size == 8
    assert (out / "cnn" / "2" / "model.onnx").is_file()
    # the same version again is refused, --force overwrites
    assert main(argv) == 2
    assert "already exists" in capsys.readouterr().err
    assert main([*argv, "--force"]) == 0


def test_the_former_version_and_delay_flags_still_work(
    package: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "repo"
    argv = [str(package), "-o", str(out), "--cut", "c2", "--max-batch-size", "4"]
    assert main([*argv, "--version", "3", "--max-queue-delay-us", "700"]) == 0
    captured = capsys.readouterr()
    assert "queue delay 700 us" in captured.out
    assert (out / "cnn" / "3" / "model.onnx").is_file()
    assert captured.err.splitlines() == [
        "splitinfer-triton: warning: --version N is deprecated; use --model-version N",
        "splitinfer-triton: warning: --max-queue-delay-us is deprecated; use --max-queue-delay",
    ]
    assert main([*argv, "--model-version", "4", "--max-queue-delay", "250us"]) == 0
    assert "queue delay 250 us" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("splitinfer-triton splitinfer ")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--cut", "c9"], "--cut c9: no such cut"),
        (["--cut", "c2", "--version-policy", "newest"], "give latest:N, all or specific"),
        (["--cut", "c2", "--version-policy", "latest:x"], "numbers expected"),
        (["--cut", "c2", "--model-version", "0"], "integers >= 1"),
        (["--cut", "c2", "--max-batch-size", "4", "--preferred-batch-size", "8"], "above"),
        (["--cut", "c2", "--instance-kind", "tpu"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    package: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    needle: str,
) -> None:
    assert main([str(package), "-o", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitinfer-triton: error: ")
    assert needle in err
    assert err.count("\n") == 1
    assert not (tmp_path / "cnn").exists()


def test_an_moe_package_is_refused(package: Path, tmp_path: Path) -> None:
    """A package whose cloud segment is an MoE program (moe.json) is not ONNX."""
    moe = tmp_path / "moe"
    shutil.copytree(package, moe)
    program = moe / "moe.json"
    program.write_text('{"steps": []}')
    data = json.loads((moe / "manifest.json").read_text())
    for cut in data["cuts"]:
        if cut["id"] == "c2":
            cut["cloud"]["file"] = "moe.json"
            cut["cloud"]["sha256"] = hashlib.sha256(program.read_bytes()).hexdigest()
    (moe / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(PackageError, match="MoE program, not ONNX"):
        export(moe, tmp_path / "out", "c2")
    export(moe, tmp_path / "out", "c0")  # its dense cut still exports


def test_a_missing_package_and_a_tampered_segment(package: Path, tmp_path: Path) -> None:
    with pytest.raises(PackageError):
        export(tmp_path / "nope", tmp_path / "out")
    bad = tmp_path / "bad"
    shutil.copytree(package, bad)
    cut = open_package(bad).manifest.find_cut("c2")
    assert cut is not None
    assert cut.cloud is not None
    (bad / cut.cloud.file).write_bytes(b"not onnx")
    with pytest.raises(PackageError, match="sha256"):
        export(bad, tmp_path / "out", "c2")


def test_validate_refuses_broken_configs(package: Path, tmp_path: Path) -> None:
    done = export(package, tmp_path, "c2")
    good = done.config_path.read_text()
    cases = {
        "max_batch_size: 32\nnot_a_field: 1\n": "not a Triton ModelConfig",
        good.replace('name: "cnn"', 'name: "other"'): "is not its folder's",
        good.replace("TYPE_FP32", "TYPE_FLOAT32", 1): "not a Triton ModelConfig",
        good.replace("max_batch_size: 32", "max_batch_size: 0"): "needs max_batch_size > 0",
        good.replace("max_batch_size: 32", "max_batch_size: 16"): "preferred_batch_size",
    }
    for text, needle in cases.items():
        done.config_path.write_text(text)
        with pytest.raises(ConfigError, match=needle) as info:
            validate(done.config_path)
        assert "\n" not in str(info.value).strip() or needle == "not a Triton ModelConfig"
    with pytest.raises(ConfigError, match="cannot read"):
        validate(tmp_path / "missing" / "config.pbtxt")
    assert render(done.config).startswith('name: "cnn"')
