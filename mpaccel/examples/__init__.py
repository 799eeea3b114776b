"""Examples shipped with the package, so that an installed mpaccel can run them:
`mpiexec -n 4 python -m mpaccel.examples.train` (what `mpaccel slurm template` scripts run)."""
