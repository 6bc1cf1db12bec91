"""model=board (models/board.py): a residual conv net over a board's planes; with `mirror`, policy and value are
exactly symmetric under the env's left-right reflection."""

import pytest
import torch

from phalanx.config import resolve
from phalanx.envs import make
from phalanx.errors import ConfigError
from phalanx.models.registry import build_model
from phalanx.slots import random_actions


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
