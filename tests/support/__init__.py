"""What the tests share and no test module is: factories of rows, second sessions, signed
requests, the scripted ACP agent, the test run's settings. Nothing here is collected."""

from pathlib import Path

# This folder, and the checkout's root (tests/support/ is two below it).
SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parent.parent
