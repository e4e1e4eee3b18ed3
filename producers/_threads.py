"""A producer's thread pools (`rollstream.infra.threads.ThreadPool`): one for user code, one for its own work."""

from __future__ import annotations

from rollstream.infra.threads import ThreadPool


class ProducerThreads:
    """A producer's pools: `user` (``rollstream-user``, `user_size` threads) for sync generate and reward
    functions, `infra` (``rollstream-infra``) for its own blocking work (encoding a large group, reading the
    prompts' lag). Built first and closed last by `rollstream.producers._parts`. Thread-safe."""

    def __init__(self, user_size: int, infra_size: int = 4) -> None:
        self.user = ThreadPool("rollstream-user", user_size)
        self.infra = ThreadPool("rollstream-infra", infra_size)

    def close(self) -> None:
        """Close both pools (a hung user call keeps only its own daemon thread). Idempotent; never blocks."""
        self.user.close()
        self.infra.close()
