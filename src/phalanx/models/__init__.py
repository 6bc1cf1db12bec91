"""Policies: MLP actor-critics and their action heads."""

from phalanx.models.mlp import ActionHead, MLPActorCritic

__all__ = ["ActionHead", "MLPActorCritic"]
