"""A trained policy for inference: observations in, env actions out."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from phalanx import checkpoint as ckpt
from phalanx import runs
from phalanx.algo import Normalizers, RunningMeanStd
from phalanx.algo.normalize import model_input
from phalanx.config import Config
from phalanx.devices import resolve_device
from phalanx.draws import Source
from phalanx.envs import make
from phalanx.envs.base import VecEnv
from phalanx.envs.spaces import Space
from phalanx.errors import CheckpointError, MissingExtraError, one_line
from phalanx.models.protocol import ActorCritic
from phalanx.models.registry import build_model, obs_dim_of


class Policy:
    """Wraps a trained model with the observation statistics it was trained under."""

    def __init__(self, model: ActorCritic, obs_rms: RunningMeanStd | None, config: Config, observation_space: Space,
                 action_space: Space, step: int | None = None, action_masks: bool = False):
        self.model = model
        self.step = step  # the training step of the checkpoint it was loaded from (None: not from one)
        self.action_masks = action_masks  # its env gives action masks (VecEnv.action_masks): an export takes one
        self.obs_rms = obs_rms
        self.config = config
        self.observation_space = observation_space
        self.action_space = action_space
        self.memory = None  # memory policies: the LSTM state / KV cache of the slots being played
        # Where set, how it always acts, whatever a caller asks: a league's frozen opponent named greedy:RUN plays
        # greedily, as `phalanx eval` plays it (exploitability is measured against the policy as it is evaluated).
        self.fixed_greedy: bool | None = None

    @property
    def recurrent(self) -> bool:
        """Whether the policy carries memory from one `act` to the next (LSTM, transformer)."""
        return self.model.recurrent

    def reset_memory(self) -> None:
        """Forget every slot's memory (the next `act` starts fresh episodes)."""
        self.memory = None

    def step_state(self) -> dict[str, torch.Tensor]:
        """The memory of the slots being played (empty without one), as a step state (phalanx.graphs)."""
        return {} if self.memory is None else self.memory.tensors()

    def load_step_state(self, state: dict[str, torch.Tensor]) -> None:
        """Take `state` (the names of `step_state`) as the memory, as it is; empty: no memory yet."""
        self.memory = type(self.memory).of(state) if state else None

    @property
    def device(self) -> torch.device:
        """Where the weights are: observations given to `act` go there."""
        return next(self.model.parameters()).device

    def preprocess(self, obs: torch.Tensor) -> torch.Tensor:
        """[*batch, *obs_shape] -> the model's input (`algo.normalize.model_input`, as the rollout's)."""
        return model_input(obs.to(self.device), len(self.observation_space.shape), self.model.obs_is_image, self.obs_rms,
                           self.config.obs_clip)

    @torch.no_grad()
    def act(
        self, obs: torch.Tensor, greedy: bool = True, generator: Source = None,
        reset: torch.Tensor | None = None, active: torch.Tensor | None = None, mask: torch.Tensor | None = None,
        moves: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Map a batch of observations [..., A, *obs_shape] to env actions, greedy or sampled.

        Memory policies carry their memory between calls: pass `reset` [..., A] where an episode
        starts (the previous step ended it) and `active` [..., A] for slots that act. `mask` [..., A, n]
        (StepRecord.action_mask): the actions each slot may take, the only ones played; `moves` (feed-forward
        policies): `moves(obs, mask, greedy)` where the caller read it already, for several policies of one
        config. The actions come back on the observations' device (a policy trained on a GPU plays a CPU env as it is).
        """
        if not torch.is_tensor(obs):
            obs = torch.as_tensor(obs)
        greedy = greedy if self.fixed_greedy is None else self.fixed_greedy
        x = self.preprocess(obs)
        mask = None if mask is None else torch.as_tensor(mask, dtype=torch.bool).to(self.device)
        if not self.recurrent:
            action, _ = self.model.act(x, generator, greedy, mask=mask, moves=moves)
            return self.model.head.to_env(action).to(obs.device)
        if moves is not None:
            raise ValueError("moves are given to a feed-forward policy's act; this policy has memory")
        slots = obs.shape[: obs.dim() - len(self.observation_space.shape)].numel()  # [..., A]: pixels keep C, H, W
        if self.memory is None or self.memory.batch_size != slots:
            self.memory = self.model.initial_state(slots, self.device)
        reset = reset.to(self.device) if reset is not None else None
        active = active.to(self.device) if active is not None else None
        action, _, _, self.memory = self.model.act_step(x, self.memory, reset, active, generator, greedy, mask)
        return self.model.head.to_env(action).to(obs.device)

    @torch.no_grad()
    def moves(self, obs: torch.Tensor, mask: torch.Tensor | None = None, greedy: bool = True) -> torch.Tensor | None:
        """The moves a feed-forward policy's `act` chooses from for observations [..., A, *obs_shape] (the model's
        `moves`: the mask, narrowed where the model reads the game's rules): the same for every policy of one
        config, whatever its weights."""
        if self.recurrent:
            raise ValueError("moves are read for feed-forward policies; this policy has memory")
        greedy = greedy if self.fixed_greedy is None else self.fixed_greedy
        mask = None if mask is None else torch.as_tensor(mask, dtype=torch.bool).to(self.device)
        return self.model.moves(self.preprocess(torch.as_tensor(obs)), mask, greedy)

    @torch.no_grad()
    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """The critic's value of observations `[*batch, A, *obs_shape]` -> `[*batch, A]`, in the units the run trained
        it in (normalised where the run normalised values)."""
        return self.model.value(self.preprocess(obs))


def build_normalizers(cfg: Config, env: VecEnv, num_envs: int, device: torch.device) -> Normalizers:
    """The run's normalisers (observations, rewards, values, as the config asks) for `num_envs` envs of `env`."""
    return Normalizers(obs_dim_of(env), num_envs, env.num_agents, norm_obs=cfg.norm_obs, norm_reward=cfg.norm_reward,
                       norm_value=cfg.norm_value, gamma=cfg.gamma, obs_clip=cfg.obs_clip, device=device)


HUB_PREFIX = "hf:"  # `phalanx.load("hf:OWNER/REPO")`: a package on the Hugging Face Hub


def load(run_dir: str | Path, device: str = "cpu", checkpoint: str | Path | None = None) -> Policy:
    """Load the policy of a run directory (its latest checkpoint, or `checkpoint`), of a package that `phalanx export
    --package` wrote, or of one on the Hugging Face Hub (`hf:OWNER/REPO`, downloaded by huggingface_hub: the hub
    extra)."""
    if isinstance(run_dir, str) and run_dir.startswith(HUB_PREFIX):
        run_dir = hub_download(run_dir.removeprefix(HUB_PREFIX))
    run_dir = Path(run_dir)
    cfg = runs.load_run_config(run_dir)
    dev = resolve_device(device)
    package = checkpoint is None and ckpt.is_package(run_dir)
    if package:
        model_t, step, source = _package_weights(run_dir), _package_step(run_dir), f"package '{run_dir}'"
        obs_stats = ckpt.read_tensors(run_dir / ckpt.OBS_STATS_FILE, "package file") if cfg.norm_obs else {}
        norm_state = {f"obs.{k}": v.to(dev) for k, v in obs_stats.items()}
    else:
        path = Path(checkpoint) if checkpoint else ckpt.latest_checkpoint(run_dir)
        model_t, state_t, meta = ckpt.load_checkpoint(path)
        step, source = meta.get("global_step"), f"checkpoint '{path}'"
        # Env-batch-shaped reward statistics do not matter for inference.
        norm_state = {k: v for k, v in ckpt.section(state_t, "norms", dev).items() if not k.startswith("reward.")}
    env = make(cfg.env, num_envs=1, device=dev, seed=0, **cfg.env_options)
    model = build_model(cfg, env).to(dev)
    if not package:
        ckpt.check_compatible(path, meta, cfg.env, model)
    ckpt.load_weights(model, model_t, source)
    model.eval()
    norms = build_normalizers(cfg, env, 1, dev)
    norms.load_state_dict(norm_state, strict=False)
    policy = Policy(model, norms.obs, cfg, env.observation_space, env.action_space, step=step,
                    action_masks=env.action_masks)
    env.close()
    return policy


def _package_weights(path: Path) -> dict[str, torch.Tensor]:
    return ckpt.read_tensors(path / ckpt.WEIGHTS_FILE, "package file")


def _package_step(path: Path) -> int | None:
    """The step of the checkpoint a package was made from (its results.json), None where it does not say."""
    try:
        step = json.loads((path / "results.json").read_text()).get("checkpoint_step")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def hub_download(repo_id: str) -> Path:
    """A package on the Hugging Face Hub, downloaded (or found in huggingface_hub's cache) -> its local folder."""
    try:
        import huggingface_hub
    except ImportError:
        raise MissingExtraError(f"loading '{HUB_PREFIX}{repo_id}' needs huggingface_hub, which is not installed: "
                                "pip install 'phalanx[hub]'") from None
    try:
        return Path(huggingface_hub.snapshot_download(repo_id=repo_id))
    except Exception as e:  # the hub's own errors: a missing repo, no network, no access
        raise CheckpointError(f"cannot download the package '{HUB_PREFIX}{repo_id}' from the Hugging Face Hub: "
                              f"{one_line(e)}") from None


def frozen_copy(policy: Policy) -> Policy:
    """A frozen `Policy` built like `policy`, with a copy of its weights and observation statistics and
    a memory of its own (a league bank slot; `load_frozen` gives it other weights in place)."""
    model = copy.deepcopy(policy.model).eval().requires_grad_(False)
    rms = copy.deepcopy(policy.obs_rms) if policy.obs_rms is not None else None
    return Policy(model, rms, policy.config, policy.observation_space, policy.action_space,
                  action_masks=policy.action_masks)


def load_frozen(policy: Policy, weights: dict[str, torch.Tensor], obs_stats: dict[str, torch.Tensor], source: str | Path) -> None:
    """Weights and observation statistics into a frozen policy's own tensors, in place (a compiled or
    recorded step that reads them stays valid). Its memory is kept: an env that starts playing it starts an episode, which resets its rows."""
    ckpt.load_weights(policy.model, weights, source)
    if policy.obs_rms is not None:
        policy.obs_rms.load_state_dict({k: v.to(policy.device) for k, v in obs_stats.items()})
