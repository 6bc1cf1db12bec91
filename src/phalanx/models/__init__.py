"""Policies: the model kinds (kinds.py), their builders (registry.py) and the networks."""
