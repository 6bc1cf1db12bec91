"""drone_swarm: spaces, kinematics, every reward term, episode ends, batching, state, planner."""

import math

import pytest
import torch

from phalanx.config import FIELDS
from phalanx.envs import make, spec
from phalanx.errors import ConfigError
from phalanx.zoo.drone_swarm import CLUSTER_HEAD, RELAY, REWARD_TERMS, SENSOR, DroneSwarmEnv

SCALE = 0.01
HOME = (200.0, 200.0)  # sar: home at the centre of the 400 m square
S0, S1, CH, RL = 0, 1, 2, 3  # default slots: sensor, sensor, cluster head, relay


def env_(n=1, **kw):
    kw = {"bearing_noise_deg": 0.0, "range_noise": 0.0, "num_victims": 1, **kw}
    return DroneSwarmEnv(num_envs=n, seed=0, **kw)


def hold(env, scan=()):
    """Raw actions: no turn, no climb, (almost) zero speed; scanning only for the slots in `scan`."""
    a = torch.zeros(env.num_envs, env.num_agents, 4)
    a[..., 2] = -30.0
    a[..., 3] = -1.0
    for i in scan:
        a[:, i, 3] = 1.0
    return a


def place(env, slot, x, y, z=30.0, env_index=0):
    env.pos[env_index, slot] = torch.tensor([x, y, z])


def term(env, name, slot, env_index=0):
    return float(env.last_terms[env_index, slot, REWARD_TERMS.index(name)])


def park_all_home(env):
    """Every drone hovering at home (exempt from idle), 3 m apart so nothing collides."""
    for i in range(env.num_agents):
        place(env, i, HOME[0] + 3.0 * i, HOME[1])


def test_spaces_shapes_roles():
    env = make("drone_swarm", num_envs=3, seed=0)
    rec = env.reset()
    assert env.name == "drone_swarm" and env.num_agents == 4
    assert rec.obs.shape == (3, 4, 64) and rec.obs.dtype == torch.float32
    assert rec.state.shape == (3, *env.state_space.shape)
    assert env.action_space.shape == (4,)
    assert env.role_names == ("sensor", "relay", "cluster_head")
    assert env.roles.tolist() == [SENSOR, SENSOR, CLUSTER_HEAD, RELAY]
    assert rec.active.all() and not (rec.terminated | rec.truncated).any()
    assert env.reward_terms == REWARD_TERMS and len(REWARD_TERMS) == 9
    # Role one-hot at the end of the task block.
    assert torch.equal(rec.obs[0, :, -3:], torch.nn.functional.one_hot(env.roles, 3).float())
    # Neighbour block: slot 1 relative to slot 0 (entries in slot order for A <= 7).
    rel = (env.pos[0, 1] - env.pos[0, 0]) / torch.tensor([400.0, 400.0, 30.0])
    assert torch.allclose(rec.obs[0, 0, 9:12], rel)
    assert torch.equal(rec.obs[0, 0, 27:52], torch.ones(25))  # nothing covered yet
    big = DroneSwarmEnv(num_envs=2, num_agents=9, profile="agriculture")
    r9 = big.reset()
    assert r9.obs.shape == (2, 9, 64)
    assert (big.roles == RELAY).sum() == 2 and (big.roles == CLUSTER_HEAD).sum() == 1 and (big.roles == SENSOR).sum() == 6
    s = spec("drone_swarm")
    assert set(s.options) >= {"profile", "num_agents", "max_steps"}
    assert set(s.options["profile"].choices) == {"sar", "inspection", "mine", "agriculture"}
    assert set(s.train_defaults) <= set(FIELDS)


def test_actions_move_drones():
    env = env_()
    env.reset()
    place(env, S0, 100.0, 100.0)
    env.heading[0, S0] = 0.3
    a = hold(env)
    a[0, S0, 2] = 0.0  # speed = sigmoid(0) * 8 = 4 m/s
    env.step(a)
    assert torch.allclose(env.pos[0, S0, :2], torch.tensor([100.0 + 4 * math.cos(0.3), 100.0 + 4 * math.sin(0.3)]), atol=1e-4)
    assert env.pos[0, S0, 2] == pytest.approx(30.0)
    # Extreme turn and climb commands are bounded to pi/6 and 1 m per step.
    a = hold(env)
    a[0, S0, 0] = 50.0
    a[0, S0, 1] = -50.0
    a[0, S0, 2] = 50.0
    h0 = float(env.heading[0, S0])
    before = env.pos[0, S0].clone()
    env.step(a)
    assert float(env.heading[0, S0]) - h0 == pytest.approx(math.pi / 6, abs=1e-5)
    assert float(before[2] - env.pos[0, S0, 2]) == pytest.approx(1.0, abs=1e-5)
    step = env.pos[0, S0, :2] - before[:2]
    assert step.norm() == pytest.approx(8.0, abs=1e-3)
    assert math.atan2(step[1], step[0]) == pytest.approx(h0 + math.pi / 6, abs=1e-4)


def test_coverage_reward_and_link():
    env = env_()
    env.reset()
    park_all_home(env)
    x, y = 100.3, 120.6
    place(env, S0, x, y)
    env.step(hold(env, scan=(S0, RL)))
    # Cells whose centres lie within scan_width / 2 = 14 m.
    c = (torch.arange(80) + 0.5) * 5.0
    expected = int((((c.view(1, -1) - x) ** 2 + (c.view(-1, 1) - y) ** 2) <= 14.0**2).sum())
    assert term(env, "coverage", S0) == pytest.approx(10 * SCALE * expected)
    assert int(env.covered[0].sum()) == expected and float(env.covered_count[0]) == expected
    assert term(env, "coverage", RL) == 0.0  # relays carry no sensor
    env.step(hold(env, scan=(S0,)))
    assert term(env, "coverage", S0) == 0.0  # nothing new under a hovering drone
    # Out of link range (more than 250 m from home) a scan is not delivered ...
    place(env, S1, 15.0, 15.0)
    place(env, RL, HOME[0] + 9.0, HOME[1])
    env.step(hold(env, scan=(S1,)))
    assert float(env.link[0, S1]) == 0.0 and term(env, "coverage", S1) == 0.0
    # ... unless a relay bridges the gap (link = min(drone-relay, relay-home)).
    place(env, RL, 107.5, 107.5)
    env.step(hold(env, scan=(S1,)))
    assert float(env.link[0, S1]) > 0.4 and term(env, "coverage", S1) > 0.0


def test_coverage_weight_scales_only_the_coverage_term():
    envs = {w: env_(coverage_weight=w) for w in (10.0, 0.4)}
    for env in envs.values():
        env.reset()
        park_all_home(env)
        place(env, S0, 100.3, 120.6)
        env.step(hold(env, scan=(S0, CH)))
    cov = {w: term(env, "coverage", S0) for w, env in envs.items()}
    assert cov[10.0] > 0 and cov[0.4] == pytest.approx(cov[10.0] * 0.04)
    for name in REWARD_TERMS[1:]:
        assert term(envs[10.0], name, CH) == term(envs[0.4], name, CH)
    with pytest.raises(ConfigError, match="coverage_weight"):
        env_(coverage_weight=-1.0)


def test_training_default_coverage_weight_and_override():
    from phalanx.config import resolve

    env = DroneSwarmEnv(num_envs=1)
    assert env.coverage_weight == 10.0 and env.approach_weight == 0.0  # the env itself keeps the WORKLOADS terms
    opts = resolve({"env": "drone_swarm"}).env_options
    assert opts["coverage_weight"] == 0.1 and opts["approach_weight"] == 0.5
    cfg = resolve({"env": "drone_swarm", "env_options": {"coverage_weight": 10.0, "max_steps": 50}})
    assert cfg.env_options["coverage_weight"] == 10.0 and cfg.env_options["max_steps"] == 50
    assert cfg.env_options["approach_weight"] == 0.5


def _victim_setup(env, angles_deg, slots, radius=10.0):
    """One victim at (150, 150); the drones in `slots` at `radius` m from it at the given angles."""
    env.reset()
    park_all_home(env)
    vx, vy = 150.0, 150.0
    env.victims[0, 0] = torch.tensor([vx, vy])
    for slot, ang in zip(slots, angles_deg):
        r = math.radians(ang)
        place(env, slot, vx + radius * math.cos(r), vy + radius * math.sin(r))


def test_victim_needs_three_scanners_30_degrees_apart():
    env = env_()
    # Two scanners, lines 90 degrees apart: contributions, no confirmation.
    _victim_setup(env, [0.0, 90.0], [S0, S1])
    env.step(hold(env, scan=(S0, S1)))
    assert not env.confirmed[0, 0]
    assert term(env, "contribution", S0) == pytest.approx(5 * SCALE) and term(env, "contribution", S1) == pytest.approx(5 * SCALE)
    assert term(env, "victim", S0) == 0.0
    env.step(hold(env, scan=(S0, S1)))
    assert term(env, "contribution", S0) == 0.0  # one contribution per drone and victim
    # A relay scanning from a third direction does not count.
    place(env, RL, 150.0 + 10 * math.cos(math.radians(225)), 150.0 + 10 * math.sin(math.radians(225)))
    env.step(hold(env, scan=(S0, S1, RL)))
    assert not env.confirmed[0, 0] and term(env, "contribution", RL) == 0.0
    # The cluster head from 225 degrees (line 45 degrees from both): confirmed.
    place(env, CH, 150.0 + 10 * math.cos(math.radians(225)), 150.0 + 10 * math.sin(math.radians(225)))
    place(env, RL, HOME[0] + 9.0, HOME[1])
    env.step(hold(env, scan=(CH,)))
    assert env.confirmed[0, 0]
    assert term(env, "contribution", CH) == pytest.approx(5 * SCALE)
    for slot in range(4):  # team reward, relays included
        assert term(env, "victim", slot) == pytest.approx(50 * SCALE)
    # Confirmed victims yield no more bearings or rewards.
    env.step(hold(env, scan=(S0, S1, CH)))
    assert env.last_terms[0, :, REWARD_TERMS.index("victim")].abs().sum() == 0
    assert env.last_terms[0, :, REWARD_TERMS.index("contribution")].abs().sum() == 0
    # Three scanners whose lines are pairwise < 30 degrees apart (opposite bearings are parallel).
    _victim_setup(env, [0.0, 20.0, 180.0], [S0, S1, CH])
    env.step(hold(env, scan=(S0, S1, CH)))
    assert not env.confirmed[0, 0]


def test_task_target_is_the_triangulation_viewpoint():
    env = env_()
    _victim_setup(env, [0.0], [S0])
    rec = env.step(hold(env, scan=(S0,)))
    assert env.detected[0, 0] and not env.confirmed[0, 0]
    view, assigned = env.triangulation_viewpoints()
    assert assigned[0].tolist() == [True, True, True, False]  # the three scanners, not the relay
    # Viewpoints 0.6 scan widths (16.8 m) from the victim at 0, 60 and 120 degrees (exact: no noise).
    for i, slot in enumerate((S0, S1, CH)):
        r = math.radians(60.0 * i)
        assert torch.allclose(view[0, slot], torch.tensor([150.0 + 16.8 * math.cos(r), 150.0 + 16.8 * math.sin(r)]), atol=1e-3)
        want = (view[0, slot] - env.pos[0, slot, :2]) / 400.0
        assert torch.allclose(rec.obs[0, slot, 57:59], want, atol=1e-5)
    assert torch.allclose(rec.obs[0, RL, 57:59], (env.relay_station()[0, RL] - env.pos[0, RL, :2]) / 400.0, atol=1e-5)
    # With one scanner depleted (two left) nobody is assigned; S0 holds a bearing, so it has no target.
    env.active[0, S1] = False
    _, assigned = env.triangulation_viewpoints()
    assert not assigned.any()
    assert env._task()[0, S0, :3].abs().sum() == 0


def test_approach_pays_progress_towards_the_assigned_viewpoint_only():
    env = env_(approach_weight=0.5)
    _victim_setup(env, [0.0], [S0])
    env.step(hold(env, scan=(S0,)))  # S0 detects: S0, S1 and CH get viewpoints
    view, assigned = env.triangulation_viewpoints()
    # S1 flies 8 m straight at its viewpoint; S0 and CH hover; the relay flies at full speed.
    d = view[0, S1] - env.pos[0, S1, :2]
    env.heading[0, S1] = torch.atan2(d[1], d[0])
    a = hold(env)
    a[0, S1, 2] = 30.0
    a[0, RL, 2] = 30.0
    before = (view[0, S1] - env.pos[0, S1, :2]).norm()
    env.step(a)
    progress = before - (view[0, S1] - env.pos[0, S1, :2]).norm()
    assert progress == pytest.approx(8.0, abs=1e-3)
    assert term(env, "approach", S1) == pytest.approx(0.5 * SCALE * 8.0, rel=1e-4)
    assert term(env, "approach", S0) == pytest.approx(0.0, abs=1e-6)
    assert term(env, "approach", RL) == 0.0  # relays are never assigned
    # Flying away costs what flying back pays: a loop earns nothing.
    env.heading[0, S1] += math.pi
    env.step(a)
    assert term(env, "approach", S1) == pytest.approx(-0.5 * SCALE * 8.0, rel=1e-3)
    # The env's own default (WORKLOADS' terms only) pays nothing for it.
    env0 = env_()
    _victim_setup(env0, [0.0], [S0])
    env0.step(hold(env0, scan=(S0,)))
    env0.step(a)
    assert term(env0, "approach", S1) == 0.0
    with pytest.raises(ConfigError, match="approach_weight"):
        env_(approach_weight=-1.0)


def test_geometry_penalty_sensors_only_and_triangulation_error():
    env = env_(max_steps=1)
    # Lines: S0 0, S1 20, CH 40 degrees: close pairs (S0, S1) and (S1, CH).
    _victim_setup(env, [0.0, 20.0, 40.0], [S0, S1, CH])
    rec = env.step(hold(env, scan=(S0, S1, CH)))
    assert term(env, "geometry", S0) == pytest.approx(-5 * SCALE)
    assert term(env, "geometry", S1) == pytest.approx(-10 * SCALE)
    assert term(env, "geometry", CH) == 0.0 and term(env, "geometry", RL) == 0.0
    assert not rec.info["victims_found"].any()
    # Well-separated bearings: no penalty, confirmation, exact fix without noise.
    env = env_(max_steps=1)
    _victim_setup(env, [0.0, 60.0, 120.0], [S0, S1, CH])
    rec = env.step(hold(env, scan=(S0, S1, CH)))
    assert env.last_terms[0, :, REWARD_TERMS.index("geometry")].abs().sum() == 0
    assert rec.truncated.all()
    assert float(rec.info["victims_found"][0]) == 1.0 and float(rec.info["success"][0]) == 1.0
    assert float(rec.info["triangulation_error"][0]) < 1e-2
    assert float(rec.info["reward_victim"][0, RL]) == pytest.approx(50 * SCALE)


def test_idle_collision_geofence():
    env = env_()
    env.reset()
    park_all_home(env)
    place(env, S0, 100.0, 100.0)  # hovering, not scanning, away from home: idle
    place(env, S1, 300.0, 300.0)  # hovering but scanning: not idle
    place(env, RL, 250.0, 250.0)  # relays hover by design: not idle
    env.step(hold(env, scan=(S1,)))
    assert term(env, "idle", S0) == pytest.approx(-2 * SCALE)
    assert term(env, "idle", S1) == 0.0 and term(env, "idle", RL) == 0.0 and term(env, "idle", CH) == 0.0
    # Collision: closer than 1.5 m (3-D) to a neighbour, both pay.
    place(env, S0, 100.0, 100.0)
    place(env, S1, 101.0, 100.0)
    place(env, RL, 110.0, 100.0)
    place(env, CH, 111.6, 100.0)
    env.step(hold(env, scan=(S0, S1)))
    assert term(env, "collision", S0) == pytest.approx(-100 * SCALE) and term(env, "collision", S1) == pytest.approx(-100 * SCALE)
    assert term(env, "collision", RL) == 0.0 and term(env, "collision", CH) == 0.0
    # Geofence: a move out of the area is clamped back and penalised.
    park_all_home(env)
    place(env, S0, 398.0, 100.0)
    env.heading[0, S0] = 0.0
    a = hold(env, scan=(S0,))
    a[0, S0, 2] = 30.0  # 8 m/s east
    env.step(a)
    assert term(env, "geofence", S0) == pytest.approx(-50 * SCALE)
    assert float(env.pos[0, S0, 0]) == pytest.approx(400.0)
    assert term(env, "geofence", S1) == 0.0


def test_battery_depletion_away_from_home():
    env = env_()
    env.reset()
    park_all_home(env)
    place(env, S0, 100.0, 100.0)
    place(env, S1, HOME[0], HOME[1] + 5.0)
    env.heading[0, S1] = math.pi / 2  # it flies north, away from the others, ending 13 m from home
    env.battery[0, S0] = 0.001
    env.battery[0, S1] = 0.001
    a = hold(env, scan=(S0,))
    a[0, S1, 2] = 30.0  # fast at home: no recharge, depletes at home (no penalty)
    rec = env.step(a)
    assert term(env, "battery", S0) == pytest.approx(-30 * SCALE) and term(env, "battery", S1) == 0.0
    assert rec.terminated[0].tolist() == [True, True, False, False]
    assert rec.active[0].tolist() == [False, False, True, True]
    frozen = env.pos[0, S0].clone()
    a = hold(env, scan=(S0,))
    a[0, S0, 2] = 30.0
    rec = env.step(a)
    assert torch.equal(env.pos[0, S0], frozen) and rec.reward[0, S0] == 0.0 and rec.reward[0, S1] == 0.0
    assert not rec.terminated.any() and rec.active[0].tolist() == [False, False, True, True]
    # A hovering drone at home recharges.
    b = float(env.battery[0, CH])
    env.step(hold(env))
    assert float(env.battery[0, CH]) >= b
    # When every drone is depleted the episode ends (terminated) and the env resets.
    env.battery[0, CH] = 0.0001
    env.battery[0, RL] = 0.0001
    place(env, CH, 50.0, 50.0)
    place(env, RL, 60.0, 50.0)
    rec = env.step(hold(env))
    assert rec.terminated.all() and not rec.truncated.any()
    assert rec.active.all() and float(rec.info["depleted"][0]) == 4.0
    assert rec.final_obs[0, CH, 7] == 0.0  # battery in the last observation
    assert torch.equal(env.pos[0], env.start_pos)


def test_time_limit_truncates_and_resets():
    env = DroneSwarmEnv(num_envs=2, seed=3, max_steps=5)
    rec = env.reset()
    g = torch.Generator().manual_seed(0)
    for t in range(5):
        rec = env.step(env.scripted_actions("planner", rec, g))
        assert rec.truncated.all() == (t == 4)
    assert not rec.terminated.any()
    for k in ("victims_found", "coverage", "collisions", "triangulation_error", "success", "link_quality"):
        assert rec.info[k].shape == (2,) and torch.isfinite(rec.info[k]).all()
    assert (rec.info["coverage"] > 0).all()
    for name in REWARD_TERMS:
        assert rec.info[f"reward_{name}"].shape == (2, 4)
    assert torch.allclose(rec.info["reward_coverage"].sum(1), rec.info["coverage"] * 6400 * 10 * SCALE)
    # obs is the next episode's first (deadline 1, nothing covered); final_obs the last one.
    assert (rec.obs[..., 60] == 1.0).all() and (rec.final_obs[..., 60] == 0.0).all()
    assert (env.t == 0).all() and not env.covered.any() and (env.uncovered[:, :-1] == 25).all()


def _slice(state, i):
    return {k: (v if k == "rng" else v[i:i + 1]) for k, v in state.items()}


def test_batched_step_equals_single_env():
    batch = DroneSwarmEnv(num_envs=3, seed=5, max_steps=8)
    rec = batch.reset()
    g = torch.Generator().manual_seed(1)
    for _ in range(7):  # diverse states; the next step ends the episode (auto-reset included)
        rec = batch.step(batch.scripted_actions("planner", rec, g) + 0.5 * torch.randn(3, 4, 4, generator=g))
    single = DroneSwarmEnv(num_envs=1, seed=99, max_steps=8)
    single.load_state_dict(_slice(batch.state_dict(), 0))
    act = batch.scripted_actions("random", rec, g)
    rb, rs = batch.step(act), single.step(act[:1])
    assert rb.truncated.all()
    for f in ("obs", "reward", "terminated", "truncated", "active", "final_obs", "state", "final_state"):
        assert torch.equal(getattr(rb, f)[:1], getattr(rs, f)), f
    for k in rb.info:
        assert torch.equal(rb.info[k][:1], rs.info[k]), k


def test_state_dict_round_trip():
    env = DroneSwarmEnv(num_envs=2, seed=7, max_steps=12)
    rec = env.reset()
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        rec = env.step(env.scripted_actions("random", rec, g))
    saved = {k: v.clone() for k, v in env.state_dict().items()}
    acts = [torch.randn(2, 4, 4, generator=g) for _ in range(10)]  # crosses the time limit
    first = [env.step(a) for a in acts]
    other = DroneSwarmEnv(num_envs=2, seed=123, max_steps=12)
    other.load_state_dict(saved)
    second = [other.step(a) for a in acts]
    for r1, r2 in zip(first, second):
        assert torch.equal(r1.obs, r2.obs) and torch.equal(r1.reward, r2.reward) and torch.equal(r1.state, r2.state)
        assert torch.equal(r1.truncated, r2.truncated)
    assert any(r.truncated.any() for r in first)


def test_planner_beats_random():
    results = {}
    for pol in ("planner", "random"):
        env = DroneSwarmEnv(num_envs=6, seed=1, max_steps=100, num_victims=8)
        rec = env.reset()
        g = torch.Generator().manual_seed(0)
        for _ in range(100):
            act = env.scripted_actions(pol, rec, g)
            assert act.shape == (6, 4, 4) and (pol == "random" or (act.abs() <= 4.0).all())
            rec = env.step(act)
        results[pol] = (float(rec.info["coverage"].mean()), float(rec.info["victims_found"].sum()), rec.info)
    assert results["planner"][0] > results["random"][0] + 0.04
    assert results["planner"][1] >= 4 and results["planner"][1] > results["random"][1]
    assert float(results["planner"][2]["collisions"].sum()) == 0.0
    with pytest.raises(KeyError):
        env.scripted_actions("nope", rec, g)


def test_random_steps_stay_finite_and_render():
    env = DroneSwarmEnv(num_envs=4, seed=2, max_steps=150, profile="mine", num_agents=5)
    rec = env.reset()
    g = torch.Generator().manual_seed(3)
    for _ in range(300):
        rec = env.step(3.0 * torch.randn(4, 5, 4, generator=g))
        assert torch.isfinite(rec.obs).all() and torch.isfinite(rec.reward).all() and torch.isfinite(rec.state).all()
        for v in rec.info.values():
            assert torch.isfinite(v).all()
    img = env.render(1)
    assert img.dtype == torch.uint8 and img.shape == (300, 300, 3) and img.device.type == "cpu"
    assert (img != img[0, 0]).any(dim=-1).any()  # something drawn besides the background
