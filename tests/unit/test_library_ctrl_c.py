"""Ctrl-C in a trainer's own loop (the Python API, no CLI): librdkafka hands over only the log lines the
``librdkafka`` logger would emit (``log_level``, `rollstream.infra.config.librdkafka_log_level`), so with that
logger quiet no Python callback runs inside ``consume()`` and SIGINT comes out as KeyboardInterrupt, never as
confluent-kafka 2.16's ``SystemError: ... returned NULL without setting an exception`` (docs/operations.md)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from rollstream.infra import KafkaConfig
from rollstream.infra.config import LIBRDKAFKA_LOGGER, librdkafka_log_level


@pytest.fixture
def librdkafka_logger() -> Iterator[logging.Logger]:
    level = LIBRDKAFKA_LOGGER.level
    try:
        yield LIBRDKAFKA_LOGGER
    finally:
        LIBRDKAFKA_LOGGER.setLevel(level)


@pytest.mark.parametrize(("level", "syslog"), [(logging.DEBUG, 7), (logging.INFO, 6), (logging.WARNING, 4),
                                               (logging.ERROR, 3), (logging.CRITICAL, 2), (logging.CRITICAL + 1, 0)])
def test_log_level_hands_over_only_what_the_logger_emits(librdkafka_logger: logging.Logger, level: int,
                                                         syslog: int) -> None:
    librdkafka_logger.setLevel(level)
    assert librdkafka_log_level() == syslog
    common = KafkaConfig(bootstrap_servers="127.0.0.1:1").common()
    assert common["log_level"] == syslog and common["logger"] is librdkafka_logger  # never straight to stderr
    # A client's own setting (a --kafka-config file) wins.
    assert KafkaConfig(bootstrap_servers="127.0.0.1:1", extra={"log_level": "7"}).common()["log_level"] == "7"


_TRAINER = """
import faulthandler, logging, signal, sys
faulthandler.register(signal.SIGUSR1)  # the test asks for the stacks of one that does not end
from confluent_kafka import TopicPartition
from rollstream.infra import KafkaConfig
from rollstream.infra.clients import open_consumer
logging.getLogger("librdkafka").setLevel(logging.CRITICAL + 1)  # the trainer does not want librdkafka's lines
dead = ",".join(f"127.0.0.1:{p}" for p in range(1, 11))  # nothing listens: librdkafka fails connections all along
consumer = open_consumer(KafkaConfig(bootstrap_servers=dead).consumer("g"))
consumer.assign([TopicPartition("t", 0, 0)])
print("polling", flush=True)
try:
    while True:
        consumer.consume(10, timeout=1.0)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
"""


def test_sigint_reaches_a_library_consumer_polling_an_unreachable_broker_as_keyboard_interrupt() -> None:
    procs = [subprocess.Popen([sys.executable, "-c", _TRAINER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "polling", proc.stderr
        time.sleep(2.0)  # librdkafka is failing connections by now
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGUSR1)  # where it is stuck: its threads' Python stacks, on stderr
                time.sleep(1.0)
                proc.kill()
                out, err = proc.communicate()
                pytest.fail(f"no end within 20 s of SIGINT; stdout {out!r}; stderr {err[-4000:]}")
            assert proc.returncode == 0 and out.strip() == "KeyboardInterrupt", err[-2000:]
            assert "SystemError" not in err
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
