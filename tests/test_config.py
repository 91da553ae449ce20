"""Configuration: defaults <- file <- --set, typed, unknown keys named with a suggestion."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from receipt_embed.config import ConfigError, load_config, save_config

REPO = Path(__file__).resolve().parents[1]
REQUIRED_KEYS = [
    "data.image_size",
    "train.epochs",
    "train.batch_size",
    "train.seed",
    "loss.name",
    "loss.temperature",
    "model.encoder",
    "model.pretrained",
    "augment.preset",
    "sampler.name",
]


def test_the_packaged_defaults_are_kept_once_and_shown_at_the_top_level():
    """configs/ holds links to the packaged files, so the defaults cannot drift apart."""
    for name in ("default.yaml", "demo.yaml"):
        top = REPO / "configs" / name
        packaged = REPO / "receipt_embed" / "configs" / name
        assert top.is_symlink() and top.resolve() == packaged.resolve(), name
        assert top.read_text() == packaged.read_text()


def test_every_setting_has_a_comment_and_design_keys_exist():
    text = (REPO / "configs" / "default.yaml").read_text()
    data = yaml.safe_load(text)
    for section, values in data.items():
        for key in values:
            line = next(l for l in text.splitlines() if l.strip().startswith(f"{key}:"))
            assert "#" in line, f"{section}.{key} has no comment"
    config = load_config()
    for dotted in REQUIRED_KEYS:
        section, key = dotted.split(".")
        assert hasattr(getattr(config, section), key), dotted


def test_file_then_overrides_merge_with_types(tmp_path):
    user = tmp_path / "exp.yaml"
    user.write_text("train:\n  epochs: 7\n  batch_size: 32\nloss:\n  params: {tau_plus: 0.1}\n")
    config = load_config(
        user, ["train.epochs=9", "data.image_size=[320,160]", "loss.temperature=0.2", "model.pretrained=null"]
    )
    assert config.train.epochs == 9 and config.train.batch_size == 32
    assert config.data.image_size == (320, 160)
    assert config.loss.temperature == 0.2 and config.loss.params == {"tau_plus": 0.1}
    assert config.model.pretrained is None
    assert config.train.seed == 0  # untouched defaults remain


def test_resolved_config_round_trips(tmp_path):
    config = load_config(overrides=["train.epochs=3"])
    save_config(config, tmp_path / "run" / "config.yaml")
    assert load_config(tmp_path / "run" / "config.yaml") == config


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.epoch=5", "unknown config key 'train.epoch'; did you mean 'train.epochs'?"),
        ("trian.epochs=5", "unknown config key 'trian'; did you mean 'train'?"),
        ("max_minutes=1", "unknown config key 'max_minutes'; did you mean 'train.max_minutes'?"),
        ("loss.temperature=0", "config key 'loss.temperature': Input should be greater than 0"),
        ("train.epochs=many", "config key 'train.epochs': a positive whole number of epochs, or auto, got 'many'"),
        ("ingest.split_ratios=[0.5,0.5,0.5]", "must be three non-negative numbers summing to 1"),
        ("model.pooling=max", "config key 'model.pooling': Input should be 'gap' or 'grid'"),
        ("noequals", "--set expects key.path=value, got 'noequals'"),
        ("model.grid=[4,2", "cannot parse --set 'model.grid=[4,2'"),
        (
            "model.encoder=${nope}",
            "config key 'model.encoder' (from --set 'model.encoder=${nope}') cannot be resolved: Interpolation key 'nope' not found",
        ),
    ],
)
def test_bad_config_names_the_key(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert message in str(info.value)


def test_bad_config_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "list.yaml")


def test_cli_config_command(cli, tmp_path):
    result = cli("config", "--set", "train.epochs=4")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["train"]["epochs"] == 4
    bad = cli("config", "--set", "train.epoch=4")
    assert bad.returncode == 2
    assert "unknown config key 'train.epoch'; did you mean 'train.epochs'?" in bad.stderr
    for key, kind in (
        ("model.encoder", "encoder"),
        ("loss.name", "loss"),
        ("augment.preset", "augmentation"),
        ("sampler.name", "sampler"),
    ):
        unknown = cli("config", "--set", f"{key}=bogus")
        assert unknown.returncode == 2 and f"unknown {kind} 'bogus'. Available: " in unknown.stderr


def test_huge_numbers_and_long_lists_are_one_line_errors(tmp_path):
    """Attack round 6: a 5000-digit integer (in a config, a --set, a JSON file) was an internal error
    (Python converts at most 4300 digits), and a 200,000-item list hung the config library."""
    import json

    from receipt_embed.config import MAX_CONFIG_NODES, ConfigError, load_config
    from receipt_embed.fileio import parse_json

    digits = "9" * 5000
    big = tmp_path / "big.yaml"
    big.write_text(f"train: {{epochs: {digits}}}\n")
    with pytest.raises(ConfigError, match=r"big.yaml: a value cannot be read \(Exceeds the limit \(4300 digits\)"):
        load_config(big)
    with pytest.raises(ConfigError, match="cannot parse --set 'train.epochs=9999"):
        load_config(overrides=[f"train.epochs={digits}"])
    with pytest.raises(json.JSONDecodeError, match="a number of more than 4300 digits"):
        parse_json(f'{{"count": {digits}}}')
    long = tmp_path / "long.yaml"
    long.write_text("data: {image_size: [" + ",".join(["64"] * 200_000) + "]}\n")
    with pytest.raises(ConfigError, match=f"long.yaml, line 1: more than {MAX_CONFIG_NODES} values"):
        load_config(long)


def test_a_huge_value_is_shown_shortened_in_the_error(tmp_path):
    """Attack round 6: a 900 KB string in a config (or a 100 KB --set) was quoted whole in the
    error, burying the message; only its start and its length are shown."""
    from receipt_embed.display import SHOWN_CHARACTERS

    huge = tmp_path / "huge.yaml"
    huge.write_text('train: {epochs: "' + "x" * 900_000 + '"}\n')
    with pytest.raises(ConfigError) as raised:
        load_config(huge)
    message = str(raised.value)
    assert message.startswith(f"config key 'train.epochs' (from config file {huge}): a positive whole number")
    assert message.endswith("... (900002 characters)") and len(message) < SHOWN_CHARACTERS + 300
    with pytest.raises(ConfigError) as raised:
        load_config(overrides=["y" * 100_000])
    assert str(raised.value) == f"--set expects key.path=value, got '{'y' * SHOWN_CHARACTERS}... (100000 characters)'"
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.z{200}\.\.\. \(300 characters\)'"):
        load_config(overrides=["train." + "z" * 300 + "=1"])


def test_no_infinity_or_nan_in_any_config_number():
    """Attack round 8: `loss.params={tau_plus: .inf}` reached the loss as None (JSON has no
    infinity), and the loss's message said "got None"."""
    with pytest.raises(ConfigError, match=r"config key 'loss.params': tau_plus is inf; plugin parameters must be"):
        load_config(overrides=["loss.params={tau_plus: .inf}"])
    with pytest.raises(ConfigError, match=r"config key 'augment.params': a\[1\] is nan"):
        load_config(overrides=["augment.params={a: [1, .nan]}"])
    with pytest.raises(ConfigError, match=r"config key 'train.lr': Input should be a finite number"):
        load_config(overrides=["train.lr=.inf"])  # 1e400: Attack round 20 K7


def test_an_unknown_component_with_a_huge_name_is_shown_shortened():
    """Attack round 8: `--set loss.name=<100 KB>` printed a 100,178-character line."""
    from conftest import builtin_registry

    from receipt_embed.registry import ComponentError

    with pytest.raises(ComponentError, match=r"^unknown loss 'q{200}\.\.\. \(100000 characters\)'\. Available: "):
        builtin_registry().get("loss", "q" * 100_000)


@pytest.mark.parametrize(
    "text,line,key,first",
    [
        ("train:\n  epochs: 2\n  batch_size: 4\nloss:\n  name: supcon\ntrain:\n  seed: 7\n", 6, "train", 1),
        ("train:\n  epochs: 2\n  epochs: 3\n", 3, "epochs", 2),
        ("loss:\n  params: {margin: 1, margin: 2}\n", 2, "margin", 2),
    ],
)
def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path, text, line, key, first):
    """Attack round 9: a second `train:` section silently replaced the first and every setting in
    it (epochs and batch_size back to the defaults, exit 0)."""
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "c.yaml")
    assert str(info.value) == (
        f"config file {tmp_path / 'c.yaml'}, line {line}: key {key!r} is given twice in one mapping (first on "
        f"line {first}); the second would replace the first and everything under it: merge them"
    )
    (tmp_path / "ok.yaml").write_text("train:\n  epochs: 2\nloss:\n  params: {epochs: 1}\n")
    assert load_config(tmp_path / "ok.yaml").train.epochs == 2, "one key in different mappings is fine"


@pytest.mark.parametrize("text,key", [("train: {epochs: 2, null: 3}\n", "null"), ("~: 1\n", "~"), ("on: 5\n", "on"),
                                      ("data: {image_size: {0: 32}}\n", "0")])  # fmt: skip
def test_a_config_key_yaml_does_not_read_as_a_name_is_one_line(tmp_path, text, key):
    """Attack round 10: a `null:` key in a config file was an internal error (exit 1); `on:` was
    reported as a key `True` the file does not hold."""
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "c.yaml")
    assert str(info.value).startswith(f"config file {tmp_path / 'c.yaml'}, line 1: key {key!r} is not a name")
    (tmp_path / "quoted.yaml").write_text("loss: {params: {'on': 1}}\n")
    assert load_config(tmp_path / "quoted.yaml").loss.params == {"on": 1}, "a quoted key is a name"


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "data.image_size[0]=32",
            "--set 'data.image_size[0]=32': data.image_size must be a list, got a mapping; a list such",
        ),
        ("train.seed=-1", "config key 'train.seed': Input should be greater than or equal to 0 (got -1)"),
        ("train.seed=99999999999999999999", "config key 'train.seed': Input should be less than 9223372036854775808"),
    ],
)
def test_an_override_the_config_cannot_take_is_one_line(override, message):
    """Attack round 10: `--set data.image_size[0]=32` and a seed numpy or torch cannot take
    (-1, 2**64) were internal errors (exit 1) instead of config errors."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    "written,read_as,kind",
    [("017", 15, "octal, hexadecimal or binary"), ("0x1e", 30, "octal, hexadecimal or binary"),
     ("0b11", 3, "octal, hexadecimal or binary"), ("1:30", 90, "base 60")],
)  # fmt: skip
def test_a_number_yaml_reads_as_another_is_refused_in_files_and_overrides(tmp_path, written, read_as, kind):
    """Attack round 10: `epochs: 017` trained 15 epochs and `batch_size: 1:30` used 90 (YAML 1.1's
    octal and base 60), silently; the file's line, or the override, is named instead."""
    expected = (
        f"{written} reads as {read_as} in YAML ({kind}); write the number in plain decimal digits (no "
        "leading zero), or quote it if it is text"
    )
    (tmp_path / "c.yaml").write_text(f"train:\n  seed: 3\n  batch_size: {written}\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "c.yaml")
    assert str(info.value) == f"config file {tmp_path / 'c.yaml'}, line 3: {expected}"
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"data.image_size=[{written},32]"])
    assert str(info.value) == f"--set 'data.image_size=[{written},32]': {expected}"
    assert load_config(overrides=["train.batch_size=1_024", "loss.params={name: '017'}"]).train.batch_size == 1024


@pytest.mark.parametrize(
    "override,message",
    [
        (
            'train.batch_size="32"',
            "'train.batch_size': Input should be a valid integer (got '32'); the value is the text '32' (it is "
            "quoted), not a number: write it unquoted",
        ),
        ("train.batch_size=true", "'train.batch_size': Input should be a valid integer (got True)"),
        ("train.bn_recalibrate=2.5", "'train.bn_recalibrate': Input should be a valid integer (got 2.5)"),
        (
            'train.epochs="3"',
            "'train.epochs': a positive whole number of epochs, or auto, got '3'; the value is the text '3' (it is "
            "quoted), not a number: write it unquoted",
        ),
        ("train.deterministic=1", "'train.deterministic': Input should be a valid boolean (got 1)"),
        ("train.lr=true", "'train.lr': a number, got the boolean true"),
        ("loss.temperature=false", "'loss.temperature': a number, got the boolean false"),
    ],
)
def test_whole_numbers_and_switches_are_taken_only_as_such(override, message):
    """Attack round 10: a quoted "32", `true` or 2.5 for a count became 32, 1 or 2 and a 1 for a switch
    became true, silently; each is now an error naming the key."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert str(info.value) == f"config key {message}"
    config = load_config(overrides=["train.lr=1e-3", "train.warmup_epochs=2", "train.deterministic=yes"])
    assert (config.train.lr, config.train.warmup_epochs, config.train.deterministic) == (0.001, 2.0, True)


@pytest.mark.parametrize("value", ["[" * 40000 + "]" * 40000, "{a: " * 20000 + "1" + "}" * 20000, "{a: &x [1], b: *x}"])
def test_an_override_nested_without_end_or_with_aliases_is_refused_like_a_file(value):
    """Attack round 11: `--set train.seed=[[[...40000...]]]` was an internal error (RecursionError,
    exit 1); overrides now get the config file's checks, event by event."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"loss.params={value}"])
    message = str(info.value)
    assert message.startswith("--set 'loss.params=") and len(message) < 400, message
    assert message.endswith(
        "nested more than 32 levels deep; a config never needs that"
        if "&x" not in value
        else "YAML aliases (*x) are not allowed in a config; write the values out"
    )


@pytest.mark.parametrize("parts", [33, 5000, 20000])
def test_a_key_path_nested_too_deep_is_refused_like_a_deep_value(parts):
    """Attack round 19 J4: a --set key path 5000 levels deep was an internal RecursionError and one 200
    deep was taken, while a config file or --set value nested over 32 levels is refused."""
    key = "model.params." + ".".join(["a"] * (parts - 2))
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"{key}=1"])
    message = str(info.value)
    assert message.startswith("--set 'model.params.a.a.") and len(message) < 400, message
    assert message.endswith("the key path is nested more than 32 levels deep; a config never needs that")


def test_a_key_path_and_its_value_count_together_towards_the_depth_limit():
    """Attack round 19 J4: as in a config file, where the key path's levels are mappings too."""
    key = "model.params." + ".".join(["a"] * 30)  # 32 levels, as deep as a config file may nest
    assert load_config(overrides=[f"{key}=1"]).model.params["a"]["a"]
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"{key}=[1]"])
    assert str(info.value).endswith(": nested more than 32 levels deep; a config never needs that")


def test_a_sweep_key_path_nested_too_deep_is_refused_before_run_names_are_made():
    """Attack round 19 J4: the --sweep key got no depth check either (and its run dir names, cut
    at 200 characters, then read as two values sharing one dir)."""
    from receipt_embed.training.sweep import parse_sweep

    with pytest.raises(ConfigError) as info:
        parse_sweep("model.params." + ".".join(["a"] * 5000) + "=1,2")
    assert str(info.value).endswith("the key path is nested more than 32 levels deep; a config never needs that")
    assert str(info.value).startswith("--sweep 'model.params.a.a.")


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "train.epochs=${oc.env:RECEIPT_EMBED_UNSET_FOR_TEST,3}",
            "config key 'train.epochs': a positive whole number of epochs, or auto, got '3'; the value is the "
            "text '3' (interpolations such as oc.env give text), not a number: write "
            "${oc.decode:${oc.env:RECEIPT_EMBED_UNSET_FOR_TEST,3}} to read it as one, or an unquoted number",
        ),
        (
            "train.batch_size=${oc.env:RECEIPT_EMBED_UNSET_FOR_TEST,8}",
            "config key 'train.batch_size': Input should be a valid integer (got '8'); the value is the text '8' "
            "(interpolations such as oc.env give text), not a number: write "
            "${oc.decode:${oc.env:RECEIPT_EMBED_UNSET_FOR_TEST,8}} to read it as one, or an unquoted number",
        ),
        (
            'data.image_size=["64",32]',
            "config key 'data.image_size.0': Input should be a valid integer (got '64'); the value is the text "
            "'64' (it is quoted), not a number: write it unquoted",
        ),
        (
            'data.grayscale="true"',
            "config key 'data.grayscale': Input should be a valid boolean (got 'true'); the value is the text "
            "'true' (it is quoted), not a boolean: write it unquoted",
        ),
        ("train.epochs=abc", "config key 'train.epochs': a positive whole number of epochs, or auto, got 'abc'"),
    ],
)
def test_a_number_given_as_text_says_it_is_text_and_how_to_give_a_number(override, message):
    """Attack round 19 J10: `train.epochs=${oc.env:NOPE,3}` said "a positive whole number ... got '3'",
    as if 3 were invalid: the config library gives an interpolation's default as the text '3'."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert str(info.value) == message
    decoded = "train.epochs=${oc.decode:${oc.env:RECEIPT_EMBED_UNSET_FOR_TEST,3}}"
    assert load_config(overrides=[decoded]).train.epochs == 3


def test_an_interpolation_that_cannot_resolve_names_its_key_and_where_it_came_from(tmp_path):
    """Attack round 12: `${nope.missing}` or an unset `${oc.env:...}` said only "cannot resolve the
    config: Interpolation key 'nope.missing' not found", naming neither the key nor its source."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["train.epochs=3", "train.seed=${nope.missing}"])
    assert str(info.value) == (
        "config key 'train.seed' (from --set 'train.seed=${nope.missing}') cannot be resolved: "
        "Interpolation key 'nope.missing' not found"
    )
    (tmp_path / "c.yaml").write_text("loss:\n  temperature: ${oc.env:RECEIPT_EMBED_UNSET_FOR_TEST}\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "c.yaml")
    assert str(info.value).startswith(f"config key 'loss.temperature' (from config file {tmp_path / 'c.yaml'}) cannot")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("train.epochs=1,017", "--sweep 'train.epochs=017': 017 reads as 15 in YAML"),
        ("train.epochs=1,x", "--sweep 'train.epochs=x': config key 'train.epochs': a positive whole number"),
        ("nokey=1,2", "--sweep 'nokey=1': unknown config key 'nokey'"),
        (
            "loss.temperature=0.1,${nope}",
            "config key 'loss.temperature' (from --sweep 'loss.temperature=${nope}') cannot be resolved",
        ),
    ],
)
def test_a_sweep_value_the_config_cannot_take_names_sweep_and_the_value(spec, message):
    """Attack round 13: a bad --sweep value was reported as coming from --set."""
    from receipt_embed.training.sweep import _swept, parse_sweep

    key, values = parse_sweep(spec)
    config = load_config()
    with pytest.raises(ConfigError) as info:
        [_swept(config, key, value) for value in values]
    assert str(info.value).startswith(message) and "--set" not in str(info.value)


def test_an_image_size_too_small_for_any_encoder_is_refused_by_the_config():
    """Attack round 14: data.image_size=[1,1] passed `config` and failed in training with "returned a
    uint8 (1, 1) view; views must be uint8 of 1 x 1 (data.image_size) x 3"."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["data.image_size=[1,32]"])
    assert str(info.value) == "config key 'data.image_size.0': Input should be greater than or equal to 16 (got 1)"
    assert load_config(overrides=["data.image_size=[16,16]"]).data.image_size == (16, 16)


def test_a_worker_count_that_would_fork_without_end_is_refused():
    """Attack round 15: train.num_workers took 100000000 (and 100 forked 100 processes on 2 cores)."""
    with pytest.raises(ConfigError, match="config key 'train.num_workers': Input should be less than or equal to 64"):
        load_config(overrides=["train.num_workers=100000000"])


def test_a_config_file_value_of_the_wrong_type_names_the_file(tmp_path):
    """Attack round 15: `train --resume` of a run whose config.yaml was edited to a wrong type named the
    key but not the file, so a user looked for a --set they never gave."""
    (tmp_path / "config.yaml").write_text("train:\n  batch_size: eight\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "config.yaml")
    assert str(info.value) == (
        f"config key 'train.batch_size' (from config file {tmp_path / 'config.yaml'}): "
        "Input should be a valid integer (got 'eight')"
    )
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "config.yaml", ["train.batch_size=x"])  # the override wins and names itself
    assert "from config file" not in str(info.value)


def test_a_cache_margin_that_would_decode_without_limit_is_refused():
    """Attack round 16 (F1): train.cache_margin had no upper bound: 1000 passed `config`, and train,
    index and search then decoded each capture to margin x data.image_size (24 GB a capture at 2000).
    The margin is at most 4 and the cached size is held to the 2048-a-side limit of data.image_size."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["train.cache_margin=1000"])
    assert str(info.value) == "config key 'train.cache_margin': Input should be less than or equal to 4 (got 1000)"
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["data.image_size=[2048,1024]"])  # at the default margin of 1.25
    assert str(info.value) == (
        "config key 'train.cache_margin': 1.25 x data.image_size [2048, 1024] caches images of 2560 x 1280, "
        "over 2048 a side; use a smaller train.cache_margin or data.image_size"
    )
    assert load_config(overrides=["train.cache_margin=4", "data.image_size=[512,256]"]).train.cache_margin == 4


@pytest.mark.parametrize("section", ["augment", "loss", "sampler", "model"])
def test_a_list_where_a_mapping_is_expected_names_the_file_and_the_key(tmp_path, section):
    """Attack round 17 G8: `augment: {params: [1, 2]}` in a --config file (or a --set) was "cannot merge
    the config: Cannot merge incompatible container types", naming neither the file nor the key."""
    path = tmp_path / "bad.yaml"
    path.write_text(f"{section}:\n  params: [1, 2]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config file {path}: {section}.params must be a mapping, got a list"
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"{section}.params=[1,2]"])
    assert str(info.value) == f"--set '{section}.params=[1,2]': {section}.params must be a mapping, got a list"
    fine, whole = tmp_path / "fine.yaml", tmp_path / "whole.yaml"
    fine.write_text("train:\n  epochs: 2\n")
    whole.write_text(f"{section}: [1]\n")
    with pytest.raises(ConfigError) as info:  # the second file is the one named
        load_config([fine, whole])
    assert str(info.value) == f"config file {whole}: {section} must be a mapping, got a list"


def test_cli_merges_several_config_files_in_order(cli, tmp_path):
    """Attack round 17 G7: a second --config silently dropped the first; now they merge in order
    (a later file wins), and a bad one is named."""
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("train:\n  epochs: 3\n  lr: 0.5\n")
    second.write_text("train:\n  lr: 0.25\n")
    result = cli("config", "--config", first, "--config", second)
    assert result.returncode == 0, result.stderr
    trained = yaml.safe_load(result.stdout)["train"]
    assert (trained["epochs"], trained["lr"]) == (3, 0.25)
    bad = tmp_path / "bad.yaml"
    bad.write_text("augment:\n  params: [1, 2]\n")
    result = cli("config", "--config", first, "--config", bad)
    assert result.returncode == 2
    assert result.stderr == f"Error: config file {bad}: augment.params must be a mapping, got a list\n"


def test_a_number_in_exponent_form_is_a_number_in_files_and_overrides(tmp_path):
    """Attack round 20 K7: `ingest.max_pixels: 1e8` was refused as "the text '1e8' (it is quoted)
    ... write it unquoted" though it was unquoted (YAML 1.1 reads 1e8 as text), and `--set
    ingest.max_pixels=1e8` as "got 100000000.0"; a whole number in exponent form is taken for a count."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "ingest:\n  max_pixels: 1e8\n  split_ratios: [8e-1, 1.0e-1, 1e-1]\ndata:\n  image_size: [1.28e2, 6.4e+1]\n"
        "loss:\n  temperature: 1e-1\n  params: {eps: 2.5e-3}\ntrain:\n  batch_size: 2.5e1\n  lr: -.5e-3\n"
    )
    with pytest.raises(ConfigError, match=r"'train.lr' \(from config file .*\): Input should be greater than 0 \(got"):
        load_config(path)
    path.write_text(path.read_text().replace("-.5e-3", "+.5e-3"))
    config = load_config(path)
    assert (config.ingest.max_pixels, config.data.image_size, config.train.batch_size) == (100_000_000, (128, 64), 25)
    assert (config.loss.temperature, config.loss.params, config.train.lr) == (0.1, {"eps": 0.0025}, 0.0005)
    assert config.ingest.split_ratios == (0.8, 0.1, 0.1)
    overrides = ["ingest.max_pixels=1e8", "data.image_size=[1.28e2,6.4e+1]", "train.batch_size=1_000e-1"]
    config = load_config(overrides=overrides)
    assert (config.ingest.max_pixels, config.data.image_size, config.train.batch_size) == (100_000_000, (128, 64), 100)
    assert load_config(overrides=["loss.params={scale: 1e3, eps: 1e-3}"]).loss.params == {"scale": 1000, "eps": 0.001}


@pytest.mark.parametrize(
    "value,message",
    [
        ("1.5e0", "config key 'ingest.max_pixels'{source}: Input should be a valid integer (got 1.5)"),
        ("2.5e-1", "config key 'ingest.max_pixels'{source}: Input should be a valid integer (got 0.25)"),
        ("true", "config key 'ingest.max_pixels'{source}: Input should be a valid integer (got True)"),
        ("1e19", "config key 'ingest.max_pixels'{source}: Input should be a valid integer (got 1e+19)"),
        (
            "'1e8'",
            "config key 'ingest.max_pixels'{source}: Input should be a valid integer (got '1e8'); the value is the "
            "text '1e8' (it is quoted), not a number: write it unquoted",
        ),
        (
            "1e400",
            "{where}: 1e400 is beyond the largest number a config holds (about 1.8e308) and would read as infinity; "
            "write a smaller number",
        ),
        ("09", "{where}: 09 reads as text in YAML (a leading zero); write the number without it, or quote it if it is text"),
    ],
)  # fmt: skip
def test_a_number_in_exponent_form_a_count_cannot_take_is_refused_truly(tmp_path, value, message):
    """Attack round 20 K7: `[1e400, 64]` was also called "quoted"; now only a quoted value is, a
    non-whole exponent number is refused for a count, and 1e400 (infinity) is refused where it is written."""
    path = tmp_path / "c.yaml"
    path.write_text(f"ingest:\n  max_pixels: {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == message.format(source=f" (from config file {path})", where=f"config file {path}, line 2")
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"ingest.max_pixels={value}"])
    assert str(info.value) == message.format(source="", where=f"--set 'ingest.max_pixels={value}'")


def test_cli_takes_a_count_in_exponent_form(cli, tmp_path):
    """Attack round 20 K7: the reproduction, through the CLI: exit 0 and the number, or one line."""
    path = tmp_path / "e8.yaml"
    path.write_text("ingest:\n  max_pixels: 1e8\n")
    result = cli("config", "--config", path)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["ingest"]["max_pixels"] == 100_000_000
    result = cli("config", "--set", "ingest.max_pixels=1e8")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["ingest"]["max_pixels"] == 100_000_000
    path.write_text("data:\n  image_size: [1e400, 64]\n")
    result = cli("config", "--config", path)
    assert result.returncode == 2
    assert result.stderr == (
        f"Error: config file {path}, line 2: 1e400 is beyond the largest number a config holds (about 1.8e308) and "
        "would read as infinity; write a smaller number\n"
    )


def test_attack_round_22_mb7_mb14_mb15_long_values_comments_and_overlong_digits_in_overrides(tmp_path):
    """A --set list of 10,000 items failed with the config library's own advice about an environment
    variable; ``--set train.epochs=3 #note`` dropped the comment silently (YAML reads it as one); a
    401-digit number read as infinity and was reported as "got inf". Underscores between digits
    read as in Python (1_024 is 1024), by design."""
    many = "model.params={a: [" + ",".join(["1"] * 10_000) + "]}"
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[many])
    assert str(info.value).endswith(
        "the value has 10,003 items and keys; a --set value may have at most 9,000: put a list this long in a "
        "config file (--config)"
    )
    assert "OMEGACONF" not in str(info.value)
    (tmp_path / "long.yaml").write_text("model:\n  params:\n    a: [" + ", ".join(["1"] * 10_000) + "]\n")
    assert len(load_config(tmp_path / "long.yaml").model.params["a"]) == 10_000
    # attack round 26: with no space before it ("{stem: 2}#x") the message quoted ' #' all the same
    for override in (
        "train.epochs=3 #note",
        "train.lr=0.1 # a comment",
        "model.params={a: 1} #x",
        "model.params={a: 1}#x",
    ):
        with pytest.raises(ConfigError) as info:
            load_config(overrides=[override])
        assert str(info.value) == (
            f"--set '{override}': YAML reads the text from its '#' on as a comment and would drop it; quote the "
            "value if the # belongs to it, or leave the comment out"
        )
    assert load_config(overrides=["loss.params={a: 'x #y', b: x#y}"]).loss.params == {"a": "x #y", "b": "x#y"}
    huge = "1" + "0" * 400 + ".0"
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"train.lr={huge}"])
    assert "is beyond the largest number a config holds (about 1.8e308) and would read as infinity" in str(info.value)
    (tmp_path / "huge.yaml").write_text(f"train:\n  lr: -{huge}\n")
    with pytest.raises(ConfigError, match=r"huge.yaml, line 2: -1000.* is beyond the largest number"):
        load_config(tmp_path / "huge.yaml")
    assert load_config(overrides=["train.epochs=1_000"]).train.epochs == 1000  # grouped in threes (round 28)


def test_attack_round_22_mb11_yaml_merge_keys_are_named_as_such(tmp_path):
    """``<<:`` in a config file was explained as a key YAML reads as "a number, a boolean or null"."""
    (tmp_path / "c.yaml").write_text("train:\n  <<: {lr: 0.5}\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "c.yaml")
    assert str(info.value) == (
        f"config file {tmp_path / 'c.yaml'}, line 2: key '<<' is YAML's merge key (it copies the keys of another "
        "mapping in); a config writes its keys out: give them one by one"
    )
    with pytest.raises(ConfigError, match=r"^--set 'loss.params=\{<<: \{a: 1\}\}': '<<' is YAML's merge key"):
        load_config(overrides=["loss.params={<<: {a: 1}}"])
    assert load_config(overrides=["loss.params={'<<': 1}"]).loss.params == {"<<": 1}, "a quoted key is a name"


@pytest.mark.parametrize(
    "override",
    [
        "model.pretrained=a#b #comment",
        "sampler.params={column: 'm#1'} #note",
        "train.epochs=3 #x",
        "train.epochs=3\t#x",
        'model.params={"x": "a # b"} # c',
        "model.params={x: 'a #b'} #b",
    ],
)
def test_attack_round_24_p7_a_comment_is_refused_even_when_a_value_holds_a_hash(override):
    """A `#` inside one value let a trailing comment elsewhere in the same --set through, silently
    dropped; so did one after a tab, or one whose first word also occurs inside a value (round 25 F2)."""
    with pytest.raises(ConfigError, match="YAML reads the text from its '#' on as a comment and would drop it"):
        load_config(overrides=[override])


def test_attack_round_24_p7_a_hash_inside_a_value_is_kept():
    assert load_config(overrides=["model.pretrained=a#b"]).model.pretrained == "a#b"
    assert load_config(overrides=["model.pretrained='x #y'"]).model.pretrained == "x #y"
    assert load_config(overrides=['loss.params={"x": "a # b", y: "\t#z"}']).loss.params == {"x": "a # b", "y": "\t#z"}


def test_attack_round_24_p6_an_interpolation_nested_thousands_deep_is_a_config_error(tmp_path):
    """``${oc.decode:[[[...]]]}`` 3,000 deep was an internal RecursionError, in --set and in files alike."""
    deep = "${oc.decode:" + "[" * 3000 + "]" * 3000 + "}"
    too_deep = "an interpolation nests too deeply to read (a config nests at most 32 levels)"
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"train.seed={deep}"])
    assert str(info.value).startswith("cannot parse --set 'train.seed=${oc.decode:[[[") and str(info.value).endswith(
        too_deep
    )
    (tmp_path / "c.yaml").write_text(f"train:\n  seed: {deep}\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "c.yaml")
    assert str(info.value) == f"config file {tmp_path / 'c.yaml'}: {too_deep}"


def test_model_params_follow_the_encoder(tmp_path):
    """``model.params`` are keyword arguments of ``model.encoder``: picking another encoder drops the
    ones below (receipt_cnn's ``stem`` would fail resnet18's constructor) and keeps those given with
    it; changing anything else keeps them."""
    from receipt_embed.config import config_with

    cnn = load_config(overrides=["model.params={stem: 4, widths: [8, 8]}"])
    assert config_with(cnn, ["model.encoder=resnet18"]).model.params == {}
    assert config_with(cnn, ["train.lr=0.1"]).model.params == {"stem": 4, "widths": [8, 8]}
    assert config_with(cnn, ["model.encoder=receipt_cnn"]).model.params == {"stem": 4, "widths": [8, 8]}
    given = config_with(cnn, ["model.encoder=resnet18", "model.params={weights_dir: x}"])
    assert given.model.params == {"weights_dir": "x"}
    # a file below the overrides: its params are given above the packaged defaults, so they stay
    (tmp_path / "c.yaml").write_text("model:\n  params: {stem: 4}\n")
    assert load_config(tmp_path / "c.yaml", ["model.encoder=resnet18"]).model.params == {"stem": 4}
    # the encoder named through an interpolation is compared once resolved
    resolved = config_with(cnn, ["model.encoder=${oc.env:RECEIPT_EMBED_TEST_ENCODER,receipt_cnn}"])
    assert resolved.model.params == {"stem": 4, "widths": [8, 8]}
    assert cnn.model.params == {"stem": 4, "widths": [8, 8]}  # the loaded config is left as it was


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data.image_size=[64]", "config key 'data.image_size': two numbers (height, width), got [64]"),
        ("data.image_size=[]", "config key 'data.image_size': two numbers (height, width), got []"),
        ("data.image_size=[64,32,3]", "config key 'data.image_size': two numbers (height, width), got [64, 32, 3]"),
        ("data.image_size=64", "config key 'data.image_size': two numbers (height, width), got 64"),
        (
            "ingest.split_ratios=[0.5,0.5]",
            "config key 'ingest.split_ratios': three numbers (train, val, heldout), got [0.5, 0.5]",
        ),
        ("model.grid=[2]", "config key 'model.grid': two numbers (rows, columns), got [2]"),
    ],
)
def test_attack_round_25_f3_a_list_of_the_wrong_length_says_what_it_holds(override, expected):
    """A short list was reported as a missing key named by its index ('data.image_size.1'), which
    reads as a key the user should add."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert str(info.value) == expected


def test_attack_round_25_f3_a_config_file_with_a_short_list_is_named(tmp_path):
    (tmp_path / "c.yaml").write_text("data:\n  image_size: [64]\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "c.yaml")
    assert str(info.value).startswith(
        f"config key 'data.image_size' (from config file {tmp_path / 'c.yaml'}): two numbers (height, width), got [64]"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train:\n  seed: 2001-12-14\n", "key 'train.seed' holds a YAML date (2001-12-14)"),
        (
            "model:\n  params: {stem: 4, when: 2001-12-14 10:00:00}\n",
            "key 'model.params.when' holds a YAML datetime (2001-12-14 10:00:00)",
        ),
        ("train: !!set {a}\n", "key 'train' holds a YAML set ({'a'})"),
        ("loss:\n  params: {names: [a, !!binary aGk=]}\n", "key 'loss.params.names[1]' holds a YAML bytes (b'hi')"),
    ],
)
def test_attack_round_27_f4_a_yaml_date_or_set_in_a_config_file_is_named_by_key(tmp_path, cli, text, message):
    """Attack round 27 F4: YAML reads 2001-12-14 as a date and !!set as a set, which the config
    library cannot hold: an internal error from `config`, `train` and `--resume` alike; now one
    line naming the file and the key, exit 2."""
    path = tmp_path / "odd.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config file {path}: {message}, which a config does not take; quote it if it is text"
    result = cli("config", "--config", path)
    assert result.returncode == 2 and message in result.stderr and "internal error" not in result.stderr


@pytest.mark.parametrize(
    "value,number", [("5_", "5"), ("0.1_5", "0.15"), ("1_0.5", "10.5"), ("1_0", "10"), ("1_e-3", "0.001")]
)
def test_attack_round_28_a_stray_underscore_in_a_number_is_refused(tmp_path, value, number):
    """Attack round 28: YAML 1.1 drops a _ anywhere in a number, so a typo (`5_`, `0.1_5`) was another
    value with no word, while the other YAML-only readings (0x10, 1:30, 09) were refused; digits
    grouped in threes (1_000_000) still read as the number."""
    message = (
        f"{value} reads as {number} in YAML (it drops a _ between any characters); write the number without _, "
        "or with _ only between groups of three digits (1_000_000), or quote it if it is text"
    )
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"loss.temperature={value}"])
    assert str(info.value) == f"--set 'loss.temperature={value}': {message}"
    path = tmp_path / "c.yaml"
    path.write_text(f"loss:\n  temperature: {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config file {path}, line 2: {message}"
    grouped = load_config(overrides=["ingest.max_pixels=1_000_000", "train.lr=1_000e-6", "train.epochs=1_000"])
    assert (grouped.ingest.max_pixels, grouped.train.lr, grouped.train.epochs) == (1_000_000, 0.001, 1000)
    assert load_config(overrides=["model.params={name: '5_'}"]).model.params["name"] == "5_", "quoted text is kept"
