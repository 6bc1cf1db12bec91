"""CNN policies for image observations: a Nature-DQN encoder, a feed-forward actor-critic and a
memory actor-critic (LSTM / transformer core) with the encoder in front.

Observations are images [..., C, H, W] (a frame stack as channels) whose pixel values lie in
[0, max_value]. They stay uint8 in the rollout buffer (4x smaller than float32); the models
normalise them themselves (`x.float() / max_value`), so no observation normaliser is needed.
The last batch axis before the image is the agent axis A (A = 1 for single-agent envs), as for
`MLPActorCritic` and the memory models.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.config import default
from phalanx.draws import Source
from phalanx.envs.spaces import Space
from phalanx.model_kinds import LSTM, TRANSFORMER
from phalanx.models.layers import ACTIVATIONS, Linear, layer_init
from phalanx.models.memory import LSTMActorCritic, MemorySettings, TransformerActorCritic
from phalanx.models.mlp import ActionHead, MaskAsGiven
from phalanx.models.state import NoMemory

MEMORY_CORES = {LSTM.name: LSTMActorCritic, TRANSFORMER.name: TransformerActorCritic}
SETTINGS_FIELDS = tuple(f.name for f in dataclasses.fields(MemorySettings) if f.name not in ("obs_dim", "action_space"))


def conv_min_size(kernels: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """The smallest spatial size that leaves at least one output pixel after the conv stack."""
    size = 1
    for k, s in zip(reversed(kernels), reversed(strides)):
        size = k + s * (size - 1)
    return size


class CNNEncoder(nn.Module):
    """Conv (ReLU) layers, then a dense layer (ReLU) to `out_dim`: images [..., C, H, W] (uint8 or
    float, any leading batch axes) -> features [..., out_dim].

    The defaults are the Nature-DQN stack. Images smaller than the smallest size the stack accepts
    (36 pixels for the defaults) are zero-padded symmetrically up to it, so any size works; a 72 x 80
    image needs no padding (conv outputs 17x19 -> 7x8 -> 5x6, 1920 features).
    """

    def __init__(
        self,
        in_shape: tuple[int, int, int],
        channels: tuple[int, ...] = default("cnn_channels"),
        kernels: tuple[int, ...] = (8, 4, 3),
        strides: tuple[int, ...] = (4, 2, 1),
        out_dim: int = default("cnn_dense"),
        max_value: float = 3.0,
    ):
        super().__init__()
        if not len(channels) == len(kernels) == len(strides) >= 1:
            raise ValueError(f"channels {channels}, kernels {kernels} and strides {strides} must have the same length")
        if len(in_shape) != 3:
            raise ValueError(f"in_shape must be (C, H, W), got {tuple(in_shape)}")
        self.in_shape = tuple(int(d) for d in in_shape)
        self.out_dim, self.max_value = out_dim, float(max_value)
        c, h, w = self.in_shape
        m = conv_min_size(tuple(kernels), tuple(strides))
        ph, pw = max(m - h, 0), max(m - w, 0)
        self.pad = (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2)  # F.pad order: W left/right, H top/bottom
        layers: list[nn.Module] = []
        for ch, k, s in zip(channels, kernels, strides):
            layers += [layer_init(nn.Conv2d(c, ch, k, s)), nn.ReLU()]
            c = ch
        layers.append(nn.Flatten())
        self.convs = nn.Sequential(*layers)
        with torch.no_grad():  # the flattened size for any image size and stack
            self.conv_out_dim = self.convs(torch.zeros(1, self.in_shape[0], h + ph, w + pw)).shape[-1]
        self.dense = nn.Sequential(layer_init(nn.Linear(self.conv_out_dim, out_dim)), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-3:]) != self.in_shape:
            raise ValueError(f"expected images [..., {', '.join(map(str, self.in_shape))}], got {tuple(x.shape)}")
        batch = x.shape[:-3]
        x = x.reshape(-1, *self.in_shape).to(self.dense[0].weight.dtype) / self.max_value
        if any(self.pad):
            x = F.pad(x, self.pad)
        return self.dense(self.convs(x)).reshape(*batch, self.out_dim)


def _trunk(in_dim: int, hidden: tuple[int, ...], activation: str) -> tuple[nn.Module, int]:
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [layer_init(Linear(in_dim, h)), ACTIVATIONS[activation]()]
        in_dim = h
    return (nn.Sequential(*layers) if layers else nn.Identity()), in_dim


class CNNActorCritic(MaskAsGiven, nn.Module):
    """Drop-in for `MLPActorCritic` over image observations [..., A, C, H, W].

    encoder -> optional dense `hidden_sizes` -> linear actor head (ActionHead) and linear critic head.
    With `shared_encoder` (the default, as CleanRL's Atari PPO) actor and critic share the encoder
    and hidden layers, so the value loss also shapes the features the policy reads; otherwise the
    critic has its own encoder and hidden layers. `agent_id` appends a one-hot of the agent slot to
    the encoder features. The critic is per-agent (IPPO); there is no centralized critic.
    `act_value` / `evaluate_value` run the shared encoder once for both heads.
    """

    obs_is_image = True
    recurrent = False
    memory_critic = False

    def __init__(
        self,
        obs_shape: tuple[int, int, int],
        action_space: Space,
        channels: tuple[int, ...] = default("cnn_channels"),
        kernels: tuple[int, ...] = (8, 4, 3),
        strides: tuple[int, ...] = (4, 2, 1),
        out_dim: int = default("cnn_dense"),
        hidden_sizes: tuple[int, ...] = (),
        activation: str = "relu",
        num_agents: int = 1,
        agent_id: bool = False,
        init_log_std: float = default("init_log_std"),
        shared_encoder: bool = True,
        max_value: float = 3.0,
        state_dim: int | None = None,
    ):
        super().__init__()
        if state_dim is not None:
            raise ValueError("CNNActorCritic has no centralized critic (state_dim); use the per-agent (ippo) critic")
        self.num_agents, self.agent_id, self.centralized = num_agents, agent_id, False
        self.slot_agnostic = not agent_id
        self.shared_encoder = shared_encoder
        self.register_buffer("agent_eye", torch.eye(num_agents))
        self.head = ActionHead(action_space, init_log_std)
        enc = dict(channels=tuple(channels), kernels=tuple(kernels), strides=tuple(strides), out_dim=out_dim,
                   max_value=max_value)
        feat_in = out_dim + (num_agents if agent_id else 0)
        self.encoder = CNNEncoder(tuple(obs_shape), **enc)
        self.trunk, feat = _trunk(feat_in, tuple(hidden_sizes), activation)
        if not shared_encoder:
            self.critic_encoder = CNNEncoder(tuple(obs_shape), **enc)
            self.critic_trunk, _ = _trunk(feat_in, tuple(hidden_sizes), activation)
        self.actor = layer_init(nn.Linear(feat, self.head.out_dim), gain=0.01)
        self.critic = layer_init(nn.Linear(feat, 1), gain=1.0)

    def _features(self, obs: torch.Tensor, encoder: nn.Module, trunk: nn.Module) -> torch.Tensor:
        x = encoder(obs)
        if self.agent_id:
            x = torch.cat([x, self.agent_eye.expand(*x.shape[:-1], self.num_agents)], -1)
        return trunk(x)

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        """The actor's features [..., A, F] from images [..., A, C, H, W]."""
        return self._features(obs, self.encoder, self.trunk)

    def _value_from(self, obs: torch.Tensor, actor_feat: torch.Tensor | None) -> torch.Tensor:
        if not self.shared_encoder:
            feat = self._features(obs, self.critic_encoder, self.critic_trunk)
        else:
            feat = self.features(obs) if actor_feat is None else actor_feat
        return self.critic(feat).squeeze(-1)

    def value(self, critic_in: torch.Tensor) -> torch.Tensor:
        """V per agent [..., A] from images [..., A, C, H, W]."""
        return self._value_from(critic_in, None)

    def act(
        self, obs: torch.Tensor, generator: Source = None, greedy: bool = False, mask: torch.Tensor | None = None,
        moves: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, moves = self.actor(self.features(obs)), mask if moves is None else moves
        action = self.head.sample(out, generator, greedy, moves)
        return action, self.head.log_prob(out, action, moves)

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor,
                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.actor(self.features(obs))
        return self.head.log_prob_entropy(out, actions, mask)

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> NoMemory:
        """A feed-forward model's memory: none (models/state.py)."""
        return NoMemory()

    def act_value(
        self, obs: torch.Tensor, generator: Source = None, greedy: bool = False, critic_in: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`act` and `value` on the same observations (the critic reads them: `critic_in` is `obs` or None),
        the shared encoder run once: -> (action, logprob, value)."""
        feat = self.features(obs)
        out = self.actor(feat)
        action = self.head.sample(out, generator, greedy, mask)
        return action, self.head.log_prob(out, action, mask), self._value_from(obs, feat)

    def evaluate_value(self, obs: torch.Tensor, actions: torch.Tensor, critic_in: torch.Tensor | None = None,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`evaluate` and `value` on the same observations (the per-agent critic reads them, so
        `critic_in` is `obs`): -> (logprob, entropy, value)."""
        feat = self.features(obs)
        out = self.actor(feat)
        return *self.head.log_prob_entropy(out, actions, mask), self._value_from(obs, feat)


class CNNMemoryActorCritic(nn.Module):
    """A memory actor-critic (see models/memory.py for the contract) over image observations.

    A `CNNEncoder` turns every image into `out_dim` features, and a memory model built with
    `obs_dim = out_dim` (`core`: "lstm", "transformer", or such a model already built) runs on them:
    step forwards take obs [*B, A, C, H, W], sequence forwards obs [*B, A, T, C, H, W]; states,
    resets, active masks and outputs are the core's. The encoder is memoryless, so encoding every
    step in one batch keeps the sequence forward equal to the step forward, and `evaluate_seq`
    trains encoder and core together. `core_kwargs` go to the core: the `MemorySettings` fields
    (num_agents, agent_id, init_log_std, memory_critic, critic_hidden) into its settings, the rest
    (hidden; width, layers, heads, horizon; activation) as its own keywords.
    """

    obs_is_image = True
    recurrent = True
    slot_agnostic = False

    def __init__(
        self,
        obs_shape: tuple[int, int, int],
        action_space: Space,
        core: str | nn.Module = LSTM.name,
        channels: tuple[int, ...] = default("cnn_channels"),
        kernels: tuple[int, ...] = (8, 4, 3),
        strides: tuple[int, ...] = (4, 2, 1),
        out_dim: int = default("cnn_dense"),
        max_value: float = 3.0,
        state_dim: int | None = None,
        **core_kwargs,
    ):
        super().__init__()
        if state_dim is not None:
            raise ValueError("CNNMemoryActorCritic has no centralized critic (state_dim); use the per-agent (ippo) critic")
        self.encoder = CNNEncoder(tuple(obs_shape), tuple(channels), tuple(kernels), tuple(strides), out_dim, max_value)
        if isinstance(core, str):
            if core not in MEMORY_CORES:
                raise ValueError(f"core must be one of {sorted(MEMORY_CORES)} or a memory model, got {core!r}")
            shared = {k: core_kwargs.pop(k) for k in SETTINGS_FIELDS if k in core_kwargs}
            core = MEMORY_CORES[core](MemorySettings(out_dim, action_space, **shared), **core_kwargs)
        elif core_kwargs:
            raise ValueError(f"core_kwargs {sorted(core_kwargs)} apply only when core is built here (a name)")
        if not core.recurrent or core.centralized:
            raise ValueError("core must be a memory model (recurrent) without a centralized critic")
        self.core = core

    # Properties, not attributes: assigning the core's head would register it twice in state_dict.
    @property
    def head(self) -> ActionHead:
        return self.core.head

    @property
    def num_agents(self) -> int:
        return self.core.num_agents

    @property
    def memory_critic(self) -> bool:
        return self.core.memory_critic

    @property
    def centralized(self) -> bool:
        return False

    def initial_state(self, batch_size: int, device: torch.device | str | None = None):
        return self.core.initial_state(batch_size, device)

    def step(self, obs: torch.Tensor, state, reset: torch.Tensor | None = None, active: torch.Tensor | None = None):
        """obs [*B, A, C, H, W] -> (head output [*B, A, out], value [*B, A] | None); updates `state`."""
        return self.core.step(self.encoder(obs), state, reset, active)

    def act_step(self, obs: torch.Tensor, state, reset: torch.Tensor | None = None, active: torch.Tensor | None = None,
                 generator: Source = None, greedy: bool = False, mask: torch.Tensor | None = None):
        """-> (action, logprob, value | None, state) with `state` updated in place."""
        return self.core.act_step(self.encoder(obs), state, reset, active, generator, greedy, mask)

    def value_step(self, obs: torch.Tensor, state) -> torch.Tensor:
        """The memory critic's V(obs) as the next step of each slot's episode; writes nothing."""
        return self.core.value_step(self.encoder(obs), state)

    def seq(self, obs: torch.Tensor, start_state, resets: torch.Tensor | None = None, active: torch.Tensor | None = None,
            idle_outputs: bool = True):
        """Segments obs [*B, A, T, C, H, W] -> (head output [*B, A, T, out], value [*B, A, T] | None)."""
        return self.core.seq(self.encoder(obs), start_state, resets, active, idle_outputs)

    def evaluate_seq(self, obs: torch.Tensor, actions: torch.Tensor, start_state, resets: torch.Tensor | None = None,
                     active: torch.Tensor | None = None, idle_outputs: bool = True, mask: torch.Tensor | None = None):
        """-> (logprob, entropy, value | None), each [*B, A, T]."""
        return self.core.evaluate_seq(self.encoder(obs), actions, start_state, resets, active, idle_outputs, mask)

    def value(self, critic_in: torch.Tensor) -> torch.Tensor:
        """The memoryless critic (memory_critic=False) on images [..., A, C, H, W] -> [..., A]."""
        return self.core.value(self.encoder(critic_in))


__all__ = ["CNNActorCritic", "CNNEncoder", "CNNMemoryActorCritic", "MEMORY_CORES", "conv_min_size"]
