"""A fixed sample of the ONNX backend node tests (tests/onnx_conformance.py has the full
run): no case that TVM's own build passes may fail with jitbyoc."""

from __future__ import annotations

import pytest

pytest.importorskip("onnx")  # noqa: E402 - a test extra

from tests.onnx_conformance import cases, run_case  # noqa: E402

SAMPLE = cases()[::20]  # ~95 cases, every op family sampled


@pytest.mark.parametrize("case", SAMPLE, ids=[c.name for c in SAMPLE])
def test_no_regression_against_tvm(case):
    out = run_case(case)
    if out is None:
        pytest.skip("TVM's ONNX frontend does not import this model")
    assert not out.regression, f"TVM passes, jitbyoc: {out.jit}"
