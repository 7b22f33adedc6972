"""The agent's configuration: defaults, TOML, flags over the file, one-line errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from splitinfer.edge.cli import build_parser, resolve
from splitinfer.edge.config import (
    AdaptConfig,
    EdgeConfig,
    PrivacyConfig,
    QueueConfig,
    RuntimeConfig,
    UplinkConfig,
    config_from_mapping,
    parse_listen,
    parse_model,
    sections,
)
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.options import options

pytestmark = pytest.mark.unit


def test_every_option_is_a_flag_with_help() -> None:
    parser = build_parser()
    flags = {o for a in parser._actions for o in a.option_strings}
    helps = {o: a.help for a in parser._actions for o in a.option_strings}
    opts = options(EdgeConfig)
    assert {o.section for o in opts} == {None, *sections()}
    for f in dataclasses.fields(EdgeConfig):
        if f.name in sections():
            cls = f.default_factory()  # type: ignore[misc]
            assert len([o for o in opts if o.section == f.name]) == len(dataclasses.fields(cls))
    for opt in opts:
        assert opt.flag in flags, opt.key
        assert helps[opt.flag], opt.flag
    # the runtime section's flags have no prefix (as in cloud-service); the queue's do
    assert {"--providers", "--threads", "--gpu", "--trt-fp16", "--queue-max-queue"} <= flags
    assert "--no-verify" in flags  # booleans have both forms
    text = parser.format_help()
    assert "--uplink-max-attempts" in text
    assert "(default: 3)" in text
    assert "--uplink-timeout DURATION" in text
    assert "(default: 5s)" in text


def test_file_then_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "edge.toml"
    cfg.write_text(
        """
package = "/srv/pkg"
cloud = ["https://a.example:8443", "https://b.example:8443"]
listen = "0.0.0.0:9000"
model = "demo:3"

[uplink]
timeout = "2s"
max_attempts = 4

[adapt]
hysteresis = 0.3
prior_uplink = "5mbit"

[privacy]
budget_epsilon = 8
"""
    )
    config, _ = resolve(["--config", str(cfg), "--uplink-timeout", "500ms", "--no-adapt-enabled"])
    assert config.package == Path("/srv/pkg")
    assert config.cloud == ("https://a.example:8443", "https://b.example:8443")
    assert config.host_port == ("0.0.0.0", 9000)
    assert config.uplink.timeout_s == 0.5  # the flag wins
    assert config.uplink.max_attempts == 4  # the file's
    assert config.adapt.hysteresis == 0.3
    assert not config.adapt.enabled
    assert config.privacy.budget_epsilon == 8.0
    assert config.runtime == RuntimeConfig()  # untouched sections keep their defaults
    flags, _ = resolve(["--package", "p", "--cloud", "http://a:1,http://b:2", "--providers", "cpu"])
    assert flags.cloud == ("http://a:1", "http://b:2")
    assert flags.runtime.providers == ("cpu",)


def test_former_spellings_still_work_with_one_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "edge.toml"
    cfg.write_text("package = 'p'\ncloud = ['http://a:1']\n[uplink]\ntimeout_s = 2\n")
    old = ["--runtime-provider", "cpu", "--queue-inline-below-ms", "0.5", "--no-runtime-verify"]
    config, _ = resolve(["--config", str(cfg), *old, "--runtime-trt-workspace-mb", "512"])
    assert config.runtime.providers == ("cpu",)
    assert not config.runtime.verify
    assert config.queue.inline_below_ms == 0.5  # the former unit: milliseconds
    assert config.runtime.trt_workspace_mb == 512
    assert config.uplink.timeout_s == 2.0
    assert capsys.readouterr().err.splitlines() == [
        "edge-agent: warning: --runtime-provider is deprecated; use --providers",
        "edge-agent: warning: --queue-inline-below-ms is deprecated; use --queue-inline-below",
        "edge-agent: warning: --no-runtime-verify is deprecated; use --no-verify",
        "edge-agent: warning: --runtime-trt-workspace-mb is deprecated; use --trt-workspace",
        f'edge-agent: warning: {cfg}: uplink.timeout_s is deprecated; use uplink.timeout = "2s"',
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "package: missing; give --package DIR"),
        (["--package", "p"], "no cloud endpoint: give --cloud URL"),
        (["--package", "p", "--cloud", "a.example"], "is not http(s)://HOST[:PORT]"),
        (["--package", "p", "--cloud", "http://a:1,http://a:1"], "lists an endpoint twice"),
        (["--package", "p", "--cloud", "http://a:99999"], "the port is not a number"),
        (["--package", "p", "--cloud", "http://a", "--listen", "8080"], "is not HOST:PORT"),
        (["--package", "p", "--cloud", "http://a", "--model", "a/b"], "is not NAME[:VERSION]"),
        (["--package", "p", "--cloud", "http://a", "--uplink-timeout", "x"], "not understood"),
        (["--package", "p", "--cloud", "http://a", "--uplink-timeout", "5"], "not understood"),
        (["--package", "p", "--cloud", "http://a", "--uplink-timeout", "0"], "must be > 0"),
        (["--package", "p", "--cloud", "http://a", "--providers", "gpu"], "give auto, or one"),
        (["--package", "p", "--cloud", "http://a", "--adapt-prior-uplink", "5mbps"], "ambiguous"),
        (["--package", "p", "--cloud", "http://a", "--queue-max-queue", "-1"], ">= 0"),
        (["--package", "p", "--cloud", "http://a", "--bogus", "1"], "unrecognized arguments"),
    ],
)
def test_bad_options_name_the_value_and_the_fix(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(argv)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("package = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve(["--config", str(bad)])
    with pytest.raises(ConfigError, match="cannot read"):
        resolve(["--config", str(tmp_path / "missing.toml")])
    with pytest.raises(ConfigError, match=r"uplink\.retries: unknown option"):
        config_from_mapping({"package": "p", "uplink": {"retries": 3}})
    with pytest.raises(ConfigError, match="nonsense: unknown option"):
        config_from_mapping({"package": "p", "nonsense": 1})
    with pytest.raises(ConfigError, match="timeout: duration 'soon' not understood"):
        config_from_mapping({"package": "p", "uplink": {"timeout": "soon"}})
    with pytest.raises(ConfigError, match=r'timeout=2: give it with units, e\.g\. "2s"'):
        config_from_mapping({"package": "p", "uplink": {"timeout": 2}})
    with pytest.raises(ConfigError, match=r"\[queue\] must be a table"):
        config_from_mapping({"package": "p", "queue": 3})


def test_sections_validate_themselves() -> None:
    with pytest.raises(ConfigError, match=r"load_low=0\.9 is above adapt\.load_high=0\.8"):
        AdaptConfig(load_low=0.9)
    with pytest.raises(ConfigError, match="load_factor"):
        AdaptConfig(load_factor=0.5)
    with pytest.raises(ConfigError, match="priority"):
        UplinkConfig(priority=10)
    with pytest.raises(ConfigError, match="max_concurrency"):
        QueueConfig(max_concurrency=0)
    with pytest.raises(ConfigError, match="on_exhausted"):
        PrivacyConfig(on_exhausted="ignore")
    with pytest.raises(ConfigError, match="budget_delta"):
        PrivacyConfig(budget_delta=1.5)


def test_small_parsers() -> None:
    assert parse_listen("[::1]:8480") == ("::1", 8480)
    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_model("demo") == ("demo", "")
    assert parse_model("demo:3") == ("demo", "3")
    with pytest.raises(ConfigError):
        parse_model("demo:3:4")
