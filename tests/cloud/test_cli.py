"""`specsplit-cloud serve` says which format the target chose and why (issue 41, blocker 3)."""

from __future__ import annotations

import io
import logging

import pytest

from specsplit.cloud.cli import target_report


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
        ("specsplit.cloud.engine.cpu_kernels", logging.INFO, "CPU kernels unavailable: no cc"),
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
