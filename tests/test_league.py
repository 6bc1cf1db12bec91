"""Self-play league: opponent mix, swaps only at resets, batched opponents, ratings, resume, CLI."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import league_env  # noqa: E402,F401  (registers test_rps)

import phalanx  # noqa: E402
from phalanx.cli import main  # noqa: E402
from phalanx.config import params_of, resolve  # noqa: E402
from phalanx.envs import make  # noqa: E402
from phalanx.errors import ConfigError  # noqa: E402
from phalanx.league import LEAGUE_FILE, League, LeagueParams, Ratings, parse_mix, wilson_interval  # noqa: E402
from phalanx.league.ratings import DRAW, LEARNER, LOSS, WIN  # noqa: E402
from phalanx.models.registry import build_model  # noqa: E402
from phalanx.policy import Policy  # noqa: E402

RPS = dict(env="test_rps", num_envs=8, num_steps=16, num_epochs=2, num_minibatches=2, progress=False, tensorboard=False)


@pytest.mark.parametrize("text,match", [
    ("self_play:8,nobody:1", "unknown opponent 'nobody'; allowed: self_play, learner, rock, paper"),
    ("rock:x", "weight of 'rock' must be a number"),
    ("rock:-1", "weight of 'rock' must be >= 0"),
    ("rock:0", "at least one opponent with a positive weight"),
])
def test_mix_errors_name_the_key(text, match):
    with pytest.raises(ConfigError, match="'opponents'") as e:
        parse_mix(text, ("rock", "paper"))
    assert match in str(e.value)


def test_mix_parses_weights():
    assert parse_mix("self_play:8, rock:1.5,paper", ("rock", "paper")) == [("self_play", 8.0), ("rock", 1.5), ("paper", 1.0)]


def test_rating_updates_move_the_right_way():
    r = Ratings()
    r.ensure("rock")
    mu_l, mu_o = r.players[LEARNER].mu, r.players["rock"].mu
    r.record("rock", WIN)
    assert r.players[LEARNER].mu > mu_l and r.players["rock"].mu < mu_o
    mu_l, mu_o = r.players[LEARNER].mu, r.players["rock"].mu
    r.record("rock", DRAW)  # a draw against a weaker player costs the stronger one
    assert r.players[LEARNER].mu < mu_l and r.players["rock"].mu > mu_o
    mu_l = r.players[LEARNER].mu
    r.record("rock", LOSS)
    assert r.players[LEARNER].mu < mu_l
    r.record_counts("paper", 7, 2, 1)
    p = r.players["paper"]
    assert (p.learner_wins, p.learner_draws, p.learner_losses, p.games) == (7, 2, 1, 10)
    assert r.players[LEARNER].ordinal > p.ordinal
    assert Ratings.from_json(json.loads(json.dumps(r.to_json()))).table() == r.table()


def test_wilson_interval():
    lo, hi = wilson_interval(8, 10)
    assert lo < 0.8 < hi and 0 <= lo and hi <= 1
    lo2, hi2 = wilson_interval(80, 100)
    assert lo < lo2 < 0.8 < hi2 < hi


def _league(tmp_path, mix, n=16, rounds=3, seed=0):
    cfg = resolve(dict(RPS, opponents=mix, num_envs=n, env_options={"rounds": rounds}))
    env = make("test_rps", num_envs=n, seed=seed, rounds=rounds)
    model = build_model(cfg, env)
    learner = Policy(model, None, cfg, env.observation_space, env.action_space)
    gen = torch.Generator().manual_seed(seed)
    return League(params_of(LeagueParams, cfg), env, tmp_path, learner, gen), env, model


def test_opponents_are_swapped_only_at_resets(tmp_path):
    league, env, model = _league(tmp_path, "rock:1,paper:1,learner:1", rounds=3)
    league_gen = torch.Generator().manual_seed(1)
    rec = env.reset(seed=0)
    swaps = ends = 0
    for _ in range(40):
        before = league.assign.clone()
        actions = league.fill(torch.zeros(env.num_envs, 2, dtype=torch.long), rec, league_gen)
        # Opponent slot plays its assigned scripted move; the learner slot is untouched.
        assert torch.equal(actions[:, 0], torch.zeros(env.num_envs, dtype=torch.long))
        for i, o in enumerate(league.players):
            if o is not None and o.kind == "scripted":
                assert (actions[league.assign == i, 1] == ("rock", "paper").index(o.name)).all()
        rec = env.step(actions)
        done = rec.terminated.all(-1)
        league.after_step(rec, done, torch.zeros(env.num_envs, 2), league_gen)
        changed = league.assign != before
        assert not (changed & ~done).any(), "an opponent changed mid-episode"
        swaps += int(changed.sum())
        ends += int(done.sum())
    assert ends > 0 and swaps > 0  # draws at resets do change opponents
    assert set(league.assign.tolist()) == {0, 1, 2}


def test_batched_opponent_actions_equal_per_env_actions(tmp_path):
    league, env, model = _league(tmp_path, "self_play:1,rock:1", n=6)
    with torch.no_grad():  # a near-deterministic policy, so sampling equals the argmax
        for p in model.parameters():
            p.normal_(0, 1.0)
        model.actor[-1].weight.mul_(200.0)
    snap = league.snapshot(100, model, None)
    league._refresh()
    league.assign = torch.full((6,), league.players.index(snap))
    rec = env.reset(seed=0)
    rec.obs = torch.rand(6, 2, 4)
    # Half the envs play the snapshot, the rest `rock` (player 0); the CPU path (a forward over the
    # snapshot's own envs) and the static path of accelerators and captured steps (every player of the
    # layout, free bank slots too, over all envs) give the same.
    mixed = torch.tensor([0, 1, 0, 0, 1, 1]) * league.players.index(snap)
    league.in_use = {0, league.players.index(snap)}
    for select_rows in (True, False):
        for assign in (league.assign, mixed):
            league.assign, league.select_rows = assign, select_rows
            batched = league.fill(torch.full((6, 2), -1, dtype=torch.long), rec, None)
            for i in range(6):
                o = league.players[int(assign[i])]
                single = snap.policy.act(rec.obs[i : i + 1], greedy=True)[0, 1] if o is snap else 0  # rock
                assert batched[i, 1] == single
                assert batched[i, 0] == -1


def test_a_league_state_listed_before_the_fixed_layout_loads_into_it(tmp_path):
    """League states saved before the fixed player layout have no `slot`: their list (scripted, the learner, the
    snapshots in turn, retired ones dropped) is the layout's order, so every env keeps its opponent on load."""
    league, env, model = _league(tmp_path, "self_play:1,rock:1,paper:1", n=6)
    for step in (100, 200):
        league.snapshot(step, model, None)
    league._refresh()
    league.assign, league.in_use = torch.tensor([0, 1, 2, 3, 4, 3]), {0, 1, 3, 4}
    state, tensors = league.state_json(200), league.state_tensors()
    old = {**state, "opponents": [{k: v for k, v in o.items() if k != "slot"} for o in state["opponents"]]}
    fresh, _, _ = _league(tmp_path, "self_play:1,rock:1,paper:1", n=6)
    fresh.load(old, tensors)
    names = lambda lg: [lg.players[i].name for i in lg.assign.tolist()]  # noqa: E731
    assert names(fresh) == names(league) == ["rock", "paper", "learner", "snapshot_000000000100", "snapshot_000000000200",
                                             "snapshot_000000000100"]
    assert fresh.in_use == league.in_use and [o.name for o in fresh.opponents] == [o.name for o in league.opponents]


def test_a_full_bank_grows_and_snapshots_still_play(tmp_path):
    """Retired snapshots keep their bank slot while an env still plays them; a snapshot that finds the bank
    full grows it (a captured step is traced again: `layout` changes) and plays like the others."""
    cfg = resolve(dict(RPS, opponents="self_play:1,rock:1", num_envs=6, pool_size=1, env_options={"rounds": 3}))
    env = make("test_rps", num_envs=6, seed=0, rounds=3)
    model = build_model(cfg, env)
    league = League(params_of(LeagueParams, cfg), env, tmp_path,
                    Policy(model, None, cfg, env.observation_space, env.action_space), torch.Generator().manual_seed(0))
    slots, layout = len(league.players), league.layout
    for step in (100, 200, 300):
        snap = league.snapshot(step, model, None)
        league.in_use.add(league.players.index(snap))  # every snapshot keeps an env: none is freed
    assert len(league.players) == slots + 1 and league.layout == layout + 1
    assert [o.name for o in league.opponents if o.kind == "snapshot"] == [f"snapshot_{s:012d}" for s in (100, 200, 300)]
    league._refresh()
    assert league.weights.shape == (len(league.players),) and league.weights[league.players.index(snap)] > 0
    league.assign = torch.full((6,), league.players.index(snap))
    league.select_rows = False
    actions = league.fill(torch.full((6, 2), -1, dtype=torch.long), env.reset(seed=0), None)
    assert (actions[:, 0] == -1).all() and (actions[:, 1] >= 0).all()


def test_snapshots_rotate_and_pool_keeps_pinned(tmp_path):
    cfg = dict(RPS, opponents="self_play:1", total_steps=128 * 8, snapshot_every=128, pool_size=2, pin_every=128 * 3)
    phalanx.train(run_dir=tmp_path / "r", **cfg)
    state = json.loads((tmp_path / "r" / LEAGUE_FILE).read_text())
    snaps = [o for o in state["opponents"] if o["kind"] == "snapshot"]
    live = [o for o in snaps if not o["retired"]]
    assert len([o for o in live if not o["pinned"]]) == 2
    assert {o["step"] for o in snaps if o["pinned"]} == {128 * 3, 128 * 6}
    files = {p.stem for p in (tmp_path / "r" / "league" / "snapshots").glob("*.safetensors")}
    assert files == {o["name"] for o in snaps}
    assert all(not o["retired"] for o in snaps if o["pinned"])


def test_the_pool_keeps_the_newest_snapshots_as_bank_slots_are_reused(tmp_path):
    """The pool retires its oldest snapshot, whichever bank slot each lies in. It retired the one in the lowest slot:
    once a retired snapshot's slot was freed and the next snapshot took it, that newest snapshot was retired at once,
    and the pool stayed the snapshots of the run's first half for good (connect four's defaults played its 1.0M-4.6M
    moves' selves until 10M)."""
    cfg = dict(RPS, opponents="self_play:1", total_steps=128 * 10, snapshot_every=128, pool_size=2)
    phalanx.train(run_dir=tmp_path / "r", **cfg)
    state = json.loads((tmp_path / "r" / LEAGUE_FILE).read_text())
    live = sorted(o["step"] for o in state["opponents"] if o["kind"] == "snapshot" and not o["retired"])
    assert live == [128 * 9, 128 * 10]


def test_pool_and_ratings_survive_resume(tmp_path):
    cfg = dict(RPS, opponents="self_play:2,rock:1,paper:1", total_steps=128 * 6, seed=3, checkpoint_every=128,
               snapshot_every=256, pool_size=2)
    phalanx.train(run_dir=tmp_path / "full", **cfg)
    phalanx.train(run_dir=tmp_path / "part", max_updates=3, **cfg)
    phalanx.train(resume=tmp_path / "part")
    full = json.loads((tmp_path / "full" / LEAGUE_FILE).read_text())
    part = json.loads((tmp_path / "part" / LEAGUE_FILE).read_text())
    assert full["opponents"] == part["opponents"] and len(full["opponents"]) > 3
    assert full["ratings"] == part["ratings"]
    a = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["league_rating"] for r in a] == [r["league_rating"] for r in b]


def test_league_learns_to_beat_scripted_and_cli_reports(tmp_path, capsys):
    run = tmp_path / "r"
    phalanx.train(run_dir=run, **dict(RPS, opponents="self_play:2,rock:1,paper:1", total_steps=12_000, num_envs=16,
                                      num_steps=32, lr=3e-3, ent_coef=0.01, snapshot_every=2048))
    assert main(["league", str(run), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["ratings"]}
    assert rows[LEARNER]["rating"] > max(rows["rock"]["rating"], rows["paper"]["rating"]) + 5
    assert rows["rock"]["learner_win_rate"] > 0.6 and rows["paper"]["learner_win_rate"] > 0.6
    assert main(["eval", str(run), "--vs", "rock,paper,snapshot:LATEST", "--episodes", "40", "--json"]) == 0
    vs = json.loads(capsys.readouterr().out)["vs"]
    for name in ("rock", "paper"):  # a fixed move is beaten every match by the trained learner
        assert vs[name]["win_rate"] >= 0.9, vs[name]
        lo, hi = vs[name]["win_rate_ci95"]
        assert lo <= vs[name]["win_rate"] <= hi
        assert vs[name]["wins"] + vs[name]["draws"] + vs[name]["losses"] == 40
    snap = next(k for k in vs if k.startswith("snapshot_"))
    after = json.loads((run / LEAGUE_FILE).read_text())["ratings"]
    assert after["rock"]["games"] == rows["rock"]["games"] + 40  # eval games are rated too
    assert after[snap]["games"] >= 40
    assert main(["eval", str(run), "--vs", "nobody", "--episodes", "4"]) == 2
    assert "unknown opponent 'nobody'" in capsys.readouterr().err
    assert (run / "behavior_metrics.csv").read_text().startswith("step,")


def test_league_needs_two_sides_and_excludes_teammates(tmp_path):
    with pytest.raises(ConfigError, match="at least 2 agent slots"):
        phalanx.train(env="cartpole", opponents="learner:1", total_steps=64, num_envs=2, num_steps=32,
                      run_dir=tmp_path / "a", progress=False, tensorboard=False)
    with pytest.raises(ConfigError, match="'teammates' and 'opponents'"):
        phalanx.train(run_dir=tmp_path / "b", teammates="rock", opponents="paper:1", total_steps=128, **RPS)


@pytest.mark.parametrize("kw", [dict(opponents="rock:1,paper:1"), dict(opponents="self_play:1,rock:1", norm_obs=True)])
def test_update_leaves_out_opponent_slots_and_is_unchanged_by_it(tmp_path, kw):
    import copy

    from phalanx.trainer import Trainer

    tr = Trainer(resolve(dict(RPS, run_dir=str(tmp_path / "r"), **kw)))
    assert tr.run.update_slots.tolist() == [0]  # the learner's side only
    tr.collect()
    model0, opt0, gen0 = copy.deepcopy(tr.run.model.state_dict()), copy.deepcopy(tr.run.optimizer.state_dict()), tr.run.gen.get_state()
    m_sliced = tr.update()
    sliced = {k: v.clone() for k, v in tr.run.model.state_dict().items()}
    tr.run.model.load_state_dict(model0)
    tr.run.optimizer.load_state_dict(opt0)
    tr.run.gen.set_state(gen0)
    tr.run.update_slots = None  # the whole agent axis, opponent slots masked out
    m_whole = tr.update()
    assert any(not torch.equal(v, model0[k]) for k, v in sliced.items())  # the update did move the weights
    for k, v in tr.run.model.state_dict().items():
        assert torch.allclose(v, sliced[k], atol=1e-6, rtol=1e-5), k
    for k in ("policy_loss", "value_loss", "entropy", "approx_kl", "explained_variance"):
        assert torch.allclose(m_sliced[k], m_whole[k], atol=1e-6, rtol=1e-5), k
    tr.close()


def test_update_keeps_every_slot_for_slot_aware_models(tmp_path):
    from phalanx.trainer import Trainer

    for kw in (dict(param_sharing="shared_id"), dict(param_sharing="per_role")):
        tr = Trainer(resolve(dict(RPS, run_dir=str(tmp_path / kw["param_sharing"]), opponents="rock:1", **kw)))
        assert tr.run.update_slots is None
        tr.close()
