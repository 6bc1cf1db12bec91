"""Adapters between Phalanx's env protocol and other libraries: gymnasium (`gym:<id>`), PettingZoo
(`pz:<module>:<fn>`), VMAS (`vmas:<scenario>`), and the export of a Phalanx env to gymnasium / SB3
(`gym_export`) and PettingZoo (`pettingzoo.to_pettingzoo`).

Each module registers its prefix (and, for VMAS, its benchmarked tasks) when imported; the registry
imports it the first time a name with that prefix is asked for, so nothing here is imported up front.
"""
