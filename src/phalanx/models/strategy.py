"""Strategy-encoder actor-critic for the 1v1 `duel` workload (docs/WORKLOADS.md section 5).

A causal transformer over the opponent's features, one token per step, summarises how the opponent
has played in this episode into a strategy latent z_t of `latent_tokens` tokens; the embedded
observation queries z_t by cross-attention, and an LSTM core over [observation embedding ; context]
feeds the actor and critic heads. Everything is trained end to end through `evaluate_seq`.

Window: every transformer layer's token attends to itself and to the opponent's last `history`
active steps of the episode (TransformerActorCritic's `horizon`), so z_t depends on the opponent's
features at the last `layers * history` active steps and on the position in the episode, nothing else
(a sliding-window transformer: the window grows with depth). The LSTM may carry information further.

Forwards, resets, inactive steps and critics follow the memory-model contract of models/memory.py:
a reset clears both memories before the step, an inactive step gets an output but writes nothing.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.config import default
from phalanx.models.layers import ACTIVATIONS, Linear, layer_init
from phalanx.models.memory import (
    CausalTransformerCore,
    KVCache,
    LSTMCore,
    LSTMState,
    MemorySettings,
    _MemoryActorCritic,
)
from phalanx.models.state import MemoryState


@dataclasses.dataclass
class StrategyState(MemoryState):
    """The strategy encoder's KV cache (k, v, pos, valid as in `KVCache`) and the LSTM core's (h, c)."""

    k: torch.Tensor  # [B, layers, history, width]
    v: torch.Tensor  # [B, layers, history, width]
    pos: torch.Tensor  # [B] long
    valid: torch.Tensor  # [B, history] bool
    h: torch.Tensor  # [B, hidden]
    c: torch.Tensor  # [B, hidden]
    _batch_dims = {**KVCache._batch_dims, **LSTMState._batch_dims}
    deployed_slots = KVCache.deployed_slots

    @property
    def kv(self) -> KVCache:
        """A view on the same tensors: the cores' in-place updates land in this state."""
        return KVCache(self.k, self.v, self.pos, self.valid)

    @property
    def lstm(self) -> LSTMState:
        return LSTMState(self.h, self.c)


class StrategyActorCritic(_MemoryActorCritic):
    """Opponent-history transformer -> strategy latent; observation cross-attends to it; LSTM core.

    `opponent_features` is the (start, stop) slice of the observation's last axis holding the
    opponent's features (default: the second half). The strategy transformer's blocks use GELU;
    `activation` is the observation encoder's (and the memoryless critic's)."""

    def __init__(
        self,
        settings: MemorySettings,
        hidden: int = default("lstm_hidden"),
        width: int = default("tf_width"),
        layers: int = default("tf_layers"),
        heads: int = default("tf_heads"),
        history: int = default("strategy_history"),
        latent_tokens: int = 4,
        opponent_features: tuple[int, int] | None = None,
        activation: str = default("activation"),
    ):
        obs_dim = settings.obs_dim
        start, stop = opponent_features if opponent_features is not None else (obs_dim // 2, obs_dim)
        if not 0 <= start < stop <= obs_dim:
            raise ValueError(f"opponent_features {(start, stop)} is not a slice of the {obs_dim} observation features")
        super().__init__(settings, hidden, activation)
        self.opponent_features, self.latent_tokens, self.width, self.heads = (start, stop), latent_tokens, width, heads
        self.strategy = CausalTransformerCore(stop - start, width, layers, heads, history, "gelu")
        self.to_latent = nn.Linear(width, latent_tokens * width)
        self.encoder = nn.Sequential(layer_init(Linear(self.in_dim, width)), ACTIVATIONS[activation]())
        self.cross_q, self.cross_kv = nn.Linear(width, width), nn.Linear(width, 2 * width)
        self.cross_out = nn.Linear(width, width)
        self.core = LSTMCore(2 * width, hidden)

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> StrategyState:
        kv, lstm = self.strategy.initial_state(batch_size, device), self.core.initial_state(batch_size, device)
        return StrategyState(kv.k, kv.v, kv.pos, kv.valid, lstm.h, lstm.c)

    def _opponent(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., self.opponent_features[0]:self.opponent_features[1]]

    def _latent(self, s: torch.Tensor) -> torch.Tensor:
        return self.to_latent(s).unflatten(-1, (self.latent_tokens, self.width))

    def _attend(self, e: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Cross-attention of the observation embeddings e [..., W] over the latents z [..., L, W]."""
        lead, w, h = e.shape[:-1], self.width, self.heads
        q = self.cross_q(e).reshape(-1, h, 1, w // h)
        k, v = self.cross_kv(z).reshape(q.shape[0], self.latent_tokens, 2, h, w // h).permute(2, 0, 3, 1, 4)
        return self.cross_out(F.scaled_dot_product_attention(q, k, v).reshape(*lead, w))

    def _core_input(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        e = self.encoder(x)
        return torch.cat([e, self._attend(e, z)], -1)

    def _step(self, x, st: StrategyState, reset, active):
        kv = st.kv
        z = self._latent(self.strategy.step(self._opponent(x), kv, reset, active))
        # A rollout's step writes into the same tensors; an exported graph's replaces them (`_graph_step`).
        st.k, st.v, st.pos, st.valid = kv.k, kv.v, kv.pos, kv.valid
        return self.core.step(self._core_input(x, z), st.lstm, reset, active)

    def _seq(self, x, st: StrategyState, resets, active, idle_outputs=True):
        z = self._latent(self.strategy.seq(self._opponent(x), st.kv, resets, active))
        return self.core.seq(self._core_input(x, z), st.lstm, resets, active, idle_outputs)

    def latent_seq(self, obs: torch.Tensor, start_state: StrategyState, resets: torch.Tensor | None = None,
                   active: torch.Tensor | None = None) -> torch.Tensor:
        """The strategy latents z_t of segments obs [*B, A, T, D] -> [*B, A, T, latent_tokens, width]."""
        x, resets, active = self._seq_inputs(obs, resets, active)
        z = self._latent(self.strategy.seq(self._opponent(x), start_state.kv, resets, active))
        return z.reshape(*obs.shape[:-1], self.latent_tokens, self.width)
