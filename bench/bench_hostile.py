"""Hostile load on both daemons while good clients keep asking (issue 17).

    python bench/bench_hostile.py [--quick] [--seconds S] [--json out.json]

Builds the digits package the way the demo does (the CNN trained on
scikit-learn's digits, ``partition --split auto``), starts ``cloud-service``
and ``edge-agent`` as processes on loopback with short timeouts, and then,
for a bounded time, runs these attacks together against both daemons:

* slow clients: request headers one byte every 0.5 s;
* idle sockets: connections opened and never written to;
* unsigned large bodies: 60 MiB POSTs without a signature, sent at full speed;
* aborted uploads: 60 MiB POSTs (signed headers, a device's worst case) closed
  after a few MiB.

Meanwhile good clients send held-out digits through the edge agent (which
signs and forwards them to the cloud). It prints good requests answered /
sent, the p99 latency of good requests, the peak RSS (VmHWM) of each daemon,
and the connections each daemon still holds once every timeout has passed
(the attackers keep their sockets open on their side). Targets: every good
request answered, peak RSS under 300 MB per daemon, no connection held past
its timeout. Loopback only; every loop is bounded; it stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import numpy as np

from splitinfer.sim.daemon import Daemon, start

ROOT = Path(__file__).resolve().parent.parent
TIMEOUTS = {"header": 2.0, "body": 3.0, "keepalive": 3.0}
BIG = 60 * 2**20


def _say(text: str) -> None:
    print(f"bench_hostile: {text}", file=sys.stderr, flush=True)


# -- set-up ---------------------------------------------------------------------------


def build(out: Path) -> tuple[Path, np.ndarray]:
    """The digits package (auto split) and held-out inputs."""
    from splitinfer.models.digits import export_digits, load_digits_split, train_digits_cnn
    from splitinfer.partitioner.cli import main as partition

    x_train, _, x_test, _ = load_digits_split(0)
    model = export_digits(out / "digits.onnx", seed=0, net=train_digits_cnn(seed=0))
    calib = out / "calibration"
    calib.mkdir()
    np.save(calib / "train.npy", x_train[:256])
    pkg = out / "package"
    argv = [str(model), "--calibration", str(calib), "--uplink", "20mbit", "--rtt", "40ms"]
    # the whole model in the cloud: every good request crosses both daemons
    code = partition([*argv, "--split", "none", "-o", str(pkg), "-q"])
    if code != 0:
        raise SystemExit(f"partition failed (exit {code})")
    return pkg, x_test


def peak_rss_mb(daemon: Daemon) -> float:
    """A daemon's peak resident set (VmHWM), in MB."""
    for line in Path(f"/proc/{daemon.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def held(port: int, peers: set[int]) -> int:
    """Server-side sockets on ``port`` still established with one of the attackers' ``peers``."""
    import psutil

    return sum(
        1
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED
        and c.laddr
        and c.laddr.port == port
        and c.raddr
        and c.raddr.port in peers
    )


def _ports(sockets: list[Any]) -> set[int]:
    ports = set()
    for w in sockets:
        name = w.get_extra_info("sockname")
        if name:
            ports.add(int(name[1]))
    return ports


# -- attackers ------------------------------------------------------------------------


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


def _head(path: str, headers: dict[str, str], length: int) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {length}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def slow_client(port: int, path: str, until: float, sockets: list[Any]) -> None:
    """Headers one byte every 0.5 s; reconnects when cut off."""
    head = _head(path, {"Content-Type": "application/octet-stream"}, 10)
    while time.monotonic() < until:
        try:
            _, writer = await _open(port)
            sockets.append(writer)
            for byte in head:
                if time.monotonic() >= until:
                    return
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.5)
        except (ConnectionError, OSError):
            await asyncio.sleep(0.2)


async def idle_sockets(port: int, n: int, sockets: list[Any]) -> None:
    for _ in range(n):
        with contextlib.suppress(ConnectionError, OSError):
            _, writer = await _open(port)
            sockets.append(writer)


async def large_body(
    port: int, path: str, headers: dict[str, str], until: float, stop_after: int | None = None
) -> int:
    """60 MiB POSTs at full speed (or closed after ``stop_after`` bytes); how many were sent."""
    chunk = bytes(2**20)
    sent = 0
    while time.monotonic() < until:
        try:
            reader, writer = await _open(port)
            writer.write(_head(path, headers, BIG))
            done = 0
            while done < (stop_after or BIG) and time.monotonic() < until:
                if reader.at_eof():
                    break
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 5)
                done += len(chunk)
            writer.close()
            sent += 1
        except (ConnectionError, OSError, TimeoutError):
            await asyncio.sleep(0.05)
    return sent


async def good_clients(
    url: str, x: np.ndarray, until: float, workers: int, limit: int
) -> tuple[int, int, int, list[float]]:
    import io

    import aiohttp

    latencies: list[float] = []
    counts = {"sent": 0, "ok": 0, "local": 0}

    async def worker(session: aiohttp.ClientSession, offset: int) -> None:
        i = offset
        while time.monotonic() < until and counts["sent"] < limit:
            buf = io.BytesIO()
            np.save(buf, x[i % len(x)][None])
            i += workers
            counts["sent"] += 1
            t0 = time.perf_counter()
            try:
                async with session.post(
                    url + "/v1/infer",
                    data=buf.getvalue(),
                    headers={"Content-Type": "application/x-npy"},
                    timeout=aiohttp.ClientTimeout(total=30),
                ) as resp:
                    await resp.read()
                    if resp.status == 200:
                        counts["ok"] += 1
                        counts["local"] += resp.headers.get("X-Splitinfer-Local") == "1"
            except (aiohttp.ClientError, TimeoutError):
                pass
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.01)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session, k) for k in range(workers)))
    return counts["sent"], counts["ok"], counts["local"], latencies


# -- the run -------------------------------------------------------------------------------


async def attack(cloud: Daemon, edge: Daemon, x: np.ndarray, seconds: float, cred: Any) -> dict:
    from splitinfer.shared.auth import sign

    # the baseline, in the same run: the good clients alone
    calm = min(5.0, seconds / 2)
    b_sent, b_ok, _, b_lat = await good_clients(
        edge.url, x, time.monotonic() + calm, workers=4, limit=100_000
    )
    until = time.monotonic() + seconds
    sockets: list[Any] = []
    infer = "/v1/models/digits/infer"
    signed = {
        "Content-Type": "application/vnd.splitinfer.frame",
        **sign("POST", infer, b"never sent", cred, time.time()),
    }
    jobs: list[Awaitable[Any]] = []
    for d, path in ((cloud, infer), (edge, "/v1/infer")):
        jobs += [slow_client(d.port, path, until, sockets) for _ in range(10)]
        jobs.append(idle_sockets(d.port, 150, sockets))
        ctype = {"Content-Type": "application/octet-stream"}
        jobs += [large_body(d.port, path, ctype, until) for _ in range(4)]
        abort = signed if d is cloud else {"Content-Type": "application/x-npy"}
        jobs += [large_body(d.port, path, abort, until, stop_after=4 * 2**20) for _ in range(4)]
    good = asyncio.ensure_future(good_clients(edge.url, x, until, workers=4, limit=100_000))
    await asyncio.gather(*jobs, return_exceptions=True)
    sent, ok, local, latencies = await good
    # every timeout has passed; the attackers still hold their side of every socket
    await asyncio.sleep(max(TIMEOUTS.values()) + 1.5)
    result = {
        "seconds": seconds,
        "good_sent": sent,
        "good_answered": ok,
        "good_answered_locally": local,
        "good_p99_ms": float(np.percentile(latencies, 99) * 1e3) if latencies else float("nan"),
        "good_p50_ms": float(np.percentile(latencies, 50) * 1e3) if latencies else float("nan"),
        "baseline": {
            "sent": b_sent,
            "answered": b_ok,
            "p50_ms": float(np.percentile(b_lat, 50) * 1e3),
            "p99_ms": float(np.percentile(b_lat, 99) * 1e3),
        },
        "peak_rss_mb": {"cloud": peak_rss_mb(cloud), "edge": peak_rss_mb(edge)},
        "held_at_end": {
            "cloud": held(cloud.port, _ports(sockets)),
            "edge": held(edge.port, _ports(sockets)),
        },
        "attacker_sockets": len(sockets),
    }
    for w in sockets:
        w.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 s of attack instead of 20")
    p.add_argument("--seconds", type=float, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    seconds = args.seconds or (8.0 if args.quick else 20.0)
    from splitinfer.shared.auth import generate_credential, render_toml

    work = Path(tempfile.mkdtemp(prefix="bench-hostile-"))
    try:
        t0 = time.perf_counter()
        pkg, x = build(work)
        _say(f"digits package built in {time.perf_counter() - t0:.1f} s")
        repo = work / "repository" / "digits" / "1"
        shutil.copytree(pkg, repo)
        cred = generate_credential("bench-cam", "k1")
        creds = work / "credentials.toml"
        creds.write_text(render_toml(cred))
        creds.chmod(0o600)
        t = TIMEOUTS
        one_thread = {"OMP_NUM_THREADS": "1"}
        cloud_args = [
            "--repository", repo.parent.parent, "--credentials", creds, "--listen", "127.0.0.1:0",
            "--header-timeout", f"{t['header']}s", "--body-timeout", f"{t['body']}s",
            "--keepalive-timeout", f"{t['keepalive']}s", "--max-connections", "200",
        ]  # fmt: skip
        with start(
            "cloud-service", cloud_args, log=work / "cloud.log", env=one_thread, timeout_s=120
        ) as cloud:
            edge_args = [
                "--package", pkg, "--cloud", cloud.url, "--credentials", creds,
                "--listen", "127.0.0.1:0",
                "--queue-header-timeout", f"{t['header']}s",
                "--queue-body-timeout", f"{t['body']}s",
                "--queue-keepalive-timeout", f"{t['keepalive']}s",
                "--queue-max-connections", "200",
            ]  # fmt: skip
            with start(
                "edge-agent", edge_args, log=work / "edge.log", env=one_thread, timeout_s=120
            ) as edge:
                _say(f"cloud {cloud.url}, edge {edge.url}; attacking for {seconds:g} s")
                result = asyncio.run(attack(cloud, edge, x, seconds, cred))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok = result["good_answered"] == result["good_sent"] and result["good_sent"] > 0
    rss = max(result["peak_rss_mb"].values()) < 300
    free = not any(result["held_at_end"].values())
    print(
        f"good requests answered / sent: {result['good_answered']} / {result['good_sent']} "
        f"({result['good_answered_locally']} of them by the edge alone)"
    )
    base = result["baseline"]
    print(
        f"good p50 / p99 under attack: {result['good_p50_ms']:.1f} / "
        f"{result['good_p99_ms']:.1f} ms (alone, same run: {base['p50_ms']:.1f} / "
        f"{base['p99_ms']:.1f} ms, {base['answered']} / {base['sent']} answered)"
    )
    print(
        f"peak RSS: cloud {result['peak_rss_mb']['cloud']:.0f} MB, "
        f"edge {result['peak_rss_mb']['edge']:.0f} MB (target < 300)"
    )
    print(
        f"connections held at the end: cloud {result['held_at_end']['cloud']}, edge "
        f"{result['held_at_end']['edge']} (attacker sockets still open: "
        f"{result['attacker_sockets']})"
    )
    for name, passed in (
        ("all good answered", ok),
        ("peak RSS < 300 MB", rss),
        ("none held", free),
    ):
        print(f"{'PASS' if passed else 'FAIL'}  {name}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if ok and rss and free else 1


if __name__ == "__main__":
    sys.exit(main())
