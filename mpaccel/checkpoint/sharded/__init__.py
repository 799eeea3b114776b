"""Checkpoints of fully sharded state (DTensors), each rank writing and reading its own rows:
save.py (sharded checkpoints and their index), load.py (reading rows at any world size and
sharding), state.py (the sharded part of a training checkpoint), export.py (whole tensors in
save_model's layout, written without a gather)."""
