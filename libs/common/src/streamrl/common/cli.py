"""``streamrl <command> ...``: one umbrella command; each package registers its subcommands.

Subcommands are entry points in the ``streamrl.commands`` group (``name = "module:function"``,
the function takes ``argv: list[str]`` and returns an exit code), so ``streamrl.common`` never
imports a service.
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points


def commands() -> dict[str, str]:
    """Registered subcommands: name -> ``module:function``."""
    return {ep.name: ep.value for ep in entry_points(group="streamrl.commands")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    available = commands()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: streamrl <command> [args...]\n\ncommands:")
        for name in sorted(available):
            print(f"  {name}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in available:
        print(f"streamrl: unknown command {name!r}; known: {', '.join(sorted(available))}", file=sys.stderr)
        return 2
    (ep,) = [ep for ep in entry_points(group="streamrl.commands") if ep.name == name]
    return int(ep.load()(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
