"""``app`` for running under hypercorn directly, configured from the
environment: ``hypercorn -k trio asgi_generate.server.asgi:app`` (see
:class:`asgi_generate.config.Settings` for the ``ASGI_GENERATE_*`` variables).

A configuration error is one line on stderr and exit status 2 of the process
importing this module, before anything starts. (hypercorn's parent process
then still exits 0 when it runs the app in a worker process, its default:
hypercorn issue #269, fixed by its pull request #372; ``hypercorn -w 0``
runs the app in the parent and exits 2.)

hypercorn configures only its own loggers, so unless something configured
logging already, the app's ``asgi_generate`` loggers get a stderr handler at
INFO here (simulators serving, a worker down or back up).

This module is hypercorn's entry point, and importing it is hypercorn
loading the app: the only moment before hypercorn serves, so it is here
that hypercorn's patches are installed
(:func:`asgi_generate.server.hypercorn.patches.install`, or one WARNING and
hypercorn as released). Import :class:`asgi_generate.server.app.App` instead
to serve the app another way.
"""

import logging
import sys

from .hypercorn import patches
from .app import App
from ..config import Settings
from ..exceptions import CodecLoadError, EngineLoadError


def _log_to_stderr() -> None:
    ours = logging.getLogger("asgi_generate")
    if not logging.getLogger().handlers and not ours.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(
            "[%(asctime)s] [%(process)d] [%(levelname)s] %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S %z"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)


def _app() -> App:
    try:
        settings = Settings.from_env()
        settings.check()
        patches.install(send_errors=App.handles_send_errors,
                        header_read_timeout=settings.header_read_timeout)
        return App(settings)
    except (ValueError, CodecLoadError, EngineLoadError) as exc:  # TraceSetupError is a ValueError
        for line in str(exc).splitlines():
            print(f"asgi-generate: {line}", file=sys.stderr)
        raise SystemExit(2) from None


_log_to_stderr()
app = _app()
