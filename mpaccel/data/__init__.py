"""The data loaders `prepare()` builds, one concept a module: `samplers` (who takes which
samples), `loader` (what both prepared loaders share), `sharded` (each rank reads its own
batches), `dispatch` (rank 0 reads for everyone), `prepare` (a DataLoader rebuilt as one of
them), and `skip` (skip_first_batches). Accelerate's names for them are at mpaccel.data_loader.
split_between_processes' shares are mpaccel/split.py, below PartialState: these loaders read
the PartialState's communicator, so a module here cannot serve PartialState."""
