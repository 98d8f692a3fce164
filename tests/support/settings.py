"""The project's settings for the test run: local-use DEBUG unless the caller says otherwise.

The settings (and every ``manage.py`` a test starts) read the environment, so the
defaults are set there, before the project's settings module runs.
"""

import os

os.environ.setdefault("DEBUG", "true")

from buzz_project.settings import *  # noqa: F403
