"""The record everything else shares: events, the guard's clock, RNG state, host reads, defaults.

Imports nothing of the package: every other layer may import it.
"""
