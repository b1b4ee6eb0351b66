"""``app`` for running under hypercorn directly, configured from the
environment: ``hypercorn -k trio asgi_generate.asgi:app`` (see
:class:`asgi_generate.config.Settings` for the ``ASGI_GENERATE_*`` variables).
"""

from .app import App
from .config import Settings

app = App(Settings.from_env())
