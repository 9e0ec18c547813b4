"""``aikg up``'s metrics ports and Prometheus target file, without starting a stack
(tests/e2e/test_cli.py scrapes a running one)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli import app
from services.stack import (
    METRICS_SERVICES,
    _service_commands,
    metrics_ports,
    metrics_target,
    write_prometheus_targets,
)


def test_a_base_gives_the_generator_and_the_worker_consecutive_ports() -> None:
    assert METRICS_SERVICES == ("generator", "worker")
    assert metrics_ports(9102) == {"generator": 9102, "worker": 9103}
    assert metrics_ports(None) == {}
    picked = metrics_ports(None, fixed=True)
    assert set(picked) == {"generator", "worker"} and len(set(picked.values())) == 2
    for port in picked.values():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free a moment ago
    for bad in (0, 65535):
        with pytest.raises(ValueError, match="1 to 65535"):
            metrics_ports(bad)


def test_the_ports_go_on_the_services_command_lines() -> None:
    """--metrics-port on the command line wins over an inherited AIKG_METRICS_PORT (the
    flag's envvar), so the two services no longer take the same one; without ports the
    command lines are as before."""
    commands = _service_commands("127.0.0.1", 8000, "cpu", None, "0", nats_setup=True,
                                 metrics_ports={"generator": 9102, "worker": 9103})
    assert commands["generator"] == ["generator", "--metrics-port", "9102"]
    assert commands["worker"][-2:] == ["--metrics-port", "9103"]
    assert "--metrics-port" not in commands["gateway"] + commands["nats-setup"]
    plain = _service_commands("127.0.0.1", 8000, "cpu", "x86_64", "0", nats_setup=False,
                              metrics_ports={})
    assert plain == {"gateway": ["gateway", "--host", "127.0.0.1", "--port", "8000"],
                     "generator": ["generator"],
                     "worker": ["worker", "--backend", "cpu", "--devices", "0",
                                "--arch", "x86_64"]}


def test_the_target_file_is_file_sd_replaced_whole(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIKG_METRICS_HOST", "0.0.0.0")
    assert metrics_target(9102) == "127.0.0.1:9102"  # bound everywhere, reached on loopback
    path = tmp_path / "new" / "aikg-up.json"
    write_prometheus_targets(path, {"gateway": "127.0.0.1:8000", "worker": "127.0.0.1:9103"})
    write_prometheus_targets(path, {"gateway": "127.0.0.1:8001"})
    assert json.loads(path.read_text()) == [
        {"targets": ["127.0.0.1:8001"], "labels": {"service": "gateway"}}]
    assert [p.name for p in path.parent.iterdir()] == ["aikg-up.json"]  # no temp file left
    assert path.stat().st_mode & 0o777 == 0o644  # Prometheus runs as another user


def test_up_refuses_a_base_that_collides_before_starting_anything(tmp_path: Path) -> None:
    runner = CliRunner()
    env = {"AIKG_UP_RUN_DIR": str(tmp_path)}
    done = runner.invoke(app, ["up", "--port", "9200", "--metrics-port-base", "9199"], env=env)
    assert done.exit_code == 2, done.output
    assert "gives port 9200 to a service, but the gateway or the supervisor has it" in done.output
    done = runner.invoke(app, ["up", "--metrics-port-base", "65535"], env=env)
    assert done.exit_code == 2 and "1 to 65535" in done.output, done.output
    assert list(tmp_path.iterdir()) == []  # no run directory: nothing started


def test_up_refuses_a_targets_file_it_cannot_write_before_starting_anything(
        tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = CliRunner().invoke(app, ["up", "--prometheus-targets", str(blocker / "t.json")],
                              env={"AIKG_UP_RUN_DIR": str(tmp_path / "run")})
    assert done.exit_code == 2, done.output
    assert f"--prometheus-targets: cannot create {blocker}" in done.output
    assert not (tmp_path / "run").exists()
