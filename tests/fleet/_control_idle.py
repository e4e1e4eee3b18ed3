"""What idle producers' NS.control watchers cost the brokers: Fetch requests per second per watcher.

Every producer runs one `rollstream.infra.control.ControlWatcher`, a consumer that long-polls NS.control
(``fetch.wait.max.ms`` 1000) for policy versions and trainer positions. With nothing announced its fetches
are what an idle fleet costs; this counts them with librdkafka's statistics (`ClientStats`), for N watchers
in one process on a namespace of their own, over a window after they caught up. Run by ``make fleet``
after its phases (``--idle-watchers``), or alone against any broker:
``python -m tests.fleet._control_idle BOOTSTRAP 32 128``.
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import replace
from typing import Any

from rollstream.infra import KafkaConfig, TopicNames, TopicPlan, create_topics
from rollstream.infra.clients import open_admin
from rollstream.infra.control import ControlWatcher

from tests.fleet._probes import CONTROL_WATCH_PREFIX, ClientStats

_STATS_S = 1.0


def measure(config: KafkaConfig, watchers: int, *, seconds: float = 10.0,
            replication_factor: int = 1) -> dict[str, Any]:
    """Start `watchers` watchers on a fresh NS.control, wait until they caught up, count their requests over
    `seconds`; delete the namespace. Blocks about `seconds` + a few."""
    names = TopicNames(f"idle-{uuid.uuid4().hex[:8]}")
    create_topics(TopicPlan(names=names, partitions=1, replication_factor=replication_factor), config)
    _wait_known_everywhere(config, names.control)
    stats = ClientStats(lambda g: g.startswith(CONTROL_WATCH_PREFIX), interval_s=_STATS_S).install()
    running = [ControlWatcher(config, names.control) for _ in range(watchers)]
    try:
        for w in running:
            w.start()
        for w in running:
            w.wait_caught_up(30.0)
        time.sleep(3 * _STATS_S)  # every client's statistics started
        t0, before = time.monotonic(), stats.totals()
        time.sleep(seconds)
        t1, after = time.monotonic(), stats.totals()
    finally:
        stats.uninstall()
        for w in running:
            w.stop()
        for w in running:
            w.join(5.0)
        admin = open_admin(config.admin())
        topics = [names.prompts, names.rollouts, names.steps, names.control, names.inflight]
        for future in admin.delete_topics(topics).values():
            try:
                future.result(timeout=30.0)
            except Exception:  # noqa: BLE001 - a topic left behind costs nothing here
                pass
    fetches = (after.get("Fetch", 0) - before.get("Fetch", 0)) / (t1 - t0)
    return {"watchers": watchers, "watchers_running": stats.clients(), "seconds": round(t1 - t0, 1),
            "fetch_per_s": round(fetches, 1),
            "fetch_per_s_per_watcher": round(fetches / watchers, 2),
            "requests_per_s_by_api": {api: round((after.get(api, 0) - before.get(api, 0)) / (t1 - t0), 1)
                                      for api in sorted(after) if after.get(api, 0) > before.get(api, 0)}}


def _wait_known_everywhere(config: KafkaConfig, topic: str, timeout_s: float = 30.0) -> None:
    """Until every node lists `topic`: a watcher whose first node does not know it yet gives up on it."""
    deadline = time.monotonic() + timeout_s
    for address in config.bootstrap_servers.split(","):
        admin = open_admin(replace(config, bootstrap_servers=address).admin())  # asks that node first
        while topic not in admin.list_topics(timeout=10.0).topics and time.monotonic() < deadline:
            time.sleep(0.2)


def main(argv: list[str]) -> int:
    config = KafkaConfig(bootstrap_servers=argv[0])
    for n in (int(a) for a in argv[1:] or ["32", "128"]):
        print(measure(config, n), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
