"""Memory actor-critics: an LSTM and a causal pre-LayerNorm transformer with a KV cache.

Both use the same action heads as `MLPActorCritic` and read observations whose last batch axis is
the agent axis A (A = 1 for single-agent envs). The agent axis is folded into the batch: memory is
kept per (env, agent) slot, flattened row-major, so slot index = env * A + agent.

Two forwards, equal to 1e-5 in float32 (docs/DESIGN.md section 4):

Step forward (rollouts; call under `torch.no_grad()`, it updates `state` in place)::

    state = model.initial_state(batch_size=N * A, device=dev)
    action, logprob, value, state = model.act_step(obs, state, reset, active, generator, greedy)
        obs [*B, A, D]; reset, active [*B, A] bool (None: no reset / all active)
        action [*B, A, *act], logprob [*B, A], value [*B, A] (None without a memory critic)
    out, value = model.step(obs, state, reset, active)     # raw head parameters [*B, A, out_dim]
    value = model.value_step(obs, state)                   # peek (e.g. V(final_obs)): writes nothing

`reset` marks slots whose episode starts at this step: their memory is cleared *before* the step.
An inactive step (`active` False) still gets an output, computed from the memory, but writes nothing
to it (the state is left exactly as it was, apart from the reset).

Sequence forward (training over segments; pure, leaves `start_state` untouched)::

    logprob, entropy, value = model.evaluate_seq(obs, actions, start_state, resets, active)
        obs [*B, A, T, D]; actions [*B, A, T, *act]; resets, active [*B, A, T] bool
        -> [*B, A, T] each (value None without a memory critic)
    out, value = model.seq(obs, start_state, resets, active)

`start_state` is the state as it was before the segment's first step (`state.clone()` taken during
the rollout; `State.select(rows)` / `State.cat(states)` assemble minibatches along the slot axis).
`resets[..., t]` marks episode starts inside the segment, exactly as passed to the step forward.
A rollout buffer laid out [T, N, A, ...] becomes segments with `x.permute(1, 2, 0, ...)` (or
reshaped into several segments per slot, each with the state stored at its start).

States (dataclasses, batch axis = flattened slots):

- `LSTMState(h [B, H], c [B, H])`.
- `KVCache(k, v [B, layers, horizon, width], pos [B] long, valid [B, horizon] bool)`: a ring buffer
  (the token at episode position p lives in slot p % horizon); `pos` counts this episode's active
  steps so far (the position of the next token); `valid` marks slots written in this episode.

Semantics shared by both models: a position is the number of *active* steps earlier in the same
episode (inactive steps write nothing, so they do not advance it). A transformer token attends to
itself and to the last `horizon` active tokens of its own episode (so `horizon` past tokens) in every
layer; stacked, an output depends on the last `layers * horizon` active steps.
The KV cache holds keys/values computed with the parameters of the rollout, like the stored LSTM
state; no gradient flows into the stored memory.

The memory cores are components too: `LSTMCore` (an `nn.LSTMCell` with the step and fused sequence
forwards) and `CausalTransformerCore`; models/strategy.py combines both.

Every memory model takes one `MemorySettings` (inputs, action space, agents, critic) and the sizes of
its own core as keywords: `LSTMActorCritic(settings, hidden=...)`, `TransformerActorCritic(settings,
width=..., layers=..., heads=..., horizon=...)`, `StrategyActorCritic(settings, ...)` (models/strategy.py);
models/registry.py builds the settings from a config once for all three.

Critic: with `memory_critic` (the default unless `state_dim` is given) a value head reads the memory
features, and `act_step` / `evaluate_seq` return values. Otherwise the critic is a memoryless MLP
(`critic_hidden`) used through `value(critic_in)` exactly as in `MLPActorCritic`: observations
[..., A, D] (IPPO) or, with `state_dim`, the global state [..., S] plus a one-hot agent id (MAPPO).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.algo.scan import linear_scan
from phalanx.config import default
from phalanx.draws import Source
from phalanx.envs.spaces import Space
from phalanx.models.layers import ACTIVATIONS, Linear, layer_init, mlp
from phalanx.models.mlp import ActionHead
from phalanx.models.state import MemoryState, exporting


@dataclasses.dataclass
class LSTMState(MemoryState):
    h: torch.Tensor  # [B, H]
    c: torch.Tensor  # [B, H]
    _batch_dims = {"h": 0, "c": 0}


@dataclasses.dataclass
class KVCache(MemoryState):
    k: torch.Tensor  # [B, layers, horizon, width]
    v: torch.Tensor  # [B, layers, horizon, width]
    pos: torch.Tensor  # [B] long: active steps so far in the episode
    valid: torch.Tensor  # [B, horizon] bool
    # Slots first, as a deployed graph feeds them ([B, A, ...] is a reshape away): with the layers first the graph
    # transposed the whole cache in and out of every call (issue 63).
    _batch_dims = {"k": 0, "v": 0, "pos": 0, "valid": 0}
    deployed_slots = ("k", "v")


@dataclasses.dataclass(frozen=True)
class MemorySettings:
    """What every memory model shares: its inputs, its action space, the agents per env and its critic.
    The sizes of the memory core itself (hidden, width, layers, ...) are each model's own keywords."""

    obs_dim: int  # features per agent observation (on images: the CNN encoder's out_dim)
    action_space: Space
    num_agents: int = 1
    agent_id: bool = False  # a one-hot agent id appended to each observation
    state_dim: int | None = None  # the global state's size: a centralized (MAPPO) critic, memoryless
    init_log_std: float = default("init_log_std")
    memory_critic: bool | None = None  # None: a value head on the memory features unless state_dim is given
    critic_hidden: tuple[int, ...] = (64, 64)  # the memoryless critic's MLP


class _MemoryActorCritic(nn.Module):
    """Inputs, heads, critic and the public forwards; subclasses provide the memory core:
    `_step(x [B, in], state, reset [B], active [B]) -> features [B, F]` (updating state in place) and
    `_seq(x [B, T, in], state, resets [B, T], active [B, T], idle_outputs) -> features [B, T, F]`.
    `activation` is the memoryless critic's; each model passes its own (it shapes its core too)."""

    recurrent = True
    obs_is_image = False
    slot_agnostic = False  # the update replays whole env segments

    def __init__(self, settings: MemorySettings, features: int, activation: str):
        super().__init__()
        s = settings
        self.num_agents, self.agent_id, self.centralized = s.num_agents, s.agent_id, s.state_dim is not None
        if s.memory_critic and self.centralized:
            raise ValueError("a centralized critic (state_dim) is a memoryless MLP: memory_critic must be False")
        self.memory_critic = not self.centralized if s.memory_critic is None else bool(s.memory_critic)
        self.register_buffer("agent_eye", torch.eye(s.num_agents))
        self.head = ActionHead(s.action_space, s.init_log_std)
        self.in_dim = s.obs_dim + (s.num_agents if s.agent_id else 0)
        self.actor_out = layer_init(nn.Linear(features, self.head.out_dim), gain=0.01)
        if self.memory_critic:
            self.value_out = layer_init(nn.Linear(features, 1), gain=1.0)
        else:
            critic_in = s.state_dim + s.num_agents if self.centralized else self.in_dim
            self.critic = mlp(critic_in, tuple(s.critic_hidden), 1, activation, out_gain=1.0)

    # -- inputs ------------------------------------------------------------------------------------
    def _with_id(self, x: torch.Tensor, agent_axis: int) -> torch.Tensor:
        eye = self.agent_eye if agent_axis == -2 else self.agent_eye[:, None]
        return torch.cat([x, eye.expand(*x.shape[:-1], self.num_agents)], -1)

    def _flat(self, x: torch.Tensor, agent_axis: int) -> torch.Tensor:
        if self.agent_id:
            x = self._with_id(x, agent_axis)
        return x.reshape(-1, *x.shape[agent_axis + 1:-1], self.in_dim)

    def _heads(self, feat: torch.Tensor, batch: torch.Size):
        out = self.actor_out(feat).reshape(*batch, -1)
        value = self.value_out(feat).reshape(batch) if self.memory_critic else None
        return out, value

    # -- step forward ------------------------------------------------------------------------------
    def step(self, obs: torch.Tensor, state, reset: torch.Tensor | None = None, active: torch.Tensor | None = None):
        """One step for every slot: obs [*B, A, D] -> (head output [*B, A, out], value [*B, A] | None)."""
        batch = obs.shape[:-1]
        x = self._flat(obs, -2)
        n = x.shape[0]
        reset = torch.zeros(n, dtype=torch.bool, device=x.device) if reset is None else reset.reshape(n)
        active = torch.ones(n, dtype=torch.bool, device=x.device) if active is None else active.reshape(n)
        return self._heads(self._step(x, state, reset, active), batch)

    def act_step(self, obs, state, reset=None, active=None, generator: Source = None, greedy: bool = False,
                 mask: torch.Tensor | None = None):
        """Sample actions (among those `mask` allows): -> (action, logprob, value | None, state) with `state`
        updated in place."""
        out, value = self.step(obs, state, reset, active)
        action = self.head.sample(out, generator, greedy, mask)
        return action, self.head.log_prob(out, action, mask), value, state

    def value_step(self, obs: torch.Tensor, state) -> torch.Tensor:
        """The memory critic's V(obs) as the next step of each slot's episode; writes nothing."""
        return self.step(obs, state, active=torch.zeros(obs.shape[:-1], dtype=torch.bool, device=obs.device))[1]

    # -- sequence forward --------------------------------------------------------------------------
    def seq(self, obs: torch.Tensor, start_state, resets: torch.Tensor | None = None, active: torch.Tensor | None = None,
            idle_outputs: bool = True):
        """Segments obs [*B, A, T, D] -> (head output [*B, A, T, out], value [*B, A, T] | None).

        `idle_outputs=False` lets a model skip the exact outputs of inactive steps (they are finite but
        unspecified) when nothing reads them, as in the PPO loss."""
        x, resets, active = self._seq_inputs(obs, resets, active)
        return self._heads(self._seq(x, start_state, resets, active, idle_outputs), obs.shape[:-1])

    def _seq_inputs(self, obs, resets, active):
        """Segments [*B, A, T, ...] -> the core's inputs x [B, T, in], resets and active [B, T]."""
        x = self._flat(obs, -3)
        n, t = x.shape[:2]
        resets = torch.zeros(n, t, dtype=torch.bool, device=x.device) if resets is None else resets.reshape(n, t)
        active = torch.ones(n, t, dtype=torch.bool, device=x.device) if active is None else active.reshape(n, t)
        return x, resets, active

    def evaluate_seq(self, obs, actions, start_state, resets=None, active=None, idle_outputs: bool = True,
                     mask: torch.Tensor | None = None):
        """-> (logprob, entropy, value | None), each [*B, A, T]; `mask` [*B, A, T, n] as the stored masks."""
        out, value = self.seq(obs, start_state, resets, active, idle_outputs)
        return *self.head.log_prob_entropy(out, actions, mask), value

    # -- memoryless critic -------------------------------------------------------------------------
    def value(self, critic_in: torch.Tensor) -> torch.Tensor:
        """V per agent [..., A] from observations [..., A, D] (IPPO) or the state [..., S] (MAPPO)."""
        if self.memory_critic:
            raise RuntimeError("this model's critic uses memory: values come from act_step / value_step / evaluate_seq")
        if self.centralized:
            x = critic_in.unsqueeze(-2).expand(*critic_in.shape[:-1], self.num_agents, critic_in.shape[-1])
            x = self._with_id(x, -2)
        else:
            x = self._with_id(critic_in, -2) if self.agent_id else critic_in
        return self.critic(x).squeeze(-1)


class LSTMCore(nn.LSTMCell):
    """An LSTM cell (orthogonal weights, zero biases) with the memory forwards over encoded inputs:
    `step(e [B, in], state, reset, active) -> h [B, H]`, updating `state` in place, and the fused
    `seq(e [B, T, in], state, resets, active, idle_outputs) -> h [B, T, H]`."""

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__(input_size, hidden_size)
        for name, p in self.named_parameters():
            nn.init.orthogonal_(p, 1.0) if name.startswith("weight") else nn.init.zeros_(p)
        # Input weights of the flush flag (gate order i, f, g, o): sigmoid(-1e4) is exactly 0.
        flush = torch.zeros(4 * hidden_size)
        flush[: 2 * hidden_size] = -1e4
        self.register_buffer("flush_gates", flush, persistent=False)

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> LSTMState:
        z = torch.zeros(batch_size, self.hidden_size, device=device, dtype=self.weight_ih.dtype)
        return LSTMState(z, z.clone())

    def _cell(self, e, h, c, reset, active):
        h, c = h.masked_fill(reset[:, None], 0.0), c.masked_fill(reset[:, None], 0.0)
        h2, c2 = self(e, (h, c))
        return h2, torch.where(active[:, None], h2, h), torch.where(active[:, None], c2, c)

    def step(self, e: torch.Tensor, st: LSTMState, reset: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        out, h, c = self._cell(e, st.h, st.c, reset, active)
        st.h.copy_(h)
        st.c.copy_(c)
        return out

    def seq(self, e: torch.Tensor, st: LSTMState, resets: torch.Tensor, active: torch.Tensor,
            idle_outputs: bool = True) -> torch.Tensor:
        # One fused LSTM call per segment. Each row becomes a sequence of events: a flush before every
        # episode start (input gate and forget gate driven to exactly 0, so h = c = 0 after it), then
        # the row's active steps; inactive steps write no memory, so they are left out and padding
        # fills the row to 2T events. An inactive step's output applies the cell once to the state
        # before it, whose c comes from a parallel scan of the LSTM's linear c recurrence.
        n, t, d = e.shape
        hid = self.hidden_size
        rows = torch.arange(n, device=e.device)[:, None]
        act, rst = active.long(), resets.long()
        step_at = rst.cumsum(1) + act.cumsum(1) - act  # event index of step t (when active)
        length = 2 * t
        events = e.new_zeros(n, length + 1, d).index_put((rows.expand(n, t), torch.where(active, step_at, length)), e)
        flush = e.new_zeros(n, length + 1).index_put((rows.expand(n, t), torch.where(resets, step_at - 1, length)),
                                                     e.new_ones(()))
        events = torch.cat([events, flush[..., None]], -1)[:, :length]
        w_ih = torch.cat([self.weight_ih, self.flush_gates[:, None]], 1)
        params = [w_ih, self.weight_hh, self.bias_ih, self.bias_hh]
        h_ev = torch.lstm(events, (st.h[None], st.c[None]), params, True, 1, 0.0, self.training, False, True)[0]
        h_active = h_ev[rows, step_at]
        if not idle_outputs:
            return torch.where(active[..., None], h_active, 0.0)
        # c after every event: c_p = f_p * c_{p-1} + i_p * g_p with the gates recomputed from h_{p-1}.
        h_in = torch.cat([st.h[:, None], h_ev[:, :-1]], 1)
        ifg = slice(0, 3 * hid)
        gates = F.linear(events, w_ih[ifg], self.bias_ih[ifg] + self.bias_hh[ifg])
        i, f, g = (gates + F.linear(h_in, self.weight_hh[ifg])).chunk(3, -1)
        decay, carry = linear_scan(torch.sigmoid(f), torch.sigmoid(i) * torch.tanh(g), 1)
        c_ev = torch.addcmul(carry, decay, st.c[:, None])
        before = step_at - 1  # the last event before step t (-1: none, the start state)
        first = (before < 0)[..., None]
        h_prev = torch.where(first, st.h[:, None], h_ev[rows, before.clamp(min=0)])
        c_prev = torch.where(first, st.c[:, None], c_ev[rows, before.clamp(min=0)])
        h_idle = self(e.reshape(n * t, d), (h_prev.reshape(n * t, hid), c_prev.reshape(n * t, hid)))[0]
        return torch.where(active[..., None], h_active, h_idle.reshape(n, t, hid))


class LSTMActorCritic(_MemoryActorCritic):
    """Linear + activation encoder, an LSTM cell, linear actor (and value) heads."""

    def __init__(self, settings: MemorySettings, hidden: int = default("lstm_hidden"), activation: str = default("activation")):
        super().__init__(settings, hidden, activation)
        self.hidden = hidden
        self.encoder = nn.Sequential(layer_init(Linear(self.in_dim, hidden)), ACTIVATIONS[activation]())
        self.cell = LSTMCore(hidden, hidden)

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> LSTMState:
        return self.cell.initial_state(batch_size, device)

    def _step(self, x, st: LSTMState, reset, active):
        return self.cell.step(self.encoder(x), st, reset, active)

    def _seq(self, x, st: LSTMState, resets, active, idle_outputs=True):
        return self.cell.seq(self.encoder(x), st, resets, active, idle_outputs)


class _Block(nn.Module):
    def __init__(self, width: int, activation: str):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), ACTIVATIONS[activation](), nn.Linear(4 * width, width))


class _CausalTransformer:
    """Causal pre-LayerNorm transformer over a token stream per slot, sinusoidal positions within the
    episode, a `horizon`-token KV cache per layer (semantics in the module docstring). A mixin on an
    nn.Module, so that TransformerActorCritic keeps its parameter names (embed, blocks, ln_f) and
    CausalTransformerCore offers the same machinery as a component:
    `_step(x [B, in], cache, reset, active) -> [B, W]` (updating `cache` in place) and
    `_seq(x [B, T, in], cache, resets, active) -> [B, T, W]`."""

    def _build(self, in_dim: int, width: int, layers: int, heads: int, horizon: int, activation: str) -> None:
        if width % heads or width % 2:
            raise ValueError(f"width {width} must be even and divisible by heads {heads}")
        if horizon < 1:
            raise ValueError("horizon must be at least 1")
        self.width, self.num_layers, self.heads, self.horizon = width, layers, heads, horizon
        self.embed = Linear(in_dim, width)
        self.blocks = nn.ModuleList(_Block(width, activation) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        freq = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(10000.0) / width))
        self.register_buffer("freq", freq, persistent=False)

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> KVCache:
        kv = torch.zeros(batch_size, self.num_layers, self.horizon, self.width, device=device, dtype=self.embed.weight.dtype)
        return KVCache(kv, kv.clone(), torch.zeros(batch_size, dtype=torch.long, device=device),
                       torch.zeros(batch_size, self.horizon, dtype=torch.bool, device=device))

    def _tokens(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ang = pos.unsqueeze(-1).to(self.freq.dtype) * self.freq
        return self.embed(x) + torch.cat([ang.sin(), ang.cos()], -1).to(x.dtype)

    def _layers(self, h: torch.Tensor, st: KVCache, mask: torch.Tensor, write=None) -> torch.Tensor:
        """h [B, Tq, W]; keys = [cache ; these tokens]; mask [B, 1, Tq, horizon + Tq] (True: attend)."""
        n, tq, w = h.shape
        split = lambda z: z.reshape(n, z.shape[1], self.heads, w // self.heads).transpose(1, 2)  # noqa: E731
        for i, blk in enumerate(self.blocks):
            q, k, v = blk.qkv(blk.ln1(h)).chunk(3, -1)
            if tq == 1 and exporting():
                a = self._graph_attention(q[:, 0], k[:, 0], v[:, 0], st.k, st.v, i, mask[:, 0, 0])[:, None]
            else:
                keys, vals = torch.cat([st.k[:, i], k], 1), torch.cat([st.v[:, i], v], 1)
                a = F.scaled_dot_product_attention(split(q), split(keys), split(vals), attn_mask=mask)
                a = a.transpose(1, 2).reshape(n, tq, w)
            h = h + blk.proj(a)
            h = h + blk.mlp(blk.ln2(h))
            if write is not None:
                write(i, k[:, 0], v[:, 0])
        return self.ln_f(h)

    def _graph_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                         cache_v: torch.Tensor, layer: int, mask: torch.Tensor) -> torch.Tensor:
        """One token's attention in `layer` as an exported step computes it: q, k, v [B, W], the caches of every layer
        [B, layers, horizon, W], mask [B, horizon + 1] (the cache's slots, then the token itself); the values of
        `scaled_dot_product_attention`. The caches are read as they are laid out, by two matmuls whose other side
        spreads the heads over a block diagonal ([B, heads, W]) and spans every layer (the other layers' weights are
        zeros; the runtime fuses the transpose into the first matmul): no copy of a layer's cache, no transposed
        copy into heads, no copy of cache and token concatenated, no product as large as the cache. Those copies
        were most of the graph's time (issue 63)."""
        n, w = q.shape
        K = self.horizon
        heads = (torch.arange(self.heads, device=q.device)[:, None]
                 == torch.arange(w, device=q.device) // (w // self.heads)).to(q.dtype)  # [heads, W]
        qh = q[:, None] * heads * (w // self.heads) ** -0.5  # [B, heads, W]: each head's part of the query
        to_cache = (qh @ cache_k.flatten(1, 2).transpose(1, 2))[:, :, layer * K:(layer + 1) * K]
        scores = torch.cat([to_cache, (qh * k[:, None]).sum(-1, keepdim=True)], 2)  # [B, heads, horizon + 1]
        blocked = torch.zeros_like(mask, dtype=q.dtype).masked_fill(~mask, -torch.inf)[:, None]
        weights = (scores + blocked).softmax(-1)
        spread = torch.cat([weights.new_zeros(n, self.heads, layer * K), weights[:, :, :-1],
                            weights.new_zeros(n, self.heads, (self.num_layers - 1 - layer) * K)], 2)
        mixed = spread @ cache_v.flatten(1, 2) + weights[:, :, -1:] * v[:, None]  # [B, heads, W]
        return (mixed * heads).sum(1)

    def _step(self, x, st: KVCache, reset, active):
        if exporting():
            return self._graph_step(x, st, reset, active)
        st.pos.masked_fill_(reset, 0)
        st.valid.masked_fill_(reset[:, None], False)
        n = x.shape[0]
        rows, slot, keep = torch.arange(n, device=x.device), st.pos % self.horizon, ~active[:, None]
        mask = torch.cat([st.valid, torch.ones(n, 1, dtype=torch.bool, device=x.device)], 1)[:, None, None]

        def write(i, k, v):  # ring-buffer write of the active slots, one indexed store for the batch
            st.k[rows, i, slot] = torch.where(keep, st.k[rows, i, slot], k)
            st.v[rows, i, slot] = torch.where(keep, st.v[rows, i, slot], v)

        out = self._layers(self._tokens(x, st.pos)[:, None], st, mask, write)[:, 0]
        st.valid[rows, slot] |= active
        st.pos += active
        return out

    def _graph_step(self, x, st: KVCache, reset, active):
        """`_step` as an exported graph computes it (the same values), the state's tensors replaced, not written into:
        the layers' new tokens go into the cache by one index_put of [n, layers] positions (ONNX ScatterND) after the
        last layer. The in-place write `st.k[rows, i, slot] = ...` exports as ScatterElements nodes with a full-size
        int64 index, 77% of the transformer graph's time, which made it 7x slower than `Policy.act` at batch 1,024,
        and a write per layer then stacked copied the cache three times (issue 63). A rollout keeps the in-place
        write (a captured step must write the memory it read)."""
        pos = st.pos.masked_fill(reset, 0)
        valid = st.valid.masked_fill(reset[:, None], False)
        n = x.shape[0]
        slot, keep = pos % self.horizon, ~active[:, None, None]
        here = (torch.arange(self.horizon, device=x.device) == slot[:, None]) & active[:, None]  # [n, K]
        mask = torch.cat([valid, torch.ones(n, 1, dtype=torch.bool, device=x.device)], 1)[:, None, None]
        keys, vals = [], []

        def write(i, k, v):
            keys.append(k)
            vals.append(v)

        # The deployed policy hands the cache with its slots as [batch, agents] (`KVCache.deployed_slots`): the write
        # then makes the graph's output itself, with no reshape copying the whole cache after it.
        slots = st.k.shape[:-3]
        flat = KVCache(st.k.flatten(0, len(slots) - 1), st.v.flatten(0, len(slots) - 1), pos, valid)
        out = self._layers(self._tokens(x, pos)[:, None], flat, mask, write)[:, 0]
        rows = torch.arange(n, device=x.device)[:, None]
        at = (*((rows // slots[1], rows % slots[1]) if len(slots) == 2 else (rows,)),
              torch.arange(self.num_layers, device=x.device)[None, :], slot[:, None])  # [n, layers] positions
        st.k = st.k.index_put(at, torch.where(keep, st.k[at], torch.stack(keys, 1)))
        st.v = st.v.index_put(at, torch.where(keep, st.v[at], torch.stack(vals, 1)))
        st.valid, st.pos = valid | here, pos + active.long()
        return out

    def _seq(self, x, st: KVCache, resets, active, idle_outputs=True):
        n, t = x.shape[:2]
        K, dev = self.horizon, x.device
        ep = resets.long().cumsum(1)  # episode index inside the segment; 0 = the start state's episode
        a = active.long()
        before = a.cumsum(1) - a  # active steps before t in the segment
        base = torch.where(resets, before, 0).cummax(1).values  # ... before the latest episode start
        pos = before - base + torch.where(ep == 0, st.pos[:, None], 0)  # [B, T] position in the episode
        # Cache slot s holds the latest position p < pos0 with p % K == s.
        p0 = st.pos[:, None]
        cache_pos = p0 - 1 - (p0 - 1 - torch.arange(K, device=dev)).remainder(K)  # [B, K]
        lo = (pos - K)[:, :, None]  # oldest position a token may attend to
        to_cache = st.valid[:, None, :] & (ep == 0)[:, :, None] & (cache_pos[:, None, :] >= lo)
        i = torch.arange(t, device=dev)
        to_seg = (i[None, :] < i[:, None]) & active[:, None, :] & (ep[:, :, None] == ep[:, None, :]) & (pos[:, None, :] >= lo)
        to_seg = to_seg | torch.eye(t, dtype=torch.bool, device=dev)  # always itself: no empty row
        mask = torch.cat([to_cache, to_seg], 2)[:, None]
        return self._layers(self._tokens(x, pos), st, mask)


class CausalTransformerCore(_CausalTransformer, nn.Module):
    """The causal transformer of TransformerActorCritic as a component over any token stream
    x [..., in]: `initial_state`, `step` and `seq` follow the memory-model semantics of resets and
    inactive steps. Each layer's token attends to itself and the last `horizon` active tokens of its
    episode, so the output at step t depends on the last `layers * horizon` active steps."""

    def __init__(self, in_dim: int, width: int = default("tf_width"), layers: int = default("tf_layers"),
                 heads: int = default("tf_heads"), horizon: int = default("tf_horizon"), activation: str = "gelu"):
        super().__init__()
        self._build(in_dim, width, layers, heads, horizon, activation)

    def step(self, x: torch.Tensor, cache: KVCache, reset: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """x [B, in] -> [B, W]; writes the active tokens into `cache` (in place)."""
        return self._step(x, cache, reset, active)

    def seq(self, x: torch.Tensor, cache: KVCache, resets: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """x [B, T, in] -> [B, T, W] from the state `cache` before the first step (left untouched)."""
        return self._seq(x, cache, resets, active)


class TransformerActorCritic(_CausalTransformer, _MemoryActorCritic):
    """Causal pre-LayerNorm transformer over each slot's episode, sinusoidal positions within the
    episode, a `horizon`-token KV cache per layer; see the module docstring for the semantics."""

    def __init__(self, settings: MemorySettings, width: int = default("tf_width"), layers: int = default("tf_layers"),
                 heads: int = default("tf_heads"), horizon: int = default("tf_horizon"), activation: str = "gelu"):
        super().__init__(settings, width, activation)
        self._build(self.in_dim, width, layers, heads, horizon, activation)
