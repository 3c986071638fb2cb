"""Calibrated hardware profiles: measured cost parameters that replace a cluster's defaults.

A profile is JSON: `{"name", "machine", "measured_at", "costs": {...}}`, optionally with `device`,
`node` and `network` sections. Its fields replace the cluster's; everything it leaves out stays.
Calibration writes profiles, never code (Calculon keeps hardware as data the same way).
"""
from __future__ import annotations

import os
from typing import Union

from pydantic import ValidationError

from simexec.specs.cluster import ClusterSpec, one_line
from simexec.errors import SpecError

SECTIONS = ("costs", "device", "node", "network")


def load_profile(path: Union[str, os.PathLike]) -> dict:
    from simexec.trace.schema import load_json

    data = load_json(path, "profile")
    if not isinstance(data, dict):
        raise SpecError(f"profile file {path} must hold a JSON object, not {type(data).__name__}")
    return data


def apply_profile(cluster: ClusterSpec, profile: Union[str, os.PathLike, dict]) -> ClusterSpec:
    """The cluster with the profile's costs (and device / node / network fields) in place of its own."""
    where = "profile" if isinstance(profile, dict) else f"profile {profile}"
    data = profile if isinstance(profile, dict) else load_profile(profile)
    if not any(s in data for s in SECTIONS):
        raise SpecError(f"{where} has none of the sections {', '.join(SECTIONS)}")
    spec = cluster.model_dump()
    for section in SECTIONS:
        over = data.get(section)
        if over is None:
            continue
        if not isinstance(over, dict):
            raise SpecError(f"{where}: {section} must be a mapping, not {type(over).__name__}")
        spec[section] = {**spec[section], **over}
    try:
        return ClusterSpec.model_validate(spec)
    except ValidationError as exc:
        raise SpecError(f"{where}: {one_line(exc)}") from None
