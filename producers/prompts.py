"""Load a JSONL prompt file into NS.prompts (``rollstream prompts load``).

Each line is a JSON object: ``id`` (string, or an integer taken as its decimal string), ``prompt`` (text or
a list of ``{"role", "content"}`` messages), optional ``label`` (any JSON value; non-strings are stored
JSON-encoded) and optional ``metadata`` (an object). Blank lines are skipped. The whole file is
validated before anything is sent: a bad line (not UTF-8, invalid JSON, missing or mistyped field,
unknown key, duplicate id, a record too large for NS.prompts) is a `PromptFileError` naming the file
and line, and nothing from the file is published.
With ``epochs=E`` every prompt is published once per epoch (epoch-major order), keyed by prompt id so
all epochs of a prompt share a partition and come in order.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

from rollstream.infra import KafkaConfig, TopicNames
from rollstream.infra.clients import open_producer
from rollstream.infra.kafka_io import produce_and_wait, require_topics
from rollstream.infra.topics import sized_to_topic
from rollstream.schemas import ConfigError, InvalidRecordError, Prompt, encode

log = logging.getLogger(__name__)
_KEYS = frozenset({"id", "prompt", "label", "metadata"})
# A record's overhead in a record batch beyond its key and value (headers, lengths, batch header): generous.
_RECORD_FRAMING_BYTES = 128


class PromptFileError(ConfigError):
    """A line of a prompt file is invalid. Attributes: `path`, `line` (1-based)."""

    def __init__(self, path: Path, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}; nothing from this file was published")
        self.path, self.line = path, line


def read_prompts(path: str | Path) -> list[Prompt]:
    """Parse and validate every line of `path` (epoch 0). Blocks on file I/O only.

    Raises:
        PromptFileError: the first bad line, by number (also a line that is not UTF-8).
        ConfigError: the file cannot be read.
    """
    return [prompt for _, prompt in _numbered_prompts(Path(path))]


def _numbered_prompts(path: Path) -> list[tuple[int, Prompt]]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read prompt file {path}: {exc.strerror or exc}") from exc
    prompts: list[tuple[int, Prompt]] = []
    seen: dict[str, int] = {}
    for number, data in enumerate(raw.splitlines(), start=1):
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PromptFileError(path, number, f"not UTF-8: byte 0x{data[exc.start]:02x} at column {exc.start + 1}"
                                                "; save the file as UTF-8") from exc
        if not line.strip():
            continue
        prompt = _parse_line(path, number, line)
        if prompt.id in seen:
            raise PromptFileError(path, number, f"duplicate id {prompt.id!r} (first on line {seen[prompt.id]})")
        seen[prompt.id] = number
        prompts.append((number, prompt))
    if not prompts:
        raise ConfigError(f"prompt file {path} has no prompts")
    return prompts


def _parse_line(path: Path, number: int, line: str) -> Prompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptFileError(path, number, f"invalid JSON: {exc.msg} at column {exc.colno}") from exc
    if not isinstance(obj, Mapping):
        raise PromptFileError(path, number, f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise PromptFileError(path, number, f"unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
                                            "id, prompt, label, metadata")
    pid = obj.get("id")
    if isinstance(pid, int) and not isinstance(pid, bool):
        pid = str(pid)
    if not isinstance(pid, str) or not pid:
        raise PromptFileError(path, number, f"'id' must be a non-empty string, got {obj.get('id')!r}")
    if "prompt" not in obj:
        raise PromptFileError(path, number, "missing 'prompt'")
    metadata = obj.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise PromptFileError(path, number, "'metadata' must be a JSON object")
    try:
        return Prompt(id=pid, prompt=obj["prompt"], label=obj.get("label"), metadata=metadata)
    except InvalidRecordError as exc:
        raise PromptFileError(path, number, str(exc)) from exc


def publish_prompts(prompts: list[Prompt], config: KafkaConfig, topic: str, *, epochs: int = 1,
                    start_epoch: int = 0, timeout: float = 60.0) -> int:
    """Publish each prompt once per epoch and wait for every acknowledgement. Blocks (a CLI loader, no
    event loop: waiting while librdkafka's queue is full is the point), then up to `timeout` s to flush.

    Returns the number of records acknowledged (len(prompts) x epochs).
    Raises:
        KafkaIOError (retriable): some records were not acknowledged (the message says how many and why).
    """
    if epochs < 1:
        raise ConfigError(f"--epochs {epochs} must be >= 1")
    producer = open_producer(config.producer({"linger.ms": 20}))

    def records() -> Iterator[tuple[bytes | None, bytes]]:
        for epoch in range(start_epoch, start_epoch + epochs):
            for prompt in prompts:
                yield prompt.id.encode(), encode(replace(prompt, epoch=epoch))

    total = produce_and_wait(producer, topic, records(), timeout=timeout)
    log.info("published %d prompts (%d epochs) to %s", total, epochs, topic)
    return total


def load_prompts(path: str | Path, config: KafkaConfig | None = None, *, namespace: str = "rollstream",
                 epochs: int = 1, start_epoch: int = 0, timeout: float = 60.0) -> int:
    """Validate the whole file, then publish it to NS.prompts (see module doc). Blocks.

    Every record must fit NS.prompts' ``max.message.bytes`` (read from the broker): one that would not
    is refused, naming its line, before anything is published, so a file loads whole or not at all.

    Returns the number of records published.
    Raises:
        PromptFileError: a bad line, or a prompt too large for the topic (nothing published).
        KafkaIOError: broker unreachable (retriable), NS.prompts missing, or records not acknowledged.
    """
    numbered = _numbered_prompts(Path(path))
    config = config or KafkaConfig()
    topic = TopicNames(namespace).prompts
    require_topics(config, [topic], namespace=namespace, timeout=min(timeout, 15.0))
    config = sized_to_topic(config, topic, timeout=min(timeout, 15.0))
    _check_sizes(Path(path), numbered, start_epoch + epochs - 1, config.max_message_bytes, topic)
    return publish_prompts([p for _, p in numbered], config, topic, epochs=epochs, start_epoch=start_epoch,
                           timeout=timeout)


def _check_sizes(path: Path, numbered: list[tuple[int, Prompt]], last_epoch: int, limit: int, topic: str) -> None:
    """Refuse the file if a prompt's record (with its key and the record framing) would exceed `limit`.

    Sizes are taken uncompressed, at the last epoch (the largest epoch number encodes longest): a record
    that compresses below the limit is still refused, which errs on the side of a clear error now."""
    for number, prompt in numbered:
        size = len(encode(replace(prompt, epoch=last_epoch))) + len(prompt.id.encode()) + _RECORD_FRAMING_BYTES
        if size > limit:
            raise PromptFileError(path, number, f"prompt {prompt.id!r} makes a record of {size} bytes, above "
                                                f"{topic}'s max.message.bytes={limit}; shorten it, or create the "
                                                "topics with a larger --max-message-mib")
