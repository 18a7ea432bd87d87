"""Shared fixtures of the framework tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in ``tmp_path``, where the frameworks write by default (``pytest.mark.usefixtures("in_tmp")``)."""
    monkeypatch.chdir(tmp_path)
