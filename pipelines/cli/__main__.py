"""`python -m pipelines.cli`: the `hyperpod-pretrain` command."""

import sys

from pipelines.cli import main

sys.exit(main())
