"""Shared fixtures. `ray_session`: one local Ray instance for every `@pytest.mark.ray` test.

Starting Ray takes seconds (about 5-9 s here), so the whole session shares one; each test still
starts and tears down its own rank actors. Tests that need a Ray of their own (a two-node cluster,
Ctrl-C of a driver that started Ray itself) run it in a subprocess.
"""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    from simexec.exec.runtime.launcher import start_ray, stop_ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    owned = start_ray()
    yield ray
    stop_ray(owned)
