"""model=board (models/board.py): a residual conv net over a board's planes; with `mirror`, policy and value are
exactly symmetric under the env's left-right reflection."""

import pytest
import torch

from phalanx.config import resolve
from phalanx.envs import make
from phalanx.errors import ConfigError
from phalanx.models.registry import build_model
from phalanx.slots import random_actions
from tests.board_positions import win_and_block


def boards(name: str, n: int = 64, plies: int = 5):
    env = make(name, num_envs=n, seed=0)
    rec = env.reset(seed=0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(plies):
        rec = env.step(random_actions(env, gen, rec.action_mask))
    return env, rec


@pytest.mark.parametrize("name", ["connect_four", "tictactoe"])
def test_a_mirrored_board_gets_the_mirrored_policy_and_the_same_value(name):
    env, rec = boards(name)
    torch.manual_seed(0)
    model = build_model(resolve({"env": name, "model": "board", "mirror": True, "board_channels": 8}), env)
    plain = build_model(resolve({"env": name, "model": "board", "board_channels": 8}), env)
    perm = torch.tensor(env.mirror_actions)
    obs, flipped = rec.obs, rec.obs.flip(-2)
    with torch.no_grad():
        out, value = model.forward_both(obs)
        out_f, value_f = model.forward_both(flipped)
        assert torch.allclose(out_f, out[..., perm], atol=1e-6)
        assert torch.allclose(value_f, value, atol=1e-6)
        raw, _ = plain.forward_both(obs)
        raw_f, _ = plain.forward_both(flipped)
        assert not torch.allclose(raw_f, raw[..., perm], atol=1e-4)  # the plain net is not symmetric: the test can fail
    # The mirror of a mirror is the board itself, and the mirrored board's free cells (tic-tac-toe's moves; connect
    # four's top row) are the board's, mapped by mirror_actions.
    assert perm[perm].tolist() == list(range(len(perm)))
    free = lambda o: (o.sum(-1) == 0).flatten(-2)  # noqa: E731  [..., cells]
    cols = env.action_space.n
    assert torch.equal(free(flipped)[..., :cols] if name == "connect_four" else free(flipped),
                       (free(obs)[..., :cols] if name == "connect_four" else free(obs))[..., perm])


def test_the_board_model_is_refused_where_it_cannot_serve():
    env = make("cartpole", num_envs=2)
    with pytest.raises(ConfigError, match="flat observations"):
        build_model(resolve({"env": "cartpole", "model": "board"}), env)
    with pytest.raises(ConfigError, match="declares no mirror_actions"):
        build_model(resolve({"env": "pixel_goal", "model": "board", "mirror": True}), make("pixel_goal", num_envs=2))


@pytest.mark.parametrize("name", ["connect_four", "tictactoe"])
def test_afterstates_are_the_boards_the_env_steps_to(name):
    """`afterstate_fn` from a mover's observation alone gives, for every legal move, the observation the env itself
    gives the mover after that move (its final observation: a move that ends the game resets the board)."""
    env, rec = boards(name, n=64, plies=0)
    after_fn = env.afterstate_fn()
    gen = torch.Generator().manual_seed(1)
    rows = torch.arange(64)
    checked = 0
    for _ in range(9):
        mover = env.turn.clone()
        after = after_fn(rec.obs[rows, mover])
        state = {k: v.clone() for k, v in env.step_state().items()}
        for move in range(env.action_space.n):
            legal = rec.action_mask[rows, mover, move]
            twin = make(name, num_envs=64, seed=0)
            twin.load_step_state({k: v.clone() for k, v in state.items()})
            actions = torch.zeros(64, 2, dtype=torch.long)
            actions[rows, mover] = move
            seen = twin.step(actions).final_obs[rows, mover]
            assert torch.equal(after[:, move][legal], seen[legal])
            checked += int(legal.sum())
        rec = env.step(random_actions(env, gen, rec.action_mask))
    assert checked > 1000


def test_lookahead_scores_each_move_by_the_board_it_makes():
    """With lookahead the actor's output for a move is the score of its afterstate alone: two positions whose move 0
    makes the same board give move 0 the same preference."""
    env, rec = boards("connect_four", n=4, plies=0)
    model = build_model(resolve({"env": "connect_four", "model": "board", "lookahead": True, "board_channels": 8}), env)
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    a = torch.zeros(1, 1, 6, 7, 2)
    b = a.clone()
    a[0, 0, 5, 0, 0] = 1.0  # my piece at the bottom of column 0, and move 0 goes on top of it...
    b[0, 0, 4, 0, 0] = 1.0  # ... the same two pieces, reached another way (not a legal position: only the score matters)
    b[0, 0, 5, 0, 0] = 1.0
    with torch.no_grad():
        out_a, _ = model.forward_both(a)
        after_b = env.afterstate_fn()(a[0])[:, 0]  # the board move 0 makes from a
        assert torch.equal(after_b, b[0])
        # move 0's score from a is the score of board b as an afterstate: the net's score head on b
        score_b = model.actor(torch.relu(model.policy_conv(model._trunk(b.reshape(1, 6, 7, 2)))).flatten(1))
        assert torch.allclose(out_a[0, 0, 0], score_b[0, 0], atol=1e-6)
        assert not torch.allclose(out_a[0, 0, 0], out_a[0, 0, 1])  # different boards, different scores
    with pytest.raises(ConfigError, match="has no afterstates"):
        build_model(resolve({"env": "pixel_goal", "model": "board", "lookahead": True}), make("pixel_goal", num_envs=1))


def test_exact_outcomes_take_a_win_block_a_loss_and_train_on_the_moves_they_allow():
    """With exact_outcomes the policy plays the winning move where there is one and the only block where the other
    side threatens, from any weights; the update's log-probs (`evaluate`, from the boards and the env's mask) are the
    rollout's; and a plain model at the same weights plays other moves, so the test can fail."""
    env = make("connect_four", num_envs=2, seed=0)
    env.reset(seed=0)
    win_and_block(env)  # copy 0: column 3 wins; copy 1: only column 6 stops the other side
    obs, mask = env._observe(env.board), env._mask()
    cfg = {"env": "connect_four", "model": "board", "lookahead": True, "board_channels": 8}
    torch.manual_seed(0)
    model = build_model(resolve({**cfg, "exact_outcomes": True}), env)
    plain = build_model(resolve({**cfg, "exact_outcomes": False}), env)
    plain.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(20):
            action, logp = model.act(obs, gen, mask=mask)
            assert action[:, 0].tolist() == [3, 6]
            assert torch.allclose(model.evaluate(obs, action, mask)[0], logp)
        assert torch.allclose(logp[:, 0], torch.zeros(2), atol=1e-6)  # the only move it allows: probability one
        plain_moves = {tuple(plain.act(obs, gen, mask=mask)[0][:, 0].tolist()) for _ in range(20)}
        assert plain_moves != {(3, 6)}
    assert bool(mask[:, 0].all())  # the env's mask still allows every column: the narrowing is the policy's


def test_the_board_options_are_refused_on_another_model(capsys):
    from phalanx.cli import main

    assert main(["train", "--env", "connect_four", "--model", "mlp", "--lookahead", "true", "--total-steps", "8192"]) == 2
    assert "config key 'lookahead' is true but applies only to model=board" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="config key 'mirror' is true but applies only to model=board"):
        build_model(resolve({"env": "connect_four", "model": "mlp", "mirror": True}), make("connect_four", num_envs=1))
    with pytest.raises(ConfigError, match="config key 'exact_outcomes' is true but applies only to model=board"):
        build_model(resolve({"env": "connect_four", "model": "mlp", "exact_outcomes": True}), make("connect_four", num_envs=1))
    with pytest.raises(ConfigError, match="config key 'exact_outcomes' is true but env 'pixel_goal' has no move outcomes"):
        build_model(resolve({"env": "pixel_goal", "model": "board", "exact_outcomes": True}), make("pixel_goal", num_envs=1))


def test_connect_four_defaults_to_the_board_model_and_another_model_drops_its_keys():
    """The env's training defaults pick the board model with its options; `--model mlp` drops the board keys those
    defaults set (a user switching model is not refused over keys they never wrote), and keeps the ones they did."""
    cfg = resolve({"env": "connect_four"})
    assert (cfg.model, cfg.lookahead, cfg.exact_outcomes, cfg.outcome_plies, cfg.play_outcome_plies, cfg.board_channels) \
        == ("board", True, True, 2, 6, 16)
    assert "threats_4" in cfg.opponents and "tactics_4" not in cfg.opponents
    assert cfg.env_options == {"opening_plies": 6}  # the longest random opening (issue 62)
    mlp = resolve({"env": "connect_four", "model": "mlp"})
    assert (mlp.model, mlp.lookahead, mlp.exact_outcomes) == ("mlp", False, False)
    build_model(mlp, make("connect_four", num_envs=1))
    with pytest.raises(ConfigError, match="config key 'lookahead' is true but applies only to model=board"):
        build_model(resolve({"env": "connect_four", "model": "mlp", "lookahead": True}), make("connect_four", num_envs=1))


def _open_three_position(owner: int = 1):
    """Slot 0 to move; slot `owner`'s mark (1: slot 0, 2: slot 1) has two in the bottom row (columns 2 and 3), both ends
    open, the other's pieces on top of them. Owner 1: column 1 or 4 makes an open three, a double threat that wins in
    3 plies whatever slot 1 does; owner 2: only columns 1 and 4 stop slot 1's."""
    env = make("connect_four", num_envs=1, seed=0)
    env.reset(seed=0)
    board = torch.zeros(1, 42, dtype=torch.long)
    board[0, [37, 38]] = owner
    board[0, [30, 31]] = 3 - owner
    env.board, env.turn = board, torch.zeros(1, dtype=torch.long)
    return env, env._observe(board), env._mask()


def test_deeper_exact_outcomes_see_a_double_threat_coming():
    """outcome_plies 4: slot 1 has two in the bottom row (columns 2 and 3) with both ends open, slot 0 to move. At 2
    plies every move looks safe; at 4 plies only columns 1 and 4 stop the open three (after any other move slot 1
    plays column 1 or 4 and wins next move whatever slot 0 does)."""
    env, obs, mask = _open_three_position(owner=2)
    cfg = {"env": "connect_four", "model": "board", "lookahead": True, "board_channels": 8, "exact_outcomes": True}
    allowed = {}
    for plies in (2, 4):
        model = build_model(resolve({**cfg, "outcome_plies": plies}), env)
        allowed[plies] = model.moves(obs, mask)[0, 0].nonzero().flatten().tolist()
    assert allowed[2] == list(range(7))
    assert allowed[4] == [1, 4]


def test_greedy_play_reads_the_outcomes_deeper_and_sampled_moves_do_not():
    """play_outcome_plies 4 with outcome_plies 2, the position above: greedy play (eval, export) chooses only among
    the two moves that stop the open three; a sampled move (a training rollout's) may still be any of the seven, and
    its log-prob is the one the update computes. Without exact outcomes the key does nothing (as outcome_plies)."""
    env, obs, mask = _open_three_position(owner=2)
    cfg = resolve({"env": "connect_four", "model": "board", "board_channels": 8, "exact_outcomes": True,
                   "outcome_plies": 2, "play_outcome_plies": 4})
    model = build_model(cfg, env)
    assert model.moves(obs, mask, greedy=True)[0, 0].nonzero().flatten().tolist() == [1, 4]
    assert model.moves(obs, mask)[0, 0].all()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        greedy = {int(model.act(obs, gen, greedy=True, mask=mask)[0][0, 0]) for _ in range(5)}
        sampled = [model.act(obs, gen, mask=mask) for _ in range(200)]
        assert greedy <= {1, 4} and {int(a[0, 0]) for a, _ in sampled} - {1, 4}
        action, logp = sampled[0]
        assert torch.allclose(model.evaluate(obs, action, mask)[0], logp)
    plain = build_model(resolve({"env": "connect_four", "model": "board", "exact_outcomes": False}), env)
    assert plain.move_outcomes is None and plain.play_outcomes is None


def test_the_play_horizon_changes_nothing_in_training(tmp_path):
    """play_outcome_plies acts where the policy plays greedily only: a run with it trains the very weights of one
    without (so a run trained before the key existed plays with it by its config alone)."""
    import json

    from safetensors.torch import load_file

    import phalanx
    from phalanx import checkpoint as ckpt

    cfg = {"env": "connect_four", "model": "board", "board_channels": 4, "num_envs": 16, "num_steps": 8,
           "total_steps": 16 * 8 * 2, "opponents": "self_play:1,threats_2:1", "progress": False, "tensorboard": False}
    weights = []
    for plies in (0, 4):
        phalanx.train({**cfg, "play_outcome_plies": plies, "run_dir": str(tmp_path / str(plies))})
        weights.append(load_file(str(ckpt.latest_checkpoint(tmp_path / str(plies)) / ckpt.WEIGHTS_FILE)))
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    # A run written before the key existed plays as it was trained, not by connect four's default now (6 plies).
    config = tmp_path / "4" / "config.json"
    written = json.loads(config.read_text())
    del written["play_outcome_plies"]
    config.write_text(json.dumps(written))
    assert phalanx.load(tmp_path / "4").model.play_outcomes is None
    assert phalanx.load(tmp_path / "0").model.play_outcomes is None
    assert phalanx.train({**cfg, "total_steps": 16 * 8, "run_dir": str(tmp_path / "d")}).policy.model.play_outcomes.keywords[
        "plies"] == 6


def test_the_play_search_finds_a_win_that_the_net_and_two_plies_do_not_see():
    """play_rollouts: greedy play judges the moves by games the policy plays on (models/board_search.py) and finds the
    double threat above (a forced win 3 plies deep) from untrained nets, which play it only by chance, where the
    outcomes read 2 plies see no difference between the moves."""
    env, obs, mask = _open_three_position()
    cfg = {"env": "connect_four", "model": "board", "board_channels": 8, "exact_outcomes": True, "outcome_plies": 2,
           "play_outcome_plies": 0, "lookahead": True}
    plain_moves, searched = set(), set()
    for seed in range(6):
        torch.manual_seed(seed)
        model = build_model(resolve({**cfg, "play_rollouts": 8}), env)
        assert model.moves(obs, mask, greedy=True)[0, 0].all()  # 2 plies: every move looks the same
        with torch.no_grad():
            searched.add(int(model.act(obs, greedy=True, mask=mask)[0][0, 0]))
            model.play_rollouts = 0
            plain_moves.add(int(model.act(obs, greedy=True, mask=mask)[0][0, 0]))
    assert searched <= {1, 4}
    assert plain_moves - {1, 4}  # the nets alone miss it: the search is what finds it


def test_the_rollouts_score_a_won_move_one_and_are_a_function_of_the_position():
    """rollout_values read directly: both moves that make the open three win every game played on; the values of a
    board do not depend on the boards searched beside it (the noise is a hash of the position); the slot that waits
    (more pieces than the other) is not searched."""
    from phalanx.models.board_search import rollout_values

    env, obs, mask = _open_three_position()
    torch.manual_seed(0)
    model = build_model(resolve({"env": "connect_four", "model": "board", "board_channels": 8, "exact_outcomes": True,
                                 "play_rollouts": 8}), env)
    board = obs[:, 0].float()
    _, other = boards("connect_four", n=5, plies=6)
    others = other.obs[:, 0].float()
    with torch.no_grad():
        wins = model._reading(board)[3]
        alone = rollout_values(board, mask[:, 0], wins, model._rollout_move, model.successors, 8)
        together = torch.cat([others, board, others])
        values = rollout_values(together, torch.ones(11, 7, dtype=torch.bool), model._reading(together)[3],
                                model._rollout_move, model.successors, 8)
    assert alone[0, [1, 4]].tolist() == [1.0, 1.0]
    assert alone[0].min() < 1.0
    assert torch.equal(values[5], alone[0])
    assert torch.equal(values[0], values[6])
    waiting = obs.flip(-1)[:, :1]  # slot 1's pieces as its own: 2 against 2 ... a piece more than slot 0 below
    waiting = waiting.clone()
    waiting[0, 0, 0, 0, 0] = 1.0  # slot 1 holds 3, slot 0 2: slot 1 waits
    with torch.no_grad():
        model.play_rollouts = 8
        searched = model.act(waiting, greedy=True, mask=mask[:, :1])[0]
        model.play_rollouts = 0
        assert torch.equal(searched, model.act(waiting, greedy=True, mask=mask[:, :1])[0])


def test_the_play_search_rides_on_exact_outcomes_and_changes_no_training_step(tmp_path):
    from safetensors.torch import load_file

    import phalanx
    from phalanx import checkpoint as ckpt

    env = make("connect_four", num_envs=1)
    plain = build_model(resolve({"env": "connect_four", "model": "board", "exact_outcomes": False, "play_rollouts": 8}), env)
    assert plain.play_rollouts == 0  # the search plays on by the exact outcomes: without them the key does nothing
    assert build_model(resolve({"env": "connect_four", "model": "board"}), env).play_rollouts == 16  # the env's default
    with pytest.raises(ConfigError, match="config key 'play_rollouts' is 8 but env 'pixel_goal' has no afterstates"):
        build_model(resolve({"env": "pixel_goal", "model": "board", "play_rollouts": 8}), make("pixel_goal", num_envs=1))
    cfg = {"env": "connect_four", "model": "board", "board_channels": 4, "num_envs": 16, "num_steps": 8,
           "total_steps": 16 * 8 * 2, "opponents": "self_play:1,threats_2:1", "progress": False, "tensorboard": False,
           "exact_outcomes": True}
    weights = []
    for rollouts in (0, 4):
        phalanx.train({**cfg, "play_rollouts": rollouts, "run_dir": str(tmp_path / str(rollouts))})
        weights.append(load_file(str(ckpt.latest_checkpoint(tmp_path / str(rollouts)) / ckpt.WEIGHTS_FILE)))
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert phalanx.load(tmp_path / "4").model.play_rollouts == 4


@pytest.mark.parametrize("rows_only", [True, False])
def test_a_leagues_alike_players_read_their_moves_once_and_play_as_if_each_read_its_own(rows_only):
    """A league's learner and snapshots are copies of one policy: the moves they choose from (the exact outcomes'
    narrowing) are read once a step for all of them (`SlotPlan.alike`), and every sampled action is the one each
    player reading its own moves plays, from the same draws; on boards where the narrowing leaves fewer moves than
    the mask, so a misplaced row of moves changes actions."""
    from phalanx.policy import Policy
    from phalanx.slots import LEARNER_SLOT, SlotPlan, opponent_slots
    env, rec = boards("connect_four", n=48, plies=13)
    cfg = resolve({"env": "connect_four", "model": "board", "lookahead": True, "exact_outcomes": True,
                   "board_channels": 8})
    players = []
    for seed in range(3):
        torch.manual_seed(seed)
        players.append(Policy(build_model(cfg, env), None, cfg, env.observation_space, env.action_space))
    side = opponent_slots(env.num_agents, env.device)
    cols = side.nonzero().squeeze(1)
    who = torch.where(side[None], (torch.arange(48) % 3)[:, None], LEARNER_SLOT)
    narrowed = players[0].moves(rec.obs[:, cols], rec.action_mask[:, cols], False)
    assert (narrowed != rec.action_mask[:, cols]).any()
    reads = []
    for p in players:
        p.model.moves = (lambda f: lambda *a, **k: reads.append(1) or f(*a, **k))(p.model.moves)
    played = {}
    for alike in ((), (0, 1, 2)):
        reads.clear()
        plan = SlotPlan(env, players, columns=cols, alike=alike)
        played[alike] = plan.fill(torch.full((48, 2), -1, dtype=torch.long), who, rec, torch.Generator().manual_seed(1),
                                  None, rows_only=rows_only)
        assert len(reads) == (3 if not alike else 1)
    assert torch.equal(played[()], played[(0, 1, 2)])
    assert (played[()][:, cols] >= 0).all()
