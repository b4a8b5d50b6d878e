"""The real-cluster tier (`make test-slurm`): a real Slurm cluster and a real Prometheus, started by the
tier itself on this machine with each node in a network namespace of its own (netns.py), and the
Kubernetes recipe's manifests checked against the API schema and their pods' commands run in namespaces.
Not part of `make test` (pyproject's testpaths leave this folder out)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.cluster)
