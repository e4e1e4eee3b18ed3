"""The slime adapter's settings (`SlimeSettings`): read from slime's ``args`` (``rollstream_*`` attributes, from
slime's command line) or the ``ROLLSTREAM_*`` environment, checked when built (`rollstream.consumers.slime`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from rollstream.consumers._consumer import DEFAULT_GROUP
from rollstream.schemas import ConfigError

LOOPS = ("sync", "async")
DEFAULT_EVAL_FUNCTION = "slime.rollout.sglang_rollout.generate_rollout"


def _setting(args: Any, name: str, env: str, default: Any = None) -> Any:
    value = getattr(args, name, None)
    if value is None:
        value = os.environ.get(env)
    return default if value is None or value == "" else value


def _number(kind: type[float] | type[int], name: str, value: Any) -> Any:
    if value is None:
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r}: give {'an integer' if kind is int else 'a number'}") from None


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class SlimeSettings:
    """The adapter's settings, read from slime's ``args`` (``rollstream_*`` attributes) or the environment."""

    bootstrap_servers: str | None
    namespace: str
    group: str
    take_timeout: float | None
    max_staleness: int | None
    dynamic_sampling: bool
    loop: str | None
    eval_function_path: str
    kafka_config_file: str | None = None  # librdkafka properties (security.protocol, sasl.*, ssl.*), as --kafka-config

    def __post_init__(self) -> None:
        if not self.namespace or not self.group:
            raise ConfigError(f"rollstream_namespace={self.namespace!r} and rollstream_group={self.group!r} must "
                              "be non-empty")
        if self.take_timeout is not None and not self.take_timeout > 0:
            raise ConfigError(f"rollstream_take_timeout={self.take_timeout}: give a positive number of seconds "
                              "(or leave it unset to wait without limit)")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"rollstream_max_staleness={self.max_staleness} must be >= 0 (or unset)")
        if self.loop is not None and self.loop not in LOOPS:
            raise ConfigError(f"rollstream_slime_loop={self.loop!r}: use 'sync' (slime's train.py) or 'async' "
                              "(train_async.py)")
        if "." not in self.eval_function_path.strip("."):
            raise ConfigError(f"rollstream_eval_function_path={self.eval_function_path!r}: give a dotted path "
                              "module.function, as slime's --eval-function-path")

    @classmethod
    def from_args(cls, args: Any) -> SlimeSettings:
        """Raises ConfigError for a setting that is not valid, naming the values that are."""
        loop = _setting(args, "rollstream_slime_loop", "ROLLSTREAM_SLIME_LOOP")
        if _setting(args, "rollstream_commit", "ROLLSTREAM_COMMIT") is not None:
            raise ConfigError("rollstream_commit is gone: commits follow slime's loop now; set "
                              "rollstream_slime_loop (ROLLSTREAM_SLIME_LOOP) to 'sync' or 'async' instead")
        timeout = _setting(args, "rollstream_take_timeout", "ROLLSTREAM_TAKE_TIMEOUT")
        staleness = _setting(args, "rollstream_max_staleness", "ROLLSTREAM_MAX_STALENESS")
        return cls(
            bootstrap_servers=_setting(args, "rollstream_bootstrap_servers", "ROLLSTREAM_BOOTSTRAP_SERVERS"),
            namespace=str(_setting(args, "rollstream_namespace", "ROLLSTREAM_NAMESPACE", "rollstream")),
            group=str(_setting(args, "rollstream_group", "ROLLSTREAM_TRAINER_GROUP", DEFAULT_GROUP)),
            take_timeout=_number(float, "rollstream_take_timeout", timeout),
            max_staleness=_number(int, "rollstream_max_staleness", staleness),
            dynamic_sampling=_flag(_setting(args, "rollstream_dynamic_sampling", "ROLLSTREAM_DYNAMIC_SAMPLING", True)),
            loop=None if loop is None else str(loop),
            eval_function_path=str(_setting(args, "rollstream_eval_function_path", "ROLLSTREAM_EVAL_FUNCTION_PATH",
                                            DEFAULT_EVAL_FUNCTION)),
            kafka_config_file=_setting(args, "rollstream_kafka_config", "ROLLSTREAM_KAFKA_CONFIG"))
