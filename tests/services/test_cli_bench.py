"""`nibble bench NAME ...` dispatches to nibble.bench.<module>.main with the remaining flags."""

import pytest

from nibble.services import cli


@pytest.mark.parametrize("name", sorted(cli.BENCHMARKS))
def test_every_benchmark_is_reachable(name, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", name, "--help"])
    assert e.value.code == 0
    assert "--out" in capsys.readouterr().out


def test_unknown_benchmark_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "nope"])
    assert e.value.code == 2
