"""Role attention over neighbours (A-MAPPO) for envs whose agents have heterogeneous roles.

Each agent attends to the *other* agent slots of its env. Keys carry the neighbour's one-hot role,
and the softmax is split into role pools (by default: relays vs everything else) that share a
fixed mass, so a pool with few members is not drowned by a crowded one. A floor on every relay
weight keeps relays, which carry no sensing but hold the swarm together, from ever vanishing.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from phalanx.config import default
from phalanx.consts import constant
from phalanx.draws import Source
from phalanx.envs.spaces import Space
from phalanx.models.layers import ACTIVATIONS, Linear, layer_init, mlp
from phalanx.models.mlp import ActionHead, MaskAsGiven
from phalanx.models.state import NoMemory

DEFAULT_RELAY_ROLES: tuple[int, ...] = (1,)
DEFAULT_MASSES: tuple[float, ...] = (0.6, 0.4)  # (every non-relay role, relays)
_TINY = 1e-12


def _check(masses: tuple[float, ...], n_pools: int, floor: float, temperature: float) -> None:
    if len(masses) != n_pools:
        raise ValueError(f"{len(masses)} masses for {n_pools} pools")
    if any(m <= 0 for m in masses):
        raise ValueError(f"pool masses must be positive, got {masses}")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must lie in [0, 1], got {floor}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")


def pooled_weights(
    scores: torch.Tensor,
    key_pool: torch.Tensor,
    mask: torch.Tensor | None,
    masses: torch.Tensor,
    floor_pool: int | None = None,
    floor: float = 0.0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """role_attention_weights with the roles already mapped to pools (`key_pool` [K] or [..., K],
    -1 = in no pool) and the masses as a tensor [P]; models precompute both once."""
    if mask is None:
        mask = torch.ones(scores.shape[-1], dtype=torch.bool, device=scores.device)
    if mask.dim() < scores.dim():
        mask = mask.unsqueeze(-2)
    member = key_pool.unsqueeze(-1) == torch.arange(masses.numel(), device=scores.device)  # [..., K, P]
    inpool = member.unsqueeze(-3) & mask.unsqueeze(-1)  # [..., Q, K, P]
    x = (scores / temperature).unsqueeze(-1).masked_fill(~inpool, -math.inf)
    # Shift by the pool max for stability; an empty pool's max is -inf, so shift by 0 there.
    top = x.detach().amax(-2, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = (x - top).exp()
    nonempty = inpool.any(-2, keepdim=True)  # [..., Q, 1, P]
    mass = masses * nonempty
    # Masses of the non-empty pools rescaled to sum to one: a lone pool gets 1.0, none gets 0.
    mass = mass / mass.sum(-1, keepdim=True).clamp_min(_TINY)
    w = (e / e.sum(-2, keepdim=True).clamp_min(_TINY) * mass).sum(-1)  # each key is in at most one pool
    if floor_pool is None or floor <= 0:
        return w
    floored = inpool[..., floor_pool]
    n = floored.sum(-1, keepdim=True)
    # floor * n > 1 cannot hold for every floored key; 1/n (uniform over them) is the closest that can.
    f = torch.where(n > 0, (1.0 / n.clamp_min(1)).clamp_max(floor), torch.zeros_like(n, dtype=w.dtype))
    phi = f * floored
    # Raise every floored key below the floor to it; the mass that costs comes from every key in
    # proportion to what it holds above its own floor (phi: f for floored keys, 0 otherwise), so
    # no floored key is pushed back below f. A no-op when the floor does not bind.
    excess = (w - phi).clamp_min(0)
    return phi + (1 - phi.sum(-1, keepdim=True)) * excess / excess.sum(-1, keepdim=True).clamp_min(_TINY)


def role_attention_weights(
    scores: torch.Tensor,
    key_roles: torch.Tensor,
    mask: torch.Tensor | None = None,
    pools: tuple[tuple[int, ...], ...] | None = None,
    masses: tuple[float, ...] = DEFAULT_MASSES,
    floor_pool: int | None = 1,
    floor: float = 0.05,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Attention weights [..., Q, K] from raw scores [..., Q, K] with role pools and a floor.

    - `key_roles` [K] or [..., K] (long): the role of every key.
    - `mask`: which keys are present; [..., K] (shared by all queries) or, with as many dims as
      `scores`, [..., Q, K] (per query-key pair, e.g. to exclude self). Absent keys get exactly 0.
    - `pools`: roles grouped into pools; None = relays (DEFAULT_RELAY_ROLES) are pool 1, every
      other role is pool 0. A role in no pool is treated as absent.
    - `masses`: one per pool. Each pool gets a softmax of scores / temperature over its present
      keys, scaled by its mass; the masses of the non-empty pools are rescaled to sum to one (so a
      lone pool gets 1.0). A query with no present key gets all-zero weights, never NaN.
    - `floor_pool`, `floor`: every present key of that pool gets at least `floor` (see
      pooled_weights for how the others pay for it); with n such keys and floor * n > 1 the floor
      becomes 1/n.
    """
    if pools is None:
        pools = ((), DEFAULT_RELAY_ROLES)
        relay = torch.isin(key_roles, constant(DEFAULT_RELAY_ROLES, key_roles.device, torch.long))
        key_pool = relay.long()
    else:
        seen = [r for p in pools for r in p]
        if len(seen) != len(set(seen)):
            raise ValueError(f"a role appears in more than one pool: {pools}")
        key_pool = torch.full_like(key_roles, -1, dtype=torch.long)
        for p, roles in enumerate(pools):
            hit = torch.isin(key_roles, constant(tuple(roles), key_roles.device, key_roles.dtype))
            key_pool = torch.where(hit, p, key_pool)
    _check(masses, len(pools), floor, temperature)
    if floor_pool is not None and not 0 <= floor_pool < len(pools):
        raise ValueError(f"floor_pool {floor_pool} is not one of the {len(pools)} pools")
    m = torch.tensor(masses, dtype=scores.dtype, device=scores.device)
    return pooled_weights(scores, key_pool, mask, m, floor_pool, floor, temperature)


class RoleAttention(nn.Module):
    """Embeds every agent's observation and attends over the other agent slots of the same env.

    forward(x [..., A, in], present [..., A] | None) -> (own embedding [..., A, W], context [..., A, W]).
    """

    def __init__(self, in_dim: int, width: int, heads: int, roles: torch.Tensor, num_roles: int,
                 pools: tuple[tuple[int, ...], ...], masses: tuple[float, ...], floor_pool: int | None,
                 floor: float, temperature: float, activation: str):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        A = roles.numel()
        self.width, self.heads, self.floor_pool, self.floor, self.temperature = width, heads, floor_pool, floor, temperature
        self.embed = nn.Sequential(layer_init(Linear(in_dim, width)), ACTIVATIONS[activation]())
        self.query = layer_init(nn.Linear(width, width), 1.0)
        self.key = layer_init(nn.Linear(width + num_roles, width), 1.0)
        self.val = layer_init(nn.Linear(width, width), 1.0)
        key_pool = torch.full((A,), -1, dtype=torch.long)
        for p, rs in enumerate(pools):
            key_pool[torch.isin(roles, torch.tensor(rs, dtype=torch.long))] = p
        self.register_buffer("role_onehot", nn.functional.one_hot(roles.long(), num_roles).float())
        self.register_buffer("key_pool", key_pool)
        self.register_buffer("masses", torch.tensor(masses, dtype=torch.float32))
        self.register_buffer("not_self", ~torch.eye(A, dtype=torch.bool))
        self.last_weights: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, present: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.embed(x)
        lead, A, H = e.shape[:-2], e.shape[-2], self.heads
        split = lambda t: t.reshape(*lead, A, H, -1).transpose(-2, -3)  # noqa: E731 -> [..., H, A, W/H]
        q = split(self.query(e))
        k = split(self.key(torch.cat([e, self.role_onehot.expand(*lead, A, -1)], -1)))
        v = self.val(e)
        pair = self.not_self if present is None else present.unsqueeze(-2) & self.not_self  # [..., Q, K]
        if present is not None:
            # Absent slots may hold garbage (even NaN); 0 * NaN would leak into the context.
            v = torch.where(present.unsqueeze(-1), v, torch.zeros_like(v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [..., H, A, A]
        # Expanded to the full rank of `scores` so pooled_weights reads it as a per-pair mask.
        mask = pair.unsqueeze(-3).expand(scores.shape)
        w = pooled_weights(scores, self.key_pool, mask, self.masses, self.floor_pool, self.floor, self.temperature)
        if not torch.compiler.is_compiling():  # kept for inspection; a compiled graph has no side effects
            self.last_weights = w.detach()
        ctx = (w @ split(v)).transpose(-2, -3).reshape(*lead, A, self.width)
        return e, ctx


class RoleAttentionActorCritic(MaskAsGiven, nn.Module):
    """Actor-critic whose agents attend over their neighbours by role (A-MAPPO); a drop-in for
    MLPActorCritic (same act / evaluate / value and shapes) over obs [..., A, D].

    - `roles` [A]: the role of every agent slot (0 .. num_roles-1); `relay_roles` form the relay
      pool (mass masses[1], floored at `relay_floor`), every other role the other pool (masses[0]).
    - Agent i's query is its own embedding; keys / values come from the other slots (never itself:
      its own embedding already goes to the actor directly), keys with the neighbour's one-hot role.
    - Actor: MLP over [own embedding ; attended context ; one-hot own role] -> ActionHead.
    - Critic: with `state_dim` (MAPPO) an MLP over [state ; one-hot agent id], as MLPActorCritic (with
      `world_value`, over the state alone with A outputs, once per world); else (IPPO) a role attention of its own over the observations plus an MLP.
    - `present` [..., A] bool (optional everywhere; default all present): which slots exist this
      step (alive / active). Absent slots get zero weight as neighbours; an agent with no present
      neighbour attends to nothing (context 0). Absent agents still get (finite) outputs of their
      own, which the trainer masks out. The MAPPO critic ignores it.
    """

    recurrent = False
    obs_is_image = False
    memory_critic = False
    slot_agnostic = False  # attention over the slots

    def __init__(
        self,
        obs_dim: int,
        action_space: Space,
        roles: torch.Tensor,
        num_roles: int,
        relay_roles: tuple[int, ...] = DEFAULT_RELAY_ROLES,
        width: int = default("tf_width"),
        heads: int = 1,
        hidden_sizes: tuple[int, ...] = default("hidden_sizes"),
        activation: str = default("activation"),
        agent_id: bool = False,
        state_dim: int | None = None,
        init_log_std: float = default("init_log_std"),
        masses: tuple[float, float] = DEFAULT_MASSES,
        relay_floor: float = default("relay_floor"),
        temperature: float = default("attn_temperature"),
        world_value: bool = False,
    ):
        super().__init__()
        if world_value and state_dim is None:
            raise ValueError("world_value needs a centralised critic (state_dim)")
        self.world_value = world_value
        roles = roles.detach().cpu().long().reshape(-1)
        if roles.numel() == 0 or int(roles.min()) < 0 or int(roles.max()) >= num_roles:
            raise ValueError(f"roles must lie in [0, {num_roles}), got {roles.tolist()}")
        A = roles.numel()
        self.num_agents, self.agent_id, self.centralized = A, agent_id, state_dim is not None
        others = tuple(r for r in range(num_roles) if r not in relay_roles)
        relays = tuple(r for r in range(num_roles) if r in relay_roles)
        pools = tuple(p for p in (others, relays) if p)
        pool_masses = tuple(m for p, m in zip((others, relays), masses) if p)
        floor_pool = len(pools) - 1 if relays else None
        _check(pool_masses, len(pools), relay_floor, temperature)
        # The floor must be satisfiable for the agent with the most relay neighbours.
        n_relays = int(torch.isin(roles, torch.tensor(relays, dtype=torch.long)).sum()) if relays else 0
        most = n_relays - (1 if n_relays == A else 0)
        assert relay_floor * most <= 1 + 1e-9, f"relay_floor {relay_floor} x {most} relay neighbours exceeds 1"
        self.register_buffer("agent_eye", torch.eye(A))
        self.register_buffer("role_onehot", nn.functional.one_hot(roles, num_roles).float())
        self.head = ActionHead(action_space, init_log_std)
        in_dim = obs_dim + (A if agent_id else 0)
        attn = dict(width=width, heads=heads, roles=roles, num_roles=num_roles, pools=pools, masses=pool_masses,
                    floor_pool=floor_pool, floor=relay_floor, temperature=temperature, activation=activation)
        self.actor_attn = RoleAttention(in_dim, **attn)
        self.actor = mlp(2 * width + num_roles, hidden_sizes, self.head.out_dim, activation, out_gain=0.01)
        if self.centralized:
            self.critic_attn = None
            self.critic = (mlp(state_dim, hidden_sizes, A, activation, out_gain=1.0) if world_value
                           else mlp(state_dim + A, hidden_sizes, 1, activation, out_gain=1.0))
        else:
            self.critic_attn = RoleAttention(in_dim, **attn)
            self.critic = mlp(2 * width + num_roles, hidden_sizes, 1, activation, out_gain=1.0)

    @property
    def last_weights(self) -> torch.Tensor | None:
        """The actor's attention weights [..., H, A, A] from its last forward (detached)."""
        return self.actor_attn.last_weights

    def _with_id(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.agent_eye.expand(*x.shape[:-1], self.num_agents)], -1)

    def actor_input(self, obs: torch.Tensor) -> torch.Tensor:
        return self._with_id(obs) if self.agent_id else obs

    def _features(self, attn: RoleAttention, obs: torch.Tensor, present: torch.Tensor | None) -> torch.Tensor:
        e, ctx = attn(self.actor_input(obs), present)
        return torch.cat([e, ctx, self.role_onehot.expand(*e.shape[:-1], -1)], -1)

    def attention(self, obs: torch.Tensor, present: torch.Tensor | None = None) -> torch.Tensor:
        """The actor's attention [..., A, A] (row i: agent i's weights over the slots), mean over heads."""
        self.actor_attn(self.actor_input(obs), present)
        return self.actor_attn.last_weights.mean(-3)

    def value(self, critic_in: torch.Tensor, present: torch.Tensor | None = None) -> torch.Tensor:
        """V per agent [..., A] from observations [..., A, D] (IPPO) or the state [..., S] (MAPPO; `world_value`:
        one pass per world, A outputs)."""
        if self.world_value:
            return self.critic(critic_in)
        if self.centralized:
            x = self._with_id(critic_in.unsqueeze(-2).expand(*critic_in.shape[:-1], self.num_agents, critic_in.shape[-1]))
        else:
            x = self._features(self.critic_attn, critic_in, present)
        return self.critic(x).squeeze(-1)

    def act(
        self, obs: torch.Tensor, generator: Source = None, greedy: bool = False,
        present: torch.Tensor | None = None, mask: torch.Tensor | None = None, moves: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, moves = self.actor(self._features(self.actor_attn, obs, present)), mask if moves is None else moves
        action = self.head.sample(out, generator, greedy, moves)
        return action, self.head.log_prob(out, action, moves)

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> NoMemory:
        """A feed-forward model's memory: none (models/state.py)."""
        return NoMemory()

    def act_value(self, obs: torch.Tensor, generator: Source = None, greedy: bool = False,
                  critic_in: torch.Tensor | None = None,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`act` and `value` in one call (the rollout's per step): -> (action, log-prob, value)."""
        return *self.act(obs, generator, greedy, mask=mask), self.value(obs if critic_in is None else critic_in)

    def evaluate(
        self, obs: torch.Tensor, actions: torch.Tensor, present: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.actor(self._features(self.actor_attn, obs, present))
        return self.head.log_prob_entropy(out, actions, mask)

    def evaluate_value(self, obs: torch.Tensor, actions: torch.Tensor, critic_in: torch.Tensor,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return *self.evaluate(obs, actions, mask=mask), self.value(critic_in)
