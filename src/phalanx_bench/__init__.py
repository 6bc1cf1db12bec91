"""`phalanx bench`: Phalanx's benchmarks, kept out of the library (a `phalanx.commands` plugin)."""
