"""flowgrpo.plugins: an entry-point group read without importing anything, loaded one name at a time, a broken entry
point named in its error only when it is loaded, and the built-in fallback of a source tree that was never installed.

The entry points are those of a real distribution (a ``*.dist-info`` folder with ``entry_points.txt``) put on
``sys.path``, read by ``importlib.metadata`` as an installed package's would be."""

from __future__ import annotations

import sys

import pytest

from flowgrpo.plugins import PluginError, PluginGroup

GROUP = "flowgrpo_test.plugins"


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A distribution declaring three entry points in GROUP: a module, a module's attribute, and a missing module."""
    dist = tmp_path / "plugin_demo-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-demo\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{GROUP}]\nwhole = plugin_demo_mod\npart = plugin_demo_mod:VALUE\nbroken = plugin_demo_missing\n")
    (tmp_path / "plugin_demo_mod.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("plugin_demo_mod", None)


def test_names_import_nothing_and_each_name_loads_alone(site):
    group = PluginGroup(GROUP)
    assert group.names() == ["whole", "part", "broken"] and "part" in group and "other" not in group
    assert "plugin_demo_mod" not in sys.modules
    assert group.load("part") == 42 and group.is_loaded("part") and not group.is_loaded("whole")
    assert group.load("whole") is sys.modules["plugin_demo_mod"]
    with pytest.raises(KeyError, match="'other'.*declared: whole, part, broken"):
        group.load("other")


def test_a_broken_entry_point_fails_only_when_loaded_and_is_named(site):
    group = PluginGroup(GROUP)
    assert group.load("part") == 42  # the broken neighbour is never touched
    with pytest.raises(PluginError) as info:
        group.load("broken")
    err = info.value
    assert (err.group, err.name, err.value, err.distribution) == (GROUP, "broken", "plugin_demo_missing",
                                                                  "plugin-demo 1.0")
    assert isinstance(err.error, ModuleNotFoundError) and err.__cause__ is err.error
    message = str(err)
    for part in ("'broken'", "broken = plugin_demo_missing", "plugin-demo 1.0", "ModuleNotFoundError",
                 "plugin_demo_missing", "pip uninstall plugin-demo"):
        assert part in message, (part, message)
    assert group.load_all() == {"part": 42, "whole": sys.modules["plugin_demo_mod"]}
    assert list(group.failures) == ["broken"]


def test_the_builtin_entry_points_stand_in_only_when_none_is_installed(site):
    alone = PluginGroup("flowgrpo_test.nothing_installed", builtin={"json": "json", "dumps": "json:dumps"})
    assert alone.names() == ["json", "dumps"]
    import json

    assert alone.load("dumps") is json.dumps
    installed = PluginGroup(GROUP, builtin={"extra": "plugin_demo_mod:VALUE"})  # its package is installed: no fallback
    assert "extra" not in installed.names()
