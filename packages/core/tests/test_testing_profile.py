"""The test profiles (``weightsync_core.testing.profile``): the default one for every commit,
the long one (``scripts/test-packages --long``) for releases."""

import pytest

from weightsync_core.testing.profile import by_profile, long_profile, profile, sample


def test_the_default_profile_runs_where_none_is_chosen(monkeypatch):
    monkeypatch.delenv("WEIGHTSYNC_TEST_PROFILE", raising=False)
    assert profile() == "default" and not long_profile()
    assert by_profile(default=40, long=200) == 40
    monkeypatch.setenv("WEIGHTSYNC_TEST_PROFILE", "long")
    assert profile() == "long" and long_profile()
    assert by_profile(default=40, long=200) == 200


def test_a_misspelt_profile_is_refused(monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_TEST_PROFILE", "lnog")
    with pytest.raises(ValueError, match="'lnog' is no test profile; use one of default, long"):
        by_profile(default=1, long=2)


def test_a_sample_keeps_the_first_and_the_last_and_the_seed_picks_the_rest(monkeypatch):
    monkeypatch.delenv("WEIGHTSYNC_TEST_PROFILE", raising=False)
    monkeypatch.setenv("WEIGHTSYNC_TEST_SEED", "7")
    picked = sample(range(20), 4)
    assert len(picked) == 4 and picked[0] == 0 and picked[-1] == 19
    assert picked == sorted(set(picked))
    assert sample(range(20), 4) == picked  # the same seed, the same sample
    others = set()
    for seed in range(20):
        monkeypatch.setenv("WEIGHTSYNC_TEST_SEED", str(seed))
        others.update(sample(range(20), 4)[1:-1])
    assert len(others) > 8  # seeds spread the sample over the positions between
    assert sample(range(3), 4) == [0, 1, 2]  # no more than asked for: every one
    monkeypatch.setenv("WEIGHTSYNC_TEST_PROFILE", "long")
    assert sample(range(20), 4) == list(range(20))


def test_a_sample_needs_room_for_the_first_and_the_last():
    with pytest.raises(ValueError, match="keeps the first and the last"):
        sample(range(10), 1)
