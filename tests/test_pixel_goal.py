"""pixel_goal: rendering, frames per step, the pixel goal detector, rewards, scripted policies, resume."""

from __future__ import annotations

import pytest
import torch

import phalanx.envs as penvs
from phalanx.config import FIELDS
from phalanx.errors import ConfigError
from phalanx.zoo import pixel_goal as pg
from phalanx.zoo.pixel_goal import (
    DOWN,
    FRAMES_PER_STEP,
    HOLD_FRAMES,
    LEFT,
    RIGHT,
    START,
    UP,
    A,
    B,
    PixelGoalEnv,
    frame_dist,
    goal_template_from_state,
)


def _tiles(*tiles: tuple[int, int]) -> torch.Tensor:
    return torch.tensor(tiles, dtype=torch.long)


def _acts(*a: int) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.long).view(-1, 1)


def _dist_reference(frame: torch.Tensor, goal: torch.Tensor) -> float:
    """mean |frame - goal| / 3 in float64, independently of the env's integer path."""
    return float((frame.double() - goal.double()).abs().mean() / 3)


def test_spaces_obs_layout_and_uint8_everywhere():
    env = penvs.make("pixel_goal", num_envs=3, seed=0, map="open", k=2, max_steps=3)
    assert isinstance(env, PixelGoalEnv) and env.num_agents == 1
    assert env.observation_space.shape == (4, 72, 80) and env.observation_space.dtype == torch.uint8
    assert env.action_space.n == 7 and env.success_key == "success"
    rec = env.reset()
    assert rec.obs.shape == (3, 1, 4, 72, 80) and rec.obs.dtype == torch.uint8
    assert int(rec.obs.max()) <= 3 and set(rec.obs.unique().tolist()) == {0, 1, 2, 3}
    # At an episode start the stack holds 4 copies of the first frame.
    assert torch.equal(rec.obs[:, :, :1].expand_as(rec.obs), rec.obs)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):  # crosses the time limit: auto-reset
        rec = env.step(env.scripted_actions("random", rec, gen))
        assert rec.obs.dtype == torch.uint8 and rec.final_obs.dtype == torch.uint8
        assert rec.final_obs.shape == rec.obs.shape and rec.reward.dtype == torch.float32
    spec = penvs.spec("pixel_goal")
    assert set(spec.options) >= {"map", "goal", "tau", "k", "max_steps"}
    assert set(spec.train_defaults) <= set(FIELDS)
    with pytest.raises(ConfigError):
        penvs.make("pixel_goal", map="nope")
    with pytest.raises(ConfigError):
        penvs.make("pixel_goal", goal="nope")


def test_rendering_is_deterministic_for_a_state():
    a, b = PixelGoalEnv(4, seed=5, map="rooms"), PixelGoalEnv(4, seed=5, map="rooms")
    ra, rb = a.reset(), b.reset()
    assert torch.equal(ra.obs, rb.obs)
    for acts in (_acts(UP, DOWN, LEFT, RIGHT), _acts(RIGHT, RIGHT, A, DOWN)):
        (ra, fa), (rb, fb) = a.step_frames(acts), b.step_frames(acts)
        assert torch.equal(fa, fb) and torch.equal(ra.obs, rb.obs)
    tiles = _tiles((3, 2), (4, 4), (7, 7), (1, 1))
    o1, o2 = a.set_player(tiles).clone(), a.set_player(tiles).clone()
    assert torch.equal(o1, o2) and torch.equal(o1, b.set_player(tiles))
    for i, t in enumerate(tiles):
        assert torch.equal(o1[i, 0, -1], goal_template_from_state("rooms", tuple(t.tolist())))
    img = a.render(1)
    assert img.shape == (72, 80, 3) and img.dtype == torch.uint8
    assert torch.equal(img, b.render(1)) and len({tuple(p) for p in img.reshape(-1, 3).tolist()}) == 4


def test_24_frames_per_step_button_released_after_8():
    env = PixelGoalEnv(4, seed=0, map="open")
    start = _tiles((4, 4), (4, 4), (4, 4), (4, 4))
    env.set_player(start)
    rec, frames = env.step_frames(_acts(RIGHT, DOWN, A, START))
    assert frames.shape == (4, FRAMES_PER_STEP, 72, 80) and frames.dtype == torch.uint8
    assert torch.equal(frames[:, -1], rec.final_obs[:, 0, -1])
    bg = env.background
    for f in range(FRAMES_PER_STEP):
        off = min(f + 1, HOLD_FRAMES)  # 1 px per held frame, then the sprite stays
        right = pg.draw_player(bg, torch.tensor([32]), torch.tensor([32 + off]))[0]
        down = pg.draw_player(bg, torch.tensor([32 + off]), torch.tensor([32]))[0]
        assert torch.equal(frames[0, f], right) and torch.equal(frames[1, f], down)
    # Movement only while the button is held: consecutive held frames differ, released ones do not.
    assert all(not torch.equal(frames[0, f], frames[0, f + 1]) for f in range(HOLD_FRAMES - 1))
    assert torch.equal(frames[:, HOLD_FRAMES:], frames[:, HOLD_FRAMES - 1 : HOLD_FRAMES].expand(-1, 16, -1, -1))
    # A and START leave the world alone for all 24 frames.
    first = goal_template_from_state("open", (4, 4))
    assert torch.equal(frames[2:], first.expand(2, FRAMES_PER_STEP, 72, 80))
    assert env.pos.tolist() == [[4, 5], [5, 4], [4, 4], [4, 4]]
    # The stack holds the last frame of each of the last 4 steps, oldest first.
    rec2 = env.step(_acts(RIGHT, RIGHT, B, B))
    assert torch.equal(rec2.obs[:, 0, :3], rec.obs[:, 0, 1:]) and torch.equal(rec2.obs[:, 0, 2], frames[:, -1])
    assert torch.equal(rec2.obs[:, 0, 3], env.render_tiles(env.pos))


def test_walls_and_trees_block_movement():
    env = PixelGoalEnv(4, seed=0, map="default")
    # (1, 1): walls above and to the left; (2, 3): a tree to the right; (5, 2): a tree above.
    tiles = _tiles((1, 1), (1, 1), (2, 3), (5, 2))
    env.set_player(tiles)
    before = env.render_tiles(tiles)
    rec, frames = env.step_frames(_acts(UP, LEFT, RIGHT, UP))  # wall, wall, tree (2, 4), tree (4, 2)
    assert env.pos.tolist() == tiles.tolist()
    assert torch.equal(frames, before.unsqueeze(1).expand_as(frames))
    env.step(_acts(DOWN, RIGHT, DOWN, DOWN))
    assert env.pos.tolist() == [[2, 1], [1, 2], [3, 3], [6, 2]]


def test_goal_detector_needs_k_consecutive_steps():
    for k in (2, 4):
        env = PixelGoalEnv(1, seed=0, map="default", k=k)
        gr, gc = env.goal_tile
        env.set_player(_tiles((gr, gc)))
        for i in range(k - 1):  # k - 1 steps on the goal are not enough
            rec = env.step(_acts((A, B, START)[i % 3]))
            assert not rec.terminated.any() and env.under.item() == i + 1
        env.step(_acts(LEFT))  # leaving resets the count
        assert env.under.item() == 0
        rec = env.step(_acts(RIGHT))
        assert env.under.item() == 1 and not rec.terminated.any()
        for _ in range(k - 2):
            assert not env.step(_acts(A)).terminated.any()
        rec = env.step(_acts(A))
        assert rec.terminated.all() and not rec.truncated.any()
        assert rec.info["success"].item() == 1.0 and rec.info["final_dist"].item() == 0.0
        assert rec.info["steps_to_goal"].item() == 2 * k
        # Auto-reset: the ended episode's last frame is the goal; obs is a fresh start.
        assert torch.equal(rec.final_obs[0, 0, -1], env.goal)
        assert torch.equal(rec.obs[0, 0], env.render_tiles(env.pos).expand(4, 72, 80))
        assert tuple(env.pos[0].tolist()) in pg.map_marks("default", "S") and env.under.item() == 0


def test_rewards_match_the_formula_on_hand_set_states():
    env = PixelGoalEnv(3, seed=0, map="default", k=2)
    gr, gc = env.goal_tile
    goal = goal_template_from_state("default", (gr, gc))
    assert torch.equal(goal, env.goal)
    tiles = _tiles((gr, gc - 1), (gr, gc), (1, 1))
    env.set_player(tiles)
    d0 = [_dist_reference(goal_template_from_state("default", tuple(t.tolist())), goal) for t in tiles]
    assert d0[1] == 0.0 and min(d0[0], d0[2]) > env.tau
    rec = env.step(_acts(RIGHT, A, DOWN))  # onto the goal; stays on it; away from it
    d1 = [_dist_reference(rec.final_obs[i, 0, -1], goal) for i in range(3)]
    assert d1[0] == 0.0 and d1[1] == 0.0 and d1[2] > 0
    want = [-0.01 + (p - d) for p, d in zip(d0, d1)]
    torch.testing.assert_close(rec.reward[:, 0].double(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-6)
    rec2 = env.step(_acts(A, LEFT, UP))  # env 0 completes k = 2; env 1 leaves the goal
    d2 = [_dist_reference(rec2.final_obs[i, 0, -1], goal) for i in range(3)]
    done = [1.0, 0.0, 0.0]
    want = [-0.01 + (p - d) + 10 * t for p, d, t in zip(d1, d2, done)]
    torch.testing.assert_close(rec2.reward[:, 0].double(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-6)
    assert rec2.terminated[:, 0].tolist() == [True, False, False]
    # The next step's prev_dist is the new episode's first frame for env 0.
    first = rec2.obs[0, 0, -1]
    rec3 = env.step(_acts(A, A, A))
    want0 = -0.01 + (_dist_reference(first, goal) - _dist_reference(rec3.final_obs[0, 0, -1], goal))
    assert rec3.reward[0, 0].item() == pytest.approx(want0, abs=1e-6)


@pytest.mark.parametrize("map", list(pg.MAPS))
def test_tau_separates_the_goal_tile_and_goal_template_has_dist_zero(map):
    free = pg.free_tiles(map)
    env = PixelGoalEnv(len(free), seed=0, map=map)
    frames = env.set_player(free)[:, 0, -1]
    for goal in pg.GOALS:
        tile = pg.goal_tile(map, goal)
        template = goal_template_from_state(map, tile)
        d = frame_dist(frames, template)
        at = (free == torch.tensor(tile)).all(1)
        assert d[at].tolist() == [0.0]
        assert bool((d[~at] >= pg.min_off_goal_dist()).all()) and pg.min_off_goal_dist() > 1.5 * pg.TAU
        assert bool((d[~at] > pg.TAU).all())


@pytest.mark.parametrize("map", list(pg.MAPS))
def test_oracle_reaches_every_goal_within_the_time_limit(map):
    for goal in pg.GOALS:
        env = PixelGoalEnv(8, seed=1, map=map, goal=goal)
        rec = env.reset()
        longest = max(pg.bfs_steps(map, env.goal_tile)[s] for s in pg.map_marks(map, "S"))
        done = torch.zeros(8, dtype=torch.bool)
        steps = torch.zeros(8)
        for _ in range(longest + env.k):
            rec = env.step(env.scripted_actions("oracle", rec, torch.Generator()))
            end = rec.terminated[:, 0] & ~done
            steps = torch.where(end, rec.info["steps_to_goal"], steps)
            done |= rec.terminated[:, 0]
        assert done.all(), (map, goal)
        assert bool((steps <= longest + env.k - 1).all()) and bool((steps >= env.k).all())


def test_random_mostly_fails_on_the_default_map():
    n = 64
    env = PixelGoalEnv(n, seed=3)
    rec = env.reset()
    gen = torch.Generator().manual_seed(7)
    ended = torch.zeros(n, dtype=torch.bool)
    success = torch.zeros(n)
    for _ in range(env.max_steps):
        rec = env.step(env.scripted_actions("random", rec, gen))
        end = (rec.terminated | rec.truncated)[:, 0] & ~ended
        success += rec.info["success"] * end
        ended |= end
    assert ended.all()
    rate = success.mean().item()
    assert 0.0 < rate < 0.6, rate


def test_custom_goal_image_and_start_any():
    template = goal_template_from_state("maze", (3, 5))
    env = PixelGoalEnv(4, seed=0, map="maze", goal_image=template, start="any", k=2)
    assert env.goal_tile == (3, 5) and torch.equal(env.goal, template)
    assert not (env.start_tiles == torch.tensor([3, 5])).all(1).any()
    rec = env.reset()
    done = torch.zeros(4, dtype=torch.bool)
    for _ in range(40):
        rec = env.step(env.scripted_actions("oracle", rec, torch.Generator()))
        done |= rec.terminated[:, 0]
    assert done.all()


def _slice_state(state: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    return {k: (v if k == "rng" else v[i : i + 1]) for k, v in state.items()}


def test_batched_step_equals_per_env_step():
    n = 6
    env = PixelGoalEnv(n, seed=2, map="rooms", k=2, max_steps=9)
    singles = [PixelGoalEnv(1, seed=2, map="rooms", k=2, max_steps=9) for _ in range(n)]
    rec = env.reset()
    gen = torch.Generator().manual_seed(1)
    ends = 0
    for t in range(24):
        rnd = env.scripted_actions("random", rec, gen)
        acts = torch.where(torch.arange(n).view(n, 1) % 2 == 0, env.scripted_actions("oracle", rec, gen), rnd)
        state = env.state_dict()
        for i, s in enumerate(singles):
            s.load_state_dict(_slice_state(state, i))
        rec = env.step(acts)
        for i, s in enumerate(singles):
            r = s.step(acts[i : i + 1])
            for name in ("final_obs", "reward", "terminated", "truncated", "active"):
                assert torch.equal(getattr(r, name), getattr(rec, name)[i : i + 1]), (t, i, name)
            for k, v in r.info.items():
                assert torch.equal(v, rec.info[k][i : i + 1]), (t, i, k)
            if not (r.terminated | r.truncated).any():
                assert torch.equal(r.obs, rec.obs[i : i + 1])
            ends += int((r.terminated | r.truncated).any())
    assert ends >= n


def test_state_dict_round_trip_continues_bit_identically():
    env = PixelGoalEnv(5, seed=4, map="default", k=2, max_steps=6)
    rec = env.reset()
    gen = torch.Generator().manual_seed(0)
    for _ in range(7):
        rec = env.step(env.scripted_actions("random", rec, gen))
    saved = {k: v.clone() for k, v in env.state_dict().items()}
    acts = [torch.randint(0, 7, (5, 1), generator=gen) for _ in range(15)]
    first = [env.step(a) for a in acts]
    other = PixelGoalEnv(5, seed=99, map="default", k=2, max_steps=6)
    other.load_state_dict(saved)
    for a, r1 in zip(acts, first):
        r2 = other.step(a)
        for name in ("obs", "final_obs", "reward", "terminated", "truncated"):
            assert torch.equal(getattr(r1, name), getattr(r2, name)), name
        assert all(torch.equal(v, r2.info[k]) for k, v in r1.info.items())
    assert sum(int(r.truncated.sum()) for r in first) > 0  # resets (RNG draws) happened
    for k, v in env.state_dict().items():
        assert torch.equal(v, other.state_dict()[k]), k
