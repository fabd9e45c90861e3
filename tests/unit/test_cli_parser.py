"""``kvx``'s parser: a command other than the daemons' does not import their
settings (pydantic), and the daemons' options are there for them."""

import subprocess
import sys

import pytest

from kvx import cli


def test_a_command_other_than_a_daemon_does_not_import_the_daemon_settings() -> None:
    probe = (
        "import sys\n"
        "from kvx import cli\n"
        "cli.build_parser('bench').parse_args(['bench', '--backend', 'tcp'])\n"
        "print('pydantic_settings' in sys.modules, 'kvx.daemon.settings' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["False", "False"], out


def test_the_daemons_options_are_there_for_the_daemons_and_by_default() -> None:
    for parser in (cli.build_parser("prefill"), cli.build_parser()):
        args = parser.parse_args(["prefill", "--metadata", "127.0.0.1:1", "--drain-timeout-s", "5"])
        assert args.metadata == "127.0.0.1:1" and args.drain_timeout_s == "5"


def test_the_etcd_compaction_period_is_0_or_1_to_86400_seconds(capsys) -> None:
    parser = cli.build_parser("metadata")
    assert parser.parse_args(["metadata"]).etcd_compact_every_s == 300
    for text, value in (("0", 0), ("1", 1), ("86400", 86_400)):
        assert parser.parse_args(["metadata", "--etcd-compact-every-s", text]).etcd_compact_every_s == value
    for text in ("-1", "86401", "0.5", "often"):
        with pytest.raises(SystemExit):
            parser.parse_args(["metadata", "--etcd-compact-every-s", text])
    assert "--etcd-compact-every-s" in capsys.readouterr().err
