"""rollstream's composition root: the `rollstream` CLI and the demo, which wire producers and consumers together.

Nothing imports this package; libraries live in `schemas`, `infra`, `producers` and `consumers`.
"""

__version__ = "0.1.0"
