"""MLP actor-critic for discrete, multi-discrete and continuous actions."""

from __future__ import annotations

import math

import torch
from torch import nn

from phalanx.config import default
from phalanx.draws import Source
from phalanx.envs.spaces import Box, Discrete, MultiDiscrete, Space
from phalanx.models import distributions as D
from phalanx.models.layers import MLP, mlp
from phalanx.models.state import NoMemory

# Up to this many rows the rollout runs actor and critic as one packed MLP (`MLPActorCritic.act_value`):
# beyond, the block-diagonal layers' doubled arithmetic outweighs the operations saved.
PACKED_MAX_ROWS = 64


def _pack_layers(actor: MLP, critic: MLP) -> list[tuple[torch.Tensor, torch.Tensor, nn.Module | None]]:
    """[(weight.t() [in, out], bias, activation or None)] of one MLP computing both side by side: the first
    layer's outputs stacked, later layers block-diagonal; the last layer's outputs are the actor's then
    the critic's. Weights are transposed as views, as nn.Linear passes them: the same matmul kernel, so
    the same numbers as the two MLPs."""
    layers = []
    pairs = list(zip(actor, critic))
    for i, (a, c) in enumerate(pairs):
        if not isinstance(a, nn.Linear):
            continue
        weight = torch.cat([a.weight, c.weight]) if i == 0 else torch.block_diag(a.weight, c.weight)
        activation = pairs[i + 1][0] if i + 1 < len(pairs) else None
        layers.append((weight.t(), torch.cat([a.bias, c.bias]), activation))
    return layers


class ActionHead(nn.Module):
    """Turns actor features into a distribution over the action space.

    `mask` (sample, log_prob, entropy, log_prob_entropy): the actions each slot may take now, bool
    [..., n] for Discrete, [..., sum(nvec)] for MultiDiscrete (each head's values in turn), as
    `StepRecord.action_mask`; None allows all. Forbidden actions are never sampled nor played greedily, and
    log-probabilities and entropy are over the allowed ones (models/distributions.py). With None every
    result is the unmasked one, to the bit.
    """

    def __init__(self, space: Space, init_log_std: float = 0.0):
        super().__init__()
        self.space = space
        # Slots with fewer actions ([A, n], or None): the others get no probability, so no sample, log-prob,
        # entropy or gradient ever involves them. Needs the agent axis whole, just before the actions.
        self.register_buffer("valid", space.valid_actions() if isinstance(space, Discrete) else None)
        if isinstance(space, Discrete):
            self.kind, self.out_dim = "discrete", space.n
        elif isinstance(space, MultiDiscrete):
            self.kind, self.out_dim = "multi", int(sum(space.nvec))
        elif isinstance(space, Box):
            self.kind = "gaussian"
            self.out_dim = int(math.prod(space.shape))
            self.log_std = nn.Parameter(torch.full((self.out_dim,), float(init_log_std)))
            self.register_buffer("low", torch.tensor(space.low, dtype=torch.float32))
            self.register_buffer("high", torch.tensor(space.high, dtype=torch.float32))
        else:
            raise TypeError(f"unsupported action space {space!r}")

    def _legal(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The env's mask laid out as the logits (per head for MultiDiscrete) and joined with the slots' own
        counts; None where the env masks nothing."""
        if mask is None:
            return None
        if self.kind == "gaussian":
            raise ValueError(f"an action mask is for Discrete and MultiDiscrete actions; this head's are {self.space.describe()}")
        if self.kind == "multi":
            return D.pad_multi_mask(mask, tuple(self.space.nvec))
        return mask if self.valid is None else mask & self.valid

    def _logits(self, out: torch.Tensor, legal: torch.Tensor | None = None) -> torch.Tensor:
        if self.kind == "multi":
            logits = D.pad_multi_logits(out, tuple(self.space.nvec))
        elif self.valid is not None:
            logits = out.masked_fill(~self.valid, D.MASKED_LOGIT)
        else:
            logits = out
        return D.masked_logits(logits, legal)

    def sample(self, out: torch.Tensor, generator: Source, greedy: bool, mask: torch.Tensor | None = None) -> torch.Tensor:
        legal = self._legal(mask)
        if self.kind == "gaussian":
            return out if greedy else D.gaussian_sample(out, self.log_std, generator)
        logits = self._logits(out, legal)
        return D.masked_argmax(logits, legal) if greedy else D.masked_categorical_sample(logits, legal, generator)

    def log_prob(self, out: torch.Tensor, actions: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        legal = self._legal(mask)
        if self.kind == "gaussian":
            return D.gaussian_log_prob(out, self.log_std, actions)
        return self._gated_log_prob(D.categorical_log_prob(self._logits(out, legal), actions), actions)

    def entropy(self, out: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        legal = self._legal(mask)
        if self.kind == "gaussian":
            return D.gaussian_entropy(out, self.log_std)
        logits = self._logits(out, legal)
        return self._gated_entropy(D.categorical_entropy(logits), logits)

    def log_prob_entropy(self, out: torch.Tensor, actions: torch.Tensor,
                         mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`log_prob` and `entropy` of the same output, computed once where they share work."""
        legal = self._legal(mask)
        if self.kind == "gaussian":
            return D.gaussian_log_prob(out, self.log_std, actions), D.gaussian_entropy(out, self.log_std)
        logits = self._logits(out, legal)
        lp, ent = D.categorical_log_prob_entropy(logits, actions)
        return self._gated_log_prob(lp, actions), self._gated_entropy(ent, logits)

    def _gated_log_prob(self, lp: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        if self.kind != "multi":
            return lp
        for h, j, v in self.space.gates:
            lp = torch.cat([lp[..., :h], lp[..., h:h + 1] * (actions[..., j:j + 1] == v), lp[..., h + 1:]], -1)
        return lp.sum(-1)

    def _gated_entropy(self, ent: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.kind != "multi":
            return ent
        # A gated sub-action contributes its entropy weighted by the chance that it matters.
        for h, j, v in self.space.gates:
            p_on = torch.softmax(logits[..., j, :], -1)[..., v:v + 1]
            ent = torch.cat([ent[..., :h], ent[..., h:h + 1] * p_on, ent[..., h + 1:]], -1)
        return ent.sum(-1)

    def to_env(self, actions: torch.Tensor) -> torch.Tensor:
        """The action the env receives: Gaussian samples are clipped to the bounds."""
        if self.kind == "gaussian":
            return torch.maximum(torch.minimum(actions, self.high), self.low)
        return actions


class MaskAsGiven:
    """`moves` of a model that reads no game rules: the moves it chooses from are the env's mask as given."""

    def moves(self, obs: torch.Tensor, mask: torch.Tensor | None = None, greedy: bool = False) -> torch.Tensor | None:
        return mask


class MLPActorCritic(MaskAsGiven, nn.Module):
    """Separate actor and critic MLPs (as CleanRL), orthogonally initialised, over [..., A, *].

    Multi-agent options: `agent_id` appends a one-hot of the agent slot to the inputs;
    `roles` (an int tensor [A]) gives every role its own parameters; `state_dim` makes the
    critic centralised (MAPPO): it reads the global state [..., S] plus the agent's one-hot id
    instead of the agent's observation (IPPO); with `world_value` it reads the state alone, once per
    world, and outputs every agent's value (A outputs: one pass where the id made A).
    """

    recurrent = False
    obs_is_image = False
    memory_critic = False

    def __init__(
        self,
        obs_dim: int,
        action_space: Space,
        hidden: tuple[int, ...] = default("hidden_sizes"),
        activation: str = default("activation"),
        num_agents: int = 1,
        agent_id: bool = False,
        roles: torch.Tensor | None = None,
        state_dim: int | None = None,
        init_log_std: float = default("init_log_std"),
        world_value: bool = False,
    ):
        super().__init__()
        if world_value and (state_dim is None or roles is not None):
            raise ValueError("world_value needs a centralised critic (state_dim) with parameters shared across roles")
        self.num_agents, self.agent_id, self.centralized = num_agents, agent_id, state_dim is not None
        self.world_value = world_value
        self.slot_agnostic = not agent_id and roles is None and state_dim is None
        self.register_buffer("agent_eye", torch.eye(num_agents))
        self.head = ActionHead(action_space, init_log_std)
        actor_in = obs_dim + (num_agents if agent_id else 0)
        critic_in = state_dim + (0 if world_value else num_agents) if state_dim is not None else actor_in
        self.actor = mlp(actor_in, hidden, self.head.out_dim, activation, out_gain=0.01, roles=roles)
        self.critic = mlp(critic_in, hidden, num_agents if world_value else 1, activation, out_gain=1.0, roles=roles)
        self.packable = roles is None and state_dim is None  # actor and critic read the same input
        self._trunk_params = [*self.actor.parameters(), *self.critic.parameters()]
        self._packed_key: list[tuple[int, int]] | None = None
        self._packed_layers: list[tuple[torch.Tensor, torch.Tensor, nn.Module | None]] = []

    def _with_id(self, x: torch.Tensor) -> torch.Tensor:
        eye = self.agent_eye.expand(*x.shape[:-1], self.num_agents)
        return torch.cat([x, eye], -1)

    def actor_input(self, obs: torch.Tensor) -> torch.Tensor:
        return self._with_id(obs) if self.agent_id else obs

    def value(self, critic_in: torch.Tensor) -> torch.Tensor:
        """V per agent [..., A] from observations [..., A, D] (IPPO) or the state [..., S] (MAPPO)."""
        if self.world_value:
            return self.critic(critic_in)
        if self.centralized:
            x = self._with_id(critic_in.unsqueeze(-2).expand(*critic_in.shape[:-1], self.num_agents, critic_in.shape[-1]))
        else:
            x = self.actor_input(critic_in)
        return self.critic(x).squeeze(-1)

    def act(
        self, obs: torch.Tensor, generator: Source = None, greedy: bool = False, mask: torch.Tensor | None = None,
        moves: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, moves = self.actor(self.actor_input(obs)), mask if moves is None else moves
        action = self.head.sample(out, generator, greedy, moves)
        return action, self.head.log_prob(out, action, moves)

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> NoMemory:
        """A feed-forward model's memory: none (models/state.py)."""
        return NoMemory()

    def act_value(self, obs: torch.Tensor, generator: Source = None, greedy: bool = False,
                  critic_in: torch.Tensor | None = None,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`act` and `value` in one call (the rollout's per step): -> (action, log-prob, value)."""
        if (critic_in is None or critic_in is obs) and self._packed_inference(obs):
            out, value = self._packed_forward(self.actor_input(obs))
            action = self.head.sample(out, generator, greedy, mask)
            return action, self.head.log_prob(out, action, mask), value
        return *self.act(obs, generator, greedy, mask), self.value(obs if critic_in is None else critic_in)

    def _packed_inference(self, obs: torch.Tensor) -> bool:
        """Whether actor and critic run as one packed MLP: a small CPU batch without autograd, where the
        number of operations, not their arithmetic, is the cost (one matmul a layer for both). Not with
        per-role layers or a centralised critic (their inputs differ). Compiled steps take the same path,
        so they compute the same numbers."""
        return self.packable and obs.is_cpu and not torch.is_grad_enabled() \
            and obs.numel() <= PACKED_MAX_ROWS * obs.shape[-1]

    def _packed_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(actor output, value) of the two MLPs as one: inputs side by side, later layers block-diagonal."""
        if torch.compiler.is_compiling():  # traced into the graph: no host-side cache there
            layers = _pack_layers(self.actor, self.critic)
        else:
            # Keyed on the parameters' versions and storage: an optimizer step, load_state_dict or .to()
            # changes one of them.
            key = [(p._version, p.data_ptr()) for p in self._trunk_params]
            if self._packed_key != key:
                self._packed_layers = _pack_layers(self.actor, self.critic)
                self._packed_key = key
            layers = self._packed_layers
        h = x.reshape(-1, x.shape[-1])
        for weight_t, bias, activation in layers:
            h = torch.addmm(bias, h, weight_t)
            if activation is not None:
                h = activation.forward(h)
        rows = x.shape[:-1]
        return h[:, :-1].reshape(*rows, -1), h[:, -1].reshape(rows)

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor,
                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.actor(self.actor_input(obs))
        return self.head.log_prob_entropy(out, actions, mask)

    def evaluate_value(self, obs: torch.Tensor, actions: torch.Tensor, critic_in: torch.Tensor,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return *self.evaluate(obs, actions, mask), self.value(critic_in)
