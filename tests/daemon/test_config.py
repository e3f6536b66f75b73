"""daemon.config: defaults < TOML file < COUNCILD_* environment < flags; every error names
the file and the key path; unknown keys are refused; the [governor] table is checked by
the governor's own schema."""

from __future__ import annotations

import pytest

from daemon.config import Config, ConfigError, SchedulerConfig, SeatConfig, SpeculationConfig, load_config

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


def write(tmp_path, text: str):
    path = tmp_path / "councild.toml"
    path.write_text(text)
    return path


def test_defaults_without_file_env_or_flags():
    cfg = load_config(None, None, env={})
    assert cfg == Config()
    assert cfg.log_format == "auto" and cfg.drain_deadline_s == 30.0 and cfg.governor_enabled
    assert cfg.scheduler == SchedulerConfig() and cfg.speculation == SpeculationConfig()
    assert cfg.seat("anyone") == SeatConfig()


def test_empty_file_means_all_defaults(tmp_path):
    assert load_config(write(tmp_path, ""), env={}) == Config()


def test_file_then_env_then_flags(tmp_path):
    path = write(tmp_path, 'log_level = "debug"\nmax_tokens = 100\ndrain_deadline_s = 7.5\nendpoint = "ipc:///file"\n'
                           '[scheduler]\nmax_active = 2\n[speculation]\nmode = "fast"\ndepth = 2\n')
    # File over defaults.
    cfg = load_config(path, env={})
    assert (cfg.log_level, cfg.max_tokens, cfg.drain_deadline_s, cfg.endpoint) == ("debug", 100, 7.5, "ipc:///file")
    # Environment over the file; strings become the key's type; an empty variable is unset.
    env = {"COUNCILD_MAX_TOKENS": "200", "COUNCILD_LOG_LEVEL": "warning", "COUNCILD_ENDPOINT": "ipc:///env",
           "COUNCILD_DRAIN_DEADLINE_S": "", "COUNCILD_HEARTBEAT_TIMEOUT_S": "4.5"}
    cfg = load_config(path, env=env)
    assert (cfg.max_tokens, cfg.log_level, cfg.endpoint) == (200, "warning", "ipc:///env")
    assert cfg.drain_deadline_s == 7.5 and cfg.heartbeat_timeout_s == 4.5
    # Flags over both, and a nested flag merges into the file's table instead of replacing it.
    cfg = load_config(path, {"endpoint": "ipc:///flag", "log_level": "error", "speculation": {"mode": "off"}}, env=env)
    assert (cfg.endpoint, cfg.log_level, cfg.max_tokens) == ("ipc:///flag", "error", 200)
    assert cfg.speculation == SpeculationConfig(mode="off", depth=2)
    assert cfg.scheduler.max_active == 2


def test_process_environment_is_read_by_default(monkeypatch):
    monkeypatch.setenv("COUNCILD_MODEL", "/models/x")
    assert load_config().model == "/models/x"
    monkeypatch.setenv("COUNCILD_MODEL", "")
    assert load_config().model is None


def test_seats(tmp_path):
    path = write(tmp_path, '[scheduler.seats.planner]\npriority = "interactive"\nweight = 3\n'
                           '[scheduler.default_seat]\npriority = "background"\n')
    cfg = load_config(path, env={})
    assert cfg.seat("planner") == SeatConfig(priority="interactive", weight=3.0)
    assert cfg.seat("critic") == SeatConfig(priority="background")


@pytest.mark.parametrize("text, needles", [
    ("[scheduler]\nmax_queued = 0\n", ["$.scheduler.max_queued", ">= 1"]),
    ("max_tokens = -1\n", ["$.max_tokens"]),
    ("heartbeat_timeout_s = 0\n", ["$.heartbeat_timeout_s"]),
    ('log_format = "xml"\n', ["$.log_format", "xml"]),
    ("[speculation]\ndepth = 9\n", ["$.speculation.depth", "<= 8"]),
    ('[speculation]\nmode = "turbo"\n', ["$.speculation.mode", "turbo"]),
    ("[scheduler.seats.a]\nweight = 0\n", ["$.scheduler.seats", "weight"]),
    ('[scheduler.seats.a]\npriority = "vip"\n', ["$.scheduler.seats", "priority", "vip"]),
    ('drain_deadline_s = "soon"\n', ["$.drain_deadline_s"]),
    ("governor = 3\n", ["$.governor"]),
], ids=["scheduler-range", "negative-int", "zero-float", "enum", "depth-range", "mode-enum", "seat-weight",
        "seat-priority", "type", "governor-not-a-table"])
def test_invalid_values_name_the_file_and_key_path(tmp_path, text, needles):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), env={})
    message = str(err.value)
    assert "councild.toml" in message
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize("text, key, where", [
    ("max_token = 5\n", "max_token", None),
    ("[scheduler]\nmax_qeued = 5\n", "max_qeued", "$.scheduler"),
    ("[speculation]\nturbo = true\n", "turbo", "$.speculation"),
    ("[scheduler.seats.a]\nweigth = 2\n", "weigth", "$.scheduler.seats"),
    ("[sheduler]\nmax_active = 1\n", "sheduler", None),
], ids=["top", "scheduler", "speculation", "seat", "table"])
def test_unknown_keys_are_refused(tmp_path, text, key, where):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), env={})
    message = str(err.value)
    assert "unknown field" in message and f"`{key}`" in message, message
    if where:
        assert where in message, message


def test_unknown_flag_override_is_refused():
    with pytest.raises(ConfigError, match="unknown field `bogus`"):
        load_config(None, {"bogus": 1}, env={})


def test_bad_environment_value_is_refused():
    with pytest.raises(ConfigError, match=r"\$\.max_tokens"):
        load_config(None, env={"COUNCILD_MAX_TOKENS": "lots"})


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError, match="COUNCILD_MAX_TOKENS"):
        load_config(None, env={"COUNCILD_MAX_TOKENS": "lots"})


def test_missing_and_unparsable_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist") as err:
        load_config(tmp_path / "nope.toml", env={})
    assert "nope.toml" in str(err.value)
    with pytest.raises(ConfigError, match="not valid TOML") as err:
        load_config(write(tmp_path, "[scheduler\n"), env={})
    assert "councild.toml" in str(err.value) and "line 1" in str(err.value)


# ---------------------------------------------------------------------------- [governor]
def test_governor_table_is_passed_through_and_validated(tmp_path):
    cfg = load_config(write(tmp_path, "[governor]\ntick_s = 0.5\nmax_depth = 2\n[governor.linux]\npsi_some_warn = 20.0\n"),
                      env={})
    assert cfg.governor == {"tick_s": 0.5, "max_depth": 2, "linux": {"psi_some_warn": 20.0}}
    from governor import load_config as load_governor_config

    gov = load_governor_config(cfg.governor)
    assert gov.tick_s == 0.5 and gov.max_depth == 2 and gov.linux.psi_some_warn == 20.0


@pytest.mark.parametrize("text, needles", [
    ("[governor]\ntick_s = -1\n", ["tick_s must be > 0"]),
    ("[governor]\ninitial_depth = 5\nmax_depth = 2\n", ["initial_depth"]),
    ("[governor]\nbogus = 1\n", ["unknown field `bogus`"]),
    ("[governor.linux]\nbogus = 1\n", ["unknown field `bogus`", "linux"]),
    ('[governor]\ntick_s = "fast"\n', ["tick_s", "float"]),
], ids=["range", "cross-field", "unknown", "unknown-nested", "type"])
def test_governor_table_errors(tmp_path, text, needles):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), env={})
    message = str(err.value)
    assert "[governor]" in message and "councild.toml" in message, message
    for needle in needles:
        assert needle in message, message


def test_governor_errors_use_the_full_key_path(tmp_path):
    with pytest.raises(ConfigError, match=r"\$\.governor\.linux\.psi_some_warn"):
        load_config(write(tmp_path, '[governor.linux]\npsi_some_warn = "x"\n'), env={})


def test_governor_can_be_disabled(tmp_path):
    cfg = load_config(write(tmp_path, "governor_enabled = false\n"), env={})
    assert cfg.governor_enabled is False and cfg.governor == {}


@pytest.mark.parametrize("text", ["heartbeat_interval_s = 12.0\n", "heartbeat_interval_s = 3.0\nheartbeat_timeout_s = 3.0\n"])
def test_heartbeat_interval_must_be_below_the_timeout(tmp_path, text):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=r"heartbeat_interval_s .* must be below heartbeat_timeout_s .*\$\.heartbeat_interval_s"):
        load_config(f, env={})
    f.write_text("heartbeat_interval_s = 2.0\nheartbeat_timeout_s = 3.0\n")
    assert load_config(f, env={}).heartbeat_interval_s == 2.0


def test_build_ahead_is_auto_or_a_bool(tmp_path):
    assert load_config(None, env={}).speculation.build_ahead == "auto"
    for text, want in (("true", True), ("false", False), ('"auto"', "auto")):
        assert load_config(write(tmp_path, f"[speculation]\nbuild_ahead = {text}\n"), env={}).speculation.build_ahead == want
    with pytest.raises(ConfigError, match="speculation.build_ahead"):
        load_config(write(tmp_path, '[speculation]\nbuild_ahead = "sometimes"\n'), env={})
