"""`python -m mpaccel ...`: the same as the `mpaccel` command."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
