"""The command-line tools: python -m cutebwd.tools.NAME --help."""
import argparse
import os
import sys


def drop_checkout_root() -> None:
    """Take this checkout's root off sys.path. `python -m` puts the working directory there; run
    from the root, the checkout's folders become top-level modules and `kernels/` shadows Hugging
    Face's `kernels` package, which transformers (5.25 and later) imports. The package is `cutebwd`,
    found by its install, not by the path; an installed copy has no root on the path to drop."""
    root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]


def tool_parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The parser of `python -m cutebwd.tools.<name>`: its usage line is the command to type, its
    description the first paragraph of `doc`."""
    return argparse.ArgumentParser(prog=f"python -m cutebwd.tools.{name}", description=doc.split("\n\n")[0])


drop_checkout_root()
