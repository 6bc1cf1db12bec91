"""The bench's studies: trained runs scored against reference players, teams and peers, each a table with its
intervals, kept beside a pack of the runs it is made from (`phalanx_bench.packs`; the packs and tables live in the
checkout's bench/results/). Each runs as `python -m phalanx_bench.studies.NAME`, from the repository's root.

| module | the study |
|---|---|
| `games` | tic-tac-toe or connect four runs against `phalanx_bench.players`, from each seat (issue 50) |
| `transfer` | a best response (`phalanx exploit`) played against another run's greedy policy, e.g. with its play search |
| `bucket_brigade` | bucket_brigade's 12 scenarios: learned teams against every archetype team and random play |
| `spread` | MPE simple_spread: trained teams against a hand-written assignment heuristic and random play (needs mpe2) |
| `learning_parity` | Phalanx at each peer's own published PPO settings, on the peers' own tables (bench/parity/) |
| `vmas_vs_benchmarl` | Phalanx's MAPPO against BenchMARL's on VMAS tasks (its Phalanx side: `vmas_phalanx`) |
"""
