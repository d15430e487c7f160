"""`specsplit-cloud serve` says which format the target chose and why (issue 41, blocker 3)."""

from __future__ import annotations

import io
import logging
import os
import socket

import pytest

from specsplit.cloud import cli
from specsplit.cloud.cli import target_report
from specsplit.cloud.engine import kernel_library
from specsplit.shared.weights.sources import SourceError


def _log_as_the_target_does(*records: tuple[str, int, str]) -> str:
    """Lines as the Triton stub writes them (model_repository/target/1/model.py's format)."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name, level, message in records:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        try:
            logger.log(level, message)
        finally:
            logger.removeHandler(handler)
    return "I1125 23:00:00.1 server.cc] started\n" + out.getvalue()


def test_the_report_holds_the_calibration_the_choice_and_the_kernels_reason():
    log = _log_as_the_target_does(
        (kernel_library.log.name, logging.INFO, "CPU kernels unavailable: no cc"),
        (
            "specsplit.cloud.engine.precision",
            logging.INFO,
            "target weights by calibration "
            "(one layer's MLP, ms at 1/9 rows): {'float32': [10.6, 16.8]} -> float32",
        ),
        ("specsplit.cloud.engine.target", logging.INFO, "forward cost by rows (ms): {1: 92.0}"),
        (
            "specsplit.cloud.engine.target",
            logging.INFO,
            "target /m on cpu (float weights, torch.float32), vocab 151665",
        ),
    )
    assert target_report(log) == [
        "CPU kernels unavailable: no cc",
        "target weights by calibration (one layer's MLP, ms at 1/9 rows): "
        "{'float32': [10.6, 16.8]} -> float32",
        "target /m on cpu (float weights, torch.float32), vocab 151665",
    ]


@pytest.mark.slow
def test_serve_prints_the_targets_format(cloud):
    """The real serve (tests/conftest.py's cloud, tiny target) prints what its target chose."""
    err = cloud.log_path.read_text()
    lines = [line for line in err.splitlines() if line.startswith("target ")]
    assert any(" weights, " in line for line in lines), err


@pytest.fixture
def held_port():
    """A port this test process listens on, as another serve would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture(autouse=True)
def no_stack_dump_handler(monkeypatch):
    """main's SIGUSR1 handler needs a real stderr, and would outlive the test in pytest."""
    monkeypatch.setattr(cli.faulthandler, "register", lambda *args, **kwargs: None)


@pytest.fixture
def target_never_loads(monkeypatch):
    """serve fails the test if it gets as far as loading the target."""

    def load(name):
        raise AssertionError(f"the target {name} was loaded before the port was checked")

    monkeypatch.setattr(cli, "resolve_model", load)


def test_a_held_port_exits_2_before_the_target_loads(held_port, target_never_loads, capsys):
    assert cli.main(["serve", "--port", str(held_port)]) == 2
    err = capsys.readouterr().err
    assert f"port {held_port} on 127.0.0.1 is in use" in err
    assert f"pid {os.getpid()} (" in err  # the holder, cheaply known: this process
    assert "--port" in err


def test_a_held_metrics_port_exits_2_before_the_target_loads(held_port, target_never_loads, capsys):
    argv = ["serve", "--port", "0", "--metrics-port", str(held_port)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"port {held_port} on 127.0.0.1 is in use" in err
    assert "--metrics-port" in err


def test_a_free_port_goes_on_to_the_target(monkeypatch, capsys):
    with socket.socket() as s:  # bound, closed: free again (SO_REUSEADDR as the gateway binds)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def load(name):
        raise SourceError(f"{name}: reached the target")

    monkeypatch.setattr(cli, "resolve_model", load)
    assert cli.main(["serve", "--port", str(port)]) == 1
    assert "reached the target" in capsys.readouterr().err
