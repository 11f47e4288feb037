"""Every registered KVSTRATA_* variable is read by the code (a documented switch that nothing
reads is a lie), and every KVSTRATA_* name the code mentions is registered."""
from __future__ import annotations

import logging
import re
from pathlib import Path

from kvstrata import envs
from kvstrata.config.resolve import log_resolutions
from kvstrata.config.resolve_types import Resolution

SRC = Path(envs.__file__).parent


def _sources() -> dict[Path, str]:
    return {p: p.read_text() for p in SRC.rglob("*.py") if p.name != "envs.py"}


def test_every_registered_variable_is_read_somewhere():
    text = "\n".join(_sources().values())
    unread = [name for name in envs.REGISTRY
              if f"envs.{name}" not in text and f'"{name}"' not in text]
    assert unread == [], f"registered but read by nothing: {unread}"


def test_every_mentioned_variable_is_registered():
    mentioned = set()
    for text in _sources().values():
        mentioned |= set(re.findall(r"\bKVSTRATA_[A-Z0-9_]+\b", text))
    assert sorted(mentioned - set(envs.REGISTRY)) == []


def test_log_resolutions_switch(monkeypatch, caplog):
    info = Resolution("page_size", 1, 16, "some.rule", "because")
    warn = Resolution("hicache_io_backend", "kernel", "direct", "R1", "rewritten", warning=True)
    log = logging.getLogger("test_envs_used")
    for value, expected in (("1", 2), ("0", 1)):
        monkeypatch.setenv("KVSTRATA_LOG_RESOLUTIONS", value)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="test_envs_used"):
            log_resolutions([info, warn], log)
        assert len(caplog.records) == expected, value
        assert caplog.records[-1].levelno == logging.WARNING
