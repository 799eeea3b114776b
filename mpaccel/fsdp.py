"""Transitional: the names accelerator_checkpoint.py still imports from here while the
checkpoint facade is rewritten on another branch; they live in strategy/fully_sharded.py, and
this module goes once that facade asks the strategy (`is_sharded`, `tied_aliases`,
`checkpoint_entries`) instead."""

from .strategy.fully_sharded import OptimizerState, fsdp_module, tied_aliases

__all__ = ["OptimizerState", "fsdp_module", "tied_aliases"]
