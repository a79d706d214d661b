"""Which optional packages this environment has (``make mindformers`` installs mindformers)."""
import importlib.metadata


def mindformers_installed() -> bool:
    """The mindformers distribution is installed (not merely a directory named mindformers on
    sys.path: tests/mindformers is a namespace package when tests/ is on the path)."""
    try:
        importlib.metadata.distribution("mindformers")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
