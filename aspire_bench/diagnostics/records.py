"""Diagnostic results as stored runs (kind `diagnostic`): never ranked, shown on their own page."""
from __future__ import annotations

from ..harness import records


def diagnostic_record(config: dict, info: dict, aggregates: dict) -> records.RunRecord:
    """config must name the diagnostic (`diagnostic`: recall | heterogeneity)."""
    return records.RunRecord(config=dict(config), config_hash=records.config_hash(config),
                             env=records.capture_environment(), kind="diagnostic", info=dict(info),
                             aggregates=dict(aggregates))
