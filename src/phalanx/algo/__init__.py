"""The algorithm: advantage estimation, PPO losses and update, normalisers."""

from phalanx.algo.adam import Adam, adam_update
from phalanx.algo.gae import GAEParams, compute_gae, pending_bootstrap
from phalanx.algo.normalize import Normalizers, RewardScaler, RunningMeanStd, model_input, normalised_values
from phalanx.algo.ppo import (
    PPOBatch,
    StepParams,
    UpdateParams,
    compile_step,
    explained_variance,
    masked_mean,
    minibatch_step,
    ppo_losses,
    ppo_update,
    saved_bytes,
)

__all__ = [
    "Adam", "GAEParams", "Normalizers", "PPOBatch", "RewardScaler", "RunningMeanStd", "StepParams", "UpdateParams",
    "adam_update", "compile_step", "compute_gae", "explained_variance", "masked_mean", "minibatch_step", "model_input",
    "normalised_values", "pending_bootstrap", "ppo_losses", "ppo_update", "saved_bytes",
]
