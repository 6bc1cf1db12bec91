"""Run under torchrun by test_distributed.py: train (full / part / resume) and save this rank's
parameters and observation statistics to OUT/rank<r>.safetensors."""

import faulthandler
import os
import sys

from safetensors.torch import save_file

import phalanx

faulthandler.enable()  # a rank that aborts (SIGABRT) prints every thread's Python stack
mode, run_dir, out = sys.argv[1:4]
cfg = dict(env="cartpole", total_steps=4 * 2 * 256, num_envs=4, num_steps=64, num_minibatches=2, checkpoint_every=512,
           norm_obs=True, norm_reward=True, target_kl=0.5, progress=False, tensorboard=False, torch_threads=1, seed=5,
           device="cpu")  # gloo on the CPU, also on a machine with fewer GPUs than ranks
if mode == "full":
    result = phalanx.train(run_dir=run_dir, **cfg)
elif mode == "part":
    result = phalanx.train(run_dir=run_dir, max_updates=2, **cfg)
else:
    result = phalanx.train(resume=run_dir)
tensors = {f"model.{k}": v.detach().contiguous() for k, v in result.policy.model.state_dict().items()}
tensors["obs_mean"] = result.policy.obs_rms.mean.detach().clone()
tensors["obs_var"] = result.policy.obs_rms.var.detach().clone()
save_file(tensors, os.path.join(out, f"rank{os.environ.get('RANK', '0')}.safetensors"))
