"""The sync layout: validation once at construction, derived sizes, replica_of, names, hosts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from weightsync_core.data import sync_layout
from weightsync_core.data.sync_layout import SyncLayout


def test_sizes_and_replicas_are_derived():
    layout = SyncLayout(actor_ranks=2, replica_workers=(2, 1, 3))
    assert (layout.rollout_world_size, layout.num_replicas, layout.world_size) == (6, 3, 8)
    assert [layout.replica_of(rank) for rank in range(6)] == [
        (0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (2, 2)
    ]
    assert [layout.replica_ranks(index) for index in range(3)] == [
        range(0, 2), range(2, 3), range(3, 6)
    ]


def test_a_list_of_workers_is_stored_as_a_tuple_and_layouts_compare_by_value():
    layout = SyncLayout(1, [2, 2])  # type: ignore[arg-type]
    assert layout.replica_workers == (2, 2)
    assert layout == SyncLayout(1, (2, 2))
    assert hash(layout) == hash(SyncLayout(1, (2, 2)))


def test_names_are_those_errors_and_blame_use():
    layout = SyncLayout(2, (1, 2))
    assert layout.actor_names == ["actor_wg rank 0", "actor_wg rank 1"]
    assert layout.rollout_names == [
        "rollout rank 0 (replica 0, worker 0)",
        "rollout rank 1 (replica 1, worker 0)",
        "rollout rank 2 (replica 1, worker 1)",
    ]
    assert layout.names == layout.actor_names + layout.rollout_names
    assert SyncLayout.replica_name(1) == "replica 1"
    assert (SyncLayout.actor_peer_name(0), SyncLayout.rollout_peer_name(3)) == (
        "actor rank 0", "rollout rank 3")


def test_engine_peer_names_translate_to_the_layout_names():
    layout = SyncLayout(1, (1, 2))
    assert layout.name_of_peer("rollout rank 2") == "rollout rank 2 (replica 1, worker 1)"
    assert layout.name_of_peer(" actor rank 0 ") == "actor_wg rank 0"
    assert layout.name_of_peer("rollout rank 3") is None  # not in this layout
    assert layout.name_of_peer("the server") is None
    assert SyncLayout.parse_peer_name("rollout rank 12") == ("rollout", 12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"actor_ranks": -1}, r"SyncLayout.actor_ranks must be an integer >= 0, got -1"),
        ({"actor_ranks": True}, r"SyncLayout.actor_ranks must be an integer >= 0, got True"),
        ({"actor_ranks": 2.0}, r"SyncLayout.actor_ranks must be an integer >= 0, got 2.0"),
        ({"actor_ranks": 1, "replica_workers": 3},
         r"SyncLayout.replica_workers must be a sequence of worker counts \(one integer >= 1 "
         r"per replica, in rollout-rank order\), got 3"),
        ({"actor_ranks": 1, "replica_workers": (2, 0)},
         r"SyncLayout.replica_workers\[1\] \(the workers of replica 1\) must be an integer "
         r">= 1, got 0"),
        ({"actor_ranks": 1, "replica_workers": ("2",)},
         r"SyncLayout.replica_workers\[0\] .* must be an integer >= 1, got '2'"),
        ({"actor_ranks": 2, "actor_rank_hosts": ("a",)},
         r"SyncLayout.actor_rank_hosts must name the host of each of the 2 actor rank\(s\), "
         r"got 1"),
        ({"actor_ranks": 1, "actor_rank_hosts": "a"},
         r"SyncLayout.actor_rank_hosts must be None or a sequence of one host name \(str\)"),
        ({"actor_ranks": 1, "replica_workers": (2,), "rollout_rank_hosts": ("a", None)},
         r"SyncLayout.rollout_rank_hosts\[1\] must be a host name \(str\), got None"),
    ],
)
def test_invalid_fields_are_refused_naming_the_field_and_what_is_accepted(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyncLayout(**kwargs)


def test_ranks_out_of_range_are_refused():
    layout = SyncLayout(1, (2,))
    with pytest.raises(ValueError, match=r"rollout_rank must be an integer in \[0, 2\).*got 2"):
        layout.replica_of(2)
    with pytest.raises(ValueError, match=r"replica must be an integer in \[0, 1\).*got -1"):
        layout.replica_ranks(-1)
    with pytest.raises(ValueError, match=r"rollout_rank must be an integer in \[0, 0\)"):
        SyncLayout(1).rollout_name(0)


def test_an_empty_side_is_a_layout_too():
    colocated = SyncLayout(2)  # the actor processes hand the weights over themselves
    assert (colocated.rollout_world_size, colocated.rollout_names) == (0, [])
    assert SyncLayout(0, (1,)).actor_names == []
    assert SyncLayout.flat(1, 3) == SyncLayout(1, (1, 1, 1))


def test_metadata_is_split_per_side_and_must_cover_every_process():
    layout = SyncLayout(2, (1, 1))
    assert layout.split(["a0", "a1", "r0", "r1"]) == (["a0", "a1"], ["r0", "r1"])
    with pytest.raises(ValueError, match="expected metadata of 4 processes, got 3"):
        layout.split(["a0", "a1", "r0"])


def test_hosts_name_processes_and_each_replica_by_its_first_worker():
    layout = SyncLayout(1, (2, 1))
    assert layout.hosts_by_name() == {}
    located = layout.with_hosts(["h0", "h1", "h2", "h3"])
    assert located.actor_rank_hosts == ("h0",)
    assert located.rollout_rank_hosts == ("h1", "h2", "h3")
    assert located.hosts_by_name() == {
        "actor_wg rank 0": "h0",
        "rollout rank 0 (replica 0, worker 0)": "h1",
        "rollout rank 1 (replica 0, worker 1)": "h2",
        "rollout rank 2 (replica 1, worker 0)": "h3",
        "replica 0": "h1",
        "replica 1": "h3",
    }
    with pytest.raises(ValueError, match="host of each of the 4 processes"):
        layout.with_hosts(["h0"])


def test_the_module_imports_neither_ray_nor_the_manager():
    tree = ast.parse(Path(sync_layout.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name.split(".")[0] == "ray"}
    assert not {name for name in imported if name.startswith("weightsync_core")}
    assert sync_layout.__all__ == ["SyncLayout"]
