"""A residual convolutional actor-critic for board games: the board is an image of a few planes, and a move's worth
depends on the patterns around it (a line of k takes a k-wide view), which shared 3 x 3 filters see wherever they
lie on the board and a flat MLP must learn again at every cell.

Observations are boards [..., A, H, W, P] as the board games give them (P planes, channels last: the slot's own
pieces, the other's; values 0 / 1). A plane of ones is added so that the zero padding at the edges differs from an
empty cell, then: a 3 x 3 conv stem and `blocks` residual blocks of `channels` filters (as AlphaZero's, without
batch norm: a PPO minibatch is no fixed distribution), a policy head (1 x 1 conv to 2 planes, then a linear layer
to the actions) and a value head (1 x 1 conv to 1 plane, a hidden layer, one value).

`afterstates` (the env's `VecEnv.afterstate_fn`, where the game is deterministic: config key `lookahead`) makes the
policy look one move ahead: each move is scored by the net's reading of the board it makes (the same trunk, a score
head), so a move that completes a line, or leaves the other side one, is seen on the board it leaves rather than
inferred from the board before it; the value head reads the board itself. It costs a forward of n + 1 boards a
decision (connect four: 8).

`move_outcomes` (the env's `VecEnv.move_outcome_fn`: config keys `exact_outcomes`, `outcome_plies`) narrows the
moves the policy chooses from by the game's own rules a few plies deep: to the soonest forced wins where there are any,
else to the moves after which the other side cannot force a win where there are any, else to the slowest losses. The
net learns the rest: which of the safe moves is best, everything beyond the horizon. It is part of the policy (its
snapshots play by it, `phalanx eval` plays it), not of the game: the env's mask still allows every legal move.

`play_solved` (the env's `VecEnv.solved_outcome_fn`: config key `play_solve_empties`) reads, where the policy plays
greedily, the game's outcome under perfect play on the boards near the end (an endgame table, as chess engines keep
one), and narrows the moves the outcomes leave to those that keep the best of it: a won ending is never drawn or
lost by a move the net likes, nor a drawn one lost. The net (and the play search) still chooses among them, and
alone wherever the board has more empty cells.

`mirror_actions` (the env's `VecEnv.mirror_actions`: where each action goes when the board is reflected left to
right) makes the policy and value exactly symmetric: the net runs on the board and on its reflection, and the
reflection's action preferences are mapped back and averaged with the board's. A board and its mirror image are
the same position of the game, so the policy learns from each game as from two.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.config import default
from phalanx.draws import Source
from phalanx.envs.spaces import Space
from phalanx.models.layers import layer_init
from phalanx.models.board_search import position_keys, rollout_values
from phalanx.models.mlp import ActionHead
from phalanx.models.state import NoMemory


# Positions the play search (models/board_search.py) remembers its move for, at most; then it starts afresh.
SEARCH_MEMORY = 1 << 20
# The moves played on in the rollouts: those the net gives at least this share of its favourite's probability.
ROLLOUT_SHARE = 0.1


class ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = layer_init(nn.Conv2d(channels, channels, 3, padding=1))
        self.conv2 = layer_init(nn.Conv2d(channels, channels, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.conv2(F.relu(self.conv1(x))))


class BoardActorCritic(nn.Module):
    """Feed-forward actor-critic over boards [..., A, H, W, P] (see the module docstring); shared parameters for
    every slot (`agent_id` appends a one-hot of the slot to both heads' inputs), a per-agent critic."""

    obs_is_image = True  # boards of 0 / 1 stay uint8 in the rollout buffer
    recurrent = False
    memory_critic = False
    centralized = False

    def __init__(
        self,
        obs_shape: tuple[int, int, int],
        action_space: Space,
        channels: int = default("board_channels"),
        blocks: int = default("board_blocks"),
        value_hidden: int = 64,
        num_agents: int = 1,
        agent_id: bool = False,
        mirror_actions: tuple[int, ...] | None = None,
        afterstates: Callable[[torch.Tensor], torch.Tensor] | None = None,
        move_outcomes: Callable[[torch.Tensor], torch.Tensor] | None = None,
        play_outcomes: Callable[[torch.Tensor], torch.Tensor] | None = None,
        successors: Callable[[torch.Tensor], torch.Tensor] | None = None,
        play_rollouts: int = default("play_rollouts"),
        play_solved: Callable[[torch.Tensor], torch.Tensor] | None = None,
        init_log_std: float = default("init_log_std"),
    ):
        super().__init__()
        if len(obs_shape) != 3:
            raise ValueError(f"obs_shape must be a board (H, W, planes), got {tuple(obs_shape)}")
        self.obs_shape = tuple(int(d) for d in obs_shape)
        H, W, P = self.obs_shape
        self.num_agents, self.agent_id = num_agents, agent_id
        self.slot_agnostic = not agent_id
        self.register_buffer("agent_eye", torch.eye(num_agents))
        self.head = ActionHead(action_space, init_log_std)
        n = self.head.out_dim
        if mirror_actions is not None and sorted(mirror_actions) != list(range(n)):
            raise ValueError(f"mirror_actions must be a permutation of the {n} actions, got {mirror_actions}")
        self.register_buffer("mirror", None if mirror_actions is None else torch.tensor(mirror_actions))
        self.afterstates = afterstates
        self.move_outcomes = move_outcomes
        self.play_outcomes = play_outcomes
        if play_rollouts and (successors is None or move_outcomes is None):
            raise ValueError("play_rollouts needs the game's successors and move outcomes (a deterministic board game)")
        self.successors, self.play_rollouts = successors, play_rollouts
        if play_solved is not None and move_outcomes is None:
            raise ValueError("play_solved narrows the moves the exact outcomes leave: it needs move_outcomes")
        self.play_solved = play_solved
        self._search_memory: tuple[tuple[int, ...], dict[tuple[int, int], int]] = ((), {})
        self.stem = layer_init(nn.Conv2d(P + 1, channels, 3, padding=1))
        self.blocks = nn.Sequential(*(ResidualBlock(channels) for _ in range(blocks)))
        ids = num_agents if agent_id else 0
        self.policy_conv = layer_init(nn.Conv2d(channels, 2, 1))
        # With afterstates a move's preference is a score of the board it makes: one output per board.
        self.actor = layer_init(nn.Linear(2 * H * W + ids, 1 if afterstates is not None else n), gain=0.01)
        self.value_conv = layer_init(nn.Conv2d(channels, 1, 1))
        self.value_hidden = layer_init(nn.Linear(H * W + ids, value_hidden))
        self.critic = layer_init(nn.Linear(value_hidden, 1), gain=1.0)

    def _trunk(self, boards: torch.Tensor) -> torch.Tensor:
        """Boards [M, H, W, P] float -> features [M, channels, H, W]."""
        x = boards.permute(0, 3, 1, 2)
        return self.blocks(F.relu(self.stem(torch.cat([x, torch.ones_like(x[:, :1])], 1))))

    def _heads(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Boards [*B, A, H, W, P] -> (actor output [*B, A, n], value [*B, A]) of the net alone (no mirror)."""
        if tuple(obs.shape[-3:]) != self.obs_shape:
            raise ValueError(f"expected boards [..., {', '.join(map(str, self.obs_shape))}], got {tuple(obs.shape)}")
        lead = obs.shape[:-3]
        x = obs.reshape(-1, *self.obs_shape).to(self.stem.weight.dtype)
        B = x.shape[0]
        eye = self.agent_eye.expand(*lead, self.num_agents).reshape(B, -1) if self.agent_id else None
        if self.afterstates is None:
            features = self._trunk(x)
            p = F.relu(self.policy_conv(features)).flatten(1)
            v = F.relu(self.value_conv(features)).flatten(1)
            if eye is not None:
                p = torch.cat([p, eye], 1)
        else:
            after = self.afterstates(x)  # [B, n, H, W, P]
            n = after.shape[1]
            features = self._trunk(torch.cat([x.unsqueeze(1), after], 1).flatten(0, 1)).unflatten(0, (B, n + 1))
            v = F.relu(self.value_conv(features[:, 0])).flatten(1)
            p = F.relu(self.policy_conv(features[:, 1:].flatten(0, 1))).flatten(1)
            if eye is not None:
                p = torch.cat([p, eye.repeat_interleave(n, 0)], 1)
        if eye is not None:
            v = torch.cat([v, eye], 1)
        out = self.actor(p).reshape(B, -1)
        value = self.critic(F.relu(self.value_hidden(v))).squeeze(-1)
        return out.reshape(*lead, -1), value.reshape(lead)

    def forward_both(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(actor output, value): with `mirror`, the mean of the board's and its reflection's, actions mapped back."""
        if self.mirror is None:
            return self._heads(obs)
        out, value = self._heads(torch.stack([obs, obs.flip(-2)]))
        return (out[0] + out[1][..., self.mirror]) / 2, (value[0] + value[1]) / 2

    def moves(self, obs: torch.Tensor, mask: torch.Tensor | None, greedy: bool = False) -> torch.Tensor | None:
        """The moves the policy chooses from: `mask` (None: all), narrowed by `move_outcomes` where the model has them
        (see the module docstring), by `play_outcomes` instead where it has them and plays `greedy`. A function of the
        boards, the mask and `greedy` alone, so that the update's log-probs are those of the rollout's choices."""
        outcomes = self.play_outcomes if greedy and self.play_outcomes is not None else self.move_outcomes
        if outcomes is None:
            return mask
        boards = obs.to(self.stem.weight.dtype)
        allowed = _narrowed(outcomes(boards), mask)
        if greedy and self.play_solved is not None:
            allowed = _best_solved(self.play_solved(boards), allowed)
        return allowed

    def _reading(self, boards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Boards [M, H, W, P] -> (the net's actor output [M, n], the board each move makes [M, n, H, W, P], the moves
        the policy samples from (the legal ones the outcomes leave), the moves that complete a line)."""
        out = self.forward_both(boards)[0]
        after = self.successors(boards)
        legal = after.flatten(2).sum(-1) > boards.flatten(1).sum(-1, keepdim=True)
        outcome = self.move_outcomes(boards)
        return out, after, _narrowed(outcome, legal), legal & (outcome > 1.0 - 1e-4)

    def _rollout_move(self, boards: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The play of `rollout_values`'s games: a move of boards [M, H, W, P] sampled as training samples it, by the
        Gumbel-max rule on `noise` [M, n] -> (the board it makes, whether it completes a line)."""
        out, after, allowed, wins = self._reading(boards)
        gumbel = -torch.log(-torch.log(noise))
        move = (self.head._logits(out, allowed) + gumbel).masked_fill(~allowed, -torch.inf).argmax(-1)
        rows = torch.arange(len(boards), device=boards.device)
        return after[rows, move], wins[rows, move]

    def _greedy(self, obs: torch.Tensor, out: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """Greedy actions [..., A] among the `allowed` moves: the most likely, or with `play_rollouts` the move whose
        games played on score best (models/board_search.py) where the slot is to move and has a choice (a slot
        holding more pieces than the other waits)."""
        action = self.head.sample(out, None, True, allowed)
        if not self.play_rollouts:
            return action
        boards = obs.reshape(-1, *self.obs_shape).to(self.stem.weight.dtype)
        choices = torch.ones_like(out, dtype=torch.bool) if allowed is None else allowed
        choices = choices.reshape(boards.shape[0], -1)
        own, other = boards[..., 0].flatten(1).sum(-1), boards[..., 1].flatten(1).sum(-1)
        rows = ((own <= other) & (choices.sum(-1) > 1)).nonzero().squeeze(-1)
        if rows.numel() == 0:
            return action
        prior = torch.where(choices[rows], out.reshape(boards.shape[0], -1)[rows], -torch.inf).softmax(-1)
        flat = action.reshape(-1).clone()
        flat[rows] = self._searched(boards[rows], choices[rows], prior)
        return flat.view(action.shape)

    def _searched(self, boards: torch.Tensor, choices: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
        """The search's moves [M] for boards [M, H, W, P] among `choices`, each distinct position searched once and
        remembered: the search is a function of the position, and a greedy policy's games against a player that
        varies little repeat their positions (200 games a seat are often a few games played again). The memory is
        dropped when the weights change (their version counters)."""
        version = tuple(p._version for p in self.parameters())
        if self._search_memory[0] != version:
            self._search_memory = (version, {})
        memory = self._search_memory[1]
        unique, inverse = torch.unique(position_keys(boards), dim=0, return_inverse=True)
        known = [memory.get(tuple(k)) for k in unique.tolist()]
        todo = [i for i, m in enumerate(known) if m is None]
        if todo:
            first = torch.zeros(len(unique), dtype=torch.long, device=boards.device)
            first.scatter_(0, inverse, torch.arange(len(boards), device=boards.device))  # a row of each position
            at = first[torch.tensor(todo, device=boards.device)]
            # Games are played on from the moves the net gives a fair share of its favourite's probability.
            liked = prior[at] >= ROLLOUT_SHARE * prior[at].amax(-1, keepdim=True)
            wins = self._reading(boards[at])[3]
            worth = rollout_values(boards[at], choices[at] & liked, wins, self._rollout_move, self.successors,
                                   self.play_rollouts)
            found = (worth + 1e-3 * prior[at]).argmax(-1).tolist()  # equal results go to the net's preference
            if len(memory) > SEARCH_MEMORY:
                memory.clear()
            for i, move in zip(todo, found):
                known[i] = move
                memory[tuple(unique[i].tolist())] = move
        return torch.tensor(known, device=boards.device)[inverse]

    def value(self, critic_in: torch.Tensor) -> torch.Tensor:
        """V per agent [..., A] from boards [..., A, H, W, P]."""
        return self.forward_both(critic_in)[1]

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> NoMemory:
        """A feed-forward model's memory: none (models/state.py)."""
        return NoMemory()

    def act(self, obs: torch.Tensor, generator: Source = None, greedy: bool = False, mask: torch.Tensor | None = None,
            moves: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.forward_both(obs)[0]
        moves = self.moves(obs, mask, greedy) if moves is None else moves
        action = self._greedy(obs, out, moves) if greedy else self.head.sample(out, generator, greedy, moves)
        return action, self.head.log_prob(out, action, moves)

    def act_value(self, obs: torch.Tensor, generator: Source = None, greedy: bool = False,
                  critic_in: torch.Tensor | None = None,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`act` and `value` of one forward (the critic reads the same boards): -> (action, log-prob, value)."""
        (out, value), moves = self.forward_both(obs), self.moves(obs, mask, greedy)
        action = self._greedy(obs, out, moves) if greedy else self.head.sample(out, generator, greedy, moves)
        return action, self.head.log_prob(out, action, moves), value

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor,
                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head.log_prob_entropy(self.forward_both(obs)[0], actions, self.moves(obs, mask))

    def evaluate_value(self, obs: torch.Tensor, actions: torch.Tensor, critic_in: torch.Tensor | None = None,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, value = self.forward_both(obs)
        return *self.head.log_prob_entropy(out, actions, self.moves(obs, mask)), value


def _narrowed(outcome: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The moves of `mask` (None: all) that the outcomes [..., n] leave: a forced win, the soonest; none: every move
    that does not lose; only losses: the slowest."""
    allowed = torch.ones_like(outcome, dtype=torch.bool) if mask is None else mask
    best = torch.where(allowed, outcome, -torch.inf).amax(-1, keepdim=True)
    floor = torch.where((best > 0.5) | (best < -0.5), best - 1e-4, -0.5)
    return allowed & (outcome >= floor)


def _best_solved(solved: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The moves of `allowed` whose outcome under perfect play, `solved` [..., n], is the best among them, on the
    boards the solver reached (finite values); `allowed` as it is on the others."""
    best = torch.where(allowed, solved, -torch.inf).amax(-1, keepdim=True)
    return torch.where(solved.isfinite().all(-1, keepdim=True), allowed & (solved >= best), allowed)


__all__ = ["BoardActorCritic", "ResidualBlock"]
