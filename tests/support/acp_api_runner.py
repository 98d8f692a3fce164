"""``python -m workflow_delivery.acp`` as an agent's machine without Django runs it:
every ``django`` import refused before the module runs, the arguments passed on.
The API runner's tests start it as ``python tests/support/acp_api_runner.py <arguments>``."""

from __future__ import annotations

import os
import runpy
import sys


class NoDjango:
    def find_spec(self, name, path=None, target=None):
        if name == "django" or name.startswith("django."):
            raise ImportError(f"{name} is not importable on this machine")


if __name__ == "__main__":
    # As ``python -m`` does: the working directory first on the path, not this folder.
    sys.path[0] = os.getcwd()
    sys.meta_path.insert(0, NoDjango())
    sys.argv = ["workflow_delivery.acp", *sys.argv[1:]]
    runpy.run_module("workflow_delivery.acp", run_name="__main__", alter_sys=True)
