"""Diagnostic results as stored runs (kind `diagnostic`): never ranked, shown on their own page."""
from __future__ import annotations

from ..harness import records


def diagnostic_record(config: dict, info: dict, aggregates: dict) -> records.RunRecord:
    """config must name the diagnostic (`diagnostic`: recall | heterogeneity); info holds its sections
    (records.RunInfo)."""
    return records.RunRecord(config=dict(config), config_hash=records.config_hash(config),
                             env=records.capture_environment(), kind="diagnostic",
                             info=records.info_sections(info),
                             aggregates=dict(aggregates))
