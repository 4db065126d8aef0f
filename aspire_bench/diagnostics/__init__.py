"""Diagnostics of a model rather than of a decoder: how well each sparse view predicts the true
attention (recall) and how much accepted draft lengths vary between requests (heterogeneity).

Harness layer: built on the engine, the decoders' public run API and the tasks; cli.py and the
report use it, never the other way round.
"""
