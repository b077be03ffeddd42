"""Errors a user can fix. One base, and the exit status each kind ends a command with.

An `XlaoptError` is an outcome the user acts on, not a bug: `xlaopt.cli.main` prints its
message as one line (no traceback) and exits with its `exit_code`, in that one place.

| status | meaning |
|---|---|
| 0 | done (`train`: also stopped by SIGTERM after its final checkpoint) |
| 1 | a check came out negative (`verify`'s MISMATCH, `ckpt verify`/`diff`, `parity`), or a bug (a traceback) |
| 2 | `UserError`: bad input, refused before the work it would spoil (argparse's refusals too) |
| 3 | `RunFailed`: a run stopped part-way (a non-finite loss); what it committed is intact, `--resume` continues |
| 4 | `xlaopt.runtime.faults.PeerLost`: a run failed because a peer process of its job went away |
"""

EXIT_USER_ERROR = 2
EXIT_RUN_FAILED = 3
EXIT_PEER_LOST = 4


class XlaoptError(Exception):
    """What a user is told in one line; `exit_code` is the command's exit status."""
    exit_code = 1


class UserError(XlaoptError, ValueError):
    """Bad input: the message names what is wrong and what would work."""
    exit_code = EXIT_USER_ERROR


class RunFailed(XlaoptError):
    """The run stopped part-way (a non-finite loss, a lost peer); nothing committed is lost."""
    exit_code = EXIT_RUN_FAILED
