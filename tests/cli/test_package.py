import re

import flowgrpo


def test_version_is_semver():
    assert re.fullmatch(r"\d+\.\d+\.\d+", flowgrpo.__version__)
