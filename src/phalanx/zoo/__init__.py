"""The built-in workloads: batched torch envs written against the env protocol (`phalanx.envs`).

Each module registers its env when imported; the registry (`phalanx.envs.registry`) imports it the
first time its name is asked for (`make("cartpole")`, `phalanx envs`), so nothing here is imported up
front and importing one workload does not import the others.
"""
