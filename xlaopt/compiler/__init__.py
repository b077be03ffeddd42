"""What surrounds XLA's compile of a program: JAX's persistent cache of executables (`cache`) and
XLA's own log lines captured into notes (`log`). The compile itself is `xlaopt.compile`."""
