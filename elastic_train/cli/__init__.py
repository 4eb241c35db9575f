"""The ``elastic-train`` command line: one module per subcommand, discovered automatically.

A subcommand module defines ``register(subparsers)``, which adds its parser and sets ``func`` (taking the
parsed ``argparse.Namespace`` and returning an exit code) with ``parser.set_defaults(func=...)``.
"""
