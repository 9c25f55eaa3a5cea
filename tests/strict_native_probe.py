"""Run only by tests/test_cuda_test_policy.py, with a pretended device (not a test_*.py file: never collected on its
own): the cuda tests' strict native ops (tests/conftest.py) fail the test during which an op is switched off and
the test after a fixture switched one off, and leave the next test a clean worker."""

from __future__ import annotations

import pytest

from dgserve import ops

pytestmark = pytest.mark.cuda


def test_an_op_switched_off_while_it_runs():
    ops.switch_off_native("rms_norm", "self-check on cuda: probe")


def test_after_it_the_worker_is_clean():
    assert ops.switched_off() == {}


@pytest.fixture
def engine_switching_an_op_off():
    ops.switch_off_native("moe_route", "self-check on cuda: probe fixture")


def test_an_op_switched_off_by_a_fixture(engine_switching_an_op_off):
    pass


def test_after_that_the_worker_is_clean_too():
    assert ops.switched_off() == {}
