"""The algorithm: advantage estimation, PPO losses and update, normalisers."""

from phalanx.algo.adam import Adam, adam_update
from phalanx.algo.gae import GAEParams, compute_gae, pending_bootstrap
from phalanx.algo.normalize import Normalizers, RewardScaler, RunningMeanStd
from phalanx.algo.ppo import (
    PPOBatch,
    PPOParams,
    compile_step,
    explained_variance,
    masked_mean,
    minibatch_step,
    ppo_losses,
    ppo_update,
    saved_bytes,
)
from phalanx.algo.update import advantages, normalised_values, ppo_batch, update_on_rollout

__all__ = [
    "Adam", "GAEParams", "Normalizers", "PPOBatch", "PPOParams", "RewardScaler", "RunningMeanStd", "compute_gae", "explained_variance",
    "adam_update", "advantages", "compile_step", "masked_mean", "minibatch_step", "normalised_values", "pending_bootstrap", "ppo_batch", "ppo_losses",
    "ppo_update", "saved_bytes", "update_on_rollout",
]
