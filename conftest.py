"""Repository-wide pytest settings.

``lightning_fedhet/flower`` needs the optional extra ``lightning-fedhet[flower]``: without Flower its modules are not
collected for doctests (tests/flower skips on its own; scripts/ci_flower.sh runs both where Flower is installed).
"""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("flwr") else ["lightning_fedhet/flower/*"]
