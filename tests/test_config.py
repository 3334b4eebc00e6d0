"""The configuration registry (kermac_like/config.py): one parser per type, reads at the time of
use (through the environment and through override), errors that name the switch and what it
accepts, ``python -m kermac_like config``, and no environment read anywhere else in the package."""

from __future__ import annotations

import json
import os
import pathlib
import re

import pytest

from kermac_like import config
from kermac_like.__main__ import main

PACKAGE = pathlib.Path(config.__file__).resolve().parent


@pytest.mark.parametrize("text,want", [("1", True), ("true", True), ("YES", True), (" On ", True), ("0", False),
                                       ("false", False), ("No", False), ("OFF", False), ("", False)])
def test_booleans_parse_one_way(monkeypatch, text, want):
    monkeypatch.setenv("KERMAC_LIKE_DEBUG", text)
    assert config.get("debug") is want
    monkeypatch.setenv("KERMAC_LIKE_GP_TC", text)  # default on: "" keeps it
    assert config.get("gp_tc") is (want or text == "")


def test_debug_false_is_off_everywhere(monkeypatch):
    """KERMAC_LIKE_DEBUG=false used to turn linalg's debug output on (it only tested for "" and "0")."""
    from kermac_like.ops import linalg

    monkeypatch.setenv("KERMAC_LIKE_DEBUG", "false")
    assert not config.get("debug") and not linalg._debug_on(False)
    monkeypatch.setenv("KERMAC_LIKE_DEBUG", "on")
    assert config.get("debug") and linalg._debug_on(False)


@pytest.mark.parametrize("name,text", [("debug", "maybe"), ("prepare", "2"), ("linalg_streams", "0"),
                                       ("linalg_streams", "many"), ("cache_max_bytes", "lots"), ("wgmma", "sometimes"),
                                       ("topk_mma_version", "7")])
def test_invalid_environment_value_names_the_switch_at_first_read(monkeypatch, name, text):
    env = config.SETTINGS[name].env
    monkeypatch.setenv(env, text)
    with pytest.raises(ValueError, match=re.escape(env)) as caught:
        config.get(name)
    assert config.SETTINGS[name].accepted in str(caught.value) and repr(text) in str(caught.value)


def test_typed_values(monkeypatch):
    for text, want in (("12345", 12345), ("3G", 3 * 1024**3), ("512MiB", 512 * 1024**2), ("64 kb", 64 * 1024)):
        monkeypatch.setenv("KERMAC_LIKE_CACHE_MAX_BYTES", text)
        assert config.get("cache_max_bytes") == want
    for text, want in (("1", "on"), ("yes", "on"), ("0", "off"), ("Off", "off"), ("always", "always")):
        monkeypatch.setenv("KERMAC_LIKE_WGMMA", text)
        assert config.get("wgmma") == want
    monkeypatch.setenv("KERMAC_LIKE_TOPK_MMA_VERSION", "5")
    assert config.get("topk_mma_version") == 5
    monkeypatch.setenv("KERMAC_LIKE_LINALG_STREAMS", "3")
    assert config.get("linalg_streams") == 3
    monkeypatch.setenv("KERMAC_LIKE_BUNDLE", os.pathsep.join(["/a", "", "~/b"]))
    assert config.get("bundle") == ("/a", "~/b")
    monkeypatch.delenv("KERMAC_LIKE_BUNDLE")
    assert config.get("bundle") == ()


def test_environment_read_at_the_time_of_use(monkeypatch):
    monkeypatch.delenv("KERMAC_LIKE_KMEANS_BOUNDS", raising=False)
    assert config.get("kmeans_bounds") is True
    monkeypatch.setenv("KERMAC_LIKE_KMEANS_BOUNDS", "0")
    assert config.get("kmeans_bounds") is False
    monkeypatch.setenv("KERMAC_LIKE_KMEANS_BOUNDS", "1")
    assert config.get("kmeans_bounds") is True


def test_override_scopes_over_the_environment(monkeypatch):
    monkeypatch.setenv("KERMAC_LIKE_WGMMA", "0")
    monkeypatch.setenv("KERMAC_LIKE_LINALG_STREAMS", "4")
    with config.override(wgmma="always", linalg_streams="2", kmeans_local=True):
        assert (config.get("wgmma"), config.get("linalg_streams"), config.get("kmeans_local")) == ("always", 2, "on")
        with config.override(wgmma=True, linalg_streams=None):  # None: the default, whatever the environment says
            assert config.get("wgmma") == "on" and config.get("linalg_streams") == 16
        assert config.get("wgmma") == "always" and config.get("linalg_streams") == 2
    assert config.get("wgmma") == "off" and config.get("linalg_streams") == 4 and config.get("kmeans_local") == "auto"


def test_override_rejects_before_changing_anything():
    with pytest.raises(ValueError, match="'no_such_switch' is not a setting.*kmeans_local"):
        with config.override(no_such_switch=1):
            pass
    for bad in (dict(debug="maybe"), dict(debug=2), dict(wgmma="sometimes"), dict(topk_mma_version=7),
                dict(linalg_streams=0), dict(cache_max_bytes=-1), dict(bundle=3), dict(distance_tune="text")):
        (name, value), = bad.items()
        with pytest.raises(ValueError, match=re.escape(config.SETTINGS[name].env)) as caught:
            with config.override(kmeans_local=True, **bad):
                pass
        assert config.SETTINGS[name].accepted in str(caught.value)
        assert config.get("kmeans_local") == "auto"  # the valid part of the call was not applied
    with pytest.raises(ValueError, match="not a setting"):
        config.get("no_such_switch")


def test_settings_fixture_restores(settings):
    settings(debug=True, grad_mma="0")
    assert config.get("debug") is True and config.get("grad_mma") is False
    settings(debug=False)
    assert config.get("debug") is False


def test_settings_fixture_restored_after_the_test():
    assert "debug" not in config._overrides and "grad_mma" not in config._overrides


def test_describe_and_cli(monkeypatch, capsys):
    monkeypatch.setenv("KERMAC_LIKE_LSE_EXPAND", "off")
    monkeypatch.delenv("KERMAC_LIKE_AUTOTUNE", raising=False)
    with config.override(kmeans_bounds=False):
        rows = {r["name"]: r for r in config.describe()}
    assert set(rows) == set(config.SETTINGS)
    assert (rows["lse_expand"]["value"], rows["lse_expand"]["source"]) == (False, "env")
    assert (rows["kmeans_bounds"]["value"], rows["kmeans_bounds"]["source"]) == (False, "override")
    assert (rows["autotune"]["value"], rows["autotune"]["source"]) == (False, "default")
    assert all(r["doc"] for r in rows.values())

    assert main(["config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(config.SETTINGS)
    line = next(ln for ln in lines if ln.startswith("KERMAC_LIKE_LSE_EXPAND "))
    assert line.split()[1:3] == ["False", "env"] and config.SETTINGS["lse_expand"].doc in line
    assert main(["config", "--json"]) == 0
    out = {r["env"]: r for r in json.loads(capsys.readouterr().out)}
    assert out["KERMAC_LIKE_CACHE_MAX_BYTES"]["value"] == 2 * 1024**3
    assert out["KERMAC_LIKE_WGMMA"]["accepted"].startswith("off (or 0/false/no)")


def test_no_environment_read_outside_the_registry():
    """kermac_like/config.py is the only module of the package that reads the environment, and every
    KERMAC_LIKE_* name the package's Python mentions is declared in it."""
    reads = re.compile(r"\bos\.environ\b|\bgetenv\b|\bputenv\b|\benviron\[|from os import .*environ")
    declared = {s.env for s in config.SETTINGS.values()}
    found, undeclared = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(PACKAGE.parent)
        if path.name != "config.py" or path.parent != PACKAGE:
            found += [f"{rel}:{n}" for n, line in enumerate(text.splitlines(), 1) if reads.search(line)]
        names = re.findall(r"KERMAC_LIKE_[A-Z0-9_]+(?![A-Z0-9_<])", text)  # not KERMAC_LIKE_GP_<NAME>
        undeclared += [f"{rel}: {m}" for m in names if m.rstrip("_") not in declared]
    assert not found, found
    assert not undeclared, undeclared
