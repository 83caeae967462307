"""`python -m jaxspec.cli ...`: the `jaxspec` command."""

import sys

from jaxspec.cli.main import main

sys.exit(main())
