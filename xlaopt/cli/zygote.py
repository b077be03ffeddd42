"""The entry point of a launched job's zygote (`python -m xlaopt.cli.zygote REPLY_FD`, started by
xlaopt.runtime.launch): it serves forks until its launcher is done; in each forked child it runs
the `xlaopt` command line it was asked to."""
import sys

from xlaopt.runtime.zygote import serve

if __name__ == "__main__":
    child = serve(int(sys.argv[1]))
    if child is None:
        sys.exit(0)
    sys.argv = ["xlaopt", *child["argv"]]
    from xlaopt.cli import main

    sys.exit(main(child["argv"]))
