"""How much of each long-running case to run: the default profile (every commit, CI) or the
long one (``./scripts/test-packages --long``, every release).

Both profiles run every case and assert the same: the long one with the counts the cases
were written with (soaks of 100-300 syncs, 25,000 connections at every port, a failure at
every position), the default one with counts still large enough to catch what each case is
about (a leak per sync, per connection), position loops sampled and failure timeouts sized
to what a healthy sync takes. Choose a count with :func:`by_profile`, a sample of positions
with :func:`sample`::

    soak_syncs = by_profile(default=40, long=200)
    for position in sample(range(len(names)), 3): ...

``WEIGHTSYNC_TEST_PROFILE`` selects the profile (``default``, or ``long``);
``WEIGHTSYNC_TEST_SEED`` the seed of :func:`sample` (``scripts/test-packages`` draws one per
run and prints it; unset, it is 0).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from typing import TypeVar

__all__ = ["PROFILES", "by_profile", "long_profile", "profile", "sample", "seed"]

PROFILE_VARIABLE = "WEIGHTSYNC_TEST_PROFILE"
SEED_VARIABLE = "WEIGHTSYNC_TEST_SEED"
PROFILES = ("default", "long")

_T = TypeVar("_T")


def profile() -> str:
    """The profile selected by ``WEIGHTSYNC_TEST_PROFILE``: ``default`` where it is unset or
    empty; a value that is no profile is refused (a typo must not run the short one)."""
    name = os.environ.get(PROFILE_VARIABLE, "").strip() or "default"
    if name not in PROFILES:
        raise ValueError(f"{PROFILE_VARIABLE}={name!r} is no test profile; use one of "
                         f"{', '.join(PROFILES)}")
    return name


def long_profile() -> bool:
    """Whether the long profile runs (the counts the cases were written with)."""
    return profile() == "long"


def by_profile(*, default: _T, long: _T) -> _T:
    """``long`` in the long profile, ``default`` otherwise."""
    return long if long_profile() else default


def seed() -> int:
    """The seed of :func:`sample`: ``WEIGHTSYNC_TEST_SEED``, 0 where it is unset."""
    value = os.environ.get(SEED_VARIABLE, "").strip()
    try:
        return int(value) if value else 0
    except ValueError:
        raise ValueError(f"{SEED_VARIABLE}={value!r} is not an integer") from None


def sample(items: Iterable[_T], count: int) -> list[_T]:
    """Every item in the long profile; in the default one the first, the last and
    ``count - 2`` others drawn with :func:`seed` (every item where there are no more than
    ``count``), in their order. A case that loops over positions names the one that failed,
    so a failure found with one seed can be rerun at that position."""
    if count < 2:
        raise ValueError(f"a sample keeps the first and the last item: count {count} < 2")
    every = list(items)
    if long_profile() or len(every) <= count:
        return every
    inner = sorted(random.Random(seed()).sample(range(1, len(every) - 1), count - 2))
    return [every[0], *(every[index] for index in inner), every[-1]]
