"""The router's flags: parsed from one table into RouterConfig with its declared defaults, and
every rule between or on values checked by RouterConfig itself (so a config built in code is
held to the same rules as the command line)."""

from __future__ import annotations

import pytest

from kvfleet.router.config import RouterConfig
from kvfleet.router.flags import ROUTER_FLAGS, build_parser, parse_args

BASE = ["--redis-url", "redis://r:6379/0", "--model-name", "m", "--model-dir", "/m"]


def test_no_flag_given_is_the_declared_config() -> None:
    parsed = parse_args(BASE, environ={})
    declared = RouterConfig(redis_url="redis://r:6379/0", model_name="m", model_dir="/m")
    assert parsed == declared


def test_router_help_shows_each_flag_in_a_section_with_its_default() -> None:
    text = build_parser().format_help()
    assert "routing:" in text and "security:" in text
    assert "--call-idle-s" in text and "default 120" in text
    assert all(f.flag in text for f in ROUTER_FLAGS)


@pytest.mark.parametrize("settings, flag", [
    ({"http_max_connections": 0}, "--http-max-connections"),
    ({"call_idle_s": 0.0}, "--call-idle-s"),
    ({"shutdown_grace_s": -1.0}, "--shutdown-grace-s"),
    ({"tls_cert": "/c.pem"}, "--tls-cert and --tls-key"),
    ({"tenant_max_inflight": 0}, "--tenant-max-inflight"),
])
def test_each_rule_is_the_configs_and_the_parser_reports_it(settings, flag, capsys) -> None:
    with pytest.raises(ValueError, match=flag):
        RouterConfig(**settings)
    (name, value), = settings.items()  # the same setting, given as its flag
    row = next(f for f in ROUTER_FLAGS if f.field == name)
    argv = [*BASE, row.flag, row.text(value)]
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv, environ={})
    assert exit_.value.code == 2
    assert flag.split()[0] in capsys.readouterr().err
