"""`python -m xlaopt.cli`: the processes `train --processes` starts, and the tests."""
import sys

from xlaopt.cli import main

# Guarded: importing the module (a walk of every module, as .ci/wheel_check's import stage does)
# must not run a command on that process's argv.
if __name__ == "__main__":
    sys.exit(main())
