"""Sessions beyond the README's test command (`pip install nox`, then `nox -s NAME`).

transformers: the transformers integration's tests against the oldest transformers that
attngrad supports and the newest one tested, each in a fresh environment with the pinned
PyTorch (`constraints.txt`). The README names both versions.
"""

import nox

# The oldest: the first release whose models all pass the integration's tests (5.4 first
# passes (q_length, q_offset) to mask functions; T5 indexes its mask as a tensor up to
# 5.14). The newest: the latest release tested.
TRANSFORMERS = ["5.15.0", "5.24.0"]

INTEGRATION_TESTS = ["tests/integrations", "tests/attngrad_torch/masks/test_functions.py"]


@nox.session(venv_backend="venv")
@nox.parametrize("version", TRANSFORMERS)
def transformers(session: nox.Session, version: str) -> None:
    session.install("-c", "constraints.txt", "-e", ".[test]")
    session.install(f"transformers=={version}")  # after the constraints, which pin the default
    session.run("python", "-m", "pytest", "-q", *INTEGRATION_TESTS, *session.posargs)
