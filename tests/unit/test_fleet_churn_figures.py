"""The arithmetic of ``python -m tests.fleet --churn`` (`tests.fleet._churn`): the bound of each moment, the lag's
stretches over a limit, and the trainer's throughput recovery after an event."""

from __future__ import annotations

from types import SimpleNamespace

from tests.fleet._churn import Churn, Event, _longest, _recovery, _settled, leaver_term, render
from tests.fleet._phase import PhaseSpec


def _spec(**kw: object) -> PhaseSpec:
    base: dict = dict(index=0, mode="pushed", producers=128, per_process=32, partitions=128, seconds=20.0,
                      concurrency=4, max_lag=64, n_samples=4, take_n=32, step_ms=20.0, gen_ms=(5.0, 50.0), seed=1,
                      churn=True)
    return PhaseSpec(**{**base, **kw})


def test_a_leaver_leaves_its_share_plus_one_plus_its_concurrency() -> None:
    # 96 producers alive on 128 partitions: one owns at most 2, its share is 64 x 2 / 128 = 1
    assert leaver_term(64, 128, 96, 4) == 1 + 1 + 4
    # 24 alive (32 producers, 8 gone): 6 partitions, share 3
    assert leaver_term(64, 128, 24, 4) == 3 + 1 + 4


def test_the_bound_grows_by_each_leaver_and_follows_the_producers_alive() -> None:
    spec = _spec()
    active = [SimpleNamespace(spec={"count": 32}) for _ in range(4)]
    churn = Churn(SimpleNamespace(spec=spec, active=active, say=lambda _m: None), None, 2)  # type: ignore[arg-type]
    assert churn._bound(churn._live()) == spec.in_flight_bound == 576
    active.pop(0)
    churn._leave(32, churn._live())  # killed; a replacement of 32 starts
    active.append(SimpleNamespace(spec={"count": 32}))
    assert churn._bound(churn._live()) == 64 + 128 * 4 + 32 * 6 == 768
    active.pop(0)
    churn._leave(32, churn._live())  # drained
    assert churn._bound(churn._live()) == 64 + 96 * 4 + 64 * 6 == 832


def test_stretches_over_a_limit_and_when_the_lag_settled() -> None:
    samples = [(0.0, 10), (1.0, 80), (2.0, 90), (3.0, 20), (4.0, 70), (5.0, 10), (6.0, 5)]
    assert _longest(samples, 64) == 1.0
    assert _settled(samples, 64, 0.0) == 5.0
    assert _settled([(0.0, 1)], 64, 0.0) == 0.0
    assert _settled([(0.0, 100)], 64, 0.0) is None


def test_recovery_is_the_first_moment_whose_next_window_is_back_near_the_baseline() -> None:
    # 2 steps/s, none in the 4 s after the event at 10 s, then 2 steps/s again
    steps = [(t / 2, 32, 0) for t in range(0, 80) if not 20 <= t < 28]
    got = _recovery(steps, 10.0, 40.0, 2.0)
    assert got["lowest_steps_per_s"] == 0.4  # [10, 15): two steps, at 14.0 and 14.5
    assert got["recovered_after_s"] == 3.0  # [13, 18): 8 steps, 1.6/s = 80% of 2
    assert _recovery(steps, 20.0, 40.0, 2.0)["recovered_after_s"] == 0.0


def test_figures_and_their_table() -> None:
    spec = _spec()
    churn = Churn(SimpleNamespace(spec=spec, say=lambda _m: None), None, 2)  # type: ignore[arg-type]
    churn.events = [Event("baseline", 0, 128, 0, 576), Event("worker-killed", 20, 128, 32, 768, "k"),
                    Event("worker-drained", 40, 96, 64, 832), Event("node-killed", 60, 96, 64, 832),
                    Event("node-restarted", 90, 96, 64, 832)]
    lag = [(t / 10, 100) for t in range(0, 1100, 5) if not 600 < t < 900]
    steps = [(t / 4, 32, 0) for t in range(0, 440) if not 240 < t < 300]
    figures = churn.figures(lag + [(95.0, 900)], steps, 110.0, 0.0, across=[(70.0, 300)], failed_at=[65.0])
    assert not figures["within_bound"] and figures["over_bound"] == [(95.0, 900, 832)]
    node = figures["events"][3]
    assert node["lag_samples"] == 1 and node["lag_max_during_commits"] == 300 and node["lag_reads_failed"] == 1
    assert node["longest_unsampled_s"] == 30.0
    assert "OVER" in "\n".join(render({"label": "x", "churn": figures}))
