"""What an operator installs from ``deploy/``: the two systemd units, the Prometheus
scrape config and alert rules, the Grafana dashboard, and shell completion.

The tools that judge them are real: ``systemd-analyze verify`` and ``security`` on the
units, ``promtool check`` and ``promtool test rules`` on the Prometheus files (each
skipped with its reason where the tool is not installed; ``make install`` installs
promtool as root). Every metric that an alert rule or a dashboard panel names is read
from a real ``/metrics`` of a real ``cloud-service`` and a real ``edge-agent``, scraped
right after they start (a metric that appears only after some event must still be
declared then) and again after one request through both.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from cloudkit import chain_repo
from daemons import daemon

from splitinfer.sim.daemon import Daemon

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "splitinfer.json"
UNITS = ("edge-agent", "cloud-service")

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian: apt-get install prometheus; "
    "`make install` does it when run as root)",
)
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (no systemd here)"
)
#: the directives that make a unit hardened; the cloud unit sets each as the edge one does
HARDENING = (
    "DynamicUser", "ProtectSystem", "ProtectHome", "PrivateTmp", "NoNewPrivileges",
    "CapabilityBoundingSet", "AmbientCapabilities", "ProtectKernelTunables",
    "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups", "ProtectClock",
    "ProtectHostname", "ProtectProc", "RestrictSUIDSGID", "RestrictRealtime",
    "RestrictNamespaces", "LockPersonality", "RemoveIPC", "UMask", "RestrictAddressFamilies",
    "SystemCallArchitectures", "SystemCallFilter", "SystemCallErrorNumber", "Restart",
    "StateDirectoryMode",
)  # fmt: skip
METRIC = re.compile(r"\bsplitinfer_[a-z0-9_]+\b")
#: the series names a family of each type puts on /metrics (what PromQL can name)
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def run(*argv: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv], check=False, capture_output=True, text=True, timeout=60, cwd=cwd
    )


# -- systemd ------------------------------------------------------------------------------


def unit_settings(name: str) -> dict[str, str]:
    """``Key=value`` of a unit's [Service] section (the last one of a repeated key)."""
    section, found = "", {}
    for raw in (DEPLOY / f"{name}.service").read_text().splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            found[key] = value
    return found


@pytest.mark.unit
def test_the_cloud_unit_is_hardened_like_the_edge_unit() -> None:
    edge, cloud = unit_settings("edge-agent"), unit_settings("cloud-service")
    differ = {k: (edge.get(k), cloud.get(k)) for k in HARDENING if edge.get(k) != cloud.get(k)}
    assert not differ, f"(edge, cloud) differ: {differ}"
    assert cloud["ExecStart"].startswith("/opt/splitinfer/bin/cloud-service ")
    # the repository lives in the state directory, made at start; keys come as credentials
    assert "--repository /var/lib/cloud-service/repository" in cloud["ExecStart"]
    assert "cloud-service/repository" in cloud["StateDirectory"].split()
    assert "${CREDENTIALS_DIRECTORY}/devices" in cloud["ExecStart"]
    assert "${CREDENTIALS_DIRECTORY}/tls-key" in cloud["ExecStart"]


def stub_units(tmp: Path) -> list[Path]:
    """Both units with ExecStart pointing at stub programs (verify checks that the
    program exists; /opt/splitinfer is not installed here)."""
    (tmp / "bin").mkdir()
    out = []
    for name in UNITS:
        stub = tmp / "bin" / name
        stub.write_text("#!/bin/sh\n")
        stub.chmod(0o755)
        text = (DEPLOY / f"{name}.service").read_text()
        assert "/opt/splitinfer/bin/" in text
        unit = tmp / f"{name}.service"
        unit.write_text(text.replace("/opt/splitinfer/bin/", f"{tmp / 'bin'}/"))
        out.append(unit)
    return out


@needs_systemd
def test_systemd_verifies_both_units(tmp_path: Path) -> None:
    units = stub_units(tmp_path)
    done = run(SYSTEMD_ANALYZE or "", "verify", "--man=no", *units)
    # verify exits 0 on an unknown key or a bad value: it only says so
    assert done.returncode == 0, done.stderr
    assert done.stdout + done.stderr == "", done.stdout + done.stderr


def exposure(unit: Path) -> float:
    done = run(SYSTEMD_ANALYZE or "", "security", "--offline=yes", "--no-pager", unit)
    assert done.returncode == 0, done.stderr
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout)
    assert found, done.stdout[-500:]
    return float(found.group(1))


@needs_systemd
def test_the_cloud_unit_is_exposed_no_more_than_the_edge_unit(tmp_path: Path) -> None:
    edge, cloud = (exposure(u) for u in stub_units(tmp_path))
    assert cloud <= edge <= 2.5, (edge, cloud)


# -- Prometheus -----------------------------------------------------------------------------


@needs_promtool
def test_promtool_accepts_the_scrape_config_and_its_rules() -> None:
    done = run(PROMTOOL or "", "check", "config", PROMETHEUS / "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 rule files found" in done.stdout


@needs_promtool
def test_promtool_accepts_the_alert_rules() -> None:
    done = run(PROMTOOL or "", "check", "rules", PROMETHEUS / "alerts.yml")
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_the_alerts_fire_on_made_up_series() -> None:
    """deploy/prometheus/alerts_test.yml: breaker open, error rate, p99, privacy budget."""
    done = run(PROMTOOL or "", "test", "rules", "alerts_test.yml", cwd=PROMETHEUS)
    assert done.returncode == 0, done.stdout + done.stderr


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard_queries() -> list[str]:
    """Every PromQL of the dashboard: panels' targets (rows' too) and variables."""
    doc = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in doc["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            exprs += [t["expr"] for t in p.get("targets", [])]
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]
            exprs.append(q["query"] if isinstance(q, dict) else q)
    return exprs


def referenced() -> dict[str, set[str]]:
    """Metric name -> where it is named (an alert or a dashboard query)."""
    found: dict[str, set[str]] = {}
    for rule in alert_rules():
        for name in METRIC.findall(rule["expr"]):
            found.setdefault(name, set()).add(f"alert {rule['alert']}")
    for expr in dashboard_queries():
        for name in METRIC.findall(expr):
            found.setdefault(name, set()).add("dashboard")
    return found


@pytest.mark.unit
def test_the_rules_cover_what_an_operator_pages_on() -> None:
    names = {r["alert"] for r in alert_rules()}
    for want in ("ErrorRate", "LatencyP99High", "QueueDeep", "PrivacyBudgetExhausted"):
        assert {f"SplitinferCloud{want}", f"SplitinferEdge{want}"} <= names
    assert {"SplitinferCloudBreakerOpen", "SplitinferEdgeEndpointOpen"} <= names
    for rule in alert_rules():
        assert METRIC.search(rule["expr"]), rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]


@pytest.mark.unit
def test_the_dashboard_is_grafana_dashboard_json() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] == "splitinfer"
    assert doc["title"]
    assert doc["schemaVersion"] >= 36  # Grafana 9.x and later
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in doc["templating"]["list"]}
    assert {"datasource", "cloud", "model", "edge"} <= variables
    titles = [p["title"] for p in doc["panels"]]
    for want in (
        "Request rate", "Error rate", "Latency p50 / p99", "Batch size", "Queue depth",
        "Circuit breakers", "Bytes on the wire", "Privacy budget spent",
        "Expert cache hits (MoE)",
    ):  # fmt: skip
        assert want in titles, want
    for p in doc["panels"]:
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24, p["title"]
        assert pos["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["type"] in ("timeseries", "state-timeline"), p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs, p["title"]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert METRIC.search(t["expr"]), (p["title"], t["expr"])
            assert t["expr"].count("(") == t["expr"].count(")"), (p["title"], t["expr"])


# -- the names against real daemons -----------------------------------------------------------


@dataclass
class Scrapes:
    """Series names each daemon puts on /metrics: declared right after start, and with a
    sample after one request through both."""

    cloud_start: set[str]
    edge_start: set[str]
    edge_start_sampled: set[str]
    cloud_after: set[str]
    edge_after: set[str]
    moe: bool


def exported(text: str) -> tuple[set[str], set[str]]:
    """(every series name the families declare, the names that have a sample)."""
    from prometheus_client.parser import text_string_to_metric_families

    declared, sampled = set(), set()
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            declared.add(family.name + suffix)
        sampled |= {s.name for s in family.samples}
    return declared, sampled


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get(url: str) -> str:
    with _DIRECT.open(url, timeout=30) as resp:
        return resp.read().decode()  # type: ignore[no-any-return]


def moe_package(repo: Path) -> bool:
    """An MoE package in ``repo`` (its export needs torch), so the service loads the
    expert cache and declares its series."""
    try:
        from splitinfer.models.moe import INPUT_SHAPES, moe_transformer
        from splitinfer.partitioner.moe_export import export_moe_package
    except ImportError:
        return False
    shape = INPUT_SHAPES["transformer"]
    work = repo.parent / "moe-src"
    export_moe_package(moe_transformer(), work, name="moe_transformer", sample_shape=shape)
    (repo / "moe_transformer").mkdir()
    shutil.move(work, repo / "moe_transformer" / "1")
    return True


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> Scrapes:
    repo = tmp_path_factory.mktemp("monitoring") / "repo"
    chain_repo(repo)
    moe = moe_package(repo)
    cloud: Daemon = daemon(
        "cloud-service", "--repository", repo, "--listen", "127.0.0.1:0", "--no-auth"
    )
    try:
        agent = daemon(
            "edge-agent", "--package", repo / "chain" / "1", "--cloud", cloud.url,
            "--listen", "127.0.0.1:0",
        )  # fmt: skip
        try:
            cloud_start, _ = exported(get(f"{cloud.url}/metrics"))
            edge_start, edge_start_sampled = exported(get(f"{agent.url}/metrics"))
            buf = io.BytesIO()
            np.save(buf, np.ones((1, 4), np.float32))
            request = urllib.request.Request(
                f"{agent.url}/v1/infer",
                data=buf.getvalue(),
                headers={"Content-Type": "application/x-npy", "X-Splitinfer-Cut": "c2"},
            )
            with _DIRECT.open(request, timeout=60) as resp:
                assert resp.status == 200
                assert resp.headers["X-Splitinfer-Local"] == "0"  # it went through the cloud
            _, cloud_after = exported(get(f"{cloud.url}/metrics"))
            _, edge_after = exported(get(f"{agent.url}/metrics"))
        finally:
            agent.stop()
    finally:
        cloud.stop()
    return Scrapes(cloud_start, edge_start, edge_start_sampled, cloud_after, edge_after, moe)


def owner(name: str) -> str:
    return "edge-agent" if name.startswith("splitinfer_edge_") else "cloud-service"


@pytest.mark.slow
def test_every_metric_a_rule_or_panel_names_is_declared_when_the_daemons_start(
    scrapes: Scrapes,
) -> None:
    declared = {"cloud-service": scrapes.cloud_start, "edge-agent": scrapes.edge_start}
    names = {n: w for n, w in referenced().items() if not n.startswith("splitinfer_moe_")}
    missing = {n: sorted(w) for n, w in names.items() if n not in declared[owner(n)]}
    assert not missing, f"named but not exported by the daemon: {missing}"
    # the local answers an edge alert counts with increase() are at 0 from the start
    assert "splitinfer_edge_local_answers_total" in scrapes.edge_start_sampled
    # the request went through both, so the series these count have samples now
    assert "splitinfer_requests_total" in scrapes.cloud_after
    assert "splitinfer_request_seconds_bucket" in scrapes.cloud_after
    assert "splitinfer_edge_uplink_bytes_total" in scrapes.edge_after
    assert "splitinfer_edge_request_seconds_bucket" in scrapes.edge_after


@pytest.mark.slow
def test_the_expert_cache_panels_name_what_an_moe_service_declares(scrapes: Scrapes) -> None:
    if not scrapes.moe:
        pytest.skip("exporting the MoE package needs torch (the torch extra)")
    names = [n for n in referenced() if n.startswith("splitinfer_moe_")]
    assert names
    assert set(names) <= scrapes.cloud_start, set(names) - scrapes.cloud_start


# -- shell completion -----------------------------------------------------------------------


TOOLS = ("partition", "edge-agent", "cloud-service", "netsim", "splitinfer-demo",
         "splitinfer-triton")  # fmt: skip


@pytest.mark.unit
def test_completion_names_every_command_of_the_package() -> None:
    import tomllib

    from splitinfer.completion import TOOLS as COMPLETED

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(COMPLETED) == set(scripts) == set(TOOLS)


@pytest.mark.unit
def test_completion_builds_each_command_s_own_parser() -> None:
    from splitinfer.completion import parser_of

    pytest.importorskip("shtab", reason="the completion extra (shtab) is not installed")
    for tool in TOOLS:
        assert parser_of(tool).prog == tool


def complete(script: Path, *words: str) -> list[str]:
    """What bash offers after ``words`` (the last one being completed) with ``script``
    sourced: the function its ``complete -F`` line registers, called as bash calls it."""
    func = re.search(rf"^complete .* -F (\S+) {re.escape(words[0])}$", script.read_text(), re.M)
    assert func, f"no `complete -F ... {words[0]}` line"
    line = " ".join(words)
    body = (
        f'source "$1"; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; '
        f'COMP_LINE="{line}"; COMP_POINT={len(line)}; '
        f'{func.group(1)} {words[0]} {words[-1]} {words[-2]}; printf "%s\\n" "${{COMPREPLY[@]}}"'
    )
    return run("bash", "-c", body, "bash", script).stdout.split()


def test_python_m_splitinfer_completion_bash_completes_all_six(tmp_path: Path) -> None:
    pytest.importorskip("shtab", reason="the completion extra (shtab) is not installed")
    import sys

    done = run(sys.executable, "-m", "splitinfer.completion", "bash")
    assert done.returncode == 0, done.stderr
    script = tmp_path / "splitinfer.bash"
    script.write_text(done.stdout)
    assert run("bash", "-n", script).returncode == 0
    for tool in TOOLS:
        assert re.search(rf"^complete .* {re.escape(tool)}$", done.stdout, re.M), tool
    assert complete(script, "cloud-service", "--repo") == ["--repository"]
    assert complete(script, "edge-agent", "pro") == ["profile"]
    assert complete(script, "edge-agent", "profile", "--out") == ["--output"]
    assert complete(script, "splitinfer-demo", "--qu") == ["--quick"]
    zsh = run(sys.executable, "-m", "splitinfer.completion", "zsh", "netsim")
    assert zsh.returncode == 0, zsh.stderr
    assert zsh.stdout.startswith("#compdef netsim")
    bad = run(sys.executable, "-m", "splitinfer.completion", "bash", "nope")
    assert bad.returncode == 2
    assert "no command named 'nope'" in bad.stderr
