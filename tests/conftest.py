"""Shared test set-up: one corpus cache for the session, GPU tests skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _corpus_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # the built-in corpus is built once per session, outside the user's home
    if "ELBOWROOM_CACHE" not in os.environ:
        os.environ["ELBOWROOM_CACHE"] = str(tmp_path_factory.mktemp("corpus-cache"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
