"""A trained policy for inference: observations in, env actions out."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from phalanx.algo import RunningMeanStd
from phalanx.config import Config
from phalanx.envs.spaces import Space


class Policy:
    """Wraps a trained model with the observation statistics it was trained under."""

    def __init__(self, model: nn.Module, obs_rms: RunningMeanStd | None, config: Config, observation_space: Space, action_space: Space):
        self.model = model
        self.obs_rms = obs_rms
        self.config = config
        self.observation_space = observation_space
        self.action_space = action_space
        self.memory = None  # memory policies: the LSTM state / KV cache of the slots being played

    @property
    def recurrent(self) -> bool:
        return getattr(self.model, "recurrent", False)

    def reset_memory(self) -> None:
        """Forget every slot's memory (the next `act` starts fresh episodes)."""
        self.memory = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def preprocess(self, obs: torch.Tensor) -> torch.Tensor:
        """[*batch, *obs_shape] -> normalised float features [*batch, obs_dim]."""
        if getattr(self.model, "obs_is_image", False):
            return obs.to(self.device)  # pixels as they are; the CNN scales them
        nd = len(self.observation_space.shape)
        x = obs.to(self.device).float()
        x = x.reshape(*x.shape[: x.dim() - nd], -1)
        if self.obs_rms is not None:
            x = self.obs_rms.normalize(x, self.config.obs_clip)
        return x

    @torch.no_grad()
    def act(
        self, obs: torch.Tensor, greedy: bool = True, generator: torch.Generator | None = None,
        reset: torch.Tensor | None = None, active: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Map a batch of observations [..., A, *obs_shape] to env actions, greedy or sampled.

        Memory policies carry their memory between calls: pass `reset` [..., A] where an episode
        starts (the previous step ended it) and `active` [..., A] for slots that act.
        """
        if not torch.is_tensor(obs):
            obs = torch.as_tensor(obs)
        x = self.preprocess(obs)
        if not self.recurrent:
            action, _ = self.model.act(x, generator, greedy)
            return self.model.head.to_env(action)
        slots = x.shape[:-1].numel()
        if self.memory is None or self.memory.batch_size != slots:
            self.memory = self.model.initial_state(slots, self.device)
        action, _, _, self.memory = self.model.act_step(x, self.memory, reset, active, generator, greedy)
        return self.model.head.to_env(action)

    @torch.no_grad()
    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.model.value(self.preprocess(obs))


def load(run_dir: str | Path, device: str = "cpu", checkpoint: str | Path | None = None) -> Policy:
    """Load the policy of a run directory (its latest checkpoint, or `checkpoint`)."""
    from phalanx import checkpoint as ckpt
    from phalanx.envs import make
    from phalanx.errors import CheckpointError
    from phalanx.runs import resolve_device
    from phalanx.train import Normalizers, build_model, check_compatible, load_run_config

    cfg = load_run_config(Path(run_dir))
    dev = resolve_device(device)
    path = Path(checkpoint) if checkpoint else ckpt.latest_checkpoint(Path(run_dir))
    model_t, state_t, meta = ckpt.load_checkpoint(path)
    env = make(cfg.env, num_envs=1, device=dev, seed=0, **cfg.env_options)
    model = build_model(cfg, env).to(dev)
    check_compatible(path, meta, cfg, model)
    try:
        model.load_state_dict(model_t)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint '{path}' does not fit this model: {str(e).splitlines()[0]}") from None
    model.eval()
    norms = Normalizers(cfg, int(torch.Size(env.observation_space.shape).numel()), 1, env.num_agents, dev)
    norm_state = {k[6:]: v.to(dev) for k, v in state_t.items() if k.startswith("norms.")}
    # Env-batch-shaped reward statistics do not matter for inference.
    norm_state = {k: v for k, v in norm_state.items() if not k.startswith("reward.")}
    norms.load_state_dict(norm_state, strict=False)
    policy = Policy(model, norms.obs, cfg, env.observation_space, env.action_space)
    env.close()
    return policy
