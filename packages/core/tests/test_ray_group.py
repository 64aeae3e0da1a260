"""Per-rank arguments of a worker group's engine calls."""

import pytest

from weightsync_core.orchestration.ray_group import split_per_rank


def test_each_rank_gets_its_own_value_of_every_argument():
    split = split_per_rank("init_process_group", {"rank": [0, 1], "port": [7, 8]}, 2)
    assert split == [{"rank": 0, "port": 7}, {"rank": 1, "port": 8}]
    assert split_per_rank("prepare", {}, 3) == [{}, {}, {}]


def test_an_argument_with_another_number_of_values_is_refused_naming_it():
    with pytest.raises(ValueError, match="argument 'port' of init_process_group has 1 values "
                                         "for 2 ranks"):
        split_per_rank("init_process_group", {"rank": [0, 1], "port": [7]}, 2)
