"""`rollstream produce` caps glibc's malloc arenas (rollstream.cli._malloc), unless MALLOC_ARENA_MAX says otherwise.
The RSS it saves is measured by `make soak` (docs/benchmarks.md); here, only that the call does what it says."""

from __future__ import annotations

import platform

import pytest

from rollstream.cli._malloc import cap_malloc_arenas


def test_the_environment_wins_and_glibc_takes_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert cap_malloc_arenas() is False
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    assert cap_malloc_arenas() is (platform.libc_ver()[0] == "glibc")
