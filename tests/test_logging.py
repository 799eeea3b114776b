"""mpaccel.logging.get_logger: Accelerate's `[RANK r] ` prefix and rank filtering, at size 1 and
under mpiexec -n 2/4."""

from __future__ import annotations

import logging

from mpaccel.logging import get_logger
from tests.conftest import accelerator


def test_messages_carry_the_rank_as_in_accelerate(comm, caplog):
    accelerator(cpu=True)
    logger = get_logger("mpaccel.test", log_level="INFO")
    with caplog.at_level(logging.INFO, logger="mpaccel.test"):
        logger.info("main only")
        logger.info("everyone %d", 7, main_process_only=False)
        logger.info("in turn", main_process_only=True, in_order=True)  # in_order wins
    messages = [rec.getMessage() for rec in caplog.records]
    mine = [f"[RANK {comm.rank}] everyone 7", f"[RANK {comm.rank}] in turn"]
    assert messages == (["[RANK 0] main only", *mine] if comm.rank == 0 else mine)
    assert {rec.funcName for rec in caplog.records} == {
        "test_messages_carry_the_rank_as_in_accelerate"  # the caller, not the adapter
    }


def test_logger_warning_once_and_the_level_from_the_environment(comm, caplog, monkeypatch):
    accelerator(cpu=True)
    root_level = logging.getLogger().level
    try:
        monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "debug")
        logger = get_logger("mpaccel.test.env")
        assert logger.logger.level == logging.DEBUG  # as Accelerate's get_logger
        monkeypatch.setenv("MPACCEL_LOG_LEVEL", "error")  # mpaccel's own name comes first
        assert get_logger("mpaccel.test.env2").logger.level == logging.ERROR
        with caplog.at_level(logging.WARNING, logger="mpaccel.test.env"):
            for _ in range(3):
                logger.warning_once("said once", main_process_only=False)
            logger.warning_once("another", main_process_only=False)
        assert [r.getMessage() for r in caplog.records] == [
            f"[RANK {comm.rank}] said once", f"[RANK {comm.rank}] another"
        ]
        assert {r.funcName for r in caplog.records} == {
            "test_logger_warning_once_and_the_level_from_the_environment"
        }
    finally:
        logging.getLogger().setLevel(root_level)
