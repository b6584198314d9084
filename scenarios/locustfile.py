"""weighbridge's Locust entry point: ``locust -f scenarios/ --scenario NAME --host URL``.

This is the only file in the folder that defines Locust classes; every other module defines
a ``SCENARIO`` and the ``--scenario`` option picks one (docs/loadgen.md).
"""

import sys
from pathlib import Path

try:
    import weighbridge.loadgen  # noqa: F401
except ImportError:  # run from a checkout without an up-to-date editable install
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from weighbridge.loadgen.locust_plugin import install

ScenarioUser, ScenarioShape = install(Path(__file__).resolve().parent,
                                      exclude=(Path(__file__),))
