"""A trained policy as a folder to share: `phalanx export RUN --package DIR` (docs/EXPORT.md, "Sharing a policy").

    from phalanx.package import write_package
    report = write_package("runs/cartpole", "pkg")       # evaluates, plots, records, writes the model card

The folder holds the ONNX graph and its I/O contract (phalanx.export), the checkpoint's weights as safetensors,
the run's config, the evaluation against the env's baselines (results.json), the learning curve, a replay GIF
where the env renders, and a model card (README.md) whose YAML front matter is in the Hugging Face Hub's format:
`library_name`, `tags` and a `model-index` with the evaluated mean return, as Stable-Baselines3's and the RL
Zoo's cards write it ("mean +/- std"). `push_to_hub` uploads the folder with huggingface_hub (the `hub` extra).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from phalanx import checkpoint as ckpt
from phalanx.checkpoint import OBS_STATS_FILE, WEIGHTS_FILE, write_tensors_atomic
from phalanx.compare import bootstrap_ci
from phalanx.config import FIELDS, Config, resolve
from phalanx.envs import make, registry
from phalanx.errors import ConfigError, MissingExtraError, PhalanxError, one_line
from phalanx.evaluate import evaluate_policy, evaluate_seats
from phalanx.export import DEFAULT_OPSET, export_onnx, require_export_extra, sidecar_path
from phalanx.plot import plot_run
from phalanx.policy import Policy, load
from phalanx.record import record_episode
from phalanx.runs import writing

ONNX_FILE = "policy.onnx"
CONTRACT_FILE = sidecar_path(ONNX_FILE).name
CONFIG_FILE = "config.json"
CARD_FILE = "README.md"
RESULTS_FILE = "results.json"
CURVE_FILE = "learning_curve.png"
REPLAY_FILE = "replay.gif"
# Everything a package may hold: what --overwrite replaces (a user's other files in the folder are kept).
PACKAGE_FILES = (ONNX_FILE, CONTRACT_FILE, WEIGHTS_FILE, OBS_STATS_FILE, CONFIG_FILE, CARD_FILE, RESULTS_FILE, CURVE_FILE,
                 REPLAY_FILE)
HUB_EXTRA = "hub"
DEFAULT_EPISODES = 100
DEFAULT_SEED = 12345  # `phalanx eval`'s
DEFAULT_LICENSE = "mit"  # the card's license where `--license` names none: said so on the card
CONFIDENCE = 0.95
REPLAY_MAX_STEPS = 1000  # a longer episode's GIF is cut here: a card's replay is for watching, not for measuring
# Config keys of the machine a run trained on, not of the training: left out of the card's summary and config.json.
MACHINE_KEYS = ("run_dir", "device", "torch_threads", "progress", "tensorboard", "wandb", "wandb_project", "wandb_mode",
                "checkpoint_every", "checkpoint_minutes", "keep_checkpoints")
# The card's summary always shows these, and every other key whose value is not its default.
SUMMARY_KEYS = ("env", "env_options", "model", "seed", "total_steps", "num_envs", "num_steps", "lr", "gamma", "gae_lambda",
                "clip_coef", "ent_coef", "vf_coef", "num_epochs", "num_minibatches", "critic", "hidden_sizes", "norm_obs")


# -- checks made before any work --------------------------------------------------------------------------------
def check_package_dir(out_dir: str | Path, run_dir: str | Path, overwrite: bool = False) -> Path:
    """Refuse, in one line, a package folder that is a file, the run directory itself, or a folder that already
    holds files (unless `overwrite`: then the package's own files in it are replaced and the others kept)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export --package '{out}' is a file; name a folder (new or empty)")
    if out.resolve() == Path(run_dir).resolve():
        raise ConfigError(f"export --package '{out}' is the run directory itself; name another folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        held = sorted(p.name for p in out.iterdir())
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise ConfigError(f"export --package '{out}' exists and is not empty ({shown}); name a new or empty folder, or "
                          "add --overwrite to replace the package's files in it")
    return out


def require_hub_extra() -> None:
    """MissingExtraError naming the extra where huggingface_hub is not importable."""
    if importlib.util.find_spec("huggingface_hub") is None:
        raise MissingExtraError("--push-to-hub needs huggingface_hub, which is not installed: "
                                f"pip install 'phalanx[{HUB_EXTRA}]'")


def check_repo_id(repo_id: str) -> None:
    """A Hub repository id refused in one line before the packaging work, by huggingface_hub's own rule."""
    require_hub_extra()
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ConfigError(f"--push-to-hub '{repo_id}' is not a Hub repository id (owner/name): {one_line(e)}") from None


# -- the evaluation table --------------------------------------------------------------------------------------
def env_facts(env_name: str, env_options: dict[str, Any]) -> dict[str, Any]:
    """What the package needs of the run's env (`env_name` with `env_options`): its scripted policies but random
    play, whether it renders, its slots."""
    env = make(env_name, num_envs=1, seed=0, **env_options)
    try:
        return {"scripted": [n for n in env.scripted_names if n != "random"], "renders": bool(env.renders),
                "num_agents": int(env.num_agents), "turn_based": bool(env.turn_based)}
    finally:
        env.close()


def interval(returns: list[float]) -> tuple[float, float]:
    """The 95% percentile-bootstrap interval of the mean return over episodes (compare.bootstrap_ci)."""
    if len(returns) < 2:
        value = returns[0] if returns else float("nan")
        return value, value
    return bootstrap_ci(np.asarray(returns), lambda a: float(a.mean()), confidence=CONFIDENCE)


def table_row(name: str, play: str, result: dict[str, Any]) -> dict[str, Any]:
    """One row of the evaluation table from an `evaluate_policy` result."""
    lo, hi = interval(result["episode_returns"])
    row = {"policy": name, "play": play, "episodes": result["episodes"], "mean_return": result["mean_return"],
           "ci95": [lo, hi], "std_return": result["std_return"], "mean_length": result["mean_length"]}
    for key in ("success_rate", "win_rate", "win_rate_ci95"):
        if key in result:
            row[key] = result[key]
    return row


def seat_row(name: str, seat: str, result: dict[str, Any]) -> dict[str, Any]:
    """One row of a game's evaluation table from one seat of an `evaluate_seats` result: the learner's outcome per
    game (win 1, draw 0, loss -1) as its return, with the counts, the win rate and the games that differ."""
    w, d, lost = result["wins"], result["draws"], result["losses"]
    outcomes = [1.0] * w + [0.0] * d + [-1.0] * lost
    row = table_row(f"learned vs {name}", f"greedy, {seat} seat", {
        "episode_returns": outcomes, "episodes": result["episodes"], "mean_return": (w - lost) / max(w + d + lost, 1),
        "std_return": float(np.std(outcomes)) if outcomes else 0.0, "mean_length": result["mean_plies"],
        "win_rate": result["win_rate"], "win_rate_ci95": result["win_rate_ci95"]})
    row.update({"wins": w, "draws": d, "losses": lost, "distinct_games": result["distinct_games"]})
    return row


def evaluation_table(policy: Policy, episodes: int = DEFAULT_EPISODES, seed: int = DEFAULT_SEED) -> dict[str, Any]:
    """The learned policy against the env's baselines, as `phalanx eval --vs` plays them: every scripted team and
    random play (a league run: the learner against each scripted opponent and random play, head to head).
    -> {"head_to_head": bool, "rows": [table_row ...], "episodes", "seed", "confidence"}."""
    cfg = policy.config
    facts = env_facts(cfg.env, cfg.env_options)
    scripted = facts["scripted"]
    common = dict(env_options=registry.evaluation_options(cfg.env, cfg.env_options), episodes=episodes, seed=seed,
                  device=policy.device)
    rows = []
    if facts["turn_based"]:  # a game: does it beat random play and the env's own players, from each seat?
        for name in ["random", *scripted]:
            seats = evaluate_seats(policy, cfg.env, name, greedy=True, **common)
            rows.extend(seat_row(name, seat, seats[seat]) for seat in ("first", "second"))
        return {"head_to_head": True, "game": True, "rows": rows, "episodes": episodes, "seed": seed,
                "confidence": CONFIDENCE}
    if cfg.opponents:
        for name in [*scripted, "random"]:
            rows.append(table_row(f"learned vs {name}", "greedy",
                                  evaluate_policy(policy, cfg.env, greedy=True, opponent=name, **common)))
    else:
        for greedy in (True, False):
            rows.append(table_row("learned", "greedy" if greedy else "sampled",
                                  evaluate_policy(policy, cfg.env, greedy=greedy, teammates=cfg.teammates, **common)))
        for name in [*scripted, "random"]:
            rows.append(table_row(name, "scripted" if name != "random" else "uniform",
                                  evaluate_policy(None if name == "random" else name, cfg.env, greedy=False, **common)))
    return {"head_to_head": bool(cfg.opponents), "rows": rows, "episodes": episodes, "seed": seed, "confidence": CONFIDENCE}


# -- the model card (pure) -------------------------------------------------------------------------------------
def env_tag(env: str) -> str:
    """The env as a Hub tag: a gymnasium id as itself (as SB3's cards tag it), other prefixes joined by '-'."""
    return env.removeprefix("gym:").replace(":", "-")


def card_metadata(cfg: Config, num_agents: int, table: dict[str, Any], license: str = DEFAULT_LICENSE) -> dict[str, Any]:
    """The card's YAML front matter: library, license, tags, and the model-index with the learned policy's evaluated
    mean return as "mean +/- std" (the first row: greedy play; a league run: against the first scripted opponent). The
    dataset is the gymnasium id the env is or reproduces (CartPole-v1), else the env's name."""
    first = table["rows"][0]
    tags = ["reinforcement-learning", "deep-reinforcement-learning", "ppo", "phalanx", "onnx", env_tag(cfg.env), cfg.model]
    if num_agents > 1:
        tags.append("multi-agent")
    if cfg.opponents:
        tags.append("self-play")
    dataset = registry.gymnasium_id(cfg.env) or env_tag(cfg.env)
    return {
        "library_name": "phalanx",
        "license": license,
        "pipeline_tag": "reinforcement-learning",
        "tags": list(dict.fromkeys(tags)),
        "model-index": [{
            "name": "PPO",
            "results": [{
                "task": {"type": "reinforcement-learning", "name": "reinforcement-learning"},
                "dataset": {"name": dataset, "type": dataset},
                "metrics": [{"type": "mean_reward", "value": f"{first['mean_return']:.2f} +/- {first['std_return']:.2f}",
                             "name": "mean_reward", "verified": False}],
            }],
        }],
    }


def _fmt(x: float) -> str:
    return f"{x:.2f}"


def _table_markdown(table: dict[str, Any], num_agents: int) -> str:
    game = table.get("game", False)
    returns = ("outcome (win 1, draw 0, loss -1)" if game else "return of the learner's side" if table["head_to_head"]
               else "team return" if num_agents > 1 else "return")
    extra = [k for k in ("success_rate", "win_rate", "distinct_games") if any(k in r for r in table["rows"])]
    heads = ["policy", "play", "episodes", f"mean {returns}", f"{round(table['confidence'] * 100)}% interval", "std",
             "mean length (plies)" if game else "mean length", *[k.replace("_", " ") for k in extra]]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in table["rows"]:
        lo, hi = r["ci95"]
        cells = [r["policy"], r["play"], str(r["episodes"]), _fmt(r["mean_return"]), f"[{_fmt(lo)}, {_fmt(hi)}]",
                 _fmt(r["std_return"]), f"{r['mean_length']:.1f}"]
        for k in extra:
            if k == "win_rate" and k in r:
                lo, hi = r["win_rate_ci95"]
                cells.append(f"{r[k]:.2f} [{lo:.2f}, {hi:.2f}]")
            elif k == "distinct_games":
                cells.append(str(r[k]))
            else:
                cells.append(_fmt(r[k]) if k in r else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def config_summary(cfg: Config) -> dict[str, Any]:
    """The keys a reader of the card wants: `SUMMARY_KEYS`, then every other training key off its default."""
    data = cfg.to_dict()
    out = {k: data[k] for k in SUMMARY_KEYS}
    for key, value in data.items():
        field = FIELDS[key]
        default = field.default if field.default is not dataclasses.MISSING else (
            field.default_factory() if field.default_factory is not dataclasses.MISSING else None)
        if key not in out and key not in MACHINE_KEYS and value != default:
            out[key] = value
    return out


def _usage(contract: dict[str, Any]) -> str:
    """How to play the graph with onnxruntime, for this contract: every input it takes (the observation of each agent
    slot, the action mask of a masked env, a memory model's memory and flags), as code that runs in the package."""
    specs = {spec["name"]: spec for spec in contract["inputs"]}
    obs = specs["obs"]
    slots = contract["num_agents"]
    shape = ", ".join(str(d) for d in ["1", *obs["shape"][1:]])
    lines = ["```python", "import json", "import numpy as np", "import onnxruntime as ort", "",
             'contract = json.load(open("policy.json"))', 'session = ort.InferenceSession("policy.onnx")',
             f'obs = np.zeros(({shape}), dtype=np.{obs["dtype"]})  # [batch, agent slot, *observation]: raw, as the env '
             "gives it", 'feeds = {"obs": obs}']
    if "action_mask" in specs:
        mask = ", ".join(str(d) for d in ["1", *specs["action_mask"]["shape"][1:]])
        lines += [f'feeds["action_mask"] = np.ones(({mask}), dtype=bool)  # the env\'s action mask: True where allowed']
    if contract["memory"]:
        lines += ["# Memory starts as the contract says, and the graph resets a slot's memory where episode_start is True.",
                  "specs = {s['name']: s for s in contract['inputs']}",
                  "memory = {f['input']: np.broadcast_to(np.asarray(f['initial'], dtype=specs[f['input']]['dtype']),",
                  "                                      [1, *specs[f['input']]['shape'][1:]]).copy()",
                  "          for f in contract['memory'].values()}",
                  f"feeds['episode_start'] = np.ones((1, {slots}), dtype=bool)  # True on an episode's first step",
                  f"feeds['active'] = np.ones((1, {slots}), dtype=bool)",
                  "feeds.update(memory)"]
    lines += ["outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))"]
    if contract["memory"]:
        lines += ["memory = {f['input']: outputs[f['output']] for f in contract['memory'].values()}  # for the next step"]
    lines += ['action = outputs["action"]  # greedy env actions, [batch, agent slot, ...]',
              'print("actions:", action.tolist())', "```"]
    return "\n".join(lines)


def _reproduces(env: str) -> str:
    """A line on what a built-in env reproduces (gymnasium's CartPole-v1 step for step), or nothing."""
    gym_id, found = registry.gymnasium_id(env), registry.spec(env)
    if gym_id is not None and not env.startswith("gym:"):
        return f"`{env}` is gymnasium's {gym_id}, its dynamics and observations step for step, batched in torch.\n"
    if found is not None and found.reproduces:
        return f"`{env}` is {found.reproduces}, batched in torch.\n"
    return ""


def _limitations(cfg: Config, table: dict[str, Any], contract: dict[str, Any]) -> str:
    """What the graph and the evaluation do not say."""
    items = ["- The graph outputs greedy actions (and the distribution's parameters, from which a sampled action can be "
             "drawn); the policy trained sampling, so greedy play can differ from its training.",
             f"- The evaluation: {table['episodes']} episodes per row from seed {table['seed']}, on "
             f"{'the evaluation options of ' if cfg.env_options else ''}`{cfg.env}`"
             + (" (training-only options off)" if registry.evaluation_options(cfg.env, cfg.env_options) != cfg.env_options
                else "") + "; it measures these opponents and this seed, not every opponent a user may bring."]
    if contract["play_search"] != "none":
        searches = [f"`play_rollouts` {cfg.play_rollouts}: games played on from each move the net likes"] \
            if cfg.play_rollouts else []
        if cfg.play_solve_empties:
            searches.append(f"`play_solve_empties` {cfg.play_solve_empties}: endgames solved")
        items.append(f"- The evaluation's greedy play searches ({'; '.join(searches)}); the graph does not: it plays the "
                     "net's own greedy move, which is weaker (docs/EXPORT.md).")
    if not any(o["name"] == "value" for o in contract["outputs"]):
        items.append("- The graph has no value output: this run's critic (MAPPO) reads the world's state, which the graph "
                     "does not take.")
    if table.get("game"):
        items.append("- A game's rows against deterministic players repeat one game (see `distinct games`); exploitability "
                     "is measured by `phalanx exploit`, not here.")
    return "\n".join(items) + "\n"


def train_command(cfg: Config) -> str:
    """`phalanx train ...` with the keys of `cfg` that differ from its env's defaults (the machine's keys left out)."""
    base = resolve({"env": cfg.env}).to_dict()
    parts = ["phalanx", "train", "--env", cfg.env]
    for key, value in cfg.to_dict().items():
        if key in ("env", "env_options", *MACHINE_KEYS) or value == base.get(key):
            continue
        text = ",".join(str(v) for v in value) if isinstance(value, list) else \
            str(value).lower() if isinstance(value, bool) else str(value)
        parts += [f"--{key.replace('_', '-')}", shlex.quote(text)]
    for key, value in cfg.env_options.items():
        if value != base["env_options"].get(key):
            parts += [f"--{key.replace('_', '-')}", shlex.quote(str(value).lower() if isinstance(value, bool) else str(value))]
    return " ".join(parts)


def _player(cfg: Config, num_agents: int) -> str:
    """The card's line on examples/onnx_play/play.py: its command where it plays the package (one slot, a gymnasium env
    to play in), else nothing (it plays gymnasium envs of one slot only)."""
    env_id = registry.gymnasium_id(cfg.env)
    if num_agents != 1 or env_id is None or cfg.env_options:
        return ""
    return ("Phalanx's `examples/onnx_play/play.py` plays the graph in gymnasium's own env this way (numpy, gymnasium "
            f"and onnxruntime alone): `python examples/onnx_play/play.py . --env {env_id} --episodes 10`.\n")


def model_card(cfg: Config, num_agents: int, step: int | None, table: dict[str, Any], contract: dict[str, Any],
               curve: str, replay: str, replay_note: str, versions: dict[str, Any], license: str = DEFAULT_LICENSE) -> str:
    """README.md: the YAML front matter (`card_metadata`) and the card's text. `curve` / `replay`: the files'
    names, or a line saying why there is none; `replay_note`: what the replay shows."""
    meta = yaml.safe_dump(card_metadata(cfg, num_agents, table, license), sort_keys=False, allow_unicode=True)
    who = ("single agent" if num_agents == 1 else f"{num_agents} agent slots, the learner on one side" if table["head_to_head"]
           else f"{num_agents} agent slots, one shared policy")
    trained = f"{step:,} env steps" if step is not None else "an unknown number of steps"
    first = table["rows"][0]
    folded = contract["observation_normalisation"]["folded_in"]
    normalised = ", the run's observation normalisation folded in" if folded else ""
    weights_note = "; the observation statistics they were trained under are folded into the graph only" if folded else ""
    scripted = any(r["play"] == "scripted" for r in table["rows"])
    against = ("a game: the learner against random play and each of the env's own players, from each seat, learned play "
               "greedy; win rate with its 95% Wilson interval; `distinct games`: how many of the row's games differ (a "
               "greedy policy against a deterministic player plays one game again and again)" if table.get("game") else
               "head to head: the learner's side against each scripted opponent and random play, learned play greedy; "
               "win rate with its 95% Wilson interval" if table["head_to_head"] else
               "learned play greedy and sampled; " + ("each of the env's scripted teams in every slot; " if scripted else "")
               + "random play uniform")
    parts = [
        f"---\n{meta}---\n",
        f"# PPO ({cfg.model}) playing {cfg.env}, trained with Phalanx\n",
        f"A policy (model `{cfg.model}`) for `{cfg.env}`{' ' + json.dumps(cfg.env_options) if cfg.env_options else ''} "
        f"({who}), trained with Phalanx's PPO for {trained}. `{ONNX_FILE}` plays it with onnxruntime alone (no PyTorch, "
        f"no Phalanx): raw observations in, greedy env actions out{normalised}.\n",
        _reproduces(cfg.env),
        "## Evaluation\n",
        f"{table['episodes']} episodes per row, seed {table['seed']} ({against}). The interval is the 95% percentile "
        "bootstrap of the mean over episodes (2,000 resamples). The model-index above reports the first row, "
        f"{_fmt(first['mean_return'])} +/- {_fmt(first['std_return'])} (mean +/- std).\n",
        _table_markdown(table, num_agents) + "\n",
        "## Learning curve\n",
        (f"![learning curve]({curve})\n" if curve.endswith(".png") else f"{curve}\n"),
        "## Replay\n",
        (f"![replay]({replay})\n\nOne episode: {replay_note}.\n" if replay.endswith(".gif") else f"{replay}\n"),
        "## Use it with onnxruntime\n",
        "`policy.json` is the I/O contract: the inputs' and outputs' names, shapes and dtypes, the spaces, and how the "
        "memory starts and resets. `pip install onnxruntime numpy`, then:\n",
        _usage(contract) + "\n",
        _player(cfg, num_agents),
        "## Files\n",
        "| file | what |\n|---|---|\n"
        f"| `{ONNX_FILE}` | the policy as an ONNX graph (opset {contract['opset']}) |\n"
        f"| `{CONTRACT_FILE}` | its I/O contract |\n"
        f"| `{WEIGHTS_FILE}` | the network's weights as trained (safetensors{weights_note}) |\n"
        + (f"| `{OBS_STATS_FILE}` | the observation statistics the weights were trained under |\n" if folded else "")
        + f"| `{CONFIG_FILE}` | the run's training config |\n"
        f"| `{RESULTS_FILE}` | the evaluation table as JSON |\n"
        + (f"| `{CURVE_FILE}` | the learning curve |\n" if curve.endswith(".png") else "")
        + (f"| `{REPLAY_FILE}` | a replay of one greedy episode |\n" if replay.endswith(".gif") else ""),
        "## Limitations\n",
        _limitations(cfg, table, contract),
        "## Reproduce\n",
        "The command that trained this run (its keys off their defaults; the same Phalanx version replays it exactly on "
        "the same device):\n",
        "```bash\n" + train_command(cfg) + "\n```\n",
        f"or, every key as it was: `phalanx train --config {CONFIG_FILE}`.\n",
        "## License\n",
        f"`{license}`" + (" (the default of `phalanx export --package`; `--license` chooses another)" if license ==
                          DEFAULT_LICENSE else "") + ".\n",
        "## Training config\n",
        "```yaml\n" + yaml.safe_dump(config_summary(cfg), sort_keys=False, default_flow_style=None) + "```\n",
        f"The whole config: `{CONFIG_FILE}`. Trained with Phalanx {versions.get('phalanx', '?')} on torch "
        f"{versions.get('torch', '?')}; exported by {contract['exporter']} (torch {contract['torch_version']}).\n",
    ]
    return "\n".join(parts)


def parse_front_matter(text: str) -> dict[str, Any]:
    """A card's YAML front matter (between the first two '---' lines) as a dict."""
    if not text.startswith("---\n"):
        raise PhalanxError("the model card does not start with a '---' line (YAML front matter)")
    end = text.find("\n---\n", 4)
    if end < 0:
        raise PhalanxError("the model card's YAML front matter has no closing '---' line")
    data = yaml.safe_load(text[4:end])
    if not isinstance(data, dict):
        raise PhalanxError("the model card's front matter is not a YAML mapping")
    return data


def validate_card(text: str) -> None:
    """The card's front matter parsed as YAML and, where huggingface_hub is installed, by its ModelCard parser (the
    model-index read into eval results, offline): a card the Hub would misread is refused."""
    meta = parse_front_matter(text)
    if importlib.util.find_spec("huggingface_hub") is None:
        return
    from huggingface_hub import ModelCard

    try:
        results = ModelCard(text).data.eval_results
    except Exception as e:  # huggingface_hub's parser raises ValueError, KeyError and its own types
        raise PhalanxError(f"huggingface_hub cannot read the model card: {one_line(e)}") from None
    want = meta["model-index"][0]["results"][0]["metrics"][0]["value"]
    if not results or results[0].metric_value != want:
        raise PhalanxError(f"huggingface_hub reads the model card's model-index as {results!r}, not mean_reward {want}")


# -- the folder (the shell) ------------------------------------------------------------------------------------
def _versions(run_dir: Path) -> dict[str, Any]:
    """The run's manifest (Phalanx and torch versions it trained with); empty where it has none."""
    path = run_dir / "manifest.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        return {}




def _stage(run_dir: Path, stage: Path, policy: Policy, checkpoint: Path, episodes: int, seed: int, opset: int,
           license: str = DEFAULT_LICENSE) -> dict[str, Any]:
    """Every file of the package written into `stage`; -> what write_package reports."""
    cfg = policy.config
    onnx_path = export_onnx(policy, stage / ONNX_FILE, opset=opset)
    contract = json.loads(sidecar_path(onnx_path).read_text())
    with writing("package file", stage / WEIGHTS_FILE):
        shutil.copyfile(checkpoint / WEIGHTS_FILE, stage / WEIGHTS_FILE)
    if policy.obs_rms is not None:  # `phalanx.load(DIR)` normalises as the run did (the graph has them folded in)
        write_tensors_atomic(stage / OBS_STATS_FILE, {k: v.detach().cpu() for k, v in policy.obs_rms.state_dict().items()},
                      "package file")
    config = {k: v for k, v in cfg.to_dict().items() if k != "run_dir"}  # a path on the machine it trained on
    (stage / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    table = evaluation_table(policy, episodes=episodes, seed=seed)
    (stage / RESULTS_FILE).write_text(json.dumps({**table, "checkpoint_step": policy.step, "env": cfg.env,
                                                  "env_options": cfg.env_options}, indent=2) + "\n")
    try:
        plot_run(run_dir, stage / CURVE_FILE)
        curve = CURVE_FILE
    except PhalanxError as e:  # a run with no metrics rows to plot
        curve = f"No learning curve: {e}."
    facts = env_facts(cfg.env, cfg.env_options)
    if facts["renders"]:
        # The replay plays the opponent of the table's first row (a game's: random play; a league run's: its first
        # scripted opponent); its return is then the learner's side's.
        opponent = "random" if facts["turn_based"] else ([*facts["scripted"], "random"][0]) if cfg.opponents else None
        info = record_episode(policy, cfg.env, stage / REPLAY_FILE, registry.evaluation_options(cfg.env, cfg.env_options), greedy=True, seed=seed,
                              max_steps=REPLAY_MAX_STEPS, opponent=opponent, device=policy.device)
        replay = REPLAY_FILE
        returns = "the learner's return" if opponent else "team return" if facts["num_agents"] > 1 else "return"
        replay_note = (f"{info['steps']} steps, {returns} {info['return']:.2f}, greedy play, seed {seed}"
                       + (f", against {opponent}" if opponent else ""))
    else:
        replay = f"No replay: env `{cfg.env}` does not render frames."
        replay_note = replay
    card = model_card(cfg, facts["num_agents"], policy.step, table, contract, curve, replay, replay_note, _versions(run_dir),
                      license)
    validate_card(card)
    (stage / CARD_FILE).write_text(card)
    return {"table": table, "curve": curve, "replay": replay, "replay_note": replay_note, "contract": contract}


def write_package(run_dir: str | Path, out_dir: str | Path, checkpoint: str | Path | None = None,
                  episodes: int = DEFAULT_EPISODES, seed: int = DEFAULT_SEED, opset: int = DEFAULT_OPSET,
                  overwrite: bool = False, license: str = DEFAULT_LICENSE) -> dict[str, Any]:
    """Write the package of a run's policy (its latest checkpoint, or `checkpoint`) into `out_dir`: policy.onnx
    and policy.json, model.safetensors, config.json, results.json, README.md (the model card), learning_curve.png
    and, where the env renders, replay.gif. Staged in a hidden folder beside `out_dir` and moved in when whole.

    -> {"dir", "files", "table", "curve", "replay", "replay_note", "contract"}."""
    if episodes < 1:
        raise ConfigError(f"export --episodes must be >= 1, got {episodes}")
    require_export_extra()
    run_dir = Path(run_dir)
    out = check_package_dir(out_dir, run_dir, overwrite)
    policy = load(run_dir, checkpoint=checkpoint)
    ckpt_dir = Path(checkpoint) if checkpoint else ckpt.latest_checkpoint(run_dir)
    with writing("package folder", out):
        out.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        report = _stage(run_dir, stage, policy, ckpt_dir, episodes, seed, opset, license)
        with writing("package folder", out):
            out.mkdir(exist_ok=True)
            for name in PACKAGE_FILES:
                (out / name).unlink(missing_ok=True)
            for path in sorted(stage.iterdir()):
                os.replace(path, out / path.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return {"dir": out, "files": sorted(p.name for p in out.iterdir() if p.name in PACKAGE_FILES), **report}


def push_to_hub(package_dir: str | Path, repo_id: str, commit_message: str = "Upload a Phalanx policy package") -> str:
    """Upload a package folder to the Hugging Face Hub model repository `repo_id` (made if missing) with
    huggingface_hub's `upload_folder`, under the token it finds (`hf auth login` or HF_TOKEN); -> the commit's URL."""
    check_repo_id(repo_id)
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
        info = api.upload_folder(folder_path=str(package_dir), repo_id=repo_id, repo_type="model", commit_message=commit_message)
    except Exception as e:  # network, authentication and Hub errors: each ends in one line
        raise PhalanxError(f"uploading '{package_dir}' to the Hub repository '{repo_id}' failed: {one_line(e)}") from None
    return str(getattr(info, "commit_url", info))


__all__ = ["CARD_FILE", "DEFAULT_EPISODES", "DEFAULT_SEED", "HUB_EXTRA", "PACKAGE_FILES", "card_metadata", "check_package_dir",
           "check_repo_id", "env_facts", "evaluation_table", "model_card", "parse_front_matter", "push_to_hub",
           "require_hub_extra", "validate_card", "write_package"]
