"""`python -m attngrad` is the `attngrad` command."""

import sys

from .cli.main import main

sys.exit(main())
