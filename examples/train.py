"""Train a small classifier with mpaccel: the example that ships inside the package (so that
`pip install mpaccel` has it: `python -m mpaccel.examples.train`, what the Slurm templates of
`mpaccel slurm template` run). Its code is in mpaccel/examples/train.py; from a checkout:

    mpiexec -n 4 python examples/train.py
    srun --mpi=pmi2 -n 8 python examples/train.py --epochs 20
    python examples/train.py                      # one process
"""

from mpaccel.examples.train import main

if __name__ == "__main__":
    main()
