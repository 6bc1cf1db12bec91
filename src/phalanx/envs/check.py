"""`check_env`: every rule of the env contract (docs/ENVIRONMENTS.md), each failure one line that names
the field, what was expected and what came back.

`quick=True` is the part the trainer runs before it creates the run directory: attributes, the reset
record, one step's record, and `state_dict`. The full check adds auto-reset with `final_obs`, inactive
slots, action validation, seeded determinism and the `state_dict` round trip. Where records carry an
`action_mask`, its shape and dtype and that it leaves every slot an action are checked in every record, and
the random actions are drawn among the actions it allows: the env must accept each one. The check steps the env;
reset it (with a seed) before using it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from phalanx.draws import Draws
from phalanx.envs.base import StepRecord, VecEnv, same_device
from phalanx.envs.spaces import ActionError, Box, Discrete, MultiDiscrete
from phalanx.episodes import stack_restarts
from phalanx.errors import EnvContractError, one_line

BOOL_FIELDS = ("terminated", "truncated", "active", "trial_end")


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _fail(env: VecEnv, text: str) -> EnvContractError:
    return EnvContractError(f"env '{env.name}': {text}")


def check_attributes(env: VecEnv) -> None:
    """The attributes every env declares (VecEnv's docstring)."""
    if not isinstance(env, VecEnv):
        raise EnvContractError(f"an env must subclass phalanx.envs.VecEnv; got {type(env).__name__}")
    for name in ("num_envs", "num_agents"):
        value = getattr(env, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _fail(env, f"{name} must be a positive int; got {value!r}")
    if not isinstance(getattr(env, "device", None), torch.device):
        raise _fail(env, f"device must be a torch.device; got {getattr(env, 'device', None)!r}")
    for name, kinds in (("observation_space", (Box,)), ("action_space", (Discrete, MultiDiscrete, Box))):
        space = getattr(env, name, None)
        if not isinstance(space, kinds):
            allowed = ", ".join(k.__name__ for k in kinds)
            kind = type(space)
            # gymnasium's spaces share our classes' names: say whose it is, and which of ours to use.
            hint = (f" (gymnasium's: make it phalanx.envs.{kind.__name__}, or train the gymnasium env through `gym:`)"
                    if kind.__module__.startswith(("gymnasium", "gym.")) else "")
            raise _fail(env, f"{name} must be a phalanx.envs space ({allowed}); got {kind.__module__}.{kind.__qualname__}{hint}")
    if env.observation_space.dtype not in (torch.float32, torch.uint8):
        raise _fail(env, f"observation_space.dtype must be float32 or uint8; got {_dt(env.observation_space.dtype)}")
    if env.state_space is not None and not isinstance(env.state_space, Box):
        raise _fail(env, f"state_space must be a Box or None; got {type(env.state_space).__name__}")
    roles = getattr(env, "roles", None)
    if not isinstance(roles, torch.Tensor):
        raise _fail(env, "roles must be a long tensor [num_agents] of role indices (all zeros: env.default_roles()); it is missing")
    if tuple(roles.shape) != (env.num_agents,) or roles.dtype != torch.long or not same_device(roles.device, env.device):
        raise _fail(env, f"roles must be int64 [{env.num_agents}] on {env.device}; got {_dt(roles.dtype)} "
                         f"{list(roles.shape)} on {roles.device}")
    if not isinstance(env.role_names, tuple) or not env.role_names or not all(isinstance(r, str) for r in env.role_names):
        raise _fail(env, f"role_names must be a non-empty tuple of str; got {env.role_names!r}")
    if roles.numel() and (int(roles.min()) < 0 or int(roles.max()) >= len(env.role_names)):
        raise _fail(env, f"roles must index role_names (0..{len(env.role_names) - 1}); got {roles.tolist()}")
    if env.capturable and env.rng is not None and not isinstance(env.rng, Draws):
        raise _fail(env, f"rng must be a phalanx.draws.Draws; got {type(env.rng).__name__}")
    stack, shape = env.frame_stack, env.observation_space.shape
    if not isinstance(stack, int) or isinstance(stack, bool) or stack < 0:
        raise _fail(env, f"frame_stack must be an int >= 0 (0: no stack); got {stack!r}")
    if stack > 1 and (len(shape) < 2 or shape[0] != stack):
        raise _fail(env, f"frame_stack = {stack} needs observations [{stack}, *frame] per slot (the stack first); "
                         f"observation_space has shape {list(shape)}")


def _check_stack(env: VecEnv, prev: StepRecord, rec: StepRecord, t: int) -> None:
    """VecEnv.frame_stack: where a slot's stack goes on it moves by one frame; where it starts afresh
    (episodes.stack_restarts) it holds copies of its first frame."""
    restart = stack_restarts(rec.terminated | rec.truncated, rec.trial_end, prev.active)
    n, a = env.num_envs, env.num_agents
    moved = (rec.obs[:, :, :-1] == prev.obs[:, :, 1:]).reshape(n, a, -1).all(-1)
    fresh = (rec.obs == rec.obs[:, :, -1:]).reshape(n, a, -1).all(-1)
    bad = torch.where(restart, ~fresh, ~moved)
    if bool(bad.any()):
        i, j = bad.nonzero()[0].tolist()
        rule = (f"a stack that starts afresh (an episode or trial start) must hold {env.frame_stack} copies of its first "
                "frame" if bool(restart[i, j]) else "a stack that goes on must drop its oldest frame and append one new "
                "frame (obs[:, :, :-1] of this step = obs[:, :, 1:] of the last)")
        raise _fail(env, f"step() record.obs breaks frame_stack = {env.frame_stack} at step {t} (env {i}, slot {j}): {rule}")


def check_record(env: VecEnv, rec: object, where: str) -> StepRecord:
    """Types, shapes, dtypes and devices of one record (`where`: 'reset' or 'step')."""
    if not isinstance(rec, StepRecord):
        hint = " (a gym-style tuple? build a phalanx.envs.StepRecord)" if isinstance(rec, tuple) else ""
        raise _fail(env, f"{where}() must return a phalanx.envs.StepRecord; got {type(rec).__name__}{hint}")
    n, a = env.num_envs, env.num_agents
    space = env.observation_space

    def tensor(field: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        x = getattr(rec, field)
        if not isinstance(x, torch.Tensor):
            raise _fail(env, f"{where}() record.{field} must be a tensor {_dt(dtype)} {list(shape)}; got {type(x).__name__}")
        if tuple(x.shape) != shape:
            raise _fail(env, f"{where}() record.{field} must have shape {list(shape)}; got {list(x.shape)}")
        if x.dtype != dtype:
            raise _fail(env, f"{where}() record.{field} must be {_dt(dtype)}; got {_dt(x.dtype)}")
        if not same_device(x.device, env.device):
            raise _fail(env, f"{where}() record.{field} must be on {env.device}; got {x.device}")

    tensor("obs", (n, a, *space.shape), space.dtype)
    tensor("final_obs", (n, a, *space.shape), space.dtype)
    tensor("reward", (n, a), torch.float32)
    for field in BOOL_FIELDS:
        tensor(field, (n, a), torch.bool)
    if env.state_space is None:
        if rec.state is not None:
            raise _fail(env, f"{where}() record.state is set but state_space is None; declare state_space (a Box)")
    else:
        tensor("state", (n, *env.state_space.shape), torch.float32)
        tensor("final_state", (n, *env.state_space.shape), torch.float32)
    _check_mask(env, rec, where, tensor)
    if not isinstance(rec.info, dict):
        raise _fail(env, f"{where}() record.info must be a dict of tensors; got {type(rec.info).__name__}")
    for key, value in rec.info.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != n or not same_device(value.device, env.device):
            got = f"{list(value.shape)} on {value.device}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise _fail(env, f"{where}() record.info['{key}'] must be a tensor [num_envs={n}] or [{n}, {a}] on {env.device}; got {got}")
    return rec


def _check_mask(env: VecEnv, rec: StepRecord, where: str, tensor: Callable[[str, tuple[int, ...], torch.dtype], None]) -> None:
    """StepRecord.action_mask: None, or bool [N, A, mask_width] for a discrete action space, leaving every
    slot (every head) at least one action."""
    mask, space = rec.action_mask, env.action_space
    if mask is None:
        if env.action_masks:
            raise _fail(env, f"{where}() record.action_mask is None but the env declares action_masks = True; give every "
                             "record a mask (all True where nothing is forbidden)")
        return
    if not env.action_masks:
        raise _fail(env, f"{where}() record.action_mask is set but the env does not declare action_masks = True (a VecEnv "
                         "attribute: the trainer keeps a mask a step only for an env that declares it)")
    if not isinstance(space, (Discrete, MultiDiscrete)):
        raise _fail(env, f"{where}() record.action_mask is set but action_space is {space.describe()}; "
                         "masks are for Discrete and MultiDiscrete actions (leave it None)")
    wide = "n" if isinstance(space, Discrete) else "sum(nvec)"
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
        raise _fail(env, f"{where}() record.action_mask must be bool (True: allowed) [N, A, {wide}]; got {_dt(mask.dtype)}")
    tensor("action_mask", (env.num_envs, env.num_agents, space.mask_width), torch.bool)
    empty = space.allows_nothing(mask)
    if bool(empty.any()):
        i, j = empty.nonzero()[0].tolist()
        heads = isinstance(space, MultiDiscrete)
        raise _fail(env, f"{where}() record.action_mask allows no action to {'a head of ' if heads else ''}slot {j} of env {i}; "
                         f"a mask must leave every slot, active or not, at least one action{' per head' if heads else ''}")


def check_state_dict(env: VecEnv) -> dict[str, torch.Tensor]:
    try:
        state = env.state_dict()
    except NotImplementedError:
        raise _fail(env, "state_dict() is not implemented: checkpoints and resume need the env's dynamic state "
                         "(implement step_state() and load_step_state(), or state_dict() and load_state_dict())") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise _fail(env, "state_dict() must return a dict of str -> torch.Tensor (saved with safetensors)")
    return state


def sample_actions(env: VecEnv, gen: torch.Generator, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Uniformly random valid actions [N, A, ...] on the env's device (drawn on the CPU, so every device agrees);
    with a record's `action_mask`, uniform over the actions it allows."""
    space = env.action_space
    if mask is None:
        return space.sample(env.num_envs, env.num_agents, gen, "cpu").to(env.device)
    return space.sample(env.num_envs, env.num_agents, gen, "cpu", mask=mask.cpu()).to(env.device)


def _step_legal(env: VecEnv, actions: torch.Tensor, prev: StepRecord, t: int) -> object:
    """env.step(actions), the actions drawn within `prev`'s mask: a refusal breaks the mask's promise."""
    if prev.action_mask is None:
        return _guarded(env, "step(actions)", lambda: env.step(actions))
    try:
        return env.step(actions)
    except EnvContractError:
        raise
    except Exception as e:
        at = "the first step" if t < 0 else f"step {t}"
        raise _fail(env, f"step() raised {one_line(e)} on actions the last record's action_mask allows ({at}); "
                         "an env must accept every action its mask allows") from None


def _guarded(env: VecEnv, what: str, fn: Callable[[], object]) -> object:
    try:
        return fn()
    except EnvContractError:
        raise
    except Exception as e:  # the env's own code failed: one line, never a traceback
        raise _fail(env, f"{what} raised {one_line(e)}") from None


def _records_equal(a: StepRecord, b: StepRecord) -> str | None:
    for field in ("obs", "reward", "terminated", "truncated", "active", "trial_end", "final_obs", "state", "action_mask"):
        x, y = getattr(a, field), getattr(b, field)
        if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
            return field
    return None


def check_env(env: VecEnv, steps: int = 64, seed: int = 7, quick: bool = False) -> None:
    """Raise EnvContractError (one line) at the first broken rule; return None where all hold."""
    check_attributes(env)
    gen = torch.Generator().manual_seed(seed)
    first = check_record(env, _guarded(env, "reset(seed)", lambda: env.reset(seed=seed)), "reset")
    if bool(first.terminated.any() | first.truncated.any()):
        raise _fail(env, "reset() record.terminated / truncated must be all False")
    check_record(env, _step_legal(env, sample_actions(env, gen, first.action_mask), first, -1), "step")
    check_state_dict(env)
    if quick:
        return
    _check_actions_refused(env)
    # Auto-reset, final_obs and inactive slots over a random run.
    first = check_record(env, env.reset(seed=seed), "reset")
    prev, trace, records = first, [], []
    layout = _step_state_layout(env, None, -1)
    ended_slots = ended_as_reset = 0
    space = env.observation_space
    low, high = space.low_tensor(env.device).float(), space.high_tensor(env.device).float()
    for t in range(steps):
        actions = sample_actions(env, gen, prev.action_mask)
        rec = check_record(env, _step_legal(env, actions, prev, t), "step")
        trace.append(actions)
        records.append(rec)
        # A slot that acted, goes on acting and did not end (nor did its env's episode or trial) keeps
        # its observation: final_obs differs from obs only across a boundary.
        ended = rec.terminated | rec.truncated | rec.trial_end
        env_ended = (ended | ~prev.active).all(-1, keepdim=True) | rec.trial_end.any(-1, keepdim=True)
        goes_on = prev.active & rec.active & ~ended & ~env_ended
        same = (rec.final_obs == rec.obs).reshape(env.num_envs, env.num_agents, -1).all(-1)
        if bool((goes_on & ~same).any()):
            i, j = (goes_on & ~same).nonzero()[0].tolist()
            raise _fail(env, f"step() record.final_obs must equal obs where no episode or trial ended (env {i}, slot {j}, "
                             f"step {t}); final_obs is the last observation of an episode that ended, obs the next one's first")
        for field in ("obs", "final_obs", "reward", "state", "final_state"):
            x = getattr(rec, field)
            if x is not None and not bool(torch.isfinite(x.float()).all()):
                raise _fail(env, f"step() record.{field} holds NaN or infinite values at step {t} (seed {seed}); "
                                 "every number an env returns must be finite")
        for field in ("obs", "final_obs"):
            x = getattr(rec, field).float()
            if bool(((x < low) | (x > high)).any()):
                i = ((x < low) | (x > high)).nonzero()[0].tolist()
                raise _fail(env, f"step() record.{field} leaves observation_space {space.describe()} at step {t} "
                                 f"(index {i}: {x[tuple(i)].item():g}); declare the bounds the observations keep")
        # The classic auto-reset bug: final_obs taken after the reset, so it is the next episode's first obs.
        ended_here = (ended | (env_ended & prev.active)) & prev.active
        if bool(ended_here.any()):
            same_as_next = (rec.final_obs == rec.obs).reshape(env.num_envs, env.num_agents, -1).all(-1)
            ended_slots += int(ended_here.sum())
            ended_as_reset += int((ended_here & same_as_next).sum())
        if env.frame_stack > 1:
            _check_stack(env, prev, rec, t)
        idle = ~prev.active
        # A turn-based env's slot may get its reward, and its end, on another slot's turn.
        if not env.turn_based and bool((idle & (rec.reward != 0)).any()):
            raise _fail(env, f"step() record.reward must be 0 for slots that were inactive before the step (step {t})")
        if not env.turn_based and bool((idle & (rec.terminated | rec.truncated)).any()):
            raise _fail(env, f"step() record.terminated / truncated must be False for slots that were inactive before the step (step {t})")
        prev = rec
        _step_state_layout(env, layout, t)
    if ended_slots >= 8 and ended_as_reset == ended_slots:
        raise _fail(env, f"step() record.final_obs equals obs (the next episode's first observation) at every one of "
                         f"{ended_slots} episode ends; final_obs must be the last observation of the episode that ended, "
                         "taken before the auto-reset")
    # Seeded determinism: the same seed and actions give the same records.
    again = env.reset(seed=seed)
    if (field := _records_equal(first, again)) is not None:
        raise _fail(env, f"reset(seed={seed}) must be deterministic: record.{field} differs between two resets with one seed")
    for t, (actions, want) in enumerate(zip(trace, records)):
        if (field := _records_equal(want, env.step(actions))) is not None:
            raise _fail(env, f"step() must be deterministic after reset(seed): record.{field} differs at step {t} "
                             "on the same seed and actions (draw randomness from the env's own seeded generator)")
    if not env.restorable:
        return
    # state_dict round trip: restoring the state replays the same steps.
    state = {k: v.clone() for k, v in check_state_dict(env).items()}
    # Fresh actions from where the env stands (the replay's last record): an action of the trace may be one
    # its mask forbids here.
    rec, replay, ahead = records[-1] if records else again, [], []
    for _ in range(min(8, len(trace))):
        replay.append(sample_actions(env, gen, rec.action_mask))
        rec = _step_legal(env, replay[-1], rec, len(trace) + len(ahead))
        ahead.append(rec)
    _guarded(env, "load_state_dict(state_dict())", lambda: env.load_state_dict(state))
    for a, want in zip(replay, ahead):
        got = _guarded(env, "step(actions) after load_state_dict(state_dict())", lambda a=a: env.step(a))
        if (field := _records_equal(want, got)) is not None:
            raise _fail(env, f"load_state_dict(state_dict()) must restore the env: record.{field} differs after the round trip "
                             "(is the generator state saved?)")


def _step_state_layout(env: VecEnv, want: dict[str, tuple] | None, t: int) -> dict[str, tuple] | None:
    """A capturable env's step state as names -> (shape, dtype): the same after every step (a replayed
    --cuda-graphs step reads and writes the tensors it was recorded with)."""
    if not env.capturable:
        return None
    try:
        state = env.step_state()
    except NotImplementedError:
        raise _fail(env, "step_state() is not implemented: a capturable env names the tensors its step reads and "
                         "replaces (step_state() and load_step_state(); docs/ENVIRONMENTS.md)") from None
    got = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    if want is not None and got != want:
        name = next(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
        raise _fail(env, f"step_state() must keep its names, shapes and dtypes from step to step; '{name}' was "
                         f"{_layout(want.get(name))} and is {_layout(got.get(name))} after step {t}")
    return got


def _layout(entry: tuple | None) -> str:
    return "missing" if entry is None else f"{_dt(entry[1])} {list(entry[0])}"


def _check_actions_refused(env: VecEnv) -> None:
    """Out-of-range and wrongly typed discrete actions must be refused (on the CPU, where reading them is free)."""
    space = env.action_space
    if env.device.type != "cpu" or not isinstance(space, (Discrete, MultiDiscrete)):
        return
    n, a = env.num_envs, env.num_agents
    bad_shape = (n, a) if isinstance(space, Discrete) else (n, a, len(space.nvec))
    high = space.n if isinstance(space, Discrete) else max(space.nvec)
    for what, actions in ((f"action {high} (out of range)", torch.full(bad_shape, high, dtype=torch.long)),
                          ("float actions", torch.full(bad_shape, 0.7))):
        env.reset(seed=0)
        try:
            env.step(actions)
        except (ActionError, ValueError, TypeError, IndexError, RuntimeError):
            continue
        raise _fail(env, f"step() accepted {what} for {space.describe()}; refuse them: "
                         "actions = self.action_space.check(actions, self.num_envs, self.num_agents)")
