from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "docker: builds the image and runs the docker-compose swarm for real (deselect: -m 'not docker')"
    )
