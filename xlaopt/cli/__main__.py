"""`python -m xlaopt.cli`: the processes `train --processes` starts, and the tests."""
import sys

from xlaopt.cli import main

sys.exit(main())
