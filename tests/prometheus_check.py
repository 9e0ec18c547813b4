"""Scrape an ``aikg up`` the way deploy/docker-compose.local.yml's Prometheus does: its
configuration (deploy/prometheus/local.yml) run by a real ``prometheus`` binary, with
only the container paths moved here (the target folder, the token secret) and a 1 s
scrape interval. Used where a test already runs a stack; the binary is optional (Debian
package ``prometheus``).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path
from typing import Any

import httpx
import yaml

from services.common.runtime import free_port

ROOT = Path(__file__).resolve().parents[1]
LOCAL_PROMETHEUS = ROOT / "deploy" / "prometheus" / "local.yml"
# Where compose mounts them in the container (deploy/docker-compose.local.yml).
CONTAINER_TARGETS = "/etc/prometheus/targets/"
CONTAINER_TOKEN = "/run/secrets/aikg_api_token"


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def local_config(targets_dir: Path, token_file: Path) -> dict[str, Any]:
    """deploy/prometheus/local.yml with the container's paths replaced by these."""
    config = yaml.safe_load(LOCAL_PROMETHEUS.read_text())
    config["global"]["scrape_interval"] = "1s"
    for job in config["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            files = sd["files"]
            assert all(f.startswith(CONTAINER_TARGETS) for f in files), files
            sd["files"] = [str(targets_dir / f[len(CONTAINER_TARGETS):]) for f in files]
        if auth := job.get("authorization"):
            assert auth["credentials_file"] == CONTAINER_TOKEN, auth
            auth["credentials_file"] = str(token_file)
    return config


async def scraped_health(targets_dir: Path, token: str, work: Path,
                         services: set[str], timeout_s: float) -> dict[str, str]:
    """Run Prometheus with :func:`local_config` until it has scraped a target of each of
    ``services`` (or ``timeout_s`` passed) and return ``service -> health`` (``up``,
    ``down``: with ``lastError``) of the targets it found.

    Raises:
        RuntimeError: no ``prometheus`` binary here.
    """
    binary = prometheus_binary()
    if binary is None:
        raise RuntimeError("no prometheus binary")
    work.mkdir(parents=True, exist_ok=True)
    token_file = work / "aikg_api_token"
    token_file.write_text(token)
    config = work / "prometheus.yml"
    config.write_text(yaml.safe_dump(local_config(targets_dir, token_file)))
    port = free_port()
    with (work / "prometheus.log").open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", stdout=log, stderr=log)
    health: dict[str, str] = {}
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            while asyncio.get_running_loop().time() < deadline:
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    active = (await client.get("/api/v1/targets")).json()["data"]["activeTargets"]
                    health = {t["labels"].get("service", ""): (
                        t["health"] + (f": {t['lastError']}" if t.get("lastError") else ""))
                        for t in active}
                    if set(health) >= services and all(
                            h != "unknown" for s, h in health.items() if s in services):
                        return health
                await asyncio.sleep(0.5)
        return health
    finally:
        proc.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 20)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
