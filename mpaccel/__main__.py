"""`python -m mpaccel ...`: the same as the `mpaccel` command."""

from .cli import main

raise SystemExit(main())
