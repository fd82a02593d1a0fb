"""The DHT latency window, and the waits that scale with it (the periodic progress exchange)."""

from __future__ import annotations

import pytest

from peerd.config import TrainingConfig
from peerd.swarm.latency import LatencyWindow
from peerd.training.trainer import progress_pause

pytestmark = pytest.mark.timeout(30)


def test_the_window_keeps_the_last_requests_and_counts_a_raised_one() -> None:
    window = LatencyWindow(size=3)
    assert window.median() == 0.0 and len(window) == 0
    for seconds in (9.0, 0.1, 0.2, 0.3):  # the first falls out
        window.record(seconds)
    assert len(window) == 3 and window.median() == pytest.approx(0.2)
    with pytest.raises(TimeoutError), window.timing():
        raise TimeoutError  # a request that timed out is still a (slow) request
    assert len(window) == 3 and window.median() == pytest.approx(0.2)  # 0.2, 0.3 and ~0


def test_progress_is_exchanged_less_often_on_a_slow_dht_but_within_its_ttl() -> None:
    config = TrainingConfig(progress_period=0.5, progress_ttl=10.0)
    assert progress_pause(config, 0.01) == 0.5  # a fast DHT: the configured period
    assert progress_pause(config, 1.0) == 2.0  # 2x the median request time
    assert progress_pause(config, 5.0) == 2.5  # a quarter of the TTL at most, or the record would lapse
