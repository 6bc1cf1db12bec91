"""Policies: the networks and their builders (registry.py, one per kind of phalanx/model_kinds.py)."""
