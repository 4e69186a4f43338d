"""The `attngrad` command line."""


def pip_install(extra: str) -> str:
    """The command that installs an extra: from a package index, and in a clone of the
    repository, where the package index's name finds no attngrad of this tree."""
    return f"pip install 'attngrad[{extra}]' (in a clone: pip install -e '.[{extra}]')"
