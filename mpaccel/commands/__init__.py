"""Accelerate's `accelerate.commands` path: what libraries import from Accelerate's command line
(`config` for environment reports, `launch` and `env` for their own CLIs), answered by mpaccel,
whose jobs are started by mpiexec or srun (docs/huggingface.md)."""
