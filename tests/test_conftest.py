"""tests/conftest.py itself: a default model that cannot be fetched skips the tests that need it,
except on CI (CI=true), where it fails them."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]


@pytest.mark.parametrize(
    "ci, outcome",
    [(None, {"skipped": 1}), ("false", {"skipped": 1}), ("true", {"errors": 1})],
)
def test_an_unavailable_default_model_fails_only_on_ci(pytester, monkeypatch, ci, outcome):
    monkeypatch.delenv("SPECINFER_TEST_GGUF", raising=False)
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makepyfile(
        # a plugin the inner run loads first: the model cannot be fetched
        unavailable_model=(
            "import specinfer.default_model\n\n"
            "def unavailable():\n"
            "    raise RuntimeError('no network and nothing cached')\n\n"
            "specinfer.default_model.default_model_path = unavailable\n"
        ),
        test_it="def test_needs_the_model(smollm_gguf):\n    pass\n",
    )
    # A subprocess: torch does not survive pytest's in-process module snapshots.
    result = pytester.runpytest_subprocess("-p", "unavailable_model", "-rsE")
    result.assert_outcomes(**outcome)
    result.stdout.fnmatch_lines(["*no network and nothing cached*"])
