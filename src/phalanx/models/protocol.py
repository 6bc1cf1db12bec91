"""The model interface the trainer, policies and the league rely on (docs/DESIGN.md section 4).

Every model declares its capabilities as attributes (class attributes where they cannot change):
the trainer reads them, never probes for methods. `tests/test_structure.py` checks every
registered model against these protocols.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import torch

from phalanx.draws import Source


@runtime_checkable
class ActorCritic(Protocol):
    """What every actor-critic offers, and its action head `head` (a phalanx.models.mlp.ActionHead).

    `head` is written here, not declared below: a submodule lives in the module's `_modules`, and
    since Python 3.12 a runtime protocol checks members with inspect.getattr_static, which does not
    see it, so a declared `head` made every model fail isinstance on 3.12."""

    recurrent: ClassVar[bool]  # memory across steps: a step forward in rollouts, a sequence forward in training
    obs_is_image: ClassVar[bool]  # takes uint8 pixels [..., A, C, H, W] and scales them itself
    centralized: bool  # the critic reads the env's global state (MAPPO), not the agent's observation
    memory_critic: bool  # the critic reads the memory: values come from act_step / value_step / evaluate_seq
    slot_agnostic: bool  # every slot is treated alike (no slot id, one parameter set, per-agent critic)
    num_agents: int

    def value(self, critic_in: torch.Tensor) -> torch.Tensor:
        """V per agent [..., A] from observations [..., A, D] (IPPO) or the global state [..., S] (MAPPO)."""
        ...

    def initial_state(self, batch_size: int, device: torch.device | str | None = None):
        """The memory (models/state.py) of `batch_size` slots at an episode start; `NoMemory` where feed-forward."""
        ...


@runtime_checkable
class FeedForwardActorCritic(ActorCritic, Protocol):
    def moves(self, obs: torch.Tensor, mask: torch.Tensor | None = None, greedy: bool = False) -> torch.Tensor | None:
        """The moves `act` chooses from: `mask` as given, or narrowed where the model reads the game's rules
        (models/board.py). A function of the observations, the mask and `greedy` alone, never of the weights, so
        models built from one config share it (a league reads it once for all its snapshots)."""
        ...

    def act(self, obs: torch.Tensor, generator: Source = None, greedy: bool = False,
            mask: torch.Tensor | None = None, moves: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """obs [..., A, *obs] -> (action [..., A, *act], log-prob [..., A]); `mask` (StepRecord.action_mask,
        None: every action) the actions each slot may take; `moves`: `moves(obs, mask, greedy)` where the caller
        has it already (None: read here), the actions chosen from, on which the log-prob is."""
        ...

    def act_value(self, obs: torch.Tensor, generator: Source = None, greedy: bool = False,
                  critic_in: torch.Tensor | None = None,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (action, log-prob, value): `act`, and `value(critic_in)` (None: `obs`), the rollout's one call a step."""
        ...

    def evaluate_value(self, obs: torch.Tensor, actions: torch.Tensor, critic_in: torch.Tensor,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (log-prob, entropy, value), each [..., A]: the update's one forward (on the masks the rollout
        stored, so the PPO ratio compares like with like)."""
        ...


@runtime_checkable
class RecurrentActorCritic(ActorCritic, Protocol):
    def act_step(self, obs: torch.Tensor, state, reset: torch.Tensor | None = None, active: torch.Tensor | None = None,
                 generator: Source = None, greedy: bool = False, mask: torch.Tensor | None = None):
        """-> (action, log-prob, value | None, state), the state updated in place."""
        ...

    def value_step(self, obs: torch.Tensor, state) -> torch.Tensor:
        """The memory critic's V(obs) as the next step of each slot's episode; writes nothing."""
        ...

    def evaluate_seq(self, obs: torch.Tensor, actions: torch.Tensor, start_state, resets: torch.Tensor | None = None,
                     active: torch.Tensor | None = None, idle_outputs: bool = True, mask: torch.Tensor | None = None):
        """Segments [*B, A, T, ...] -> (log-prob, entropy, value | None), each [*B, A, T]."""
        ...
