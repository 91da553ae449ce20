"""Plugin discovery through real mechanisms: an installed entry point, a plugins folder."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import run_cli

from receipt_embed import hookspecs, plugin_manager
from receipt_embed.plugin_manager import PluginLoader, PluginLoadError, PluginLoadWarning
from receipt_embed.registry import ComponentError, Registry

REPO = Path(__file__).resolve().parents[1]

TINY_PLUGIN = '''
"""A tiny third-party plugin providing one sampler."""
from receipt_embed.hookspecs import hookimpl

def build(identities, batch_size, seed, **params):
    return [list(range(batch_size))]

@hookimpl
def register_samplers(register):
    register("tiny_sampler", build, description="from an installed package")
'''


@pytest.fixture(scope="session")
def installed_plugin(tmp_path_factory) -> Path:
    """pip-install a tiny plugin package (with a ``receipt_embed`` entry point) into a
    target folder; returns the folder to put on PYTHONPATH."""
    src = tmp_path_factory.mktemp("tiny_src")
    (src / "tiny_receipt_plugin.py").write_text(TINY_PLUGIN)
    (src / "pyproject.toml").write_text(
        textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "tiny-receipt-plugin"
        version = "0.3.1"
        [project.entry-points.receipt_embed]
        tiny = "tiny_receipt_plugin"
        [tool.setuptools]
        py-modules = ["tiny_receipt_plugin"]
    """)
    )
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(src),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return target


def _plugins_json(cli, tmp_path, env=None, plugins_dir=None, extra=()):
    args = ["--plugins-dir", plugins_dir or tmp_path / "no-plugins", *extra, "plugins", "--json"]
    return cli(*args, cwd=tmp_path, env=env)


def _write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def test_builtins_listed_like_plugins(cli, tmp_path):
    result = _plugins_json(cli, tmp_path)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    builtins = {p["name"]: p for p in info["plugins"] if p["source"] == "builtin"}
    assert {"builtin.encoders", "builtin.augmentations"} <= set(builtins)
    encoders = {c["name"] for c in builtins["builtin.encoders"]["components"] if c["kind"] == "encoder"}
    assert {
        "resnet18",
        "resnet50",
        "mobilenet_v3_small",
        "mobilenet_v3_large",
        "efficientnet_b0",
        "convnext_tiny",
    } <= encoders


def test_entry_point_plugin_discovered(cli, tmp_path, installed_plugin):
    result = _plugins_json(cli, tmp_path, env={"PYTHONPATH": str(installed_plugin)})
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    tiny = plugins["tiny"]
    assert tiny["source"] == "entry point"
    assert tiny["version"] == "0.3.1"
    assert "tiny-receipt-plugin" in tiny["location"]
    assert tiny["components"] == [
        {"kind": "sampler", "name": "tiny_sampler", "description": "from an installed package"}
    ]
    # the human listing shows it too
    text = cli("--plugins-dir", tmp_path / "none", "plugins", cwd=tmp_path, env={"PYTHONPATH": str(installed_plugin)})
    assert "tiny 0.3.1  [entry point: tiny-receipt-plugin" in text.stdout
    assert "tiny_sampler" in text.stdout


def test_disabled_plugin_is_not_loaded(cli, tmp_path, installed_plugin):
    env = {"PYTHONPATH": str(installed_plugin), "RECEIPT_EMBED_DISABLE_PLUGINS": "tiny, builtin.augmentations"}
    names = {p["name"] for p in json.loads(_plugins_json(cli, tmp_path, env=env).stdout)["plugins"]}
    assert "tiny" not in names and "builtin.augmentations" not in names
    assert "builtin.encoders" in names


def test_folder_plugin_loaded_after_entry_points(cli, tmp_path, installed_plugin):
    folder = tmp_path / "myplugins"
    _write(
        folder,
        "shop_sampler.py",
        """
        __version__ = "1.2"
        from receipt_embed.hookspecs import hookimpl

        @hookimpl
        def register_samplers(register):
            register("by_shop", lambda identities, batch_size, seed: [], description="folder plugin")
    """,
    )
    _write(folder, "_private.py", "raise RuntimeError('files starting with _ are not plugins')\n")
    result = _plugins_json(cli, tmp_path, env={"PYTHONPATH": str(installed_plugin)}, plugins_dir=folder)
    assert result.returncode == 0, result.stderr
    plugins = json.loads(result.stdout)["plugins"]
    order = [p["name"] for p in plugins]
    assert order.index("builtin.encoders") < order.index("tiny") < order.index("shop_sampler")
    shop = plugins[order.index("shop_sampler")]
    assert shop["source"] == "folder" and shop["version"] == "1.2"
    assert shop["location"] == str(folder / "shop_sampler.py")
    assert shop["components"][0]["name"] == "by_shop"


def test_default_plugins_folder_is_cwd_plugins(cli, tmp_path):
    _write(
        tmp_path / "plugins",
        "here.py",
        """
        from receipt_embed.hookspecs import hookimpl
        @hookimpl
        def register_losses(register):
            register("here_loss", lambda **p: None)
    """,
    )
    result = cli("plugins", "--json", cwd=tmp_path)
    assert "here" in {p["name"] for p in json.loads(result.stdout)["plugins"]}


BROKEN = "import not_a_real_module_xyz\n"
GOOD = """
from receipt_embed.hookspecs import hookimpl
@hookimpl
def register_losses(register):
    register("good_loss", lambda **p: None)
"""


def test_broken_plugin_warns_and_others_load(cli, tmp_path):
    folder = tmp_path / "p"
    _write(folder, "broken.py", BROKEN)
    _write(folder, "good.py", GOOD)
    result = _plugins_json(cli, tmp_path, plugins_dir=folder)
    assert result.returncode == 0, result.stderr
    assert "Warning: plugin 'broken' failed to load and was skipped" in result.stderr
    assert "plugin_manager.py" not in result.stderr  # a message, not a source location
    assert "not_a_real_module_xyz" in result.stderr
    info = json.loads(result.stdout)
    assert "good" in {p["name"] for p in info["plugins"]}
    assert info["failed"][0]["name"] == "broken"


def test_broken_plugin_is_fatal_when_strict(cli, tmp_path):
    folder = tmp_path / "p"
    _write(folder, "broken.py", BROKEN)
    result = _plugins_json(cli, tmp_path, plugins_dir=folder, extra=["--strict-plugins"])
    assert result.returncode == 2
    assert (
        "plugin 'broken' failed to load (--strict-plugins): ModuleNotFoundError: No module named 'not_a_real_module_xyz'"
        in result.stderr
    )


def test_plugin_whose_hook_raises_is_skipped_whole(tmp_path):
    _write(
        tmp_path,
        "half.py",
        """
        from receipt_embed.hookspecs import hookimpl
        @hookimpl
        def register_losses(register):
            register("half_loss", lambda **p: None)
            raise RuntimeError("boom after one registration")
    """,
    )
    loader = PluginLoader()
    loader.load_folder(tmp_path)
    with pytest.warns(PluginLoadWarning, match="plugin 'half' failed to load.*boom after one registration"):
        loader.collect_components()
    assert "half_loss" not in loader.registry.components["loss"]
    assert "half" not in loader.registry.plugins


def test_name_clash_names_both_plugins(cli, tmp_path):
    folder = tmp_path / "p"
    _write(
        folder,
        "my_resnet.py",
        """
        from receipt_embed.hookspecs import hookimpl
        @hookimpl
        def register_encoders(register):
            register("resnet18", lambda **p: None)
    """,
    )
    result = _plugins_json(cli, tmp_path, plugins_dir=folder)
    assert result.returncode == 2
    assert (
        "encoder 'resnet18' is registered by two plugins: 'builtin.encoders' and 'my_resnet'; leave one out: "
        "skip it with RECEIPT_EMBED_DISABLE_PLUGINS=my_resnet"
    ) in result.stderr
    # disabling one of them resolves it
    ok = _plugins_json(cli, tmp_path, plugins_dir=folder, env={"RECEIPT_EMBED_DISABLE_PLUGINS": "builtin.encoders"})
    assert ok.returncode == 0, ok.stderr


def test_unknown_component_lists_available_names():
    registry = Registry()
    registry.add("encoder", "builtin.encoders", "resnet18", lambda **p: "r18")
    registry.add("encoder", "builtin.encoders", "resnet50", lambda **p: "r50")
    with pytest.raises(ComponentError) as info:
        registry.create("encoder", "resnet19")
    assert str(info.value) == (
        "unknown encoder 'resnet19'. Available: resnet18, resnet50. Did you mean 'resnet18'? "
        "(From a plugin? `receipt-embed plugins` lists what loads here, from ./plugins or --plugins-dir.)"
    )
    assert registry.create("encoder", "resnet50") == "r50"


def test_bad_component_params_name_the_component():
    registry = Registry()
    registry.add("loss", "someplugin", "mine", lambda temperature: temperature)
    with pytest.raises(
        ComponentError, match=r"loss 'mine' \(from plugin 'someplugin'\): .*unexpected keyword argument 'tau'"
    ):
        registry.create("loss", "mine", tau=0.1)


def test_strict_loader_raises_plugin_load_error(tmp_path):
    _write(tmp_path, "broken.py", BROKEN)
    loader = PluginLoader(strict=True)
    with pytest.raises(PluginLoadError, match="broken"):
        loader.load_folder(tmp_path)


def test_every_hookspec_documented_with_its_signature():
    """docs/plugins.md has a reference heading per hook with its exact signature, and the
    README's summary table names each one the same way."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Writing plugins") :]
    guide = (REPO / "docs" / "plugins.md").read_text()
    specs = [
        name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(fn, "receipt_embed_spec")
    ]
    assert len(specs) == 7
    for name in specs:
        signature = f"{name}{inspect.signature(getattr(hookspecs, name))}"
        assert f"### `{signature}`" in guide, f"docs/plugins.md lacks a reference heading for {signature}"
        assert f"`{signature}`" in section, f"README 'Writing plugins' lacks the signature {signature}"
    assert f"`receipt_embed.hookspecs.HOOKSPEC_VERSION` (now `{hookspecs.HOOKSPEC_VERSION}`)" in guide


def _hooks_marked_in_tests() -> dict[str, list[str]]:
    """hook name -> tests decorated with ``@pytest.mark.hook(name)`` in tests/test_*.py."""
    import ast

    marked: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            for decorator in node.decorator_list:
                if isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "pytest.mark.hook":
                    for arg in decorator.args:
                        marked.setdefault(arg.value, []).append(f"{path.name}::{node.name}")
    return marked


def test_every_hookspec_has_a_test():
    """Each hook in receipt_embed.hookspecs has a test marked ``@pytest.mark.hook(NAME)``, and
    every marked name is a real hook (a renamed hook cannot keep a stale test)."""
    specs = {
        name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(fn, "receipt_embed_spec")
    }
    marked = _hooks_marked_in_tests()
    assert {"on_epoch_end", "register_audit_checks"} <= specs
    assert not specs - set(marked), f"hooks without a test marked @pytest.mark.hook: {sorted(specs - set(marked))}"
    assert not set(marked) - specs, f"tests marked for hooks that do not exist: {sorted(set(marked) - specs)}"


@pytest.mark.hook("register_samplers")
def test_sampler_factory_declaring_metadata_receives_the_manifest_rows(tmp_path):
    from receipt_embed.sampling import build_sampler

    _write(
        tmp_path,
        "meta.py",
        """
        from receipt_embed.hookspecs import hookimpl

        def with_metadata(identities, batch_size, seed, metadata, column="merchant"):
            return {"identities": identities, "values": [row[column] for row in metadata]}

        def without_metadata(identities, batch_size, seed, **params):
            return {"params": params}

        @hookimpl
        def register_samplers(register):
            register("with_metadata", with_metadata)
            register("without_metadata", without_metadata)
    """,
    )
    loader = PluginLoader()
    loader.load_folder(tmp_path)
    loader.collect_components()
    rows = [{"path": f"{i}.jpg", "receipt_id": f"r{i // 2}", "merchant": f"m{i // 4}"} for i in range(8)]
    labels = [i // 2 for i in range(8)]
    got = build_sampler(loader.registry, "with_metadata", labels, rows, 2, 0, {})
    assert got == {"identities": labels, "values": ["m0"] * 4 + ["m1"] * 4}
    assert (
        build_sampler(loader.registry, "with_metadata", labels, rows, 2, 0, {"column": "receipt_id"})["values"][2]
        == "r1"
    )
    # a factory that does not declare metadata is called exactly as before (no surprise keyword)
    assert build_sampler(loader.registry, "without_metadata", labels, rows, 2, 0, {"k": 3}) == {"params": {"k": 3}}


@pytest.mark.hook("register_losses")
@pytest.mark.hook("register_encoders")
@pytest.mark.hook("register_augmentations")
@pytest.mark.hook("register_samplers")
@pytest.mark.hook("register_verifiers")
def test_folder_plugin_can_implement_every_register_hook(tmp_path):
    _write(
        tmp_path,
        "everything.py",
        """
        from receipt_embed.hookspecs import hookimpl

        @hookimpl
        def register_losses(register):
            register("l1_loss", lambda scale=1.0: ("loss", scale))

        @hookimpl
        def register_encoders(register):
            register("tiny_cnn", lambda **params: ("encoder", params))

        @hookimpl
        def register_augmentations(register):
            register("flip", lambda image_size, **params: ("augmentation", tuple(image_size)))

        @hookimpl
        def register_samplers(register):
            register("every_other", lambda identities, batch_size, seed: ("sampler", batch_size))

        @hookimpl
        def register_verifiers(register):
            register("same_total", lambda column="total": ("verifier", column))
    """,
    )
    loader = PluginLoader()
    loader.load_builtins()
    loader.load_folder(tmp_path)
    loader.collect_components()
    registry = loader.registry
    assert registry.create("loss", "l1_loss", scale=2.0) == ("loss", 2.0)
    assert registry.create("encoder", "tiny_cnn", depth=3) == ("encoder", {"depth": 3})
    assert registry.create("augmentation", "flip", image_size=[8, 4]) == ("augmentation", (8, 4))
    assert registry.create("sampler", "every_other", identities=[], batch_size=4, seed=0) == ("sampler", 4)
    assert registry.create("verifier", "same_total", column="amount") == ("verifier", "amount")
    assert {
        c.plugin
        for kind in registry.components.values()
        for c in kind.values()
        if c.name in {"l1_loss", "tiny_cnn", "flip", "every_other", "same_total"}
    } == {"everything"}


def test_plugin_registering_a_name_twice(tmp_path):
    _write(
        tmp_path,
        "twice.py",
        """
        from receipt_embed.hookspecs import hookimpl
        @hookimpl
        def register_encoders(register):
            register("same", lambda **p: None)
            register("same", lambda **p: None)
    """,
    )
    loader = PluginLoader()
    loader.load_folder(tmp_path)
    with pytest.warns(PluginLoadWarning, match="plugin 'twice' failed to load.*registers encoder 'same' twice"):
        loader.collect_components()
    assert "same" not in loader.registry.names("encoder") and "twice" not in loader.registry.plugins


def test_misconfigured_discovery_is_reported(cli, tmp_path):
    result = cli(
        "--plugins-dir",
        tmp_path / "nope",
        "plugins",
        cwd=tmp_path,
        env={"RECEIPT_EMBED_DISABLE_PLUGINS": "builtin.encoders,typo_plugin"},
    )
    assert result.returncode == 0
    assert f"Warning: plugins folder {tmp_path / 'nope'} does not exist" in result.stderr
    assert "RECEIPT_EMBED_DISABLE_PLUGINS names 'typo_plugin', which is not a plugin here" in result.stderr
    assert "builtin.encoders" not in result.stderr  # a real plugin name is not a typo
    quiet = cli("plugins", cwd=tmp_path)  # the default ./plugins may be absent silently
    assert "Warning" not in quiet.stderr


def test_plugins_dir_from_config(cli, tmp_path):
    _write(tmp_path / "elsewhere", "cfg_plugin.py", GOOD)
    result = cli("plugins", "--json", "--set", f"plugins.dir={tmp_path / 'elsewhere'}", cwd=tmp_path)
    assert "cfg_plugin" in {p["name"] for p in json.loads(result.stdout)["plugins"]}


EMPTY_PLUGINS_DIR = (
    "Error: config key 'plugins.dir'{source}: an empty folder name, which reads as the current directory; "
    "name the plugins folder, or leave plugins.dir out (null) for ./plugins\n"
)


def test_empty_plugins_dir_in_config_is_refused(cli, tmp_path):
    """Attack round 17 G3: plugins.dir set to "" (a --set or a config file) imported every *.py in the
    current directory, since an empty path resolves to "."; it is refused naming the key, nothing imported."""
    _write(tmp_path, "stray.py", "open('imported', 'w').close()\n")
    (tmp_path / "empty.yaml").write_text('plugins:\n  dir: ""\n')
    for args, source in (
        (["--set", 'plugins.dir=""'], ""),
        (["--set", "plugins.dir=''"], ""),
        (["--config", "empty.yaml"], " (from config file empty.yaml)"),
    ):
        result = cli("plugins", *args, cwd=tmp_path)
        assert (result.returncode, result.stdout) == (2, ""), result
        assert result.stderr == EMPTY_PLUGINS_DIR.format(source=source)
    assert not (tmp_path / "imported").exists()


def test_empty_plugins_dir_in_library_calls_is_refused(tmp_path, monkeypatch):
    """Attack round 17 G3: get_registry(plugins_dir="") (and create_loss's) imported the current
    directory's *.py files; an empty name is refused, None still means no folder."""
    import receipt_embed
    from receipt_embed.errors import BadInput

    _write(tmp_path, "stray.py", "open('imported', 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    message = "plugins_dir is empty, which reads as the current directory; name the plugins folder, or pass None"
    for call in (
        lambda: plugin_manager.get_registry(plugins_dir=""),
        lambda: plugin_manager.get_plugin_manager(plugins_dir=b""),
        lambda: receipt_embed.create_loss("ntxent", plugins_dir=""),
    ):
        with pytest.raises(BadInput) as raised:
            call()
        assert str(raised.value) == message
    assert "stray" not in plugin_manager.get_registry(plugins_dir=None).plugins
    assert not (tmp_path / "imported").exists()


def test_discovery_happens_once_per_process(tmp_path, monkeypatch):
    """Every command asks for the registry; plugins are discovered the first time only, and
    the plugin manager the hooks are called through is the one that discovery built."""
    from receipt_embed import plugin_loader, plugin_manager

    calls = []
    real = plugin_loader.entry_points

    def counting(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(plugin_loader, "entry_points", counting)
    plugin_manager._load.cache_clear()
    try:
        first = plugin_manager.get_registry(tmp_path)
        again = [plugin_manager.get_registry(tmp_path) for _ in range(3)]
        pm = plugin_manager.get_plugin_manager(tmp_path)
        assert all(r is first for r in again) and pm is first.plugin_manager
        assert calls == [{"group": "receipt_embed"}]
        (tmp_path / "other").mkdir()
        plugin_manager.get_registry(tmp_path / "other")  # another folder is another discovery
        assert len(calls) == 2
    finally:
        plugin_manager._load.cache_clear()


def _loaded(folder: Path, strict: bool = False):
    loader = PluginLoader(strict=strict)
    loader.load_builtins()
    loader.load_folder(folder)
    loader.collect_components()
    return loader.registry


def test_unusable_registrations_skip_that_plugin_only(tmp_path):
    _write(
        tmp_path,
        "not_callable.py",
        """
        from receipt_embed.hookspecs import hookimpl
        @hookimpl
        def register_losses(register):
            register("fine_before", lambda temperature=0.1: None)
            register("notcallable", 42)
    """,
    )
    _write(
        tmp_path,
        "spaced.py",
        """
        from receipt_embed.hookspecs import hookimpl
        @hookimpl
        def register_losses(register):
            register("My Loss", lambda temperature=0.1: None)
    """,
    )
    _write(
        tmp_path,
        "wrong_keyword.py",
        """
        from receipt_embed.hookspecs import hookimpl
        @hookimpl
        def register_losses(register):
            register("kw", lambda temperature=0.1: None, desc="typo for description")
    """,
    )
    _write(
        tmp_path,
        "good.py",
        """
        from receipt_embed.hookspecs import hookimpl
        @hookimpl
        def register_losses(register):
            register("good_loss", lambda temperature=0.1: None)
    """,
    )
    with pytest.warns(PluginLoadWarning) as caught:
        registry = _loaded(tmp_path)
    messages = "\n".join(str(w.message) for w in caught)
    assert (
        "plugin 'not_callable' failed to load" in messages and "with a factory that is not callable (int)" in messages
    )
    assert "invalid name 'My Loss' (letters, digits, '_', '-', '.'; no spaces)" in messages
    assert "register(name, factory, description=''): got an unexpected keyword argument 'desc'" in messages
    assert "<locals>" not in messages
    # the broken plugins are gone whole (fine_before too), the good one stays
    assert "good_loss" in registry.names("loss")
    assert not {"fine_before", "notcallable", "kw", "My Loss"} & set(registry.names("loss"))
    assert set(registry.failures) == {"not_callable", "spaced", "wrong_keyword"}
    with pytest.raises(PluginLoadError, match="not_callable"):
        _loaded(tmp_path, strict=True)


def test_misspelled_or_undecorated_hooks_are_reported(tmp_path):
    _write(
        tmp_path,
        "misspelled.py",
        """
        from receipt_embed.hookspecs import hookimpl
        @hookimpl
        def register_loss(register):
            register("x", lambda temperature=0.1: None)
    """,
    )
    _write(
        tmp_path,
        "undecorated.py",
        """
        def register_losses(register):
            register("forgot_decorator", lambda temperature=0.1: None)
    """,
    )
    with pytest.warns(PluginLoadWarning) as caught:
        registry = _loaded(tmp_path)
    messages = "\n".join(str(w.message) for w in caught)
    assert (
        "plugin 'misspelled' failed to load and was skipped: ValueError: @hookimpl function 'register_loss' is "
        "not a receipt-embed hook (did you mean 'register_losses'?)"
    ) in messages
    assert "plugin 'undecorated' defines register_losses() without @hookimpl, so it is ignored" in messages
    assert "undecorated" in registry.plugins and "forgot_decorator" not in registry.names("loss")


@pytest.mark.hook("on_epoch_end")
def test_hook_wrappers_are_refused_at_load_time(tmp_path):
    """Hooks are called one plugin at a time (so one failure cannot stop the others), which
    would silently skip a wrapper's body; a wrapper is refused by name when it loads."""
    from receipt_embed.plugin_manager import PluginLoader, PluginLoadError, call_hook

    for name, flag in (("wraps", "wrapper=True"), ("old_style", "hookwrapper=True")):
        _write(
            tmp_path,
            f"{name}.py",
            f"""
            from receipt_embed.hookspecs import hookimpl
            CALLS = []
            @hookimpl({flag})
            def on_epoch_end(epoch, metrics):
                CALLS.append(epoch)
                return (yield)
        """,
        )
    _write(
        tmp_path,
        "plain.py",
        """
        from receipt_embed.hookspecs import hookimpl
        @hookimpl
        def on_epoch_end(epoch):
            return epoch * 10
    """,
    )
    with pytest.warns(PluginLoadWarning) as caught:
        registry = _loaded(tmp_path)
    messages = "\n".join(str(w.message) for w in caught)
    for name, flag in (("wraps", "wrapper=True"), ("old_style", "hookwrapper=True")):
        assert (
            f"plugin {name!r} failed to load and was skipped: ValueError: on_epoch_end() is a hook wrapper ({flag}); "
            "receipt-embed calls each plugin's hooks on their own"
        ) in messages, messages
        assert name not in registry.plugins
    assert call_hook(registry, "on_epoch_end", epoch=3, metrics={}, run_dir=tmp_path, model=None) == {"plain": 30}

    loader = PluginLoader(strict=True)
    with pytest.raises(PluginLoadError, match=r"plugin 'old_style' failed to load \(--strict-plugins\).*wrapper"):
        loader.load_folder(tmp_path)


def test_folder_plugins_share_helpers_through_relative_imports(tmp_path):
    _write(
        tmp_path,
        "_shared.py",
        """
        SCALE = 3.0
    """,
    )
    _write(
        tmp_path,
        "uses_helper.py",
        """
        from receipt_embed.hookspecs import hookimpl
        from ._shared import SCALE

        @hookimpl
        def register_losses(register):
            register("scaled", lambda temperature=0.1: SCALE)
    """,
    )
    registry = _loaded(tmp_path)
    assert registry.create("loss", "scaled") == 3.0
    assert "_shared" not in registry.plugins  # helpers are not plugins
    # another folder with its own _shared.py: each plugin sees its own folder's helper
    _write(tmp_path / "other", "_shared.py", "SCALE = 7.0\n")
    _write(
        tmp_path / "other",
        "uses_other.py",
        """
        from ._shared import SCALE
    """,
    )
    from receipt_embed.testing import load_plugin

    assert load_plugin(tmp_path / "uses_helper.py").SCALE == 3.0
    assert load_plugin(tmp_path / "other" / "uses_other.py").SCALE == 7.0
    assert load_plugin(tmp_path / "uses_helper.py").SCALE == 3.0


def test_bad_parameters_and_factory_bugs_name_the_component(tmp_path):
    _write(
        tmp_path,
        "buggy.py",
        """
        from receipt_embed.hookspecs import hookimpl

        def build(temperature=0.1, margin=0.2):
            return {}["missing"]

        @hookimpl
        def register_losses(register):
            register("buggy", build)
    """,
    )
    registry = _loaded(tmp_path)
    with pytest.raises(
        ComponentError,
        match=r"loss 'buggy' \(from plugin 'buggy'\): .*unexpected keyword argument "
        r"'marign'; its loss.params may set margin \(did you mean 'margin' for 'marign'\?\)",
    ):
        registry.create("loss", "buggy", marign=0.3)
    with pytest.raises(
        ComponentError, match=r"loss 'buggy' \(from plugin 'buggy'\) failed to build: KeyError: 'missing'"
    ):
        registry.create("loss", "buggy")


def test_blocked_plugins_are_listed(cli, tmp_path):
    result = cli(
        "--plugins-dir",
        tmp_path / "none",
        "plugins",
        cwd=tmp_path,
        env={"RECEIPT_EMBED_DISABLE_PLUGINS": "builtin.augmentations"},
    )
    assert "blocked builtin.augmentations (RECEIPT_EMBED_DISABLE_PLUGINS)" in result.stdout
    info = json.loads(
        cli(
            "--plugins-dir",
            tmp_path / "none",
            "plugins",
            "--json",
            cwd=tmp_path,
            env={"RECEIPT_EMBED_DISABLE_PLUGINS": "builtin.augmentations"},
        ).stdout
    )
    assert info["blocked"] == ["builtin.augmentations"]


BROKEN_COMPONENTS = """
import torch
from receipt_embed.hookspecs import hookimpl

class VectorLoss(torch.nn.Module):
    def forward(self, z, labels):
        return (z ** 2).sum(dim=1)

class NoEpochs:
    def __init__(self, identities, batch_size):
        self.batches = [list(range(batch_size))]
    def __len__(self):
        return 1
    def __iter__(self):
        return iter(self.batches)

class NoFeatureDim(torch.nn.Module):
    def forward(self, x):
        return x.flatten(1)

class OneArgument(torch.nn.Module):
    def forward(self, z):
        return z.sum()

class WrongDim(torch.nn.Module):
    feature_dim = 32
    def forward(self, x):
        return x.mean(dim=(2, 3)).repeat(1, 8)  # 8 features, claims 32

class OutOfRange(NoEpochs):
    batch_layout = "any"
    def set_epoch(self, epoch):
        pass
    def __iter__(self):
        return iter([[0, 10 ** 6] * 4])

class Sideways(OutOfRange):
    batch_layout = "sideways"

class Raising(OutOfRange):
    def __iter__(self):
        yield [0, 1]  # a first batch trains, the second fails inside the plugin
        raise RuntimeError("boom in my sampler")

class FalseTwoView(OutOfRange):
    batch_layout = "two_view"
    def __iter__(self):
        return iter([list(range(8))])  # captures 0..7: not [first views; second views]

class Endless(OutOfRange):
    def __len__(self):
        return 2
    def __iter__(self):
        while True:  # never ends: the epoch stopped only at its len()
            yield [0, 1]

class Empty(OutOfRange):
    def __iter__(self):
        return iter([])

class EmptyLater(OutOfRange):
    epoch = 0
    def set_epoch(self, epoch):
        self.epoch = epoch
    def __iter__(self):
        return iter([[0, 1]] if self.epoch == 0 else [])

class ReturnsArray:
    def set_random_seed(self, seed):
        pass
    def __call__(self, image):
        return image

class HugeLength(Endless):
    def __len__(self):
        return 10 ** 12

class Width(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.feature_dim = width
        self.layer = torch.nn.Linear(1, width)
    def forward(self, x):
        return self.layer(x.mean(dim=(1, 2, 3))[:, None])

@hookimpl
def register_losses(register):
    register("vector_loss", lambda temperature=0.1: VectorLoss())
    register("one_argument", lambda temperature=0.1: OneArgument())
    register("plain_function_loss", lambda temperature=0.1: (lambda z, labels: z.sum()))


@hookimpl
def register_augmentations(register):
    register("plain_function", lambda image_size: (lambda image: {"image": image}))
    register("no_resize", lambda image_size: __import__("albumentations").Compose([]))
    register("returns_array", lambda image_size: ReturnsArray())

@hookimpl
def register_encoders(register):
    register("no_feature_dim", lambda **params: NoFeatureDim())
    register("wrong_dim", lambda **params: WrongDim())
    register("width", lambda pretrained, in_channels, pooling, grid, width=4: Width(width))

@hookimpl
def register_samplers(register):
    register("no_epochs", lambda identities, batch_size, seed: NoEpochs(identities, batch_size))
    register("out_of_range", lambda identities, batch_size, seed: OutOfRange(identities, batch_size))
    register("sideways", lambda identities, batch_size, seed: Sideways(identities, batch_size))
    register("raising", lambda identities, batch_size, seed: Raising(identities, batch_size))
    register("false_two_view", lambda identities, batch_size, seed: FalseTwoView(identities, batch_size))
    register("endless", lambda identities, batch_size, seed: Endless(identities, batch_size))
    register("empty", lambda identities, batch_size, seed: Empty(identities, batch_size))
    register("empty_later", lambda identities, batch_size, seed: EmptyLater(identities, batch_size))
    register("huge_length", lambda identities, batch_size, seed: HugeLength(identities, batch_size))
"""


@pytest.mark.parametrize(
    "setting, message",
    [
        (
            "loss.name=vector_loss",
            r"loss 'vector_loss' \(from plugin 'broken_components'\) returned \(16,\), not a scalar tensor",
        ),
        (
            "sampler.name=no_epochs",
            r"sampler 'no_epochs' \(from plugin 'broken_components'\) built a NoEpochs without set_epoch",
        ),
        (
            "augment.preset=plain_function",
            r"augmentation 'plain_function' \(from plugin 'broken_components'\) built a function "
            r"without set_random_seed",
        ),
        (
            "model.encoder=no_feature_dim",
            r"encoder 'no_feature_dim' \(from plugin 'broken_components'\) built an object of type NoFeatureDim "
            r"that is not a torch.nn.Module with an integer feature_dim",
        ),
        (
            "loss.name=one_argument",
            r"loss 'one_argument' \(from plugin 'broken_components'\) failed while computing the loss: "
            r"TypeError: .*forward\(\) takes 2 positional arguments but 3 were given at .*torch",
        ),
        (
            "loss.name=plain_function_loss",
            r"loss 'plain_function_loss' \(from plugin 'broken_components'\) built a function, "
            r"not a torch.nn.Module",
        ),
        (
            "model.encoder=wrong_dim",
            r"encoder 'wrong_dim' \(from plugin 'broken_components'\) returned \(2, 8\) for 2 images "
            r"of 1 x 64 x 32; expected \(N, feature_dim\) = \(2, 32\)",
        ),
        (
            "augment.preset=no_resize",
            r"augmentation 'no_resize' returned a uint8 \(\d+, \d+, 3\) view; views must be uint8 of "
            r"64 x 32 \(data.image_size\) x 3",
        ),
        (  # attack round 22 MB13: the error named a line of receipt-embed's own views.py
            "augment.preset=returns_array",
            r"^augmentation 'returns_array' returned a ndarray; an augmentation is called as transform\(image=\.\.\.\) "
            r"and returns a dict holding the view under 'image', as an albumentations Compose does$",
        ),
        (
            "sampler.name=out_of_range",
            r"sampler 'out_of_range' \(from plugin 'broken_components'\) yielded 1000000 in batch 1 of epoch 1; indices must be integers "
            r"in 0..143",
        ),
        (
            "sampler.name=sideways",
            r"sampler 'sideways' \(from plugin 'broken_components'\) built a Sideways whose batch_layout is "
            r"'sideways'; it must be one of two_view, any",
        ),
        (
            "sampler.name=raising",
            r"sampler 'raising' \(from plugin 'broken_components'\) failed while yielding a batch: "
            r"RuntimeError: boom in my sampler at .*broken_components.py:\d+",
        ),
        (
            "sampler.name=false_two_view",
            r"sampler 'false_two_view' \(from plugin 'broken_components'\) declares batch_layout 'two_view', "
            r"\[first views of B distinct identities; .*\], but batch 1 of epoch 1 is not: row 0 and row 4 are",
        ),
        (  # attack round 17 G5: a sampler that never stops hung the epoch
            "sampler.name=endless",
            r"^sampler 'endless' \(from plugin 'broken_components'\) yielded more than 2 batches in one epoch "
            r"\(epoch 1\), the 2 its len\(\) declares; a sampler's epoch must end after len\(sampler\) batches$",
        ),
        (  # attack round 17 G5: ... and so did one whose len() is as good as endless
            "sampler.name=huge_length",
            r"^sampler 'huge_length' \(from plugin 'broken_components'\) declares 1000000000000 batches an epoch "
            r"\(its len\(\)\), more than 14400: 100 for each of the 144 training captures$",
        ),
        (  # attack round 17 G10: a sampler that yields nothing "trained"
            "sampler.name=empty",
            r"^sampler 'empty' \(from plugin 'broken_components'\) yielded no batch in epoch 1 \(its len\(\) is 1\); "
            r"a sampler must yield at least one batch an epoch$",
        ),
        (
            "sampler.name=empty_later & train.epochs=2",
            r"^sampler 'empty_later' \(from plugin 'broken_components'\) yielded no batch in epoch 2",
        ),
        (
            "loss.name=moco & sampler.name=pk",
            r"loss 'moco' needs two-view batches, and sampler 'pk' declares batch_layout 'any'; "
            r"use sampler unique_identity",
        ),
        (
            "loss.params={temperature: 0.5}",
            r"loss.params sets 'temperature', which receipt-embed passes to loss 'supcon' itself; "
            r"remove it from loss.params \(temperature comes from loss.temperature\)",
        ),
    ],
)
def test_train_names_a_component_that_breaks_its_contract(tmp_path, setting, message):
    from conftest import TINY_TRAINING

    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest
    from receipt_embed.training.trainer import train

    _write(tmp_path / "plugins", "broken_components.py", BROKEN_COMPONENTS)
    registry = _loaded(tmp_path / "plugins")
    ingest(REPO / "data_samples", tmp_path / "ds", load_config().ingest)
    with pytest.raises((ComponentError, ValueError), match=message):
        train(
            load_config(overrides=[*TINY_TRAINING, "train.num_workers=0", *setting.split(" & ")]),
            tmp_path / "ds",
            tmp_path / "run",
            registry,
            progress=False,
            log=lambda m: None,
        )


def test_a_sampler_that_yields_no_batch_fails_train_without_a_run_dir(cli, tmp_path):
    """Attack round 17 G10: a sampler that yielded nothing printed "Trained" and exited 0, with a run
    dir of no training; now it is bad input naming the sampler (exit 2) before the run dir is made."""
    from conftest import TINY_TRAINING

    _write(tmp_path / "plugins", "broken_components.py", BROKEN_COMPONENTS)
    ingest = cli("ingest", REPO / "data_samples", "--out", tmp_path / "ds")
    assert ingest.returncode == 0, ingest.stderr
    sets = [a for key in [*TINY_TRAINING, "sampler.name=empty"] for a in ("--set", key)]
    result = cli("train", "--data", tmp_path / "ds", "--out", tmp_path / "run", *sets, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        "Error: sampler 'empty' (from plugin 'broken_components') yielded no batch in epoch 1 (its len() is 1); "
        "a sampler must yield at least one batch an epoch"
    ]
    assert "Trained" not in result.stdout and not (tmp_path / "run").exists()


def test_encoder_params_come_from_model_params(tmp_path):
    from conftest import TINY_TRAINING

    from receipt_embed.config import load_config
    from receipt_embed.models.build import build_model

    _write(tmp_path / "plugins", "broken_components.py", BROKEN_COMPONENTS)
    registry = _loaded(tmp_path / "plugins")
    model = build_model(
        load_config(overrides=[*TINY_TRAINING, "model.encoder=width", "model.params={width: 12}"]), registry
    )
    assert model.encoder.feature_dim == 12
    with pytest.raises(ComponentError, match=r"model.params may set width \(did you mean 'width' for 'widht'\?\)"):
        build_model(
            load_config(overrides=[*TINY_TRAINING, "model.encoder=width", "model.params={widht: 12}"]), registry
        )


def test_hook_arguments_and_helper_imports_get_pointed_messages(tmp_path):
    _write(
        tmp_path,
        "wrong_argument.py",
        """
        from receipt_embed.hookspecs import hookimpl
        @hookimpl
        def on_epoch_end(epoch, cfg):
            pass
    """,
    )
    _write(tmp_path, "_shared.py", "X = 1\n")
    _write(
        tmp_path,
        "absolute_helper.py",
        """
        from _shared import X
    """,
    )
    with pytest.warns(PluginLoadWarning) as caught:
        _loaded(tmp_path)
    messages = "\n".join(str(w.message) for w in caught)
    assert (
        "on_epoch_end() takes arguments named cfg; the hook offers run_dir, epoch, metrics, model, config"
    ) in messages
    assert "_shared.py is in the plugins folder: import it relatively, `from ._shared import ...`" in messages


def test_unknown_component_from_a_checkpoint_names_its_plugins_folder(tmp_path):
    from conftest import TINY_TRAINING

    from receipt_embed.config import load_config
    from receipt_embed.embedding import load_model
    from receipt_embed.ingest import ingest
    from receipt_embed.training.trainer import train

    _write(
        tmp_path / "mine",
        "enc.py",
        """
        from receipt_embed.hookspecs import hookimpl

        def build(pretrained, in_channels, pooling, grid):
            import torch

            class Tiny(torch.nn.Module):
                feature_dim = 4

                def __init__(self):
                    super().__init__()
                    self.layer = torch.nn.Linear(1, 4)

                def forward(self, x):
                    return self.layer(x.mean(dim=(1, 2, 3))[:, None])

            return Tiny()

        @hookimpl
        def register_encoders(register):
            register("tiny_encoder", build)
    """,
    )
    ingest(REPO / "data_samples", tmp_path / "ds", load_config().ingest)
    config = load_config(overrides=[*TINY_TRAINING, "model.encoder=tiny_encoder", f"plugins.dir={tmp_path / 'mine'}"])
    train(config, tmp_path / "ds", tmp_path / "run", _loaded(tmp_path / "mine"), progress=False, log=lambda m: None)
    checkpoint = tmp_path / "run" / "checkpoints" / "last.pt"
    assert load_model(checkpoint, _loaded(tmp_path / "mine")).model.encoder.feature_dim == 4
    with pytest.raises(
        ComponentError,
        match=rf"unknown encoder 'tiny_encoder'.*trained with plugins from "
        rf"{tmp_path / 'mine'}: run `receipt-embed --plugins-dir",
    ):
        load_model(checkpoint, _loaded(tmp_path / "elsewhere"))


FLIP_PLUGIN = """
from receipt_embed.hookspecs import hookimpl

def build(image_size):
    import albumentations as A
    return A.Compose([A.Resize(*image_size), A.HorizontalFlip(p=0.5)])

@hookimpl
def register_augmentations(register):
    register("flip", build)
"""


def _train_with_flip_plugin(cli, tmp_path):
    """data_samples ingested into TMP/ds, then a tiny run into TMP/run with the folder plugin
    TMP/mine/flip.py given as `--plugins-dir mine`; returns (result, the --set arguments)."""
    from conftest import TINY_TRAINING

    _write(tmp_path / "mine", "flip.py", FLIP_PLUGIN)
    sets = [arg for item in [*TINY_TRAINING, "augment.preset=flip"] for arg in ("--set", item)]
    assert cli("ingest", REPO / "data_samples", "--out", tmp_path / "ds", cwd=tmp_path).returncode == 0
    result = cli(
        "--plugins-dir",
        "mine",
        "train",
        "--data",
        tmp_path / "ds",
        "--out",
        tmp_path / "run",
        "-q",
        *sets,
        cwd=tmp_path,
    )
    return result, sets


def test_plugins_dir_given_on_the_command_line_is_recorded_in_the_run(cli, tmp_path):
    result, sets = _train_with_flip_plugin(cli, tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"dir: {tmp_path / 'mine'}" in (tmp_path / "run" / "config.yaml").read_text()
    # a vector-valued loss through the command line: one line, exit 2
    _write(tmp_path / "broken", "broken_components.py", BROKEN_COMPONENTS)
    broken = cli(
        "--plugins-dir",
        "broken",
        "train",
        "--data",
        tmp_path / "ds",
        "--out",
        tmp_path / "run2",
        "-q",
        *sets[:-2],
        "--set",
        "loss.name=vector_loss",
        cwd=tmp_path,
    )
    assert broken.returncode == 2 and "not a scalar tensor" in broken.stderr and "Traceback" not in broken.stderr


def test_strict_plugins_refuses_a_missing_plugins_folder(cli, tmp_path):
    result = cli("--strict-plugins", "--plugins-dir", tmp_path / "typo", "plugins", cwd=tmp_path)
    assert (
        result.returncode == 2
        and f"plugins folder {tmp_path / 'typo'} does not exist (--strict-plugins)" in result.stderr
    )
    assert cli("--plugins-dir", tmp_path / "typo", "plugins", cwd=tmp_path).returncode == 0  # a warning otherwise


def test_call_hooks_keep_pluggy_order_and_accept_kwargs(tmp_path):
    from receipt_embed.plugin_manager import call_hook

    for name, opts in (("a_first", "tryfirst=True"), ("b_plain", ""), ("c_last", "trylast=True")):
        _write(
            tmp_path,
            f"{name}.py",
            f'''
            from receipt_embed.hookspecs import hookimpl
            ORDER = []

            @hookimpl({opts})
            def on_epoch_end(epoch, **rest):
                import sys
                sys.modules["{name}_order"] = ORDER
                return "{name}"
        ''',
        )
    registry = _loaded(tmp_path)
    results = call_hook(registry, "on_epoch_end", run_dir=tmp_path, epoch=1, metrics={}, model=None, config=None)
    assert list(results) == ["a_first", "b_plain", "c_last"]
    assert list(
        registry.plugin_manager.hook.on_epoch_end(run_dir=tmp_path, epoch=1, metrics={}, model=None, config=None)
    ) == ["a_first", "b_plain", "c_last"]


def test_resume_does_not_load_plugins_from_the_run_dir(cli, tmp_path):
    first, _ = _train_with_flip_plugin(cli, tmp_path)
    assert first.returncode == 0, first.stderr
    (tmp_path / "elsewhere").mkdir()
    resumed = cli("train", "--out", tmp_path / "run", "--resume", "--set", "train.epochs=2", cwd=tmp_path / "elsewhere")
    assert resumed.returncode == 2
    assert (
        f"The run was trained with plugins from {tmp_path / 'mine'}: resume with `receipt-embed --plugins-dir "
        f"{tmp_path / 'mine'} train --out"
    ) in resumed.stderr
    again = cli(
        "--plugins-dir",
        tmp_path / "mine",
        "train",
        "--out",
        tmp_path / "run",
        "--resume",
        "-q",
        "--set",
        "train.epochs=2",
        cwd=tmp_path / "elsewhere",
    )
    assert again.returncode == 0, again.stderr
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_plugins_dir_that_is_a_fifo_is_named_as_one(cli, tmp_path):
    """Attack round 4: RECEIPT_EMBED_PLUGINS_DIR naming a FIFO said "does not exist"."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    result = cli("plugins", "--json", env={"RECEIPT_EMBED_PLUGINS_DIR": str(fifo)}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"Warning: plugins folder {fifo} is a FIFO, not a folder; no folder plugins loaded" in result.stderr
    strict = cli("--strict-plugins", "plugins", env={"RECEIPT_EMBED_PLUGINS_DIR": str(fifo)}, cwd=tmp_path)
    assert strict.returncode == 2 and "is a FIFO, not a folder (--strict-plugins)" in strict.stderr, strict.stderr


def test_attack_round_27_f6_an_empty_plugins_dir_variable_is_refused_as_the_empty_option_is(cli, tmp_path):
    """Attack round 27 F6: click reads an empty variable as unset, so RECEIPT_EMBED_PLUGINS_DIR=
    (an unset shell variable) loaded ./plugins, which `--plugins-dir ''` refuses."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "here.py").write_text("")
    result = cli("plugins", "--json", env={"RECEIPT_EMBED_PLUGINS_DIR": ""}, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        "Error: RECEIPT_EMBED_PLUGINS_DIR is set but empty (an unset shell variable?): name a plugins folder or "
        "unset it\n"
    )
    given = cli("--plugins-dir", tmp_path / "plugins", "plugins", "--json", env={"RECEIPT_EMBED_PLUGINS_DIR": ""})
    assert given.returncode == 0 and '"here"' in given.stdout, given.stderr  # the option wins over the variable


def test_a_plugin_name_with_a_backslash_is_escaped_once(cli, tmp_path):
    """Attack round 4: names went through repr() and then printable(), so a backslash showed as four."""
    folder = tmp_path / "p"
    _write(folder, "bad\\name.py", BROKEN)
    result = _plugins_json(cli, tmp_path, plugins_dir=folder)
    assert "Warning: plugin 'bad\\\\name' failed to load" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "raised", ["SystemExit(0)", "KeyboardInterrupt()", "__import__('receipt_embed.stops').stops.StoppedBySignal(143)"]
)
def test_a_plugin_that_exits_while_loading_is_a_failed_plugin_not_the_end_of_the_command(tmp_path, raised):
    """Attack round 12: a folder plugin raising SystemExit(0) at import made every command do
    nothing and exit 0; one raising KeyboardInterrupt printed click's "Aborted!" (exit 1). Issue 13
    N14: one raising receipt-embed's own StoppedBySignal, with no signal sent, read as a real stop."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "quitter.py").write_text(f"raise {raised}\n")
    result = run_cli("--plugins-dir", tmp_path / "plugins", "plugins", "--json")
    assert result.returncode == 0, result.stderr
    name = "StoppedBySignal" if "StoppedBySignal" in raised else raised.split("(")[0]
    assert "stopped by" not in result.stderr
    assert f"Warning: plugin 'quitter' failed to load and was skipped: RuntimeError: it raised {name}(" in result.stderr
    assert "supcon" in result.stdout
    result = run_cli("--plugins-dir", tmp_path / "plugins", "--strict-plugins", "plugins")
    assert result.returncode == 2 and "plugin 'quitter' failed to load (--strict-plugins)" in result.stderr


@pytest.mark.parametrize("strict", [[], ["--strict-plugins"]], ids=["lenient", "strict"])
def test_dot_files_in_the_plugins_folder_are_not_imported(tmp_path, strict):
    """Attack round 18 H8: `.hidden.py` was executed, and editor and OS droppings such as a macOS
    AppleDouble `._good.py` (binary) or an Emacs lock link `.#good.py` (dangling) were imported or
    reported as failed plugins, fatal under --strict-plugins. Names starting with "." are skipped."""
    folder = tmp_path / "p"
    _write(folder, "good.py", GOOD)
    _write(folder, ".hidden.py", 'raise RuntimeError("hidden loaded")\n')
    (folder / "._good.py").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        \xff\xfe\x00")
    (folder / ".#good.py").symlink_to("user@host.1234:1700000000")
    result = run_cli("--plugins-dir", folder, *strict, "plugins", "--json")
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr and "hidden" not in result.stderr, result.stderr
    info = json.loads(result.stdout)
    assert [p["name"] for p in info["plugins"] if p["source"] == "folder"] == ["good"], info["plugins"]
    assert info["failed"] == []


def test_a_factory_that_exits_is_a_component_error_naming_it(tmp_path):
    """A loss factory raising SystemExit(0) would have ended `train` silently with exit 0."""
    from receipt_embed.errors import ComponentError

    (tmp_path / "quitting.py").write_text(
        "from receipt_embed.hookspecs import hookimpl\n\n"
        "class Loud(Exception):\n    def __str__(self):\n        raise RuntimeError('no message')\n\n"
        "def quit(**params):\n    raise SystemExit(0)\n\n"
        "def loud(**params):\n    raise Loud()\n\n"
        "@hookimpl\ndef register_losses(register):\n"
        "    register('quitting', quit)\n    register('loud', loud)\n"
    )
    registry = plugin_manager.get_registry(tmp_path)
    with pytest.raises(ComponentError) as info:
        registry.create("loss", "quitting")
    assert str(info.value) == "loss 'quitting' (from plugin 'quitting') failed to build: SystemExit: 0"
    with pytest.raises(ComponentError) as info:
        registry.create("loss", "loud")
    assert str(info.value).endswith("failed to build: Loud: (its message cannot be shown)")


EXITING_COMPONENTS = """
import numpy as np
import torch
from receipt_embed.hookspecs import hookimpl

def stop(what):
    raise SystemExit(0) if what == "exit" else KeyboardInterrupt()

class ExitLoss(torch.nn.Module):
    def __init__(self, what):
        super().__init__()
        self.what = what
    def forward(self, z, labels):
        stop(self.what)

class ExitEncoder(torch.nn.Module):
    feature_dim = 8
    def __init__(self, when):
        super().__init__()
        self.layer, self.when = torch.nn.Linear(1, 8), when
    def forward(self, x):
        if len(x) > 2 and self.when == ("train" if self.training else "eval"):  # not in the two-image test
            stop("exit")
        return self.layer(x.mean(dim=(1, 2, 3))[:, None])

class ExitSampler:
    batch_layout = "any"
    def __init__(self):
        self.calls = 0
    def __len__(self):
        return 1
    def set_epoch(self, epoch):
        pass
    def __iter__(self):
        self.calls += 1
        if self.calls > 1:  # not in the look at the first batch train takes before the run
            stop("exit")
        return iter([list(range(8))])

class ExitAugment:
    def __init__(self, image_size, what):
        self.size, self.what, self.calls = tuple(image_size), what, 0
    def set_random_seed(self, seed):
        pass
    def __call__(self, image):
        self.calls += 1
        if self.calls > 1:  # not in the test view
            stop(self.what)
        return {"image": np.ascontiguousarray(image[: self.size[0], : self.size[1]])}

@hookimpl
def register_losses(register):
    register("exit_loss", lambda temperature, what="exit": ExitLoss(what))

@hookimpl
def register_encoders(register):
    register("exit_encoder", lambda pretrained, in_channels, pooling, grid, when="train": ExitEncoder(when))

@hookimpl
def register_samplers(register):
    register("exit_sampler", lambda identities, batch_size, seed: ExitSampler())

@hookimpl
def register_augmentations(register):
    register("exit_augment", lambda image_size, what="exit": ExitAugment(image_size, what))
"""


@pytest.fixture(scope="module")
def sample_dataset(tmp_path_factory):
    from receipt_embed.config import load_config
    from receipt_embed.ingest import ingest

    base = tmp_path_factory.mktemp("samples")
    ingest(REPO / "data_samples", base / "ds", load_config().ingest)
    return base / "ds"


@pytest.mark.parametrize(
    "setting, message",
    [
        (
            "loss.name=exit_loss & sampler.name=unique_identity",
            "loss 'exit_loss' (from plugin 'exiting') failed while computing the loss: SystemExit: 0 at ",
        ),
        (
            "loss.name=exit_loss & sampler.name=unique_identity & loss.params={what: interrupt}",
            "loss 'exit_loss' (from plugin 'exiting') failed while computing the loss: KeyboardInterrupt at ",
        ),
        (
            "model.encoder=exit_encoder",
            "encoder 'exit_encoder' (from plugin 'exiting') failed while embedding a batch: SystemExit: 0 at ",
        ),
        (
            "model.encoder=exit_encoder & model.params={when: eval}",
            "encoder 'exit_encoder' (from plugin 'exiting') failed while evaluating: SystemExit: 0 at ",
        ),
        (
            "sampler.name=exit_sampler",
            "sampler 'exit_sampler' (from plugin 'exiting') failed while yielding a batch: SystemExit: 0 at ",
        ),
        (
            "augment.preset=exit_augment & augment.params={what: interrupt}",
            "augmentation 'exit_augment' (from plugin 'exiting') failed while making a view: KeyboardInterrupt at ",
        ),
    ],
    ids=["loss exit", "loss interrupt", "encoder in a step", "encoder in evaluation", "sampler", "augmentation"],
)
def test_a_training_component_that_exits_at_run_time_is_a_failure_naming_it(tmp_path, sample_dataset, setting, message):
    """Attack round 16 (F4): a loss whose forward called sys.exit(0) ended `train` with exit 0, no epoch
    line and no checkpoint (only config.yaml and data.json); a KeyboardInterrupt it raised (no signal
    sent) printed click's "Aborted!" (exit 1). The same held for an encoder, sampler or augmentation
    raising either one mid-run. Now it is the plugin's failure: one line naming it, exit 2."""
    from conftest import TINY_TRAINING

    _write(tmp_path / "plugins", "exiting.py", EXITING_COMPONENTS)
    sets = [item for setting_ in [*TINY_TRAINING, *setting.split(" & ")] for item in ("--set", setting_)]
    result = run_cli(
        "--plugins-dir", tmp_path / "plugins", "train", "--data", sample_dataset, "--out", tmp_path / "run", *sets, "-q"
    )
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: " + message), result.stderr
    assert not (tmp_path / "run" / "checkpoints" / "best.pt").exists()


def test_a_plugin_encoder_that_exits_while_index_embeds_is_a_failure_naming_it(tmp_path, sample_dataset):
    """Attack round 16 (F4): an encoder plugin raising SystemExit(0) in its forward ended `index`
    silently (exit 0, no index written). Now it is the plugin's failure: one line naming it, exit 2."""
    import torch
    from conftest import TINY_TRAINING

    from receipt_embed.config import load_config
    from receipt_embed.training.checkpoint import save_checkpoint
    from receipt_embed.training.trainer import train

    _write(tmp_path / "plugins", "exiting.py", EXITING_COMPONENTS)
    config = load_config(overrides=[*TINY_TRAINING, "model.encoder=exit_encoder", "model.params={when: never}"])
    train(config, sample_dataset, tmp_path / "run", _loaded(tmp_path / "plugins"), progress=False, log=lambda m: None)
    state = torch.load(tmp_path / "run" / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    state.pop("format_version")
    state["config"]["model"]["params"]["when"] = "eval"  # the encoder now exits when it embeds captures
    save_checkpoint(tmp_path / "exits.pt", state)
    result = run_cli(
        "--plugins-dir", tmp_path / "plugins", "index", "--checkpoint", tmp_path / "exits.pt",
        "--data", sample_dataset, "--out", tmp_path / "index", "-q",
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert (
        result.stderr.startswith(
            "Error: encoder 'exit_encoder' (from plugin 'exiting') failed while embedding captures: SystemExit: 0 at "
        )
        and len(result.stderr.strip().splitlines()) == 1
    ), result.stderr
    assert not (tmp_path / "index").exists()


def test_a_hook_or_plugin_raising_an_exit_of_its_own_is_only_its_failure(tmp_path):
    """Attack round 13: an on_epoch_end hook raising SystemExit(0) ended `train` after epoch 1 with exit
    0; a plugin raising GeneratorExit at import was a traceback (exit 1)."""
    from receipt_embed.plugin_manager import call_hook

    (tmp_path / "quits.py").write_text(
        "from receipt_embed.hookspecs import hookimpl\n\n@hookimpl\ndef on_epoch_end(epoch):\n    raise SystemExit(0)\n"
    )
    (tmp_path / "generator.py").write_text("raise GeneratorExit('x')\n")
    with pytest.warns(PluginLoadWarning, match=r"plugin 'generator' failed to load .*GeneratorExit\('x'\)"):
        registry = plugin_manager.get_registry(tmp_path)
    with pytest.warns(Warning, match=r"plugin 'quits' failed in on_epoch_end \(epoch 1\): SystemExit: 0; going on"):
        call_hook(registry, "on_epoch_end", where="epoch 1", epoch=1)


def test_an_augmentation_parameter_of_the_wrong_type_is_named():
    """Attack round 14: `augment.params={strength: abc}` failed inside the preset with "'<=' not supported
    between instances of 'float' and 'str'", naming neither the parameter nor its type."""
    from receipt_embed import get_registry
    from receipt_embed.registry import ComponentError

    registry = get_registry()
    with pytest.raises(ComponentError, match="parameter 'strength' takes a number \\(float\\), got 'abc'"):
        registry.create("augmentation", "capture", image_size=(64, 32), strength="abc")
    assert registry.create("augmentation", "capture", image_size=(64, 32), strength=0.5) is not None
