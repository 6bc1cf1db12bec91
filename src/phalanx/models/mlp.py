"""MLP actor-critic for discrete, multi-discrete and continuous actions."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from phalanx.draws import Source
from phalanx.envs.spaces import Box, Discrete, MultiDiscrete, Space
from phalanx.models import distributions as D
from phalanx.models.state import NoMemory

# Below this many elements torch.tanh itself is the faster form, forward and backward (a 64-wide layer
# of up to 256 rows on a 2-core CPU: the custom function's dispatch cost more than tanh's arithmetic).
PLAIN_TANH_MAX_ELEMENTS = 16384


class _FastTanhFunction(torch.autograd.Function):
    """tanh as 2 sigmoid(2x) - 1 (`_sigmoid_tanh`), its gradient from the output as torch.tanh's (1 - y^2)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        # ctx in forward, not a separate setup_context: with one, every apply binds its arguments
        # through inspect.signature.
        y = _sigmoid_tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return torch.ops.aten.tanh_backward(grad, y)


class FastTanh(nn.Module):
    """tanh, in the fastest form on the device. On a CPU torch.tanh is several times slower than sigmoid on
    large tensors and dominated the rollout: from `PLAIN_TANH_MAX_ELEMENTS` on, 2 sigmoid(2x) - 1 (one kernel;
    abs. difference from torch.tanh < 2e-7), and in a compiled rollout a rational function (inductor fuses
    its multiply-adds into one loop, faster than its exp; eager, each of its ops would be a pass over
    memory). Training keeps the sigmoid form, compiled too: there inductor recomputed the rational chain in
    the backward instead of saving its output, a slower update. The timings: docs/BENCHMARKS.md."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cpu or x.numel() <= PLAIN_TANH_MAX_ELEMENTS:
            return torch.tanh(x)
        if x.requires_grad:
            return _FastTanhFunction.apply(x)
        if torch.compiler.is_compiling():
            return _rational_tanh(x)
        # Inference (the rollout, evaluation): the same arithmetic without autograd.Function's dispatch,
        # which cost a small-batch rollout more than the forward itself.
        return _sigmoid_tanh(x)


def _sigmoid_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x * 2).mul_(2).sub_(1)


# tanh(x) ~ x P(x^2) / Q(x^2) on [-8, 8] (tanh(8) is 1 to float32's precision beyond it): a weighted
# least-squares fit of ours, reweighted towards the smallest largest error; in float32 within 3.5e-7 of
# tanh everywhere and never above 1 in magnitude.
RATIONAL_TANH_BOUND = 8.0
RATIONAL_TANH_P = (9.9999999118e-01, 1.3121025457e-01, 3.1456719987e-03, 1.1604223457e-05, -2.2160715563e-08,
                   6.2910764132e-11, -1.1369417902e-13)
RATIONAL_TANH_Q = (1.0, 4.6454354791e-01, 2.4660241059e-02, 2.6076239147e-04)


def _rational_tanh(x: torch.Tensor) -> torch.Tensor:
    x = x.clamp(-RATIONAL_TANH_BOUND, RATIONAL_TANH_BOUND)
    s = x * x
    return x * _polynomial(s, RATIONAL_TANH_P) / _polynomial(s, RATIONAL_TANH_Q)


def _polynomial(s: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    out = s * coefficients[-1] + coefficients[-2]
    for c in reversed(coefficients[:-2]):
        out = out * s + c
    return out


ACTIVATIONS = {"tanh": FastTanh, "relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU}

# A layer with at most this many input features (and at least `NARROW_WEIGHT_GRAD_MIN_ROWS` rows) computes
# its weight gradient as x^T @ grad: torch computes grad^T @ x, a product whose result is `in_features`
# wide, which MKL runs several times slower below 16 columns (docs/BENCHMARKS.md).
NARROW_INPUT_MAX_FEATURES = 15
# Below this many rows the custom function's dispatch costs more than the product saves.
NARROW_WEIGHT_GRAD_MIN_ROWS = 512


class _LinearFunction(torch.autograd.Function):
    """F.linear (the same forward, so the same numbers as inference) whose backward products suit the
    layer's shape: with `broadcast`, both gradients as broadcast products and sums (a compiled narrow
    output, see NARROW_OUTPUT_MAX_FEATURES), else the weight gradient as (x^T @ grad)^T (a narrow input)
    and the input's as torch computes it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, broadcast: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.broadcast = bias is not None, broadcast
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        # Under autocast the forward ran in `grad`'s dtype (bfloat16): so do the products, as autograd's
        # would through autocast's casts; the engine casts each gradient back to its input's dtype.
        dtype = grad.dtype
        grad_rows, x_rows, weight = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1]).to(dtype), weight.to(dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad.unsqueeze(-1) * weight).sum(-2) if ctx.broadcast else grad.matmul(weight)
        if ctx.needs_input_grad[1]:
            grad_w = (grad_rows.unsqueeze(-1) * x_rows.unsqueeze(-2)).sum(0) if ctx.broadcast else x_rows.t().mm(grad_rows).t()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_rows.sum(0)
        return grad_x, grad_w, grad_b, None


# Compiled, a layer with at most this many outputs (a value or a two-action head) has both gradients
# computed as broadcast products and sums, which inductor fuses into the kernels around them; as
# products with an inner dimension of 1 or 2 they were separate matrix calls, twice as slow in a value
# head's backward (docs/BENCHMARKS.md). Eager, every op would be a pass.
NARROW_OUTPUT_MAX_FEATURES = 2


class Linear(nn.Linear):
    """nn.Linear whose training backward suits its shape (`_LinearFunction`, from
    NARROW_WEIGHT_GRAD_MIN_ROWS rows): the same parameters, state dict and forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad and x.numel() >= NARROW_WEIGHT_GRAD_MIN_ROWS * self.in_features:
            if self.out_features <= NARROW_OUTPUT_MAX_FEATURES and torch.compiler.is_compiling():
                return _LinearFunction.apply(x, self.weight, self.bias, True)
            if self.in_features <= NARROW_INPUT_MAX_FEATURES:
                return _LinearFunction.apply(x, self.weight, self.bias, False)
        return F.linear(x, self.weight, self.bias)


def layer_init(layer: nn.Linear, gain: float = math.sqrt(2), bias: float = 0.0) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.constant_(layer.bias, bias)
    return layer


class RoleLinear(nn.Module):
    """One linear layer per role, applied to the agent axis: x [..., A, in] -> [..., A, out].

    `roles [A]` maps each agent slot to its parameter set, so the agent axis is one batched
    matmul, never a Python loop over agents.
    """

    def __init__(self, in_dim: int, out_dim: int, roles: torch.Tensor, gain: float):
        super().__init__()
        groups = int(roles.max()) + 1
        self.register_buffer("roles", roles.clone().long())
        self.weight = nn.Parameter(torch.empty(groups, in_dim, out_dim))
        self.bias = nn.Parameter(torch.zeros(groups, out_dim))
        for g in range(groups):
            w = torch.empty(out_dim, in_dim)
            nn.init.orthogonal_(w, gain)
            self.weight.data[g] = w.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...ai,aio->...ao", x, self.weight[self.roles]) + self.bias[self.roles]


class MLP(nn.Sequential):
    """Layers in sequence, each called through its `forward`: nn.Module.__call__'s hook handling cost more
    than a small batch's matmul (a 4-env rollout made 69k module calls for 23k layer forwards), and these
    layers take no hooks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer.forward(x)
        return x


def mlp(
    in_dim: int, hidden: tuple[int, ...], out_dim: int, activation: str, out_gain: float, roles: torch.Tensor | None = None
) -> MLP:
    """An MLP; with `roles`, every layer has one parameter set per role (see RoleLinear)."""

    def linear(i: int, o: int, gain: float) -> nn.Module:
        return layer_init(Linear(i, o), gain) if roles is None else RoleLinear(i, o, roles, gain)

    layers: list[nn.Module] = []
    d = in_dim
    for h in hidden:
        layers += [linear(d, h, math.sqrt(2)), ACTIVATIONS[activation]()]
        d = h
    layers.append(linear(d, out_dim, out_gain))
    return MLP(*layers)


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


class MLPActorCritic(nn.Module):
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
        hidden: tuple[int, ...] = (64, 64),
        activation: str = "tanh",
        num_agents: int = 1,
        agent_id: bool = False,
        roles: torch.Tensor | None = None,
        state_dim: int | None = None,
        init_log_std: float = 0.0,
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
        self, obs: torch.Tensor, generator: Source = None, greedy: bool = False, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.actor(self.actor_input(obs))
        action = self.head.sample(out, generator, greedy, mask)
        return action, self.head.log_prob(out, action, mask)

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
